"""Dequeue with a brief long-poll, so idle runners wait on the server instead of hammering it."""

from __future__ import annotations

import time

from django.db.models import Q
from django.utils import timezone

from store import waits, wakeups
from store.models import Attempt, Project, Rollout
from store.services._rows import LiveKey
from store.services.rollouts import rollout_dequeue_many
from store.statemachine import QUEUED

MAX_DEQUEUE_WAIT_SECONDS = 20.0


def rollout_dequeue_wait(
    *, project: Project, worker_id: str | None = None, limit: int = 1, wait_seconds: float = 0.0,
    live_key: LiveKey | None = None,
) -> list[tuple[Rollout, Attempt]]:
    """Claim like `rollout_dequeue_many`; while nothing is queued, sleep until rollouts of the
    project are queued (store/wakeups.py: Postgres NOTIFY) and look again (a cheap read over
    the claim index), for up to `wait_seconds` (capped at 20 s). `live_key`: as
    `rollout_dequeue_many`'s, for every claim."""
    deadline = waits.deadline_for(min(max(wait_seconds, 0.0), MAX_DEQUEUE_WAIT_SECONDS))
    claimed = rollout_dequeue_many(project=project, worker_id=worker_id, limit=limit,
                                   live_key=live_key)
    if claimed or wait_seconds <= 0:
        return claimed
    waiter = wakeups.Waiter(wakeups.QUEUED, project.pk)
    while True:
        waiter.start()
        if _queue_has_work(project):
            claimed = rollout_dequeue_many(project=project, worker_id=worker_id,
                                           limit=limit, live_key=live_key)
            if claimed:
                return claimed
        remaining = deadline - time.monotonic()
        if remaining <= 0 or waits.defer(wakeups.QUEUED, project.pk, waiter.token, deadline):
            return claimed  # under a deferral the server waits, then reruns the request
        waiter.sleep(remaining)


def _queue_has_work(project: Project) -> bool:
    now = timezone.now()
    return (
        Rollout.objects.filter(project=project, status__in=QUEUED)
        .filter(Q(queue_deadline__isnull=True) | Q(queue_deadline__gt=now))
        .exists()
    )
