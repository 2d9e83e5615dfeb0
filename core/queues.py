"""The one list of Celery queue names. Every task declares its queue; every worker names the
queues it serves (`celery worker -Q rollouts`)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Queue(StrEnum):
    # CPU workers running agents, many processes per box.
    ROLLOUTS = "rollouts"
    # GPU workers running training steps, one process per GPU (-c 1).
    TRAINING = "training"
    # The sweep, reconciliation and housekeeping: small, frequent, must not wait behind rollouts.
    CONTROL = "control"


def route_task(name: str, args: Any, kwargs: Any, options: dict, task: Any = None,
               **kw: Any) -> dict[str, str] | None:
    """Celery router (CELERY_TASK_ROUTES): a task declares its queue as `lightning_queue`,
    `@shared_task(name=..., lightning_queue=Queue.ROLLOUTS.value)`. (Celery 5.7 deprecates the
    `queue` task attribute, and 6.0 will ignore it.)"""
    queue = getattr(task, "lightning_queue", None)
    return {"queue": str(queue)} if queue else None
