"""A lean path for the JSON requests of an AGL runner's loop: `POST
/v1/agl/queues/rollouts/dequeue` (without a wait), `POST
/v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}` (the attempt update that reports the
verdict), and the two AGL 0.3's client sends for a span it adds as JSON
(`add_otel_span`, and a reward the rollout function returns): `POST /v1/agl/spans/next` and
`POST /v1/agl/spans`; the resources read AGL's runner sends before every rollout, `GET
/v1/agl/resources/{resources_id}` (without a query); and its worker heartbeat, `POST
/v1/agl/workers/{worker_id}`; as store/api/fastpath.py is for OTLP exports.

The ASGI front (lightning_site/asgi.py) offers it these requests first (`route`). It answers
only the common well-formed case: a valid key of a role the view allows, `Content-Type:
application/json` with an `Accept` that DRF answers as plain JSON, no query string, a body
that is a JSON object whose fields the view's own serializer fields accept (each field's
`run_validation`, as `Serializer.is_valid` runs them, without copying the serializer's
fields per request). It then calls the same service code as the view and renders the same
serializer output with the same renderer (JSONNullRenderer), with the same headers
(tests/api/test_api_fastjson.py compares status, headers and body with Django's answer).
Anything else, an error included, returns None before anything is stored, and Django answers
as it always has:

- a dequeue with `wait_seconds` > 0 is answered here only when it claims something (the
  claim then records the worker as busy, as Django's first look would); when the queue is
  empty nothing is stored (the worker is not marked idle) and the request goes through Django,
  whose long-poll waits via the front's deferral;
- an attempt update whose service call fails (unknown attempt, illegal move) rolled back and
  is answered by Django, in its words;
- `spans/next` is one UPDATE of the rollout's counter in autocommit that checks the key too;
  an unknown rollout (or another project's) reserves nothing and Django answers 404;
- a span is the OTLP export's one statement (`services.span_add_lean`); where that statement
  leaves the work to the full path (unknown or unresponsive attempt, a dead key, text the
  database refuses) it wrote nothing and Django answers;
- a resources read is one SELECT of the latest version that checks the key too; an unknown id
  (or another project's) and a dead key are left to Django (404, 401). Its body must be empty
  and its `Accept` one DRF answers as plain JSON; `Content-Type` is not read (nor by Django).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from django.utils import timezone
from rest_framework.fields import SkipField, empty

from store import selectors, services, watchdog
from store.api import fastpath, limits
from store.api import serializers as s
from store.api import views as v
from store.api.auth import ANY_ROLE, LeanKey
from store.api.base import CANCELLED_HEADER, JSONNullRenderer
from store.services import _verdict
from store.services._rows import native_sql
from store.services.longpoll import rollout_dequeue_wait
from store.statemachine import ATTEMPT_FINAL

log = logging.getLogger(__name__)

Answer = fastpath.Answer
DEQUEUE_PATH = "/v1/agl/queues/rollouts/dequeue"
# The route labels Django's metrics middleware gives these requests (resolver_match.route).
DEQUEUE_ROUTE = DEQUEUE_PATH
ATTEMPT_ROUTE = "/v1/agl/rollouts/<str:rollout_id>/attempts/<str:attempt_id>"
SPANS_PATH = "/v1/agl/spans"
NEXT_SPAN_PATH = "/v1/agl/spans/next"
_ROLLOUTS_PREFIX = "/v1/agl/rollouts/"
_RESOURCES_PREFIX = "/v1/agl/resources/"
RESOURCE_ROUTE = "/v1/agl/resources/<str:resources_id>"
_WORKERS_PREFIX = "/v1/agl/workers/"
WORKER_ROUTE = "/v1/agl/workers/<str:worker_id>"
_ACCEPTS = (None, b"*/*", b"application/json")
_JSON = b"application/json"

_RENDERER = JSONNullRenderer()
_DEQUEUE_FIELDS = s.DequeueIn().fields
_UPDATE_FIELDS = s.UpdateAttemptIn().fields
_ATTEMPTED = s.AttemptedRolloutOut()
_ATTEMPT = s.AttemptOut()
_REFUSED_NULLS = ("status", "worker_id", "last_heartbeat_time", "metadata")
_NEXT_SPAN_FIELDS = s.NextSequenceIdIn().fields
_SPAN = s.SpanOut()


def _allow(view: type) -> bytes:
    """DRF's Allow header, of the view as Django sets it up (`head` follows `get`)."""
    instance = view()
    instance.setup(None)
    return ", ".join(instance.allowed_methods).encode()


def _roles(view: type) -> frozenset:
    return frozenset(getattr(view, "post_roles", ANY_ROLE))


_DEQUEUE_VIEW = v.DequeueRolloutsView
_DEQUEUE_ALLOW = _allow(_DEQUEUE_VIEW)
_DEQUEUE_ROLES = _roles(_DEQUEUE_VIEW)


def _attempt_view() -> type:
    from store.api.urls import AttemptEndpoint  # the class Django's URL resolves to

    return AttemptEndpoint


def _spans_view() -> type:
    from store.api.urls import SpansEndpoint

    return SpansEndpoint


def _worker_view() -> type:
    from store.api.urls import WorkerEndpoint

    return WorkerEndpoint


def _resource_view() -> type:
    from store.api.urls import ResourceEndpoint

    return ResourceEndpoint


_ATTEMPT_VIEW = _attempt_view()
_ATTEMPT_ALLOW = _allow(_ATTEMPT_VIEW)
_ATTEMPT_ROLES = _roles(_ATTEMPT_VIEW)
_SPANS_VIEW = _spans_view()
_SPANS_ALLOW = _allow(_SPANS_VIEW)
_SPANS_ROLES = _roles(_SPANS_VIEW)
_NEXT_SPAN_VIEW = v.NextSpanSequenceIdView
_NEXT_SPAN_ALLOW = _allow(_NEXT_SPAN_VIEW)
_NEXT_SPAN_ROLES = _roles(_NEXT_SPAN_VIEW)

_WORKER_VIEW = _worker_view()
_WORKER_ALLOW = _allow(_WORKER_VIEW)
_WORKER_ROLES = _roles(_WORKER_VIEW)
_WORKER_FIELDS = s.UpdateWorkerIn().fields
_WORKER = s.WorkerOut()

_RESOURCE_VIEW = _resource_view()
_RESOURCE_ALLOW = _allow(_RESOURCE_VIEW)
_RESOURCE_GET_ROLES = frozenset(getattr(_RESOURCE_VIEW, "get_roles", ANY_ROLE))
_RESOURCES = s.ResourcesUpdateOut()

Handler = Callable[[dict[bytes, bytes], str, bytes], Answer | None]


def route(method: str, path: str, query_string: bytes) -> tuple[str, Handler] | None:
    """The (route label, handler) of a request this path may answer, or None (cheap: it
    runs on the event loop)."""
    if query_string:
        return None
    if method == "GET":
        if path.startswith(_RESOURCES_PREFIX):
            resources_id = path[len(_RESOURCES_PREFIX):]
            if resources_id and "/" not in resources_id and resources_id != "latest":
                return RESOURCE_ROUTE, get_resources
        return None
    if method != "POST":
        return None
    if path == DEQUEUE_PATH:
        return DEQUEUE_ROUTE, dequeue
    if path == NEXT_SPAN_PATH:
        return NEXT_SPAN_PATH, next_span_sequence_id
    if path == SPANS_PATH:
        return SPANS_PATH, add_span
    if path.startswith(_WORKERS_PREFIX):
        worker_id = path[len(_WORKERS_PREFIX):]
        # workers/search is another view (search workers).
        if worker_id and "/" not in worker_id and worker_id != "search":
            return WORKER_ROUTE, update_worker
        return None
    if path.startswith(_ROLLOUTS_PREFIX):
        parts = path[len(_ROLLOUTS_PREFIX) :].split("/")
        # rollouts/<id>/attempts/search is another view (search attempts).
        if (
            len(parts) == 3
            and parts[1] == "attempts"
            and parts[2] != "search"
            and parts[0]
            and parts[2]
        ):
            return ATTEMPT_ROUTE, update_attempt
    return None


def _strict_constant(name: str) -> Any:
    raise ValueError(f"Out of range float values are not JSON compliant: {name!r}")


def _key(headers: dict[bytes, bytes], path: str, body: bytes, roles: frozenset
         ) -> LeanKey | None:
    """The request's key when the request is one this path answers as Django would. From
    this process's cache after the first request: its liveness is then checked by the
    service call's own statement (`live_key`), and a dead key falls back to Django (401)."""
    if headers.get(b"content-type", b"").strip() != _JSON:
        return None
    if headers.get(b"accept", None) not in _ACCEPTS or headers.get(b"content-encoding"):
        return None
    if headers.get(b"x-forwarded-host") or not body or len(body) > limits.MAX_BODY_BYTES:
        return None
    if not (path.isascii() and path.isprintable()):
        return None
    return fastpath.lean_key(headers, roles)


def _swept(project_id: int) -> bool:
    """StoreView.initial's sweep, before the view's body; False when it failed (Django's
    path sweeps again and answers)."""
    try:
        watchdog.sweep_on_call(project_id)
    except Exception:
        log.debug("lean path: the sweep failed; falling back to Django", exc_info=True)
        return False
    return True


_FAILED: Answer = (500, [(b"content-type", _JSON)], b'{"detail":"internal server error"}')


def _answer(allow: bytes, build: Callable[[], tuple[Any, set[str]]], status: int = 200
            ) -> Answer:
    """The answer, built once the service call committed: an error now is a 500, never a
    second run of the request through Django (it would claim or write again)."""
    try:
        data, cancelled = build()
        content = _RENDERER.render(data, "application/json", {})
    except Exception:
        log.exception("lean path: the answer failed after the write")
        return _FAILED
    return _answered(allow, status, content, cancelled)


def _answered(allow: bytes, status: int, content: bytes, cancelled: set[str]) -> Answer:
    headers = fastpath._headers()
    headers[0] = (b"content-type", _JSON)
    headers[1] = (b"allow", allow)
    if cancelled:
        headers.append((CANCELLED_HEADER.lower().encode(), ",".join(sorted(cancelled)).encode()))
    return status, headers, content


def _object(body: bytes) -> dict | None:
    """The body as DRF's JSONParser reads it (strict: no NaN), when it is an object."""
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_strict_constant)
    except Exception:
        return None
    return data if isinstance(data, dict) else None


def _validated(fields: Any, data: dict) -> dict | None:
    """What `Serializer.is_valid` makes of `data` (a dict) with these fields, or None where
    it would refuse it."""
    out = {}
    for name, field in fields.items():
        try:
            out[name] = field.run_validation(data.get(name, empty))
        except SkipField:
            continue
        except Exception:
            return None
    return out


def _checked(headers: dict[bytes, bytes], path: str, body: bytes, roles: frozenset,
             check: Callable[[dict], Any]) -> tuple[LeanKey, Any] | None:
    """The key and the body as `check` validates it (None from it: not ours), once the
    project's sweep ran: what every lean route does before its service call; None lets
    Django answer."""
    key = _key(headers, path, body, roles)
    if key is None:
        return None
    payload = _object(body)
    data = None if payload is None else check(payload)
    if data is None or not _swept(key.project.pk):
        return None
    return key, data


def dequeue(headers: dict[bytes, bytes], path: str, body: bytes) -> Answer | None:
    """DequeueRolloutsView's answer, or None: let Django answer."""
    checked = _checked(headers, path, body, _DEQUEUE_ROLES,
                       lambda payload: _validated(_DEQUEUE_FIELDS, payload))
    if checked is None:
        return None
    key, data = checked
    project = key.project
    claimed = []
    if data["limit"] <= 0:
        try:
            services.require_key_live(key.live_check)  # no claim statement to check it
        except Exception:
            return None
    else:
        try:
            if data["wait_seconds"] > 0:
                # Only a claim that finds work: on an empty queue it stores nothing (the
                # worker is not marked idle) and Django's path waits.
                claimed = services.rollout_dequeue_many(
                    project=project,
                    worker_id=data.get("worker_id"),
                    limit=data["limit"],
                    idle_if_none=False,
                    live_key=key.live_check,
                )
                if not claimed:
                    return None
            else:
                claimed = rollout_dequeue_wait(
                    project=project,
                    worker_id=data.get("worker_id"),
                    limit=data["limit"],
                    wait_seconds=0.0,
                    live_key=key.live_check,
                )
        except Exception:
            # Rolled back: Django's path answers (and refuses) it again, in its words.
            log.debug("dequeue fast path: falling back to Django", exc_info=True)
            return None
    return _answer(
        _DEQUEUE_ALLOW,
        lambda: ([_ATTEMPTED.to_representation(s.attempted(r, a)) for r, a in claimed], set()),
    )


def _update_fields(payload: dict) -> dict | None:
    if any(name in payload and payload[name] is None for name in _REFUSED_NULLS):
        return None
    return _validated(_UPDATE_FIELDS, payload)


def update_attempt(headers: dict[bytes, bytes], path: str, body: bytes) -> Answer | None:
    """UpdateAttemptView's answer, or None: let Django answer."""
    checked = _checked(headers, path, body, _ATTEMPT_ROLES, _update_fields)
    if checked is None:
        return None
    key, data = checked
    rollout_id, _, attempt_id = path[len(_ROLLOUTS_PREFIX) :].split("/")
    project = key.project
    try:
        attempt = services.attempt_update(
            project=project, rollout_id=rollout_id, attempt_id=attempt_id,
            live_key=key.live_check, **data
        )
    except Exception:
        # Rolled back: Django's path refuses it again, in its words.
        log.debug("attempt update fast path: falling back to Django", exc_info=True)
        return None

    def build() -> tuple[Any, set[str]]:
        cancelled: set[str] = set()
        if attempt.status not in ATTEMPT_FINAL:  # a runner that gave its verdict is done
            cancelled = v._cancelled([attempt])
        return _ATTEMPT.to_representation(attempt), cancelled

    return _answer(_ATTEMPT_ALLOW, build)


def _plain_id(value: Any) -> bool:
    """A string `StrictCharField(max_length=ID_MAX)` keeps as it is: printable ASCII (no
    NUL, no surrogate), neither blank nor too long."""
    return type(value) is str and 0 < len(value) <= s.ID_MAX and value.isascii() \
        and value.isprintable()


def _next_span_fields(payload: dict) -> dict | None:
    """NextSequenceIdIn's validated data: the common case (two plain ids) checked here,
    anything else by the serializer's own fields."""
    rollout_id, attempt_id = payload.get("rollout_id"), payload.get("attempt_id")
    if _plain_id(rollout_id) and _plain_id(attempt_id):
        return {"rollout_id": rollout_id, "attempt_id": attempt_id}
    return _validated(_NEXT_SPAN_FIELDS, payload)


def next_span_sequence_id(headers: dict[bytes, bytes], path: str, body: bytes
                          ) -> Answer | None:
    """NextSpanSequenceIdView's answer, or None: let Django answer. One statement in
    autocommit, which checks the key too (`services.span_next_sequence_id`), and only a
    reservation that may commit asynchronously: it runs on the ASGI front's event loop,
    which must not wait for a WAL flush. Where it reserved nothing (one that must be
    durable first: the first past the rollout's reserve, or in a new span epoch; or
    an unknown rollout, a dead key) it answers OnThread: `next_span_sequence_id_durable` on
    a thread."""
    return _next_span(headers, path, body, durable_ok=False)


def next_span_sequence_id_durable(headers: dict[bytes, bytes], path: str, body: bytes
                                  ) -> Answer | None:
    """`next_span_sequence_id` with any reservation (a synchronous commit where it must be
    durable), for a thread; None: let Django answer (an unknown rollout, a dead key)."""
    return _next_span(headers, path, body, durable_ok=True)


def _next_span(headers: dict[bytes, bytes], path: str, body: bytes, durable_ok: bool
               ) -> Answer | fastpath.OnThread | None:
    checked = _checked(headers, path, body, _NEXT_SPAN_ROLES, _next_span_fields)
    if checked is None:
        return None
    key, data = checked
    project = key.project
    try:
        sequence_id = services.span_next_sequence_id(
            project=project, live_key=key.live_check, durable_ok=durable_ok, **data
        )
    except Exception:
        # Nothing reserved (unknown rollout, dead key): Django's path answers, in its words.
        log.debug("spans/next fast path: falling back to Django", exc_info=True)
        return None
    if sequence_id is None:  # nothing reserved here: a thread's reservation may be durable
        return fastpath.OnThread(next_span_sequence_id_durable)
    # NextSequenceIdOut rendered: one integer field, compact JSON.
    return _answered(_NEXT_SPAN_ALLOW, 200, b'{"sequence_id":%d}' % sequence_id, set())


_SPAN_FIELD = s.SpanField()


def _span_field(payload: dict) -> Any:
    try:
        return _SPAN_FIELD.run_validation(payload)  # AddSpanView's check
    except Exception:
        return None


def add_span(headers: dict[bytes, bytes], path: str, body: bytes) -> Answer | None:
    """AddSpanView's answer (201: the stored span, or `null` for a duplicate), or None: let
    Django answer. The OTLP export's one statement (`services.span_add_lean`)."""
    checked = _checked(headers, path, body, _SPANS_ROLES, _span_field)
    if checked is None:
        return None
    key, span = checked
    project = key.project
    try:
        ingested = services.span_add_lean(project=project, span=span, live_key=key.live_check)
    except Exception:
        # Refused before anything was stored: Django's path refuses it again, in its words.
        log.debug("add span fast path: falling back to Django", exc_info=True)
        return None
    if ingested is None:
        return None
    stored = ingested.rows[0]
    return _answer(
        _SPANS_ALLOW,
        lambda: (None if stored is None else _SPAN.to_representation(stored),
                 ingested.cancelled),
        status=201,
    )


def get_resources(headers: dict[bytes, bytes], path: str, body: bytes) -> Answer | None:
    """GetResourcesView's answer (the latest version; `?version=` goes to Django), or None:
    let Django answer. AGL 0.3's runner reads its rollout's resources this way before every
    rollout. One statement reads the latest version and checks the key
    (`selectors.resources_get_lean`)."""
    if body or headers.get(b"content-encoding") or headers.get(b"x-forwarded-host"):
        return None
    if headers.get(b"accept", None) not in _ACCEPTS or not (path.isascii()
                                                            and path.isprintable()):
        return None
    key = fastpath.lean_key(headers, _RESOURCE_GET_ROLES)
    if key is None or not _swept(key.project.pk):
        return None
    try:
        row = selectors.resources_get_lean(project=key.project, live_key=key.live_check,
                                           resources_id=path[len(_RESOURCES_PREFIX):])
    except Exception:
        log.debug("get resources fast path: falling back to Django", exc_info=True)
        return None
    if row is None:  # unknown (or another project's) id, a dead key: Django's words
        return None
    return _answer(_RESOURCE_ALLOW, lambda: (_RESOURCES.to_representation(row), set()))


def _worker_fields(payload: dict) -> dict | None:
    if "heartbeat_stats" in payload and payload["heartbeat_stats"] is None:
        return None  # refused (UpdateWorkerView.refuse_nulls): Django's words
    return _validated(_WORKER_FIELDS, payload)


def update_worker(headers: dict[bytes, bytes], path: str, body: bytes) -> Answer | None:
    """UpdateWorkerView's answer (a worker's heartbeat, which AGL 0.3's runner sends every
    few seconds), or None: let Django answer. The view's service call, which checks the key
    in its transaction (`live_key`)."""
    worker_id = path[len(_WORKERS_PREFIX):]
    if len(worker_id) > s.WORKER_ID_MAX:
        return None
    checked = _checked(headers, path, body, _WORKER_ROLES, _worker_fields)
    if checked is None:
        return None
    key, data = checked
    try:
        worker = services.worker_update(project=key.project, worker_id=worker_id,
                                        heartbeat_stats=data.get("heartbeat_stats"),
                                        live_key=key.live_check)
    except Exception:
        # Rolled back (or a dead key): Django's path answers, in its words.
        log.debug("worker update fast path: falling back to Django", exc_info=True)
        return None
    return _answer(_WORKER_ALLOW, lambda: (_WORKER.to_representation(worker), set()))


class Awaited(NamedTuple):
    """A lean request's one statement, for the ASGI front to run on a connection of its own
    in autocommit and await (lightning_site/awaited.py: a synchronous commit, without holding
    the event loop or a thread), and `done`, which makes the answer of its row (run on the
    loop): an Answer; None when the statement stored nothing (no row: the request goes to
    the thread's lean path, which answers it in full, Django's words included); or a
    callable to run on a thread (it reads the database) that returns the Answer."""

    sql: bytes  # Postgres' own placeholders ($1, $2, ...)
    params: list
    done: Callable[[tuple | None], Answer | Callable[[], Answer] | None]


def next_span_awaited(headers: dict[bytes, bytes], path: str, body: bytes) -> Awaited | None:
    """`next_span_sequence_id` as an Awaited (its one UPDATE, which checks the key), or None:
    the thread's lean path answers."""
    checked = _checked(headers, path, body, _NEXT_SPAN_ROLES, _next_span_fields)
    if checked is None:
        return None
    key, data = checked
    sql, params = services.span_next_sequence_statement(
        project=key.project, rollout_id=data["rollout_id"], live_key=key.live_check)

    def done(row: tuple | None) -> Answer | None:
        if row is None:  # nothing reserved (unknown rollout, dead key): the full answer
            return None
        return _answered(_NEXT_SPAN_ALLOW, 200, b'{"sequence_id":%d}' % row[0], set())

    return Awaited(native_sql(sql), params, done)


def update_attempt_awaited(headers: dict[bytes, bytes], path: str, body: bytes
                           ) -> Awaited | None:
    """A bare final verdict (`{"status": ...}` alone) as an Awaited: `update_attempt`'s
    one-statement case (store/services/_verdict.py); None for anything else (the thread's
    lean path answers it)."""
    checked = _checked(headers, path, body, _ATTEMPT_ROLES, _update_fields)
    if checked is None:
        return None
    key, data = checked
    rollout_id, _, attempt_id = path[len(_ROLLOUTS_PREFIX) :].split("/")
    status = data.get("status")
    if set(data) != {"status"} or not _verdict.possible(attempt_id, status):
        return None
    sql, params = _verdict.statement(key.project, rollout_id, attempt_id, status,
                                     timezone.now(), live_key=key.live_check)

    def answer(row: tuple) -> Answer:
        # A final verdict: no cancellation to report (update_attempt's build).
        return _answer(_ATTEMPT_ALLOW,
                       lambda: (_ATTEMPT.to_representation(_verdict.attempt_of(row)), set()))

    def done(row: tuple | None) -> Answer | Callable[[], Answer] | None:
        if row is None:  # nothing written: the full path answers
            return None
        if not _verdict.needs_follow_up(row):
            return answer(row)

        def on_thread() -> Answer:
            try:
                _verdict.follow_up(row, rollout_id)
            except Exception:  # committed: the answer stands; the control sweep catches up
                log.exception("verdict: the follow-up after the commit failed")
            return answer(row)

        return on_thread

    return Awaited(native_sql(sql), params, done)


# Route label -> its Awaited maker: the lean routes whose one statement commits synchronously.
AWAITED_ROUTES: dict[str, Callable[[dict[bytes, bytes], str, bytes], Awaited | None]] = {
    NEXT_SPAN_PATH: next_span_awaited,
    ATTEMPT_ROUTE: update_attempt_awaited,
}
