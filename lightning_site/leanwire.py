"""The lean routes answered in uvicorn's HTTP protocol itself, below the ASGI cycle.

uvicorn makes, for every request, a scope dict, a RequestResponseCycle with an asyncio.Event,
an asyncio task running the application, and `receive`/`send` coroutines with a message dict
each; the ASGI front (lightning_site/asgi.py) then reads the body under a timer, finds the
lean route, runs it and sends two messages. On AGL's runner mix every request but the rare
ones is a lean route (the OTLP export, `spans`, `spans/next`, the resources read on the event
loop's thread; the dequeue, the verdict and the heartbeat on a pool thread), so that
machinery is much of the web process's CPU per request (README "Seventh pass on AGL's runner
mix").

Here the protocol (uvicorn's httptools protocol, with one write per response: onewrite.py)
looks at a request once its headers are parsed. Where the front's route table
(`Front.lean_route`) has a lean route for its method and path, and nothing makes it unusual
(another request still in flight on the connection, `Expect: 100-continue`, an upgrade, a
declared body over STORE_API_MAX_BODY_BYTES, writes paused by a slow reader, uvicorn's
concurrency limit or access log, the front's awaited routes), no scope, cycle or task is
made: the protocol collects the body itself (a body over STORE_API_MAX_BODY_BYTES is answered
413, one not complete within WEB_BODY_TIMEOUT_SECONDS 408, as the front answers them), calls
the front's own lean call for it (`Front._inline` on the loop's thread for its inline routes,
`Front._fast` on the front's pool of threads for the others, and for an inline call that
answered `OnThread`, with the handler it names: the same handlers, the same Prometheus
counters) and writes the answer's bytes as uvicorn would write them (its status
line and default headers, the front's Content-Length, `connection: close` where the request
or the server ends the connection). Where the lean path answers None (Django answers), the
request goes on as uvicorn would have started it, with its body already read, through the
ASGI front, which then does not offer it to the lean path again (`asgi.LEAN_DECLINED`).

One request at a time per connection, as uvicorn serves them: while a lean request is in
flight the protocol stands as the connection's current cycle, so a pipelined request behind
it waits in uvicorn's own queue (reading paused) and starts when the lean answer is written.

Written against uvicorn 0.55's HttpToolsProtocol (the tests in tests/api/test_api_leanwire.py
compare its answers with the ASGI path's, byte for byte). WEB_LEAN_PROTOCOL=0 turns it off.
"""

from __future__ import annotations

import asyncio
import sys
import urllib.parse
from functools import partial
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from lightning_site.onewrite import OneWriteProtocol

# The uvicorn releases this module was written and tested against (it takes part in
# HttpToolsProtocol's parsing and stands in for its RequestResponseCycle). pyproject.toml lets
# pip install a newer one; then the server uses OneWriteProtocol, uvicorn's own cycle.
TESTED_UVICORN = ("0.55.",)


def supported() -> str | None:
    """None when this uvicorn is one LeanProtocol was tested against; else why not."""
    import uvicorn

    version = uvicorn.__version__
    if not version.startswith(TESTED_UVICORN):
        return (f"uvicorn {version} is not one the lean protocol was tested against "
                f"({', '.join(v + 'x' for v in TESTED_UVICORN)})")
    if not hasattr(HttpToolsProtocol, "_start_asgi_task"):
        return f"uvicorn {version}'s HttpToolsProtocol has no _start_asgi_task"
    return None

_CLOSE = (b"connection", b"close")
# uvicorn's own answer to an application that failed (RequestResponseCycle.send_500_response)
_FAILED = (500, [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"),
                 _CLOSE], b"Internal Server Error")


class _NoEvent:
    """What uvicorn's connection_lost sets on the current cycle's `message_event`."""

    @staticmethod
    def set() -> None:
        pass


class LeanRequest:
    """A request the protocol answers itself; it stands as the connection's current cycle
    (`response_complete`, `disconnected`, `keep_alive`, `message_event`: what uvicorn's
    protocol reads of one)."""

    __slots__ = ("lean", "method", "path", "raw_path", "query_string", "http_version",
                 "headers", "parts", "size", "keep_alive", "timer", "receiving",
                 "response_complete", "disconnected")
    message_event = _NoEvent

    def __init__(self, lean: tuple, method: str, path: str, raw_path: bytes,
                 query_string: bytes, http_version: str, headers: list,
                 keep_alive: bool) -> None:
        self.lean, self.method, self.path, self.raw_path = lean, method, path, raw_path
        self.query_string, self.http_version, self.headers = query_string, http_version, headers
        self.keep_alive = keep_alive
        self.parts: list[bytes] | None = []
        self.size = 0
        self.timer: asyncio.TimerHandle | None = None
        self.receiving = True
        self.response_complete = self.disconnected = False


def _front_of(app: Any) -> Any:
    """The ASGI front under uvicorn's wrappers (its proxy-headers middleware), or None."""
    asgi = sys.modules.get("lightning_site.asgi")
    if asgi is None:
        return None
    for _ in range(8):
        if isinstance(app, asgi.Front):
            return app
        app = getattr(app, "app", None)
    return None


class LeanProtocol(OneWriteProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        front = _front_of(self.app)
        self.front = None if front is None or self.limit_concurrency is not None else front
        if self.front is not None:
            from lightning_site import asgi  # loaded already: the front is its application

            self._declined_key = asgi.LEAN_DECLINED
            self._on_thread = asgi.fastpath.OnThread  # an inline call: "on a thread"
            self._refusal = asgi._JSON + [_CLOSE]  # the front's 408 / 413, in its words
            self._detail = asgi._detail
        self._default_headers: list | None = None
        self._default_head = b""

    # -- parsing ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.front is None:
            super().on_message_begin()
            return
        self.url = b""
        self.expect_100_continue = False
        self.headers = []  # the scope, only where the request goes through the ASGI cycle

    def on_headers_complete(self) -> None:
        if self.front is not None:
            request = self._lean_request()
            if request is not None:
                self.cycle = request  # type: ignore[assignment]
                return
            headers, url, expect = self.headers, self.url, self.expect_100_continue
            HttpToolsProtocol.on_message_begin(self)  # uvicorn's scope, as it makes it
            self.headers = self.scope["headers"] = headers
            self.url, self.expect_100_continue = url, expect
        super().on_headers_complete()

    def _lean_request(self) -> LeanRequest | None:
        front = self.front
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.expect_100_continue \
                or self.flow.write_paused or self.access_log:
            return None
        parser = self.parser
        method = parser.get_method()
        if (method != b"POST" and method != b"GET") or parser.should_upgrade():
            return None
        parsed = httptools.parse_url(self.url)
        raw_path = parsed.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        path = self.root_path + path
        query_string = parsed.query or b""
        method_name = method.decode("ascii")
        lean = front.lean_route(method_name, path, query_string)
        if lean is None or lean[0] in front.awaited_routes:
            return None
        for name, value in self.headers:
            if name == b"content-length":
                if value.isdigit() and int(value) > front.max_body:
                    return None  # the view refuses it by its Content-Length, unread (413)
                break
        http_version = parser.get_http_version()
        return LeanRequest(lean, method_name, path,
                           self.root_path.encode("ascii") + raw_path, query_string,
                           http_version, self.headers,
                           http_version != "1.0" and parser.should_keep_alive())

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        request = self.cycle
        if type(request) is LeanRequest and request.receiving and request.timer is None:
            # A body still to come (most arrive with their headers): the front's timeout.
            request.timer = self.loop.call_later(self.front.body_timeout,
                                                 self._lean_timed_out, request)

    def on_body(self, body: bytes) -> None:
        request = self.cycle
        if type(request) is not LeanRequest:
            super().on_body(body)
            return
        if not request.receiving:
            return
        request.size += len(body)
        if request.size > self.front.max_body:
            self._lean_refuse(request, 413, f"request body over {self.front.max_body} bytes")
            return
        request.parts.append(body)

    def on_message_complete(self) -> None:
        request = self.cycle
        if type(request) is not LeanRequest:
            super().on_message_complete()
            return
        if not request.receiving:
            return
        request.receiving = False
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None
        parts, request.parts = request.parts, None
        self._lean_run(request, parts[0] if len(parts) == 1 else b"".join(parts))

    def connection_lost(self, exc: Exception | None) -> None:
        request = self.cycle
        if type(request) is LeanRequest:
            request.receiving = False
            if request.timer is not None:
                request.timer.cancel()
                request.timer = None
        super().connection_lost(exc)

    # -- answering -------------------------------------------------------------------------

    def _lean_run(self, request: LeanRequest, body: bytes) -> None:
        front = self.front
        lean = request.lean
        headers = dict(request.headers)
        if lean[0] in front.inline_routes:
            try:
                answer = front._inline(lean, request.method, request.path, headers, body)
            except Exception as exc:
                self._lean_answered(request, body, None, exc)
                return
            if type(answer) is not self._on_thread:
                self._lean_answered(request, body, answer, None)
                return
            lean = (lean[0], answer.handler)  # not on the loop: on a thread
        front.pool.submit(front._fast, (lean, request.method, request.path, headers, body),
                          partial(self._lean_answered, request, body))

    def _lean_answered(self, request: LeanRequest, body: bytes, answer: tuple | None,
                       exc: BaseException | None) -> None:
        if request.disconnected:
            return
        if exc is not None:
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            self._lean_write(request, *_FAILED)
            return
        if answer is None:
            self._lean_declined(request, body)
            return
        status, headers, content = answer
        # The front's _send: its own Content-Length, last.
        headers = [h for h in headers if h[0] != b"content-length"]
        headers.append((b"content-length", b"%d" % len(content)))
        self._lean_write(request, status, headers, content)

    def _lean_refuse(self, request: LeanRequest, status: int, message: str) -> None:
        """The front's 408 / 413 for a body (Front._read_body), the connection closed."""
        request.receiving = False
        request.parts = None
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None
        content = self._detail(message)
        self._lean_write(request, status, [*self._refusal,
                                           (b"content-length", b"%d" % len(content))], content)

    def _lean_timed_out(self, request: LeanRequest) -> None:
        request.timer = None
        if request.receiving and not request.disconnected:
            self._lean_refuse(request, 408, "request body not received in time")

    def _lean_write(self, request: LeanRequest, status: int, headers: list,
                    content: bytes) -> None:
        """The answer as uvicorn's RequestResponseCycle.send writes it, in one write."""
        transport = self.transport
        if request.disconnected or transport.is_closing():
            return
        default = self.server_state.default_headers
        if default is not self._default_headers:  # a new Date each second
            self._default_head = b"".join(b"%s: %s\r\n" % (name.lower(), value)
                                          for name, value in default)
            self._default_headers = default
        names = b"".join([name for name, _ in headers])
        values = b"".join([value for _, value in headers])
        if HEADER_RE.search(names) or HEADER_VALUE_RE.search(values):
            # uvicorn raises there with the response started: the connection is closed
            self.logger.error("Exception in ASGI application\n",
                              exc_info=RuntimeError("Invalid HTTP header."))
            request.response_complete = True
            transport.close()
            return
        head = [STATUS_LINE[status], self._default_head]
        keep_alive = request.keep_alive
        closing = False
        for name, value in headers:
            name = name.lower()
            if name == b"connection" and b"close" in [token.lower().strip()
                                                       for token in value.split(b",")]:
                keep_alive, closing = False, True
            head.append(b"%s: %s\r\n" % (name, value))
        if not keep_alive and not closing:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        head.append(content)
        transport.write_whole(b"".join(head))
        request.response_complete = True
        if not keep_alive:
            transport.close()
        self.on_response_complete()

    def _lean_declined(self, request: LeanRequest, body: bytes) -> None:
        """The lean path left the request to Django: it goes on as uvicorn would have started
        it (its scope, a cycle, a task running the ASGI application), its body already read."""
        scope = {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": request.http_version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": request.headers,
            "state": self.app_state.copy(),
            "method": request.method,
            "path": request.path,
            "raw_path": request.raw_path,
            "query_string": request.query_string,
            self._declined_key: True,
        }
        cycle = RequestResponseCycle(
            scope=scope,  # type: ignore[arg-type]
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=request.keep_alive,
            on_response=self.on_response_complete,
        )
        cycle.body = body  # type: ignore[assignment]  # read once, as bytes
        cycle.more_body = False
        cycle.message_event.set()
        if self.cycle is request:  # else a pipelined request behind it is the current one
            self.cycle = cycle
        self._start_asgi_task(cycle, self.app)
