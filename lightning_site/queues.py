"""The one list of Celery queue names. Every task declares its queue; every worker names the
queues it serves (`celery worker -Q rollouts`)."""

from __future__ import annotations

from enum import StrEnum


class Queue(StrEnum):
    # CPU workers running agents, many processes per box.
    ROLLOUTS = "rollouts"
    # GPU workers running training steps, one process per GPU (-c 1).
    TRAINING = "training"
    # The sweep, reconciliation and housekeeping: small, frequent, must not wait behind rollouts.
    CONTROL = "control"
