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

from store import rules
from store.errors import InvalidInput
from store.rules import MAX_LIMIT_SECONDS
from store.statuses import (
    ATTEMPT_ENDED,
    ATTEMPT_FINAL,
    ATTEMPT_LIVE,
    ATTEMPT_LOST,
    QUEUED,
    ROLLOUT_ACTIVE,
    ROLLOUT_TERMINAL,
    AttemptStatus,
    RolloutMode,
    RolloutStatus,
    WorkerStatus,
)

__all__ = [
    "ATTEMPT_ENDED", "ATTEMPT_FINAL", "ATTEMPT_LIVE", "ATTEMPT_LOST", "MAX_LIMIT_SECONDS",
    "QUEUED", "ROLLOUT_ACTIVE", "ROLLOUT_TERMINAL", "AttemptStatus", "RolloutConfig",
    "RolloutMode", "RolloutStatus", "WorkerStatus", "check_attempt_transition",
    "check_limit_seconds", "check_rollout_transition", "rollout_status_for_attempt",
]


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
    """What a rollout becomes when its latest attempt reaches `attempt_status`
    (rules.ROLLOUT_FOR_ATTEMPT, with the retry rule)."""
    return rules.ROLLOUT_FOR_ATTEMPT.python(attempt_status, sequence_id, config.retry_condition,
                                            config.max_attempts)


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
