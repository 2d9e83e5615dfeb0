"""Versioned resources: an id names an immutable history of versions; "latest" is the most
recently updated id of the project."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from store.errors import InvalidInput, NotFound, ResourceInUse
from store.ids import new_resources_id
from store.models import Project, ResourceSet, ResourceVersion, Rollout
from store.statemachine import ROLLOUT_TERMINAL


def _check(resources: Any) -> None:
    if not isinstance(resources, dict):
        raise InvalidInput("resources", "must be an object of name -> resource")
    for name, value in resources.items():
        if not isinstance(value, dict):
            raise InvalidInput(f"resources.{name}", "must be an object")


def resources_add(*, project: Project, resources: dict[str, Any]) -> ResourceVersion:
    """Create a new resources id at version 1."""
    return resources_update(project=project, resources_id=new_resources_id(), resources=resources)


def resources_update(
    *, project: Project, resources_id: str, resources: dict[str, Any]
) -> ResourceVersion:
    """Append a version to `resources_id`, creating the id if it does not exist (AGL)."""
    _check(resources)
    if not resources_id or len(resources_id) > 40:
        raise InvalidInput("resources_id", "must be 1-40 characters")
    now = timezone.now()
    with transaction.atomic():
        rs = _lock_or_create(project, resources_id, now)
        rs.version += 1
        rs.update_time = now
        rs.save(update_fields=["version", "update_time"])
        version = ResourceVersion.objects.create(
            resource_set=rs, version=rs.version, resources=resources, created_at=now
        )
    version.resource_set = rs
    return version


def _lock_or_create(project: Project, resources_id: str, now) -> ResourceSet:
    """The project's set named `resources_id`, locked; created at version 0 if missing (a
    concurrent creator of the same id wins the unique key, and we lock its row instead)."""
    for _ in range(2):
        rs = (ResourceSet.objects.select_for_update()
              .filter(project=project, resources_id=resources_id).first())
        if rs is not None:
            return rs
        try:
            with transaction.atomic():
                return ResourceSet.objects.create(
                    project=project, resources_id=resources_id, version=0, create_time=now,
                    update_time=now,
                )
        except IntegrityError:
            continue
    raise NotFound("resources", resources_id)  # created and deleted under our feet


def resources_delete(*, project: Project, resources_id: str) -> None:
    """Delete a resources id with all its versions; refused while an unfinished rollout
    still refers to it (ResourceInUse)."""
    with transaction.atomic():
        rs = (
            ResourceSet.objects.select_for_update()
            .filter(project=project, resources_id=resources_id)
            .first()
        )
        if rs is None:
            raise NotFound("resources", resources_id)
        in_use = Rollout.objects.filter(project=project, resources_id=resources_id).exclude(
            status__in=ROLLOUT_TERMINAL
        )
        if in_use.exists():
            raise ResourceInUse(f"resources {resources_id!r} are used by unfinished rollouts")
        rs.delete()


def resources_set_keep(
    *, project: Project, resources_id: str, version: int, keep: bool = True
) -> None:
    """Protect (or unprotect) a version from retention, e.g. the best checkpoint."""
    updated = ResourceVersion.objects.filter(
        resource_set__project=project, resource_set__resources_id=resources_id, version=version
    ).update(keep=keep)
    if not updated:
        raise NotFound("resources version", f"{resources_id}@{version}")


def resources_retain(
    *, keep_last: int, project: Project | None = None, resources_id: str | None = None
) -> int:
    """Delete old versions: keep the last `keep_last` of each id, every version marked keep,
    and every version an unfinished rollout pinned. Returns how many were deleted."""
    if keep_last < 1:
        raise InvalidInput("keep_last", "must be >= 1")
    sets = ResourceSet.objects.all()
    if project is not None:
        sets = sets.filter(project=project)
    if resources_id is not None:
        sets = sets.filter(resources_id=resources_id)
    deleted = 0
    for rs_id in sets.values_list("pk", flat=True).iterator():
        deleted += _retain_one(rs_id, keep_last)
    return deleted


def _retain_one(rs_pk: str, keep_last: int) -> int:
    with transaction.atomic():
        # Waits for enqueues that hold a share lock on this id while pinning its version.
        rs = ResourceSet.objects.select_for_update().filter(pk=rs_pk).first()
        if rs is None or rs.version <= keep_last:
            return 0
        in_use = Rollout.objects.filter(
            project_id=rs.project_id, resources_id=rs.resources_id
        ).exclude(status__in=ROLLOUT_TERMINAL)
        pinned = set(in_use.values_list("resources_version", flat=True))
        doomed = ResourceVersion.objects.filter(
            resource_set=rs, version__lte=rs.version - keep_last, keep=False
        ).exclude(Q(version__in=pinned - {None}))
        count, _ = doomed.delete()
    return count
