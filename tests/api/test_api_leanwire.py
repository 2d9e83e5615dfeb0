"""The lean routes answered in uvicorn's protocol, below the ASGI cycle
(lightning_site/leanwire.py): the same bytes as the ASGI path (WEB_LEAN_PROTOCOL=0) for good
and bad input, unknown ids, another project's, a revoked key, keep-alive and `Connection:
close`, a pipelined series, a body over the limit (413) and a client that stops mid-body
(408), over raw sockets to two one-process servers; and in process, that a lean request
makes no asyncio task (a request its lean path declines does, through the front, which does
not offer it to the lean path again)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import pytest
from django.db import connections
from django.utils import timezone

from lightning_site import asgi
from store import services
from store.models import ApiKey
from tests.api.conftest import start_server
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)
MAX_BODY = 4096
_DATE = re.compile(rb"\r\ndate: [^\r]*")


@pytest.fixture(scope="module")
def servers(django_db_setup):
    env = {"STORE_API_MAX_BODY_BYTES": str(MAX_BODY), "WEB_BODY_TIMEOUT_SECONDS": "1"}
    lean = start_server(workers=1, env={**env, "WEB_LEAN_PROTOCOL": "1"})
    try:
        plain = start_server(workers=1, env={**env, "WEB_LEAN_PROTOCOL": "0"})
    except BaseException:
        lean.stop()
        raise
    try:
        yield lean, plain
    finally:
        lean.stop()
        plain.stop()


@pytest.fixture
def key(project) -> str:
    return services.api_key_create(project=project, role="runner")[1]


def _request(method: str, path: str, key: str | None, body: bytes | None = None,
             *extra: str, content_type: str = "application/json") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Accept: */*"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    if body is not None:
        lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    lines += extra
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def response(self) -> bytes:
        """One response, its Date header left out (it moves with the clock)."""
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), self.buffer
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = int(re.search(rb"\r\ncontent-length: (\d+)", head).group(1))
        while len(rest) < length:
            assert self._fill(), self.buffer
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
        self.buffer = rest[length:]
        return _DATE.sub(b"", head) + b"\r\n\r\n" + rest[:length]

    def closed(self) -> bool:
        try:
            return not self.buffer and not self._fill()
        except ConnectionResetError:
            return True


def _exchange(server, data: bytes, answers: int = 1, *, pause: float = 0.0) -> list[bytes]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        sock.sendall(data)
        if pause:
            time.sleep(pause)
        reader = _Reader(sock)
        return [reader.response() for _ in range(answers)]


def _both(servers, data: bytes, answers: int = 1) -> list[bytes]:
    lean, plain = servers
    below, through = _exchange(lean, data, answers), _exchange(plain, data, answers)
    assert below == through, (below, through)
    return below


def test_the_same_bytes_as_the_asgi_path(servers, project, other_project, key):
    mine = services.resources_add(project=project, resources={"llm": {"resource_type": "llm"}})
    theirs = services.resources_add(project=other_project,
                                    resources={"llm": {"resource_type": "llm"}})
    resources = f"/v1/agl/resources/{mine.resource_set.resources_id}"
    span = json.dumps({"rollout_id": "ro-nope", "attempt_id": "at-nope"}).encode()
    cases = {
        "resources": (_request("GET", resources, key), b"200 OK"),
        "unknown id": (_request("GET", "/v1/agl/resources/rs-000000000000", key), b"404"),
        "another project's id": (
            _request("GET", f"/v1/agl/resources/{theirs.resource_set.resources_id}", key),
            b"404"),
        "no key": (_request("GET", resources, None), b"401"),
        "html accepted": (_request("GET", resources, key, None, "Accept: text/html"), None),
        "empty queue": (_request("POST", "/v1/agl/queues/rollouts/dequeue", key,
                                 b'{"worker_id": "w1"}'), b"200 OK"),
        "bad json": (_request("POST", "/v1/agl/spans", key, b"{"), b"400"),
        "not an object": (_request("POST", "/v1/agl/spans/next", key, b"[]"), b"422"),
        "unknown rollout": (_request("POST", "/v1/agl/spans/next", key, span), b"404"),
        "bad protobuf": (_request("POST", "/v1/traces", key, b"\xff\xff\xff",
                                  content_type="application/x-protobuf"), b"400"),
        "not lean": (_request("GET", "/v1/agl/health", None), b"200 OK"),
    }
    for name, (data, status) in cases.items():
        answer = _both(servers, data)[0]
        assert status is None or answer.startswith(b"HTTP/1.1 " + status), (name, answer)
        assert b"connection: close" not in answer, name
    # Good input that writes: the sequence ids differ (one per call), nothing else.
    enqueue(project)
    rollout, attempt = claim(project)
    body = json.dumps({"rollout_id": rollout.pk, "attempt_id": attempt.attempt_id}).encode()
    data = _request("POST", "/v1/agl/spans/next", key, body)
    lean, plain = servers
    below, through = _exchange(lean, data)[0], _exchange(plain, data)[0]
    assert below.endswith(b'{"sequence_id":1}') and through.endswith(b'{"sequence_id":2}')
    assert below[:-2] == through[:-2]


def test_a_revoked_key_is_refused_alike(servers, project, key):
    rs = services.resources_add(project=project, resources={"llm": {"resource_type": "llm"}})
    data = _request("GET", f"/v1/agl/resources/{rs.resource_set.resources_id}", key)
    assert _both(servers, data)[0].startswith(b"HTTP/1.1 200")  # the key now cached
    ApiKey.objects.filter(prefix=key[:12]).update(revoked_at=timezone.now())
    assert _both(servers, data)[0].startswith(b"HTTP/1.1 401")


def test_keep_alive_and_connection_close(servers, project, key):
    rs = services.resources_add(project=project, resources={"llm": {"resource_type": "llm"}})
    read = _request("GET", f"/v1/agl/resources/{rs.resource_set.resources_id}", key)
    dequeue = _request("POST", "/v1/agl/queues/rollouts/dequeue", key, b"{}")
    last = _request("GET", f"/v1/agl/resources/{rs.resource_set.resources_id}", key, None,
                    "Connection: close")
    answers = []
    for server in servers:
        with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
            reader = _Reader(sock)
            got = []
            for data in (read, dequeue, read, last):  # one after another on one connection
                sock.sendall(data)
                got.append(reader.response())
            assert reader.closed()  # closed after the answer to `Connection: close`
        answers.append(got)
    assert answers[0] == answers[1]
    assert [a[:15] for a in answers[0]] == [b"HTTP/1.1 200 OK"] * 4
    assert [b"connection: close" in a for a in answers[0]] == [False, False, False, True]


def test_http_1_0_is_answered_and_closed_alike(servers, project, key):
    rs = services.resources_add(project=project, resources={"llm": {"resource_type": "llm"}})
    data = _request("GET", f"/v1/agl/resources/{rs.resource_set.resources_id}", key).replace(
        b"HTTP/1.1\r\n", b"HTTP/1.0\r\n", 1)
    answers = []
    for server in servers:
        with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
            sock.sendall(data)
            reader = _Reader(sock)
            answers.append(reader.response())
            assert reader.closed()
    assert answers[0] == answers[1]
    assert answers[0].startswith(b"HTTP/1.1 200 OK") and b"connection: close" in answers[0]


def test_a_pipelined_series_is_answered_in_order(servers, project, key):
    rs = services.resources_add(project=project, resources={"llm": {"resource_type": "llm"}})
    read = _request("GET", f"/v1/agl/resources/{rs.resource_set.resources_id}", key)
    series = [
        _request("POST", "/v1/agl/queues/rollouts/dequeue", key, b"{}"),  # a thread's
        read,  # the loop's
        _request("GET", "/v1/agl/resources/rs-000000000000", key),  # declined: Django's
        read,
        _request("GET", "/v1/agl/health", None),  # Django's
        read,
    ]
    answers = _both(servers, b"".join(series), len(series))
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [
        b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]
    assert answers[1] == answers[3] == answers[5]


def test_a_body_over_the_limit(servers, key):
    big = b'{"x": "' + b"a" * MAX_BODY + b'"}'
    chunked = (b"POST /v1/agl/spans HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n"
               b"Authorization: Bearer " + key.encode() + b"\r\n"
               b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n" % len(big) + big + b"\r\n0\r\n\r\n")
    answer = _both(servers, chunked)[0]
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer
    assert answer.endswith(b'{"detail": "request body over 4096 bytes"}')
    declared = _both(servers, _request("POST", "/v1/agl/spans", key, big))[0]
    assert declared.startswith(b"HTTP/1.1 413")  # Django's, by its Content-Length


def test_a_client_that_stops_mid_body_gets_408(servers, key):
    head = (b"POST /v1/agl/spans HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"rollout')
    answers = []
    for server in servers:
        with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
            started = time.monotonic()
            sock.sendall(head)
            reader = _Reader(sock)
            answers.append(reader.response())
            assert 0.8 < time.monotonic() - started < 10
            assert reader.closed()
    assert answers[0] == answers[1]
    assert answers[0].startswith(b"HTTP/1.1 408") and b"connection: close" in answers[0]


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()
        self.closing = False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(
            name, default)

    def write(self, data) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_lean_request_makes_no_task(project, key, monkeypatch):
    import uvicorn
    from uvicorn.server import ServerState

    from lightning_site.leanwire import LeanProtocol

    rs = services.resources_add(project=project, resources={"llm": {"resource_type": "llm"}})
    # A front of its own, with one thread, whose connection the test closes.
    app = asgi.application
    front = asgi.Front(app.wsgi, threads=1, body_timeout=app.body_timeout,
                       max_body=app.max_body, slots=app.slots, fast=app.fast,
                       fast_json=app.fast_json, inline=app.inline_routes)
    routed = []
    table = front.lean_route
    monkeypatch.setattr(front, "lean_route", lambda *a: routed.append(a[1]) or table(*a))
    config = uvicorn.Config(app=front, log_config=None, http=LeanProtocol)
    config.load()
    state = ServerState()

    async def answer(transport: _Transport) -> bytes:
        for _ in range(500):
            if transport.data:
                break
            await asyncio.sleep(0.01)
        data = bytes(transport.data)
        transport.data.clear()
        return data

    async def main() -> None:
        protocol = LeanProtocol(config=config, server_state=state, app_state={},
                                _loop=asyncio.get_running_loop())
        protocol.access_log = False  # as the server runs (pytest's log capture adds handlers)
        transport = _Transport()
        protocol.connection_made(transport)
        # The resources read: answered on the loop's thread, inside data_received.
        protocol.data_received(_request(
            "GET", f"/v1/agl/resources/{rs.resource_set.resources_id}", key))
        assert not state.tasks
        assert bytes(transport.data).startswith(b"HTTP/1.1 200 OK\r\n")
        transport.data.clear()
        # The dequeue: on a pool thread, still no task.
        protocol.data_received(_request("POST", "/v1/agl/queues/rollouts/dequeue", key, b"{}"))
        assert not state.tasks
        assert (await answer(transport)).startswith(b"HTTP/1.1 200 OK\r\n")
        # Declined (an unknown id): a task runs the front, which routes it no more.
        routed.clear()
        protocol.data_received(_request("GET", "/v1/agl/resources/rs-000000000000", key))
        assert len(state.tasks) == 1
        assert (await answer(transport)).startswith(b"HTTP/1.1 404 Not Found\r\n")
        assert routed == ["/v1/agl/resources/rs-000000000000"]  # once: the protocol's
        protocol.connection_lost(None)
        await front.pool.run(connections.close_all)

    try:
        asyncio.run(main())
    finally:
        front.pool.shutdown()
        connections.close_all()  # the loop thread's (this one's), with its lock_timeout


@pytest.mark.parametrize(("one_write", "lean", "expected"), [
    ("1", "1", "LeanProtocol"), ("1", "0", "OneWriteProtocol"), ("0", "1", "auto")])
def test_the_server_runs_the_lean_protocol_by_default(monkeypatch, one_write, lean, expected):
    from lightning_site import web

    seen = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: seen.update(kwargs))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.setenv("WEB_THREADS", "8")  # main() sets it for its processes
    monkeypatch.setenv("WEB_ONE_WRITE", one_write)
    monkeypatch.setenv("WEB_LEAN_PROTOCOL", lean)
    web.main([])
    assert getattr(seen["http"], "__name__", seen["http"]) == expected


def test_an_untested_uvicorn_gets_uvicorns_own_cycle(monkeypatch, capsys):
    """leanwire stands in for parts of uvicorn's HttpToolsProtocol; pyproject.toml lets pip
    install a newer uvicorn, whose internals may differ: the server then runs the one-write
    protocol (uvicorn's own cycle) and says why."""
    import uvicorn

    from lightning_site import leanwire, web

    assert leanwire.supported() is None  # the uvicorn installed here is one it was tested on
    seen = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(uvicorn, "__version__", "0.99.0")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.setenv("WEB_THREADS", "8")
    monkeypatch.setenv("WEB_ONE_WRITE", "1")
    monkeypatch.setenv("WEB_LEAN_PROTOCOL", "1")
    web.main([])
    assert seen["http"].__name__ == "OneWriteProtocol"
    assert "WEB_LEAN_PROTOCOL: off, uvicorn 0.99.0 is not one the lean protocol was tested " \
           "against (0.55.x)" in capsys.readouterr().err
