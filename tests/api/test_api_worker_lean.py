"""The lean path of a worker's heartbeat (store/api/fastjson.py, `POST /v1/agl/workers/{id}`,
which AGL 0.3's runner sends every few seconds) answers exactly what Django's path answers
(status, headers, body; times masked), in-process and through the real server, and leaves
everything else to Django (None) having stored nothing."""

from __future__ import annotations

import json
import re

import pytest
from django.test import Client
from django.urls import resolve
from django.utils import timezone

from store import services
from store.api import fastjson
from store.models import ApiKey, Worker
from tests.api.conftest import Server, http

pytestmark = pytest.mark.django_db(transaction=True)
JSON = "application/json"
_SERVER_ONLY = ("content-length", "date", "server")  # uvicorn's own headers
TIME = re.compile(rb"\d{9,10}\.\d+")


def _path(worker_id: str) -> str:
    return f"/v1/agl/workers/{worker_id}"


def _comparable(status: int, headers, body: bytes) -> tuple:
    headers = {k.lower(): v for k, v in headers if k.lower() not in _SERVER_ONLY}
    return status, headers, TIME.sub(b"T", body)


def _lean(key: str, path: str, body: bytes, **extra: str):
    headers = {b"content-type": JSON.encode(), b"host": b"127.0.0.1", b"accept": b"*/*",
               b"authorization": f"Bearer {key}".encode()}
    headers.update({k.encode(): v.encode() for k, v in extra.items()})
    lean = fastjson.route("POST", path, b"")
    assert lean is not None and lean[0] == fastjson.WORKER_ROUTE
    answer = lean[1](headers, path, body)
    if answer is None:
        return None
    status, pairs, content = answer
    return _comparable(status, [(k.decode(), v.decode()) for k, v in pairs], content)


def _django(key: str, path: str, body: bytes):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="127.0.0.1")
    answer = client.post(path, data=body, content_type=JSON)
    return _comparable(answer.status_code, answer.headers.items(), answer.content)


def _served(server: Server, key: str, path: str, body: bytes):
    with http(server, key) as client:
        answer = client.post(server.url + path, content=body,
                             headers={"Content-Type": JSON, "Accept": "*/*"})
    return _comparable(answer.status_code, answer.headers.items(), answer.content)


def _workers() -> list:
    return sorted(Worker.objects.values_list("project_id", "worker_id", "heartbeat_stats",
                                             "last_heartbeat_time"))


@pytest.fixture
def key(project) -> str:
    return services.api_key_create(project=project, role="runner")[1]


def test_the_route_is_the_url_django_resolves_with_the_same_metric_label():
    assert "/" + resolve(_path("w-1")).route == fastjson.WORKER_ROUTE
    assert fastjson.route("POST", _path("w-1"), b"")[0] == fastjson.WORKER_ROUTE
    for method, other, query in [
        ("GET", _path("w-1"), b""),  # get_worker
        ("POST", _path("w-1"), b"x=1"),
        ("POST", "/v1/agl/workers/search", b""),  # search_workers
        ("POST", "/v1/agl/workers/", b""),
        ("POST", "/v1/agl/workers/w-1/x", b""),
    ]:
        assert fastjson.route(method, other, query) is None, (method, other, query)


@pytest.mark.parametrize("body", [
    {"heartbeat_stats": {"cpu": 0.5, "text": "é\u2028", "nested": {"n": [1, None]}}},
    {},  # the time only
    {"heartbeat_stats": {}, "extra": 1},  # unknown fields are ignored
])
def test_a_heartbeat_answers_what_django_answers(project, key, body):
    raw = json.dumps(body).encode()
    fast = _lean(key, _path("w-lean"), raw)
    slow = _django(key, _path("w-django"), raw)
    assert fast is not None
    assert fast[:2] == slow[:2]
    assert fast[2].replace(b"w-lean", b"w-django") == slow[2]
    # A second beat of a known worker, with its earlier stats kept when none are sent.
    fast = _lean(key, _path("w-lean"), b"{}")
    slow = _django(key, _path("w-django"), b"{}")
    assert fast[:2] == slow[:2] and fast[2].replace(b"w-lean", b"w-django") == slow[2]
    stats = {w: s for _, w, s, _ in _workers()}
    assert stats["w-lean"] == stats["w-django"] == body.get("heartbeat_stats")


@pytest.mark.parametrize("body, extra", [
    (b'{"heartbeat_stats": null}', {}),  # refused (AGL: 400)
    (b'{"heartbeat_stats": [1]}', {}),
    (b'{"heartbeat_stats": "x"}', {}),
    (b"[1]", {}),
    (b"not json", {}),
    (b'{"heartbeat_stats": {"x": NaN}}', {}),
    (b"", {}),
    (b"{}", {"content-type": "text/plain"}),
    (b"{}", {"accept": "text/html"}),
])
def test_anything_else_is_left_to_django_and_nothing_is_stored(project, key, body, extra):
    assert _lean(key, _path("w-1"), body, **extra) is None
    assert _workers() == []


def test_an_over_long_worker_id_is_left_to_django(project, key):
    path = _path("w" * 201)
    assert _lean(key, path, b"{}") is None
    assert _django(key, path, b"{}")[0] == 422
    assert _workers() == []


def test_a_revoked_key_and_another_projects_key(api_server, project, other_project, key):
    other = services.api_key_create(project=other_project, role="runner")[1]
    assert _lean(other, _path("w-1"), b"{}") is not None  # its own project's worker
    assert [(p, w) for p, w, _, _ in _workers()] == [(other_project.pk, "w-1")]
    assert _lean(key, _path("w-1"), b"{}") is not None  # the key is cached here
    for _ in range(4):  # both server processes, most likely
        assert _served(api_server, key, _path("w-1"), b"{}")[0] == 200
    ApiKey.objects.filter(prefix=key[:12]).update(revoked_at=timezone.now())
    before = _workers()
    assert _lean(key, _path("w-1"), b'{"heartbeat_stats": {"a": 1}}') is None
    assert _workers() == before
    slow = _django(key, _path("w-1"), b"{}")
    assert slow[0] == 401
    for _ in range(4):
        assert _served(api_server, key, _path("w-1"), b"{}") == slow
    assert _workers() == before


def test_through_the_server_as_through_django(api_server, project, key):
    raw = json.dumps({"heartbeat_stats": {"queue": 3}}).encode()
    served = _served(api_server, key, _path("w-http"), raw)
    slow = _django(key, _path("w-dj"), raw)
    assert served[:2] == slow[:2]
    assert served[2].replace(b"w-http", b"w-dj") == slow[2]
