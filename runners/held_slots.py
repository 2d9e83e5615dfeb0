"""Worker slots held by attempts the store already ended (runners.models.HeldSlot): recorded
by the executor while such an agent runs on (runners/stopping.py), read by queue_watch, the
job page and /metrics."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from runners.models import HeldSlot
from store.models import Attempt

# Rows older than this were left by a process that died: they are removed by the reconcile.
FORGET_AFTER_SECONDS = 600.0


def stale_after_seconds() -> float:
    """A row not refreshed for this long is no longer counted (its process is gone)."""
    return max(3 * settings.RUNNERS_HEARTBEAT_SECONDS, 30.0)


@dataclass(frozen=True)
class HeldSlotRecorder:
    """The executor's `HeldSlots` for the rollout tasks (runners.services.rollout_run)."""

    project_id: int
    worker_id: str

    def mark(self, *, rollout_id: str, attempt_id: str) -> None:
        status = (Attempt.objects.filter(rollout_id=rollout_id, attempt_id=attempt_id)
                  .values_list("status", flat=True).first()) or "ended"
        now = timezone.now()
        HeldSlot.objects.bulk_create(
            [HeldSlot(rollout_id=rollout_id, attempt_id=attempt_id, project_id=self.project_id,
                      worker_id=self.worker_id, attempt_status=status, since=now, seen=now)],
            update_conflicts=True, unique_fields=["rollout_id", "attempt_id"],
            update_fields=["worker_id", "attempt_status", "seen"],
        )

    def release(self, *, rollout_id: str, attempt_id: str) -> None:
        HeldSlot.objects.filter(rollout_id=rollout_id, attempt_id=attempt_id).delete()


def held_slots(*, project_id: int | None = None) -> list[HeldSlot]:
    """Slots held now (rows refreshed recently), oldest first."""
    cutoff = timezone.now() - timedelta(seconds=stale_after_seconds())
    rows = HeldSlot.objects.filter(seen__gte=cutoff)
    if project_id is not None:
        rows = rows.filter(project_id=project_id)
    return list(rows.order_by("since"))


def held_slots_forget() -> int:
    """Remove the rows of processes that died (the reconcile's)."""
    cutoff = timezone.now() - timedelta(seconds=FORGET_AFTER_SECONDS)
    return HeldSlot.objects.filter(seen__lt=cutoff).delete()[0]
