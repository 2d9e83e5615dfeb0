"""A lean path for the hottest request of an AGL runner fleet: an OTLP/HTTP protobuf export to
`POST /v1/traces` (four of a rollout's six requests in the AGL-style workload).

The ASGI front (lightning_site/asgi.py) offers it the request first. It answers only the
well-formed common case (a valid key of a role the view allows, `Content-Type:
application/x-protobuf` without gzip, a body that parses, within every limit), through the
same code as the view (`otlp.export_spans`: parsing, limits, attribution, the store), with the
same status, body and headers (tests/api/test_api_fastpath.py compares them with Django's
answer). Anything else, an error included, returns None before anything is stored, and the
request goes through Django as always, which answers it as it always has. What it leaves out
is the per-request machinery, not behaviour: Django's middleware chain (sessions, CSRF, auth,
messages: unused by key-authenticated API calls), DRF's request wrapping, content negotiation
and renderers, and the connection health check (a broken connection fails the fast attempt,
and Django's path, with its health check, answers instead).

Switched off (everything through Django) when a setting would make Django's answer depend on
more than this request: an HTTPS redirect, HSTS, or a proxy's HTTPS header.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.http.request import split_domain_port, validate_host
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from store import watchdog
from store.api import limits, otlp
from store.api.auth import ANY_ROLE, LeanKey, authenticate_key_lean, raw_key_from_header
from store.api.base import CANCELLED_HEADER

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


class OnThread(NamedTuple):
    """What a lean call run on the ASGI front's event loop answers for a request it must not
    finish there (a statement that would wait for a WAL flush): the front runs `handler`
    (the same signature) on one of its threads instead, having stored nothing."""

    handler: Callable[[dict[bytes, bytes], str, bytes], Answer | None]


def enabled() -> bool:
    return not (settings.SECURE_SSL_REDIRECT or settings.SECURE_HSTS_SECONDS
                or settings.SECURE_PROXY_SSL_HEADER)


# _headers' answer, made once from the settings it reads (a settings read costs a lookup
# through Django's lazy settings object each: several per request); forgotten, as the
# hosts' verdicts below, when a setting changes (tests' override_settings).
_security_headers: tuple[tuple[bytes, bytes], ...] | None = None


@receiver(setting_changed)
def _forget_settings(**kwargs: Any) -> None:
    global _security_headers
    _security_headers = None
    _hosts_seen.clear()


def _headers() -> list[tuple[bytes, bytes]]:
    """The headers Django's path gives a successful OTLP answer (DRF's Allow, the security
    and clickjacking middleware's): a new list each time (callers change it)."""
    global _security_headers
    made = _security_headers
    if made is None:
        made = _security_headers = tuple(_made_headers())
    return list(made)


def _made_headers() -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", otlp.PROTOBUF.encode()), (b"allow", b"POST, OPTIONS")]
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append((b"x-content-type-options", b"nosniff"))
    if settings.SECURE_REFERRER_POLICY:
        policy = settings.SECURE_REFERRER_POLICY
        policy = policy if isinstance(policy, str) else ",".join(policy)
        headers.append((b"referrer-policy", policy.encode()))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append((b"cross-origin-opener-policy",
                        settings.SECURE_CROSS_ORIGIN_OPENER_POLICY.encode()))
    if settings.X_FRAME_OPTIONS:
        headers.append((b"x-frame-options", settings.X_FRAME_OPTIONS.upper().encode()))
    return headers


_hosts_seen: dict[str, bool] = {}  # host -> allowed, under the settings now


def _host_allowed(host: str) -> bool:
    """Django's Host check (`HttpRequest.get_host`), remembered per host (a runner sends the
    same Host on every request) until a setting changes."""
    verdict = _hosts_seen.get(host)
    if verdict is None:
        allowed = settings.ALLOWED_HOSTS
        if settings.DEBUG and not allowed:
            allowed = [".localhost", "127.0.0.1", "[::1]"]
        domain, _ = split_domain_port(host)
        verdict = bool(domain) and validate_host(domain, allowed)
        if len(_hosts_seen) < 256:  # hosts are whatever clients send: bounded
            _hosts_seen[host] = verdict
    return verdict


def lean_key(headers: dict[bytes, bytes], roles: frozenset) -> LeanKey | None:
    """The key of a request a lean path (this module, fastjson.py) may answer: an allowed
    Host, a well-formed Authorization with a live key of one of `roles`; else None (Django
    answers). From this process's cache after the first request: the key's liveness is then
    checked by the service call's own statement (a dead key: Django's path answers 401)."""
    if not _host_allowed(headers.get(b"host", b"").decode("latin-1")):
        return None
    try:
        raw = raw_key_from_header(headers.get(b"authorization", b""))
        if raw is None:
            return None
        key = authenticate_key_lean(raw)  # a database error: Django's path answers (503)
    except Exception:
        return None
    if key is None or key.role not in roles:
        return None
    return key


def otlp_traces(headers: dict[bytes, bytes], body: bytes) -> Answer | None:
    """The answer to `POST /v1/traces`, or None: let Django answer."""
    if headers.get(b"content-type", b"").strip().lower() != otlp.PROTOBUF.encode():
        return None
    if headers.get(b"content-encoding") or not body or len(body) > limits.MAX_BODY_BYTES:
        return None
    key = lean_key(headers, frozenset(getattr(otlp.OtlpTracesView, "post_roles", ANY_ROLE)))
    if key is None:
        return None
    message = ExportTraceServiceRequest()
    try:
        message.ParseFromString(body)
        otlp.check_resource_copies(message, len(body))  # OtlpTracesView.check
    except Exception:  # Django's path words the refusal
        return None
    project = key.project
    watchdog.sweep_on_call(project.pk)
    try:
        reply, cancelled = otlp.export_spans(project, message, key.live_check)
    except Exception:
        # Refused before anything was stored (limits, bad text: the transaction rolled
        # back); Django's path refuses it again, in its words.
        log.debug("OTLP fast path: falling back to Django", exc_info=True)
        return None
    answer = _headers()
    if cancelled:
        answer.append((CANCELLED_HEADER.lower().encode(), ",".join(sorted(cancelled)).encode()))
    return 200, answer, reply.SerializeToString()
