"""The cost ledger's writes that are not an attempt's verdict (those are written by the
verdict itself: store/services/_ledger.py)."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from store.models import Project, UsageEntry
from store.services._ledger import Usage, cost_of


def usage_record_step(*, project: Project, group_id: int | None, usage: Usage,
                      now: datetime | None = None) -> UsageEntry:
    """A training step's ledger row (or a gang member's part of one). Call it inside the
    transaction that finishes the step, or that checks the member's try (it refuses to run
    outside one), so the row commits with what justifies it."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("usage_record_step runs in the step's finishing transaction")
    return UsageEntry.objects.create(
        project=project, kind=UsageEntry.Kind.STEP, group_id=group_id,
        cpu_seconds=usage.cpu_seconds, gpu_seconds=usage.gpu_seconds, gpu_type=usage.gpu_type,
        tokens=0, cost=cost_of(usage, 0), created_at=now or timezone.now())
