"""The lean JSON path of a runner's loop (store/api/fastjson.py: dequeue, attempt update)
answers exactly what Django's path answers, and leaves every other request to Django (None),
having stored nothing. A long-polled dequeue on an empty queue still waits via the front."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from django.test import Client
from django.urls import resolve

from store import services, wakeups
from store.api import fastjson, limits
from store.models import Attempt, Rollout, Worker
from store.services import RolloutSpec
from tests.api.conftest import Keys, http
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)
JSON = "application/json"
DEQUEUE = fastjson.DEQUEUE_PATH


def _headers(key: str | None, **extra: str) -> dict[bytes, bytes]:
    headers = {b"content-type": JSON.encode(), b"host": b"127.0.0.1", b"accept": b"*/*"}
    if key:
        headers[b"authorization"] = f"Bearer {key}".encode()
    headers.update({k.encode(): v.encode() for k, v in extra.items()})
    return headers


def _django(key: str, path: str, body: bytes):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="127.0.0.1")
    return client.post(path, data=body, content_type=JSON)


def _django_get(key: str, path: str):
    return Client(HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="127.0.0.1").get(path)


def _fast(key: str, path: str, body: bytes, **headers: str):
    lean = fastjson.route("POST", path, b"")
    assert lean is not None, path
    return lean[1](_headers(key, **headers), path, body)


def _comparable(status: int, headers, body: bytes) -> tuple:
    return status, {k.lower(): v for k, v in headers if k.lower() != "content-length"}, body


def _fast_comparable(answer) -> tuple:
    status, headers, body = answer
    return _comparable(status, [(k.decode(), v.decode()) for k, v in headers], body)


def _django_comparable(response) -> tuple:
    return _comparable(response.status_code, response.headers.items(), response.content)


TIME = re.compile(rb"\d{9,10}\.\d+")


def _same_but_ids_and_times(fast: tuple, slow: tuple, ids: dict[str, str]) -> None:
    """Equal, once the first request's ids are the second's and times are masked."""
    fast_body, fast_headers = fast[2], dict(fast[1])
    for mine, theirs in ids.items():
        fast_body = fast_body.replace(mine.encode(), theirs.encode())
        fast_headers = {k: v.replace(mine, theirs) for k, v in fast_headers.items()}
    assert (fast[0], fast_headers) == slow[:2]
    assert TIME.sub(b"T", fast_body) == TIME.sub(b"T", slow[2])


@pytest.fixture
def key(project) -> str:
    return services.api_key_create(project=project, role="runner")[1]


def test_routes_are_the_urls_django_resolves_with_the_same_metric_labels():
    assert "/" + resolve(DEQUEUE).route == fastjson.DEQUEUE_ROUTE
    path = "/v1/agl/rollouts/ro-1/attempts/at-1"
    assert "/" + resolve(path).route == fastjson.ATTEMPT_ROUTE
    assert fastjson.route("POST", path, b"")[0] == fastjson.ATTEMPT_ROUTE
    for method, other, query in [
        ("GET", path, b""),  # get_attempt
        ("POST", path, b"x=1"),  # a query string
        ("POST", "/v1/agl/rollouts/ro-1/attempts/search", b""),  # search_attempts
        ("POST", "/v1/agl/rollouts/ro-1/attempts", b""),  # start_attempt
        ("POST", "/v1/agl/rollouts/ro-1/attempts/at-1/finish", b""),
        ("POST", "/v1/agl/rollouts//attempts/at-1", b""),
        ("POST", DEQUEUE + "/", b""),
    ]:
        assert fastjson.route(method, other, query) is None, (method, other, query)


@pytest.mark.parametrize(
    "body",
    [
        {"limit": 1, "worker_id": "runner-1"},  # AGL's client
        {"limit": 1},
        {},
        {"limit": "1", "worker_id": "w"},  # DRF's IntegerField takes "1"
        {"limit": 1.0, "wait_seconds": 0},
        {"limit": 2, "worker_id": "w", "extra": [1]},  # unknown fields are ignored
        {"limit": 0},  # AGL: [] for a limit of 0 or less
        {"limit": -5, "worker_id": "w"},
        {"limit": 1, "worker_id": "w", "wait_seconds": 3},  # work is there: no wait
    ],
)
def test_dequeue_answers_what_django_answers(project, key, body):
    specs = [
        RolloutSpec(input={"q": "é"}, metadata={"k": "é\u2028"}, config={"timeout_seconds": 30})
        for _ in range(4)
    ]
    services.rollout_enqueue_many(project=project, specs=specs)
    raw = json.dumps(body).encode()
    fast = _fast(key, DEQUEUE, raw)
    assert fast is not None
    fast_claimed = json.loads(fast[2])
    slow = _django(key, DEQUEUE, raw)
    slow_claimed = slow.json()
    assert len(fast_claimed) == len(slow_claimed)
    ids = {}
    for mine, theirs in zip(fast_claimed, slow_claimed, strict=True):
        ids[mine["rollout_id"]] = theirs["rollout_id"]
        ids[mine["attempt"]["attempt_id"]] = theirs["attempt"]["attempt_id"]
    _same_but_ids_and_times(_fast_comparable(fast), _django_comparable(slow), ids)
    # Byte for byte: Django's rendering of the same rollouts, as stored.
    got = [_django_get(key, f"/v1/agl/rollouts/{r['rollout_id']}").content for r in fast_claimed]
    assert fast[2] == b"[" + b",".join(got) + b"]"
    if body.get("worker_id") and int(body.get("limit", 1)) > 0:
        worker = Worker.objects.get(project=project, worker_id=body["worker_id"])
        assert worker.status == "busy"


def test_an_empty_queue_answers_the_same_and_marks_the_worker_idle(project, key):
    raw = b'{"limit": 1, "worker_id": "w1"}'
    fast = _fast(key, DEQUEUE, raw)
    assert fast is not None and fast[2] == b"[]"
    assert Worker.objects.get(project=project, worker_id="w1").status == "idle"
    assert _fast_comparable(fast) == _django_comparable(_django(key, DEQUEUE, raw))


@pytest.mark.parametrize(
    "headers,body",
    [
        ({}, b'{"limit": %d}' % (limits.MAX_ROLLOUTS_PER_REQUEST + 1)),  # over the maximum: 422
        ({}, b'{"limit": "x"}'),
        ({}, b'{"limit": 1.5}'),
        ({}, b'{"limit": null}'),
        ({}, b'{"limit": true}'),
        ({}, b'{"worker_id": ""}'),
        ({}, b'{"worker_id": 5}'),
        ({}, b'{"worker_id": "a\\u0000b"}'),
        ({}, json.dumps({"worker_id": "w" * 201}).encode()),
        ({}, b'{"wait_seconds": -1}'),
        ({}, b'{"wait_seconds": 1e9}'),
        ({}, b'{"wait_seconds": "NaN"}'),
        ({}, b'{"limit": NaN}'),
        ({}, b'{"limit": 1'),  # not JSON: 400
        ({}, b"[1]"),
        ({}, b"null"),  # Django takes it for {} (and claims)
        ({}, b""),
        ({}, b"\xff"),
        ({"content-type": "text/plain"}, b'{"limit": 1}'),
        ({"content-type": "application/json; charset=latin-1"}, b'{"limit": 1}'),
        ({"accept": "application/json; indent=4"}, b'{"limit": 1}'),
        ({"accept": "text/html"}, b'{"limit": 1}'),  # 406
        ({"host": "evil.example"}, b'{"limit": 1}'),
        ({"authorization": "Token x"}, b'{"limit": 1}'),
        ({"authorization": "Bearer agl_nope"}, b'{"limit": 1}'),
        ({"content-encoding": "gzip"}, b'{"limit": 1}'),
    ],
)
def test_dequeue_leaves_anything_else_to_django_and_claims_nothing(project, key, headers, body):
    enqueue(project, 1)
    assert _fast(key, DEQUEUE, body, **headers) is None
    assert Rollout.objects.get(project=project).status == "queuing"
    assert not Attempt.objects.exists() and not Worker.objects.exists()


def test_a_long_poll_on_an_empty_queue_is_left_to_django_and_stores_nothing(
        project, key, monkeypatch):
    def no_wait(*args, **kwargs):
        raise AssertionError("the lean path waited: the front's deferral waits")

    monkeypatch.setattr(wakeups.Waiter, "sleep", no_wait)
    monkeypatch.setattr(wakeups._Listener, "wait", no_wait)
    assert _fast(key, DEQUEUE, b'{"worker_id": "w1", "wait_seconds": 5}') is None
    assert not Worker.objects.exists()  # not marked idle by this look


def _update_path(rollout_id: str, attempt_id: str) -> str:
    return f"/v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}"


@pytest.mark.parametrize(
    "body",
    [
        {"status": "succeeded"},  # the bench's and AGL's runner verdict
        {"status": "failed"},
        {"status": "running", "worker_id": "runner-1"},
        {"worker_id": "runner-2", "metadata": {"x": [1, 2.5, None, "é"]}},
        {"worker_id": ""},  # "" clears the worker, as in AGL
        {"last_heartbeat_time": 1700000000.25},
        {"last_heartbeat_time": 1700000000},
        {"metadata": {}},
        {},
        {"status": "succeeded", "extra": True},
    ],
)
def test_attempt_update_answers_what_django_answers(project, key, body):
    enqueue(project, 2, config={"timeout_seconds": 60})
    first, first_attempt = claim(project)
    second, second_attempt = claim(project)
    raw = json.dumps(body).encode()
    fast = _fast(key, _update_path(first.pk, first_attempt.attempt_id), raw)
    assert fast is not None
    slow = _django(key, _update_path(second.pk, second_attempt.attempt_id), raw)
    _same_but_ids_and_times(
        _fast_comparable(fast),
        _django_comparable(slow),
        {first.pk: second.pk, first_attempt.attempt_id: second_attempt.attempt_id},
    )
    # Byte for byte: Django's rendering of the attempt as stored...
    path = _update_path(first.pk, first_attempt.attempt_id)
    assert _django_get(key, path).content == fast[2]
    # ... and Django's answer to the same report again (idempotent).
    again = _django(key, path, raw)
    if body.get("status") in ("succeeded", "failed") or not body:
        assert _django_comparable(again) == _fast_comparable(fast)
    first.refresh_from_db()
    if body.get("status") == "succeeded":
        assert first.status == "succeeded"


def test_latest_and_a_cancelled_rollout_answer_as_django(project, key):
    enqueue(project, 2)
    first, _ = claim(project)
    second, _ = claim(project)
    for rollout in (first, second):
        services.rollout_update(project=project, rollout_id=rollout.pk, status="cancelled")
    raw = b'{"status": "running"}'
    fast = _fast(key, _update_path(first.pk, "latest"), raw)
    assert fast is not None
    assert (b"x-cancelled-rollouts", first.pk.encode()) in fast[1]
    slow = _django(key, _update_path(second.pk, "latest"), raw)
    _same_but_ids_and_times(
        _fast_comparable(fast),
        _django_comparable(slow),
        {first.pk: second.pk, first.latest_attempt.attempt_id: second.latest_attempt.attempt_id},
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"status": "bogus"}',
        b'{"status": 1}',
        b'{"status": null}',  # AGL's 400: null is refused
        b'{"worker_id": null}',
        b'{"metadata": null}',
        b'{"last_heartbeat_time": null}',
        b'{"metadata": []}',
        b'{"metadata": {"a": NaN}}',
        b'{"last_heartbeat_time": "x"}',
        b'{"last_heartbeat_time": 1e300}',
        b'{"last_heartbeat_time": true}',
        b'{"worker_id": 7}',
        json.dumps({"worker_id": "w" * 201}).encode(),
        b'{"status": "succeeded"',
        b"[]",
        b"null",
        b"",
    ],
)
def test_attempt_update_leaves_anything_else_to_django_and_stores_nothing(project, key, body):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    before = Attempt.objects.get(pk=attempt.pk)
    assert _fast(key, _update_path(rollout.pk, attempt.attempt_id), body) is None
    after = Attempt.objects.get(pk=attempt.pk)
    assert (after.status, after.worker_id, after.metadata, after.last_heartbeat_time) == (
        before.status,
        before.worker_id,
        before.metadata,
        before.last_heartbeat_time,
    )
    assert _django(
        key, _update_path(rollout.pk, attempt.attempt_id), body
    ).status_code != 200 or body in (b"null", b"")


def test_failed_service_calls_are_left_to_django(project, key, other_project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.attempt_update(
        project=project, rollout_id=rollout.pk, attempt_id=attempt.attempt_id, status="succeeded"
    )
    other_key = services.api_key_create(project=other_project, role="runner")[1]
    for who, path, body in [
        (key, _update_path(rollout.pk, attempt.attempt_id), b'{"status": "failed"}'),  # 409
        (key, _update_path(rollout.pk, "at-nope"), b'{"status": "succeeded"}'),  # 404
        (key, _update_path("ro-nope", "latest"), b'{"status": "succeeded"}'),
        (other_key, _update_path(rollout.pk, attempt.attempt_id), b'{"status": "succeeded"}'),
    ]:
        assert _fast(who, path, body) is None, (path, body)
        assert _django(who, path, body).status_code in (404, 409)
    assert Attempt.objects.get(pk=attempt.pk).status == "succeeded"


def test_a_long_polled_dequeue_still_waits_via_the_front(api_server, keys: Keys):
    """Through the server: the lean path leaves the wait to the front, which answers when a
    rollout is queued."""
    with http(api_server, keys.runner) as runner, http(api_server, keys.algorithm) as algo:

        def later() -> None:
            time.sleep(0.6)
            algo.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]})

        thread = threading.Thread(target=later)
        thread.start()
        answer = runner.post(
            "/queues/rollouts/dequeue", json={"worker_id": "w1", "wait_seconds": 10}
        )
        thread.join()
        # It waited: it got the rollout queued after it was sent.
        assert answer.status_code == 200, answer.text
        assert [r["input"] for r in answer.json()] == [1]
        # Work is there: a long-poll is answered with it (by the lean path).
        algo.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": 2}]})
        answer = runner.post(
            "/queues/rollouts/dequeue", json={"worker_id": "w1", "wait_seconds": 10}
        )
        assert [r["input"] for r in answer.json()] == [2]
