"""Authentication (project API keys) and roles, in one place.

A key is sent as `Authorization: Bearer KEY` (our client) or as HTTP Basic with the key as the
password (`http://runner:KEY@host:port`, which AGL 0.3's `LightningStoreClient` and its OTLP
exporter turn into `Basic base64("runner:KEY")`). Every view then works inside the key's
project only; ids of another project are simply not found.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from store import services, waits
from store.models import ApiKey, Project
from store.services._rows import pk_only

RUNNER = ApiKey.Role.RUNNER.value
ALGORITHM = ApiKey.Role.ALGORITHM.value
ADMIN = ApiKey.Role.ADMIN.value
SITE_ADMIN = ApiKey.Role.SITE_ADMIN.value
ANY_ROLE = frozenset({RUNNER, ALGORITHM, ADMIN, SITE_ADMIN})
ALGORITHM_ROLES = frozenset({ALGORITHM, ADMIN, SITE_ADMIN})
ADMIN_ONLY = frozenset({ADMIN, SITE_ADMIN})
# Creating projects is the site's business, not a tenant's: a project's admin key could
# create any number of projects and learn which names exist.
SITE_ADMIN_ONLY = frozenset({SITE_ADMIN})
# The roles a new project gets a key for (POST /v1/projects).
PROJECT_ROLES = (RUNNER, ALGORITHM, ADMIN)


@dataclass(frozen=True)
class KeyPrincipal:
    """`request.user` of a request authenticated by a project key."""

    project: Project
    role: str
    key_name: str

    is_authenticated = True
    is_anonymous = False
    is_staff = False
    is_superuser = False

    @property
    def pk(self) -> str:  # DRF throttles and logging like a primary key
        return f"{self.project.pk}/{self.key_name}"


def raw_key_from_header(header: bytes) -> str | None:
    """The key in an Authorization header, or None when there is none."""
    parts = header.split()
    if not parts:
        return None
    scheme = parts[0].lower()
    if len(parts) != 2 or scheme not in (b"bearer", b"basic"):
        raise exceptions.AuthenticationFailed("Authorization must be 'Bearer KEY' or Basic auth")
    if scheme == b"bearer":
        return parts[1].decode("latin-1")
    try:
        decoded = base64.b64decode(parts[1], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise exceptions.AuthenticationFailed("malformed Basic credentials") from None
    user, _, password = decoded.partition(":")
    # The password part is the key; a URL with the key as the user name works too.
    return password or user


def authenticate_key(raw: str) -> ApiKey | None:
    """The live key, read from the database on every request: a revoked key is refused by
    the next request, in every process (no cache to outlive the revocation). The lean paths
    use `authenticate_key_lean`, whose cache holds only what never changes and leaves the
    liveness to each request's own statement."""
    return services.api_key_authenticate(raw=raw)


@dataclass(frozen=True)
class LeanKey:
    """What a lean path (store/api/fastpath.py, fastjson.py) knows of a request's key: its
    facts, and `live_check`: None when the key was just authenticated in full (read and
    compared in this request), else (pk, role): the request's own statement must find that
    key still live with that role (`live_key` of the services it calls)."""

    pk: int
    project: Project
    role: str
    name: str
    live_check: tuple[int, str] | None


# Per process: what keys authenticated in full (`authenticate_key`) are, by the sha256 of
# the raw key (never the key itself). A key's pk, project and hash never change; its
# liveness does (revoked, deleted), and its role may (the admin edits it): every lean
# request's statement checks both (store/services/_rows.py KEY_LIVE_SQL).
LEAN_CACHE_SIZE = 4096
# A cache hit older than this goes through `authenticate_key` once (its last_used_at
# bookkeeping: at most one write a minute per key).
LEAN_RECHECK_SECONDS = 60.0
_lean_cache: OrderedDict[bytes, tuple[int, int, str, str, str, float]] = OrderedDict()
_lean_lock = threading.Lock()


def lean_cache_clear() -> None:
    with _lean_lock:
        _lean_cache.clear()


def cached_key_lean(raw: str) -> LeanKey | None:
    """The key from this process's cache alone (no database: its liveness is left to the
    request's statement), or None on a miss (and once a minute per key)."""
    digest = hashlib.sha256(raw.encode()).digest()
    with _lean_lock:
        hit = _lean_cache.get(digest)
        if hit is None or time.monotonic() - hit[5] >= LEAN_RECHECK_SECONDS:
            return None
        _lean_cache.move_to_end(digest)
    pk, project_id, db, role, name, _ = hit
    # The project by its pk alone (its other fields load if ever read): never stale.
    project = pk_only(Project, db, project_id)
    return LeanKey(pk, project, role, name, (pk, role))


def authenticate_key_lean(raw: str, cached: bool = True) -> LeanKey | None:
    """The key for a lean path: from this process's cache (`cached_key_lean`), or
    authenticated in full (`authenticate_key`: read and compared, last_used_at kept) on a
    miss, once a minute per key, and always with `cached` False (the cache then updated);
    None when it is not a live key."""
    hit = cached_key_lean(raw) if cached else None
    if hit is not None:
        return hit
    digest = hashlib.sha256(raw.encode()).digest()
    clock = time.monotonic()
    key = authenticate_key(raw)
    with _lean_lock:
        if key is None:
            _lean_cache.pop(digest, None)
            return None
        _lean_cache[digest] = (key.pk, key.project_id, key._state.db, key.role, key.name,
                               clock)
        _lean_cache.move_to_end(digest)
        while len(_lean_cache) > LEAN_CACHE_SIZE:
            _lean_cache.popitem(last=False)
    return LeanKey(key.pk, key.project, key.role, key.name, None)


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[KeyPrincipal, ApiKey] | None:
        raw = raw_key_from_header(get_authorization_header(request))
        if raw is None:
            return None
        key = authenticate_key(raw)
        if key is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        waits.note_key(key.pk)
        return KeyPrincipal(project=key.project, role=key.role, key_name=key.name), key

    def authenticate_header(self, request: Request) -> str:
        # Makes DRF answer 401 (not 403) when the key is missing or wrong.
        return 'Bearer realm="lightning"'


class HasRole(BasePermission):
    """The key's role must be among the view's `<method>_roles` (default: any role)."""

    message = "this API key's role may not do this"

    def has_permission(self, request: Request, view: object) -> bool:
        user = request.user
        if not isinstance(user, KeyPrincipal):
            return False
        allowed = getattr(view, f"{request.method.lower()}_roles", ANY_ROLE)
        return user.role in allowed
