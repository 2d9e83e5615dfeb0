"""Agent Lightning 0.3's status machine, as pure functions (no database).

A rollout follows its latest attempt; terminal rollouts stay terminal against late runner
reports and the watchdog (AGL 0.3 let a late report turn a cancelled or timed-out rollout into
"succeeded": we record it on the attempt only). The algorithm's explicit commands are honoured
as AGL honours them: `update_rollout(status=...)` and `start_attempt` may reopen a terminal
rollout (requeue a failed one, retry a finished one by hand).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import models

from store.errors import InvalidInput


class RolloutStatus(models.TextChoices):
    QUEUING = "queuing"
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REQUEUING = "requeuing"


class AttemptStatus(models.TextChoices):
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    UNRESPONSIVE = "unresponsive"


class WorkerStatus(models.TextChoices):
    IDLE = "idle"
    BUSY = "busy"
    UNKNOWN = "unknown"


class RolloutMode(models.TextChoices):
    TRAIN = "train"
    VAL = "val"
    TEST = "test"


QUEUED = (RolloutStatus.QUEUING, RolloutStatus.REQUEUING)
ROLLOUT_TERMINAL = frozenset(
    {RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED}
)
ROLLOUT_ACTIVE = (RolloutStatus.PREPARING, RolloutStatus.RUNNING)
ATTEMPT_LIVE = (AttemptStatus.PREPARING, AttemptStatus.RUNNING)
# A runner's own verdict: once given it is final.
ATTEMPT_FINAL = frozenset({AttemptStatus.SUCCEEDED, AttemptStatus.FAILED})
# The watchdog's verdicts; a runner's late report may still overwrite them.
ATTEMPT_LOST = frozenset({AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE})
ATTEMPT_ENDED = ATTEMPT_FINAL | {AttemptStatus.TIMEOUT}


# The longest limit (seconds) a rollout may set: about a century. Beyond it a deadline may not
# fit a datetime (Python's, or psycopg's reading of Postgres's), so every path that computes one
# (the claim's SQL, the export's, the services') can rely on it; the REST serializers use it too.
MAX_LIMIT_SECONDS = 3.2e9


@dataclass(frozen=True)
class RolloutConfig:
    timeout_seconds: float | None = None
    unresponsive_seconds: float | None = None
    max_attempts: int = 1
    retry_condition: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> RolloutConfig:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise InvalidInput("config", "must be an object")
        unknown = set(raw) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise InvalidInput("config", f"unknown fields {sorted(unknown)}")
        timeout = _positive_or_none(raw.get("timeout_seconds"), "config.timeout_seconds")
        unresp = _positive_or_none(raw.get("unresponsive_seconds"), "config.unresponsive_seconds")
        max_attempts = raw.get("max_attempts", 1)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise InvalidInput("config.max_attempts", "must be an integer >= 1")
        retry = raw.get("retry_condition") or []
        if not isinstance(retry, list | tuple) or any(s not in AttemptStatus.values for s in retry):
            raise InvalidInput(
                "config.retry_condition", f"must be a list of {sorted(AttemptStatus.values)}"
            )
        return cls(timeout, unresp, max_attempts, tuple(retry))

    def as_json(self) -> dict[str, Any]:
        return {
            "timeout_seconds": self.timeout_seconds,
            "unresponsive_seconds": self.unresponsive_seconds,
            "max_attempts": self.max_attempts,
            "retry_condition": list(self.retry_condition),
        }


def _positive_or_none(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidInput(name, "must be a positive number or null")
    if not value <= MAX_LIMIT_SECONDS:  # also NaN and infinity
        raise InvalidInput(name, f"must be at most {MAX_LIMIT_SECONDS:.0f} seconds")
    return float(value)


def check_limit_seconds(value: Any, name: str) -> None:
    """A non-negative limit in seconds within MAX_LIMIT_SECONDS, or None (InvalidInput)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidInput(name, "must be a number >= 0")
    if not value <= MAX_LIMIT_SECONDS:
        raise InvalidInput(name, f"must be at most {MAX_LIMIT_SECONDS:.0f} seconds")


def rollout_status_for_attempt(
    attempt_status: str, sequence_id: int, config: RolloutConfig
) -> str:
    """What a rollout becomes when its latest attempt reaches `attempt_status`."""
    if attempt_status in (AttemptStatus.PREPARING, AttemptStatus.RUNNING, AttemptStatus.SUCCEEDED):
        return attempt_status
    if attempt_status in config.retry_condition and sequence_id < config.max_attempts:
        return RolloutStatus.REQUEUING
    return RolloutStatus.FAILED


def check_attempt_transition(current: str, requested: str) -> bool:
    """True when an attempt may go from `current` to `requested`; False for a no-op.

    Raises ValueError for an illegal move (the caller wraps it with ids).
    """
    if current == requested:
        return False
    if current in ATTEMPT_FINAL:
        raise ValueError("a finished attempt keeps the verdict its runner gave")
    if requested == AttemptStatus.PREPARING:
        raise ValueError("an attempt never goes back to preparing")
    if current == AttemptStatus.TIMEOUT and requested in ATTEMPT_LIVE:
        raise ValueError("a timed-out attempt is not revived")
    return True


def check_rollout_transition(current: str, requested: str, *, explicit: bool = False) -> bool:
    """True when a rollout may go from `current` to `requested`; False for a no-op.
    `explicit`: the algorithm's own command, which may leave a terminal status."""
    if requested not in RolloutStatus.values:
        raise ValueError(f"unknown rollout status {requested!r}")
    if current == requested:
        return False
    if current in ROLLOUT_TERMINAL and not explicit:
        raise ValueError("terminal rollouts stay terminal")
    return True
