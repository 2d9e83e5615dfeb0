"""How queued rollouts are delivered: by a message (e.g. a Celery task) instead of a dequeue.

The store only records it; the app that sends messages (runners) decides what to send. A
message is a wake-up call, the row is the truth: these services tell the sender which rollouts
need a (new) message, and mark them sent in the same short transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import DateTimeField, F, Q, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from store.errors import InvalidInput
from store.models import Project, Rollout
from store.statemachine import QUEUED


@dataclass(frozen=True)
class Dispatch:
    """A rollout whose message must be sent (after the caller's transaction commits)."""

    project_id: int
    rollout_id: str
    dispatch: str
    target: str | None


def rollout_dispatch_set(
    *, project: Project, rollout_ids: Sequence[str], dispatch: str, target: str | None,
    now: datetime | None = None,
) -> list[Dispatch]:
    """Mark queued rollouts as delivered by `dispatch` running `target`, a message sent now.
    Returns the rollouts marked (rollouts no longer queued are left alone)."""
    if not dispatch or len(dispatch) > 16:
        raise InvalidInput("dispatch", "must be 1-16 characters")
    if target is not None and len(target) > 300:
        raise InvalidInput("target", "must be at most 300 characters")
    now = now or timezone.now()
    with transaction.atomic():
        ids = list(
            Rollout.objects.filter(project=project, pk__in=rollout_ids, status__in=QUEUED)
            .values_list("pk", flat=True)
        )
        # Never before the enqueue time: a batch's enqueue times are spread a microsecond
        # apart, and "enqueued after its last send" is how a requeued rollout is recognised.
        Rollout.objects.filter(pk__in=ids, status__in=QUEUED).update(
            dispatch=dispatch, dispatch_target=target,
            dispatched_at=Greatest(Value(now, output_field=DateTimeField()), F("enqueue_time")),
            dispatch_count=F("dispatch_count") + 1,
        )
    return [Dispatch(project.pk, rid, dispatch, target) for rid in ids]


def rollout_dispatch_unpublished(*, rollout_ids: Sequence[str]) -> int:
    """The messages of these rollouts could not be published (the broker was down): the next
    `rollout_dispatch_due` returns them at once, not after the re-send age."""
    return Rollout.objects.filter(pk__in=list(rollout_ids), status__in=QUEUED).update(
        dispatched_at=None
    )


def rollout_dispatch_due(
    *, resend_after_seconds: float, limit: int, now: datetime | None = None,
    project_id: int | None = None,
) -> list[Dispatch]:
    """Queued message-delivered rollouts whose message may be lost: never published (the
    broker was down, or a ticket found its project at its cap), requeued since their last
    send (a retry), or sent more than `resend_after_seconds` ago and still waiting; of one
    project with `project_id`. Marks them sent now (compare-and-swap under SKIP LOCKED), so
    concurrent sweeps send each once."""
    if limit < 1:
        raise InvalidInput("limit", "must be >= 1")
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=resend_after_seconds)
    with transaction.atomic():
        # Served by the partial index rollout_dispatch_due (queued, dispatch set).
        rows = list(
            Rollout.objects.select_for_update(skip_locked=True)
            .filter(status__in=QUEUED, dispatch__isnull=False)
            .filter(Q(dispatched_at__isnull=True) | Q(dispatched_at__lte=cutoff)
                    | Q(enqueue_time__gt=F("dispatched_at")))
            .filter(**({"project_id": project_id} if project_id is not None else {}))
            .order_by(F("dispatched_at").asc(nulls_first=True))
            .values_list("pk", "project_id", "dispatch", "dispatch_target")[:limit]
        )
        Rollout.objects.filter(pk__in=[r[0] for r in rows]).update(
            dispatched_at=now, dispatch_count=F("dispatch_count") + 1
        )
    return [Dispatch(project_id, pk, dispatch, target) for pk, project_id, dispatch, target in rows]
