"""The admin's login, throttled: after ADMIN_LOGIN_MAX_FAILURES failed logins for one user
name (or four times that from one client address) within ADMIN_LOGIN_LOCKOUT_SECONDS, further
attempts answer 429 with Retry-After until the window has passed, the right password included.

Counts live in Django's cache, which settings leave at its default, each process's memory:
under gunicorn with N workers, a guesser gets at most N times the limit per window."""

from __future__ import annotations

import hashlib
import time

from django.conf import settings
from django.contrib import admin
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse


def _keys(request: HttpRequest) -> list[tuple[str, int]]:
    limit = settings.ADMIN_LOGIN_MAX_FAILURES
    user = request.POST.get("username", "").strip().lower()
    address = request.META.get("REMOTE_ADDR", "")
    digest = hashlib.sha256(user.encode()).hexdigest()[:32]
    return [(f"admin-login:user:{digest}", limit), (f"admin-login:addr:{address}", 4 * limit)]


def _locked_until(keys: list[tuple[str, int]]) -> float:
    until = 0.0
    for key, limit in keys:
        failures = [t for t in cache.get(key, []) if t > time.time()]
        if len(failures) >= limit:
            until = max(until, min(failures))
    return until


def _record_failure(keys: list[tuple[str, int]]) -> None:
    window = settings.ADMIN_LOGIN_LOCKOUT_SECONDS
    expires = time.time() + window
    for key, limit in keys:
        failures = [t for t in cache.get(key, []) if t > time.time()][-(limit - 1):] if limit > 1 \
            else []
        cache.set(key, [*failures, expires], timeout=window)


def throttled_login(request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
    if request.method != "POST":
        return admin.site.login(request, extra_context)
    keys = _keys(request)
    until = _locked_until(keys)
    if until:
        wait = max(1, int(until - time.time()) + 1)
        response = HttpResponse(
            f"Too many failed logins; try again in {wait} seconds.\n", status=429,
            content_type="text/plain; charset=utf-8")
        response["Retry-After"] = str(wait)
        return response
    response = admin.site.login(request, extra_context)
    # Django's login view answers a failed login with the form again (200), a success with a
    # redirect.
    if response.status_code == 200:
        _record_failure(keys)
    else:
        cache.delete(keys[0][0])
    return response
