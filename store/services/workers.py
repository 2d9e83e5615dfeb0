from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from store.errors import InvalidInput
from store.models import Project, Worker
from store.services._rows import LiveKey, require_key_live


def worker_update(
    *, project: Project, worker_id: str, heartbeat_stats: dict[str, Any] | None = None,
    live_key: LiveKey | None = None,
) -> Worker:
    """A worker's heartbeat (AGL update_worker): records its stats and the time. With
    `live_key` (a lean request's key), KeyNotLive and nothing written unless it is live."""
    if not worker_id or len(worker_id) > 200:
        raise InvalidInput("worker_id", "must be 1-200 characters")
    if heartbeat_stats is not None and not isinstance(heartbeat_stats, dict):
        raise InvalidInput("heartbeat_stats", "must be an object")
    now = timezone.now()
    row = Worker(
        project=project, worker_id=worker_id, heartbeat_stats=heartbeat_stats,
        last_heartbeat_time=now,
    )
    fields = ["last_heartbeat_time"] + (["heartbeat_stats"] if heartbeat_stats is not None else [])
    with transaction.atomic():
        require_key_live(live_key)
        Worker.objects.bulk_create(
            [row], update_conflicts=True, unique_fields=["project", "worker_id"],
            update_fields=fields,
        )
    return Worker.objects.get(project=project, worker_id=worker_id)
