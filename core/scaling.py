"""The scaling signal: how many workers each Celery queue wants (README "Scaling").

KEDA's guidance for queue workers is to scale on (queued + running) / concurrency per worker,
not on the raw queue length: counting what runs keeps a busy worker from being scaled away
mid-task. Apps report their queue's backlog through a registry (the store's Celery rollouts
for `rollouts`, the trainer's steps for `training`), so the reader (`runners.selectors`,
`/metrics`) needs no import of the app that owns the rows:

    from core.scaling import register_backlog
    register_backlog("training", trainer.selectors.training_backlog)

A backlog function takes no arguments and returns (queued, running).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings

Backlog = Callable[[], tuple[int, int]]
_backlogs: dict[str, Backlog] = {}


def register_backlog(queue: str, backlog: Backlog) -> Backlog:
    """Register (or replace) how `queue`'s backlog is counted."""
    _backlogs[queue] = backlog
    return backlog


def backlog_of(queue: str) -> tuple[int, int] | None:
    """(queued, running) of `queue`, or None when no app counts it (it is not scaled)."""
    backlog = _backlogs.get(queue)
    return backlog() if backlog else None


@dataclass(frozen=True)
class ScaleBounds:
    minimum: int
    maximum: int
    # Slots one worker of this queue brings (celery -c); 0: the mean of the live workers'.
    slots_per_worker: int


def bounds(queue: str) -> ScaleBounds:
    """The bounds of `queue` from settings: SCALE_<QUEUE>_MIN_WORKERS, _MAX_WORKERS and
    _SLOTS_PER_WORKER (a queue without them: 0, 0, 1)."""
    prefix = f"SCALE_{queue.upper()}_"
    return ScaleBounds(getattr(settings, prefix + "MIN_WORKERS", 0),
                       getattr(settings, prefix + "MAX_WORKERS", 0),
                       getattr(settings, prefix + "SLOTS_PER_WORKER", 1))


def desired_workers(*, queued: int, running: int, slots_per_worker: int,
                    minimum: int, maximum: int) -> int:
    """ceil((queued + running) / slots per worker), within [minimum, maximum]."""
    wanted = math.ceil((queued + running) / max(1, slots_per_worker))
    return max(minimum, min(maximum, wanted))
