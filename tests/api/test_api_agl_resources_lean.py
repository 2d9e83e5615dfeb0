"""The lean `GET /v1/agl/resources/{resources_id}` (store/api/fastjson.py), which AGL 0.3's
runner sends before every rollout: it answers exactly what Django's path answers (status,
headers, body), in-process and through the real server (the ASGI front under uvicorn), and
leaves everything else to Django (None)."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import resolve
from django.utils import timezone

from store import services
from store.api import fastjson
from store.models import ApiKey
from tests.api.conftest import Server, http

pytestmark = pytest.mark.django_db(transaction=True)
PREFIX = "/v1/agl/resources/"
_SERVER_ONLY = ("content-length", "date", "server")  # uvicorn's own headers
LLM = {"resource_type": "llm", "endpoint": "http://127.0.0.1:9/v1", "model": "m\u00e9",
       "sampling_parameters": {"temperature": 0.5}}


@pytest.fixture
def key(project) -> str:
    return services.api_key_create(project=project, role="runner")[1]


def _comparable(status: int, headers, body: bytes) -> tuple:
    return status, {k.lower(): v for k, v in headers if k.lower() not in _SERVER_ONLY}, body


def _lean(key: str, path: str, **extra: str):
    headers = {b"host": b"127.0.0.1", b"accept": b"*/*",
               b"authorization": f"Bearer {key}".encode()}
    headers.update({k.encode(): v.encode() for k, v in extra.items()})
    lean = fastjson.route("GET", path, b"")
    assert lean is not None and lean[0] == fastjson.RESOURCE_ROUTE
    answer = lean[1](headers, path, b"")
    if answer is None:
        return None
    status, pairs, content = answer
    return _comparable(status, [(k.decode(), v.decode()) for k, v in pairs], content)


def _django(key: str, path: str):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="127.0.0.1")
    answer = client.get(path, HTTP_ACCEPT="*/*")
    return _comparable(answer.status_code, answer.headers.items(), answer.content)


def _served(server: Server, key: str, path: str):
    with http(server, key) as client:
        answer = client.get(server.url + path, headers={"Accept": "*/*"})
    return _comparable(answer.status_code, answer.headers.items(), answer.content)


def test_the_route_is_the_url_django_resolves():
    assert resolve(PREFIX + "rs-1").route == fastjson.RESOURCE_ROUTE[1:]
    for method, path, query in [
        ("GET", PREFIX + "latest", b""),  # another view
        ("GET", PREFIX + "rs-1", b"version=1"),  # a query: Django's
        ("GET", PREFIX + "rs-1/x", b""),
        ("GET", PREFIX, b""),
        ("HEAD", PREFIX + "rs-1", b""),
        ("DELETE", PREFIX + "rs-1", b""),
    ]:
        assert fastjson.route(method, path, query) is None, (method, path, query)


def test_get_resources_answers_what_django_answers(api_server, project, key):
    first = services.resources_add(project=project, resources={"llm": LLM})
    services.resources_update(project=project, resources_id=first.resource_set.resources_id,
                              resources={"llm": LLM, "other": {**LLM, "model": "x"}})
    path = PREFIX + first.resource_set.resources_id
    lean = _lean(key, path)
    assert lean is not None
    assert lean == _served(api_server, key, path) == _django(key, path)
    assert lean[0] == 200 and b'"version":2' in lean[2]


def test_anything_else_is_left_to_django(api_server, project, other_project, key):
    mine = services.resources_add(project=project, resources={"llm": LLM})
    theirs = services.resources_add(project=other_project, resources={"llm": LLM})
    path = PREFIX + mine.resource_set.resources_id
    for other in (PREFIX + "rs-000000000000", PREFIX + theirs.resource_set.resources_id):
        assert _lean(key, other) is None, other
        slow = _django(key, other)
        assert slow[0] == 404 and _served(api_server, key, other) == slow, other
    for headers in ({"accept": "text/html"}, {"host": "evil.example"},
                    {"authorization": "Bearer agl_nope"}, {"content-encoding": "gzip"},
                    {"x-forwarded-host": "elsewhere"}):
        assert _lean(key, path, **headers) is None, headers
    lean = fastjson.route("GET", path, b"")[1]
    with_body = {b"host": b"127.0.0.1", b"authorization": f"Bearer {key}".encode()}
    assert lean(with_body, path, b"{}") is None  # a GET with a body: Django's


def test_a_revoked_key_is_refused_as_django_refuses_it(api_server, project, key):
    rs = services.resources_add(project=project, resources={"llm": LLM})
    path = PREFIX + rs.resource_set.resources_id
    assert _lean(key, path) is not None  # now cached by this process's lean paths
    for _ in range(4):  # both server processes, most likely
        assert _served(api_server, key, path)[0] == 200
    ApiKey.objects.filter(prefix=key[:12]).update(revoked_at=timezone.now())
    assert _lean(key, path) is None
    slow = _django(key, path)
    assert slow[0] == 401
    for _ in range(4):
        assert _served(api_server, key, path) == slow
