from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from store.errors import InvalidInput
from store.models import ApiKey, Project
from store.services import _rows

KEY_PREFIX_LEN = 12


def project_create(*, name: str, description: str = "") -> Project:
    if not name or Project._meta.get_field("name").max_length < len(name):
        raise InvalidInput("name", "must be 1-100 characters")
    if Project.objects.filter(name=name).exists():
        raise InvalidInput("name", f"project {name!r} already exists")
    return Project.objects.create(name=name, description=description)


# What `project_quota_set` leaves as it is when not given (None means "no cap").
UNCHANGED: Any = object()


def project_quota_set(*, project: Project, gpu_seconds_per_day: float | None = UNCHANGED
                      ) -> Project:
    """Set the project's quotas (README "Quotas"); a cap given as None removes it, one not
    given stays. A cap must be a finite number >= 0 (0: hold every training step)."""
    changes: dict[str, Any] = {}
    if gpu_seconds_per_day is not UNCHANGED:
        changes["gpu_seconds_per_day"] = _cap("gpu_seconds_per_day", gpu_seconds_per_day)
    if changes:
        Project.objects.filter(pk=project.pk).update(**changes)
        project.refresh_from_db(fields=list(changes))
    return project


def _cap(field: str, value: Any) -> float | None:
    if value is None:
        return None
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or value < 0):
        raise InvalidInput(field, f"must be a finite number >= 0 or null (no cap), got {value!r}")
    return float(value)


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def api_key_create(*, project: Project, role: str, name: str = "") -> tuple[ApiKey, str]:
    """Create a key; returns the row and the raw key, which is never stored or shown again."""
    if role not in ApiKey.Role.values:
        raise InvalidInput("role", f"must be one of {ApiKey.Role.values}")
    raw = "agl_" + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        project=project,
        role=role,
        name=name or role,
        prefix=raw[:KEY_PREFIX_LEN],
        hashed_key=_hash(raw),
    )
    return key, raw


def api_key_authenticate(*, raw: str) -> ApiKey | None:
    """The live key matching `raw`, compared in constant time, or None."""
    if not raw or len(raw) < KEY_PREFIX_LEN:
        return None
    if connection.vendor == "postgresql":  # a hand-written SELECT: every request runs it
        key = _rows.api_key_live(raw[:KEY_PREFIX_LEN])
    else:
        key = (
            ApiKey.objects.select_related("project")
            .filter(prefix=raw[:KEY_PREFIX_LEN], revoked_at__isnull=True)
            .first()
        )
    if key is None or not hmac.compare_digest(key.hashed_key, _hash(raw)):
        return None
    now = timezone.now()
    # Bookkeeping only: at most one write a minute per key.
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() > 60:
        with transaction.atomic():
            ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
    return key


def project_first_start(*, name: str, role: str) -> str | None:
    """A store's first start: create project `name` with one key of `role` and return the raw
    key (shown once); None when the project already exists (a later start)."""
    with transaction.atomic():
        if Project.objects.filter(name=name).exists():
            return None
        project = project_create(name=name, description="made by the store's first start")
        _, raw = api_key_create(project=project, role=role)
    return raw
