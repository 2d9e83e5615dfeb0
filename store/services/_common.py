"""Helpers shared by the services: deadlines, the rollout-follows-attempt rule, worker sync."""

from __future__ import annotations

from datetime import datetime

from django.db import connection
from django.db.models import F, Q

from store import rules
from store.errors import NotFound
from store.models import Attempt, Project, Rollout, Worker
from store.services._bulk import Write, write_together
from store.statemachine import (
    ATTEMPT_ENDED,
    ATTEMPT_LOST,
    QUEUED,
    ROLLOUT_TERMINAL,
    AttemptStatus,
    RolloutConfig,
    RolloutStatus,
    WorkerStatus,
    rollout_status_for_attempt,
)


def attempt_deadline(
    config: RolloutConfig, start: datetime, heartbeat: datetime | None
) -> datetime | None:
    """rules.DEADLINE for a live attempt of a rollout with this config."""
    return rules.DEADLINE.python(start, heartbeat, config.timeout_seconds,
                                 config.unresponsive_seconds, rules.first_report_seconds())


def queue_deadline(rollout: Rollout, now: datetime) -> datetime | None:
    return rules.after(now, rollout.queue_timeout_seconds)


def set_attempt_status(attempt: Attempt, status: str, now: datetime) -> None:
    """Apply an already-checked status change to an attempt instance."""
    previous = attempt.status
    attempt.status = status
    if status in ATTEMPT_ENDED:
        attempt.end_time = now
    if previous in ATTEMPT_LOST and status not in ATTEMPT_LOST:
        # A runner reported after the watchdog gave up on it: keep the watchdog's verdict too;
        # the watchdog's error goes unless the attempt failed (a failure's own error replaces it).
        metadata = {**(attempt.metadata or {}), "store.watchdog_verdict": previous}
        if status != AttemptStatus.FAILED:
            metadata.pop("error", None)
        attempt.metadata = metadata


def follow_latest_attempt(rollout: Rollout, attempt: Attempt, now: datetime) -> bool:
    """Make `rollout` follow its latest attempt's status; True when the rollout changed.

    Terminal rollouts stay terminal, and an attempt that is no longer the latest changes
    nothing but itself.
    """
    if not rules.FOLLOWS.python(rollout.status, rollout.latest_attempt_id, attempt.pk):
        return False
    config = RolloutConfig.parse(rollout.config)
    new = rollout_status_for_attempt(attempt.status, attempt.sequence_id, config)
    if new == rollout.status:
        return False
    rollout.status = new
    if new in ROLLOUT_TERMINAL:
        rollout.end_time = now
    elif new in QUEUED:
        # Back to the tail of the queue, with a fresh bound on the wait.
        rollout.enqueue_time = now
        rollout.queue_deadline = queue_deadline(rollout, now)
    return True


ROLLOUT_FOLLOW_FIELDS = ["status", "end_time", "enqueue_time", "queue_deadline"]


def worker_sync_for_attempts(project_id: int, attempts: list[Attempt], now: datetime) -> None:
    write_together(worker_writes_for_attempts(project_id, attempts, now))


def worker_writes_for_attempts(
    project_id: int, attempts: list[Attempt], now: datetime
) -> list[Write]:
    """AGL's worker bookkeeping: finished -> idle, lost -> unknown, otherwise busy."""
    rows: dict[str, Worker] = {}
    for attempt in attempts:
        if not attempt.worker_id:
            continue
        worker = Worker(project_id=project_id, worker_id=attempt.worker_id,
                        status=rules.WORKER_FOR_ATTEMPT.python(attempt.status))
        if worker.status == WorkerStatus.IDLE:
            worker.last_idle_time = now
        elif worker.status == WorkerStatus.BUSY:
            worker.last_busy_time = now
            worker.current_rollout_id = attempt.rollout_id
            worker.current_attempt_id = attempt.attempt_id
        rows[attempt.worker_id] = worker
    return _worker_upserts(list(rows.values()))


def worker_mark_dequeued(
    project_id: int, worker_id: str, claimed: list[Attempt], now: datetime
) -> None:
    worker = Worker(project_id=project_id, worker_id=worker_id, last_dequeue_time=now,
                    status=rules.WORKER_AFTER_CLAIM.python(bool(claimed)))
    if claimed:
        last = claimed[-1]
        worker.last_busy_time = now
        worker.current_rollout_id, worker.current_attempt_id = last.rollout_id, last.attempt_id
    else:
        worker.last_idle_time = now
    write_together(_worker_upserts([worker], extra=["last_dequeue_time"]))


def _worker_upserts(workers: list[Worker], extra: list[str] = ()) -> list[Write]:
    workers.sort(key=lambda w: w.worker_id)  # one lock order for every writer
    busy = [w for w in workers if w.status == WorkerStatus.BUSY]
    idle = [w for w in workers if w.status == WorkerStatus.IDLE]
    lost = [w for w in workers if w.status == WorkerStatus.UNKNOWN]
    groups = [
        (busy, ["status", "last_busy_time", "current_rollout_id", "current_attempt_id"]),
        (idle, ["status", "last_idle_time", "current_rollout_id", "current_attempt_id"]),
        (lost, ["status"]),
    ]
    return [
        Write.upsert(group, ["project", "worker_id"], fields + list(extra))
        for group, fields in groups if group
    ]


def get_rollout(project: Project, rollout_id: str, *, lock: bool = False) -> Rollout:
    qs = Rollout.objects.filter(project=project, pk=rollout_id)
    if lock:
        qs = qs.select_for_update()
    rollout = qs.first()
    if rollout is None:
        raise NotFound("rollout", rollout_id)
    return rollout


def attempt_filter(project: Project, rollout_id: str, attempt_id: str) -> Q:
    """Rows for `attempt_id` of a rollout; "latest" names the rollout's latest attempt."""
    base = Q(rollout_id=rollout_id, rollout__project=project)
    if attempt_id == "latest":
        return base & Q(rollout__latest_attempt_id=F("pk"))
    return base & Q(attempt_id=attempt_id)


def lock_resource_set_shared(project_id: int, resources_id: str) -> None:
    """Hold a share lock on a resources id until commit, so retention waits for us."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM store_resourceset WHERE project_id = %s AND resources_id = %s "
                "FOR SHARE",
                [project_id, resources_id],
            )


__all__ = [
    "ROLLOUT_FOLLOW_FIELDS",
    "RolloutStatus",
    "attempt_deadline",
    "attempt_filter",
    "follow_latest_attempt",
    "get_rollout",
    "lock_resource_set_shared",
    "queue_deadline",
    "set_attempt_status",
    "worker_mark_dequeued",
    "worker_sync_for_attempts",
    "worker_writes_for_attempts",
]
