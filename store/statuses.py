"""The store's status enums and the sets of them the rules name (no database, no other
module of ours: store/rules.py and store/statemachine.py both build on it)."""

from __future__ import annotations

from django.db import models


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
