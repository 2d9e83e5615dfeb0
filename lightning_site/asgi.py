"""The API server: an ASGI front (under uvicorn) over the Django application.

    uvicorn lightning_site.asgi:application --workers 2    (./lightning serve does this)

What it adds over running Django under gunicorn's threads:

- **Waits hold no thread.** `waits/rollouts` and a long-polled dequeue run on a pool thread
  with a deferral (store/waits.py): the view checks once and, where it would sleep, the front
  instead waits for the wake-up on the event loop (Postgres NOTIFY through
  store/wakeups.py), then runs the request again with the same deadline. A thousand waiting
  requests cost a thousand futures, not a thousand threads; the pool stays free for others.
- **A cap on concurrent waits** per API key and per project (STORE_API_MAX_WAITS_PER_KEY,
  STORE_API_MAX_WAITS_PER_PROJECT, counted per server process): a request that would wait
  past the cap is answered 429 with `Retry-After` and nothing waits.
- **Slow clients pin nothing.** The front reads the whole body on the event loop before any
  thread sees the request (the pool never waits on a socket); a body that has not arrived
  within WEB_BODY_TIMEOUT_SECONDS is answered 408, one larger than STORE_API_MAX_BODY_BYTES
  without a Content-Length 413 (with one, the view answers 413 as before, unread). uvicorn
  itself bounds slow headers (h11's limits) and idle keep-alive connections.
- A body sent without Content-Length (chunked) is handed to Django with its length, so it is
  read, not taken for empty.

- A lean path for OTLP protobuf exports (store/api/fastpath.py), the bulk of a runner's
  requests, and for a runner's dequeue (without a wait), attempt update and AGL's per-span
  `spans/next` and `spans` (store/api/fastjson.py): the common well-formed case without
  Django's middleware and DRF,
  the same answer; anything else falls through to Django. Those whose one statement only
  reads or commits asynchronously (INLINE_ROUTES: the OTLP export, `spans`, `spans/next`
  within its rollout's reserve, the resources read) run on the event loop's own thread and
  connection, without the hand-off to a thread (WEB_INLINE=0: on the threads too); a row
  lock held by another transaction sends such a request to Django's path after
  INLINE_LOCK_TIMEOUT_MS, and a call that finds its statement would have to commit
  synchronously answers fastpath.OnThread, stored nothing, and goes to a thread. Those whose
  one statement commits synchronously (fastjson.AWAITED_ROUTES: a bare verdict, and
  `spans/next` with WEB_INLINE=0) are checked on the
  loop's thread too, and their statement runs on one of a few asynchronous connections of
  the process (lightning_site/awaited.py), awaited: a WAL flush, or a row lock another
  transaction holds, holds neither the loop nor a thread (with WEB_AWAITED=1; off by default:
  psycopg's asynchronous path cost more CPU per request than the hand-off it saves,
  bench/front_bench.py; every awaited connection in use: on the threads).

Every other request (and each run of a waiting one) goes through Django's WSGI handler on a
pool of WEB_THREADS threads, unchanged: the same views, validation, statuses and bodies.

Under `python -m lightning_site.web` (WEB_LEAN_PROTOCOL=1) the lean routes are answered one
level lower, in uvicorn's HTTP protocol (lightning_site/leanwire.py), without the ASGI cycle:
it reads this front's route table (`lean_route`) and calls its lean calls (`_inline`,
`_fast` on its pool); a request it leaves to Django comes here marked LEAN_DECLINED.
"""

from __future__ import annotations

import asyncio
import asyncio.events as asyncio_events
import io
import json
import logging
import os
import sys
import time
from collections import Counter
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")

from django.conf import settings  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.db import DEFAULT_DB_ALIAS, connections  # noqa: E402

_django = get_wsgi_application()  # sets Django up: the imports below need it

from lightning_site import awaited, handoff  # noqa: E402
from lightning_site.metrics import http_latency, http_requests  # noqa: E402
from store import waits, wakeups  # noqa: E402
from store.api import fastjson, fastpath  # noqa: E402

log = logging.getLogger(__name__)
_JSON = [(b"content-type", b"application/json")]
RETRY_AFTER_SECONDS = 2
# Lean routes answered on the event loop's thread (Front._inline): one statement that
# commits asynchronously (span writes, a `spans/next` within its rollout's reserve) or only
# reads, so the loop never waits for a WAL flush; the claim, the verdict and the heartbeat
# (synchronous commits), a `spans/next` that must be durable, and everything through Django
# stay on the pool's threads.
INLINE_ROUTES = frozenset({fastpath.TRACES_PATH, fastjson.SPANS_PATH, fastjson.NEXT_SPAN_PATH,
                           fastjson.RESOURCE_ROUTE})
INLINE_LOCK_TIMEOUT_MS = 50
# A scope key the protocol sets on a request its lean path left to Django: the front does not
# offer it to the lean path again.
LEAN_DECLINED = "lightning.lean_declined"
RERUN_INTERVAL = 0.1  # seconds between two runs of one waiting request, at least


class WaitSlots:
    """Concurrent waits per API key and per project, in this process (the event loop's
    thread only: no lock)."""

    def __init__(self, per_key: int, per_project: int) -> None:
        self.per_key, self.per_project = per_key, per_project
        self.keys: Counter = Counter()
        self.projects: Counter = Counter()

    def take(self, key: Any, project: int) -> str | None:
        """None when a slot was taken; else the refusal's message."""
        if self.keys[key] >= self.per_key:
            return (f"too many waiting requests for this API key (at most {self.per_key} "
                    "at a time); retry later")
        if self.projects[project] >= self.per_project:
            return (f"too many waiting requests in this project (at most {self.per_project} "
                    "at a time); retry later")
        self.keys[key] += 1
        self.projects[project] += 1
        return None

    def give(self, key: Any, project: int) -> None:
        for counter, name in ((self.keys, key), (self.projects, project)):
            counter[name] -= 1
            if counter[name] <= 0:
                del counter[name]


class Front:
    def __init__(self, wsgi, *, threads: int, body_timeout: float, max_body: int,
                 slots: WaitSlots, fast=None, fast_json=None,  # noqa: ANN001
                 inline: frozenset = frozenset(), awaited_routes: dict | None = None,
                 awaited_connections: int = 0, lifo: bool = False) -> None:
        # fast: fastpath.otlp_traces; fast_json: fastjson.route
        self.wsgi, self.fast, self.fast_json = wsgi, fast, fast_json
        self._traces = None if fast is None else (
            fastpath.TRACES_PATH, lambda headers, path, body: fast(headers, body))
        self.pool = handoff.Pool(threads, name="web", lifo=lifo)
        self.body_timeout, self.max_body, self.slots = body_timeout, max_body, slots
        self.inline_routes = frozenset(inline)
        self._inline_raw = None  # the loop thread's connection, once lock_timeout is set on it
        # fastjson.AWAITED_ROUTES' makers, and the connections their statements are awaited on
        self.awaited_routes = dict(awaited_routes or {}) if awaited_connections > 0 else {}
        self.awaited = awaited.AwaitedConnections(awaited_connections)

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        # LEAN_DECLINED: the protocol (lightning_site/leanwire.py) already ran the lean path,
        # which left the request to Django.
        lean = None if scope.get(LEAN_DECLINED) else self.lean_route(
            scope["method"], scope["path"], scope["query_string"])
        if lean is not None:
            method, path, headers = scope["method"], scope["path"], dict(scope["headers"])
            if lean[0] in self.inline_routes:
                answer = self._inline(lean, method, path, headers, body)
                if type(answer) is fastpath.OnThread:  # not on the loop: on a thread
                    answer = await self.pool.run(self._fast, (lean[0], answer.handler),
                                                 method, path, headers, body)
            elif lean[0] in self.awaited_routes:
                answer = await self._awaited(lean, method, path, headers, body)
            else:
                answer = await self.pool.run(self._fast, lean, method, path, headers, body)
            if answer is not None:
                await self._send(send, *answer)
                return
        deferral = waits.Deferral()
        answer = await self.pool.run(self._run, scope, body, deferral)
        plan = deferral.plan
        if plan is not None:
            answer = await self._wait(scope, body, deferral, plan)
        await self._send(send, *answer)

    async def _wait(self, scope: dict, body: bytes, deferral: waits.Deferral,
                    plan: waits.Plan) -> tuple:
        """The view would sleep: wait on the loop, rerun, until it answers without a plan."""
        key = (plan.project_id, deferral.key)
        refused = self.slots.take(key, plan.project_id)
        if refused is not None:
            return 429, _JSON + [(b"retry-after", str(RETRY_AFTER_SECONDS).encode())], \
                _detail(refused)
        try:
            while True:
                ran = time.monotonic()
                remaining = plan.deadline - ran
                await wakeups.sleep_async(plan.channel, plan.project_id, plan.token, remaining)
                # A busy project notifies often (every finished rollout): rerun a waiting
                # request at most every RERUN_INTERVAL, so a burst of notifications costs one
                # rerun (a whole request through Django), not one each.
                pause = min(ran + RERUN_INTERVAL, plan.deadline) - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                deferral = waits.Deferral(deadline=plan.deadline, key=deferral.key)
                answer = await self.pool.run(self._run, scope, body, deferral)
                if deferral.plan is None:
                    return answer
                plan = deferral.plan
        finally:
            self.slots.give(key, plan.project_id)

    async def _read_body(self, scope: dict, receive, send) -> bytes | None:
        """The whole body, or None after answering 408/413 (or when the client went away)."""
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return b""  # the view refuses it by its Content-Length, unread (413)
        parts: list[bytes] = []
        size = 0
        try:
            # One timer for the whole body (asyncio.wait_for per message made a task each).
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body:
                        break
                    parts.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(parts)
        except TimeoutError:
            await self._send(send, 408, _JSON + [(b"connection", b"close")],
                             _detail("request body not received in time"))
            return None
        await self._send(send, 413, _JSON + [(b"connection", b"close")],
                         _detail(f"request body over {self.max_body} bytes"))
        return None

    def lean_route(self, method: str, path: str, query_string: bytes) -> tuple | None:
        """(route label, handler(headers, path, body)) of a lean path that may answer the
        request, or None: the one route table of the lean paths, which this front and the
        protocol below it (lightning_site/leanwire.py) both read."""
        if path == fastpath.TRACES_PATH and method == "POST":
            return self._traces
        if self.fast_json is not None:
            return self.fast_json(method, path, query_string)
        return None

    def _fast(self, lean: tuple, method: str, path: str, headers: dict, body: bytes,
              on_loop: bool = False) -> tuple | fastpath.OnThread | None:
        """A lean path (store/api/fastpath.py, fastjson.py), counted in /metrics like
        Django's. A handler returns None (Django answers) before it stored anything, or
        OnThread (stored nothing either): its other handler answers, on a thread (here, or
        on the loop's thread (`on_loop`) the caller's to hand over)."""
        route, handler = lean
        started = time.perf_counter()
        answer = handler(headers, path, body)
        if type(answer) is fastpath.OnThread:
            if on_loop:
                return answer
            answer = answer.handler(headers, path, body)
        if answer is not None:
            _count(route, method, answer[0], time.perf_counter() - started)
        return answer

    async def _awaited(self, lean: tuple, method: str, path: str, headers: dict, body: bytes
                       ) -> tuple | None:
        """A lean route of AWAITED_ROUTES: checked on the loop's thread (as `_inline`), its
        one statement awaited on an awaited connection (a synchronous commit: the loop serves
        others meanwhile). Where the maker declines, every awaited connection is in use, or
        the statement failed or stored nothing, the thread's lean path answers as before
        (and Django's, where that declines)."""
        route, _ = lean
        started = time.perf_counter()
        try:
            made = self._on_loop_thread(self.awaited_routes[route], headers, path, body)
        except Exception:  # stored nothing: the thread's path answers, in its words
            log.debug("awaited lean path: declined", exc_info=True)
            made = None
        if made is not None:
            try:
                row = await self.awaited.fetch_one(made.sql, made.params)
            except awaited.Busy:
                row = answer = None
            except Exception:  # its own transaction: nothing stored
                log.debug("awaited lean path: the statement failed", exc_info=True)
                row = answer = None
            else:
                answer = made.done(row)
                if callable(answer):
                    answer = await self.pool.run(answer)
            if answer is not None:
                _count(route, method, answer[0], time.perf_counter() - started)
                return answer
        return await self.pool.run(self._fast, lean, method, path, headers, body)

    def _inline(self, lean: tuple, method: str, path: str, headers: dict, body: bytes
                ) -> tuple | None:
        """A lean path run on the event loop's own thread, on that thread's own connection,
        for INLINE_ROUTES: their one statement is short and never waits for a WAL flush, so
        the hand-off to a pool thread and back (and another of the pool's connections) cost
        more than the call. A row lock held longer than INLINE_LOCK_TIMEOUT_MS (a verdict's
        transaction on the same rollout, a sweep) fails the statement, which stored nothing,
        and the request goes to Django's path on a thread, as any None does: the loop is never
        held up longer than that by another transaction."""
        return self._on_loop_thread(self._fast, lean, method, path, headers, body, True)

    def _on_loop_thread(self, fn, *args: Any) -> Any:  # noqa: ANN001
        """`fn(*args)` on the event loop's thread, with that thread's own Django connection
        (lock_timeout INLINE_LOCK_TIMEOUT_MS); None, as from `fn`, lets a thread answer."""
        loop = asyncio_events._get_running_loop()
        asyncio_events._set_running_loop(None)  # Django refuses queries beside a running loop
        try:
            db = connections[DEFAULT_DB_ALIAS]
            if db.connection is None or db.connection is not self._inline_raw:
                try:
                    db.ensure_connection()
                    with db.cursor() as cursor:
                        cursor.execute(f"SET lock_timeout = {INLINE_LOCK_TIMEOUT_MS}")
                except Exception:  # no connection: Django's path (its health check) answers
                    log.debug("inline lean path: no connection", exc_info=True)
                    db.close_if_unusable_or_obsolete()
                    return None
                self._inline_raw = db.connection
            answer = fn(*args)
            if answer is None:
                # As Django's request_finished does for its threads: a connection that
                # failed is dropped, the next call opens another.
                db.close_if_unusable_or_obsolete()
            return answer
        finally:
            asyncio_events._set_running_loop(loop)

    def _run(self, scope: dict, body: bytes, deferral: waits.Deferral) -> tuple:
        """One run of the request through Django (on a pool thread)."""
        captured: list = []

        def start_response(status: str, headers: list, exc_info: Any = None) -> None:
            captured[:] = [int(status.split(" ", 1)[0]),
                           [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in headers]]

        waits.install(deferral)
        try:
            result = self.wsgi(_environ(scope, body), start_response)
            try:
                content = b"".join(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
        finally:
            waits.install(None)
        return captured[0], captured[1], content

    @staticmethod
    async def _send(send, status: int, headers: list, content: bytes) -> None:
        headers = [h for h in headers if h[0] != b"content-length"]
        headers.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.pool.shutdown()
                await self.awaited.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


# (route, method, status) -> its latency histogram's and request counter's children: a
# lean request is counted in /metrics as Django's are, without `labels()` (a lock and a
# lookup each) per request. Bounded: the lean routes are few, and so are their statuses.
_counted: dict[tuple[str, str, int], tuple[Any, Any]] = {}


def _count(route: str, method: str, status: int, seconds: float) -> None:
    children = _counted.get((route, method, status))
    if children is None:
        children = _counted[(route, method, status)] = (
            http_latency.labels(route), http_requests.labels(route, method, str(status)))
    children[0].observe(seconds)
    children[1].inc()


def _detail(message: str) -> bytes:
    return json.dumps({"detail": message}).encode()


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _environ(scope: dict, body: bytes) -> dict:
    server = scope.get("server") or ("localhost", 80)
    client = scope.get("client") or ("", 0)
    environ = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": scope.get("root_path", "").encode().decode("latin-1"),
        "PATH_INFO": scope["path"].encode().decode("latin-1"),
        "QUERY_STRING": scope["query_string"].decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1]),
        "REMOTE_ADDR": client[0],
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").upper().replace("-", "_")
        value = raw_value.decode("latin-1")
        if name == "CONTENT_TYPE":
            environ["CONTENT_TYPE"] = value
            continue
        if name == "CONTENT_LENGTH":
            environ["CONTENT_LENGTH"] = value
            continue
        name = f"HTTP_{name}"
        environ[name] = f"{environ[name]},{value}" if name in environ else value
    if "CONTENT_LENGTH" not in environ and body:
        environ["CONTENT_LENGTH"] = str(len(body))  # chunked: Django reads what we have
    return environ


def build() -> Front:
    return Front(
        _django,
        fast=fastpath.otlp_traces if fastpath.enabled() else None,
        fast_json=fastjson.route if fastpath.enabled() else None,
        inline=INLINE_ROUTES if os.environ.get("WEB_INLINE", "1") == "1" else frozenset(),
        awaited_routes=fastjson.AWAITED_ROUTES,
        awaited_connections=(int(os.environ.get("WEB_AWAITED_CONNECTIONS", "4"))
                             if os.environ.get("WEB_AWAITED", "0") == "1"
                             and connections[DEFAULT_DB_ALIAS].vendor == "postgresql" else 0),
        threads=int(os.environ.get("WEB_THREADS", "8")),
        lifo=os.environ.get("WEB_POOL_LIFO", "1") == "1",
        body_timeout=settings.WEB_BODY_TIMEOUT_SECONDS,
        max_body=settings.STORE_API_MAX_BODY_BYTES,
        slots=WaitSlots(settings.STORE_API_MAX_WAITS_PER_KEY,
                        settings.STORE_API_MAX_WAITS_PER_PROJECT),
    )


application = build()
