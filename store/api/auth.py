"""Authentication (project API keys) and roles, in one place.

A key is sent as `Authorization: Bearer KEY` (our client) or as HTTP Basic with the key as the
password (`http://runner:KEY@host:port`, which AGL 0.3's `LightningStoreClient` and its OTLP
exporter turn into `Basic base64("runner:KEY")`). Every view then works inside the key's
project only; ids of another project are simply not found.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from store import services, waits
from store.models import ApiKey, Project

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
    the next request, in every process (no cache to outlive the revocation)."""
    return services.api_key_authenticate(raw=raw)


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
