"""Reads for operators: live workers per queue, and why work is waiting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.db.models import Count

from core import scaling
from core.queues import Queue
from runners.held_slots import held_slots
from runners.models import CeleryWorker
from store.models import Project, Rollout
from store.statemachine import QUEUED, ROLLOUT_TERMINAL, RolloutStatus


@dataclass(frozen=True)
class QueueState:
    queue: str
    live_workers: list[str]
    cuda_workers: list[str]
    # Why work sent to this queue would wait (None: a live worker serves it).
    waiting_reason: str | None
    # Slots still running an agent whose attempt the store already ended (runners/stopping.py).
    held_by_ended: int = 0
    # The scaling signal (core/scaling.py): None for a queue no app counts.
    load: QueueLoad | None = None


@dataclass(frozen=True)
class QueueLoad:
    queued: int
    running: int
    # Slots of the live workers serving the queue (the sum of their concurrency).
    slots: int
    slots_per_worker: int
    desired_workers: int

    def describe(self) -> str:
        return (f"{self.queued} queued, {self.running} running, {self.slots} live slots: "
                f"{self.desired_workers} worker(s) wanted at {self.slots_per_worker} slot(s) "
                f"each")


def celery_workers_live() -> list[CeleryWorker]:
    return list(CeleryWorker.objects.filter(status=CeleryWorker.Status.ALIVE).order_by("name"))


def queue_state(*, queue: str, needs_cuda: bool = False,
                live: list[CeleryWorker] | None = None) -> QueueState:
    """Who serves `queue`; with `needs_cuda`, work that only a CUDA worker may take waits
    until one serves the queue."""
    live = celery_workers_live() if live is None else live
    serving = [w for w in live if queue in (w.queues or [])]
    cuda = [w.name for w in serving if w.cuda_devices]
    reason = None
    if not serving:
        reason = f"no live worker serves queue '{queue}'"
    elif needs_cuda and not cuda:
        reason = (f"no live worker with CUDA serves queue '{queue}' "
                  f"({len(serving)} CPU-only worker(s) do)")
    held = len(held_slots()) if queue == Queue.ROLLOUTS.value else 0
    return QueueState(queue, [w.name for w in serving], cuda, reason, held,
                      queue_load(queue=queue, serving=serving))


def queue_load(*, queue: str, serving: list[CeleryWorker]) -> QueueLoad | None:
    """The queue's backlog against its live slots, and the workers it wants (KEDA's rule:
    (queued + running) / slots per worker, within the settings' bounds)."""
    backlog = scaling.backlog_of(queue)
    if backlog is None:
        return None
    queued, running = backlog
    bounds = scaling.bounds(queue)
    slots = sum(w.concurrency for w in serving)
    per_worker = bounds.slots_per_worker or (round(slots / len(serving)) if serving else 1)
    desired = scaling.desired_workers(queued=queued, running=running,
                                      slots_per_worker=per_worker,
                                      minimum=bounds.minimum, maximum=bounds.maximum)
    return QueueLoad(queued, running, slots, max(1, per_worker), desired)


def celery_rollout_backlog() -> tuple[int, int]:
    """(queued, running) rollouts delivered by Celery messages: those the rollout workers
    serve (a remote runner's rollouts, dispatch None, are not theirs to scale for)."""
    live = (RolloutStatus.PREPARING, RolloutStatus.RUNNING)
    counts = dict(Rollout.objects.filter(dispatch__isnull=False, status__in=[*QUEUED, *live])
                  .values_list("status").annotate(n=Count("pk")).order_by())
    return (sum(counts.get(s, 0) for s in QUEUED), sum(counts.get(s, 0) for s in live))


def live_worker_devices(queue: str) -> list[tuple[str, list[dict]]]:
    """(name, registered CUDA devices) of each live worker serving `queue`."""
    return [(w.name, list(w.cuda_devices or [])) for w in celery_workers_live()
            if queue in (w.queues or [])]


def queue_states() -> list[QueueState]:
    live = celery_workers_live()
    return [queue_state(queue=q.value, live=live) for q in Queue]


@dataclass(frozen=True)
class ProjectQueue:
    by_status: dict[str, int]
    celery_waiting: int  # queued rollouts delivered by Celery messages
    waiting_reason: str | None


def project_queue(*, project: Project) -> ProjectQueue:
    """A project's rollouts by status, and why its Celery rollouts wait, if they do."""
    by_status: dict[str, int] = {}
    rows = Rollout.objects.filter(project=project).values_list("status", "dispatch")
    waiting = 0
    for status, dispatch in rows.iterator():
        by_status[status] = by_status.get(status, 0) + 1
        waiting += status in QUEUED and dispatch is not None
    reason = queue_state(queue=Queue.ROLLOUTS.value).waiting_reason if waiting else None
    return ProjectQueue(by_status, waiting, reason)


def rollouts_by_status(*, project: Project, rollout_ids: Sequence[str] | None = None
                       ) -> dict[str, int]:
    """Counts by status of a project's rollouts (or of the listed ones)."""
    qs = Rollout.objects.filter(project=project)
    if rollout_ids is not None:
        qs = qs.filter(pk__in=list(rollout_ids))
    return dict(qs.values_list("status").annotate(n=Count("pk")).order_by())


def finished_count(by_status: dict[str, int]) -> int:
    return sum(n for status, n in by_status.items() if status in ROLLOUT_TERMINAL)


def open_rollout_ids(*, project: Project) -> list[str]:
    """The project's rollouts not finished yet (served by the project-status index)."""
    return list(Rollout.objects.filter(project=project).exclude(status__in=ROLLOUT_TERMINAL)
                .values_list("pk", flat=True))
