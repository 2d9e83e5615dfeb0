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
from dataclasses import dataclass

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from store import services
from store.models import ApiKey, Project

RUNNER = ApiKey.Role.RUNNER.value
ALGORITHM = ApiKey.Role.ALGORITHM.value
ADMIN = ApiKey.Role.ADMIN.value
ANY_ROLE = frozenset({RUNNER, ALGORITHM, ADMIN})
ALGORITHM_ROLES = frozenset({ALGORITHM, ADMIN})
ADMIN_ONLY = frozenset({ADMIN})


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


# A key checked in the last few seconds is not looked up again (one query less per request);
# so a revoked key may keep working for up to this long in a process that just used it.
KEY_CACHE_SECONDS = 5.0
_KEY_CACHE_MAX = 1024
_key_cache: dict[str, tuple[float, ApiKey]] = {}
_key_cache_lock = threading.Lock()


def authenticate_key(raw: str) -> ApiKey | None:
    digest = hashlib.sha256(raw.encode()).hexdigest()
    now = time.monotonic()
    with _key_cache_lock:
        hit = _key_cache.get(digest)
    if hit is not None and hit[0] > now:
        return hit[1]
    key = services.api_key_authenticate(raw=raw)
    if key is not None:
        with _key_cache_lock:
            if len(_key_cache) >= _KEY_CACHE_MAX:
                _key_cache.clear()
            _key_cache[digest] = (now + KEY_CACHE_SECONDS, key)
    return key


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[KeyPrincipal, ApiKey] | None:
        raw = raw_key_from_header(get_authorization_header(request))
        if raw is None:
            return None
        key = authenticate_key(raw)
        if key is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
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
