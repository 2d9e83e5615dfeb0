"""The lean paths' key cache (store/api/auth.py `authenticate_key_lean`): after a key's first
full authentication, a process remembers what the key is, and each lean request's own
statement checks that the key is still live with that role. A key revoked, deleted or given
another role after its facts were cached writes nothing through a lean path; the request
falls through to Django, which answers as it would (401 for a dead key)."""

from __future__ import annotations

import json
from datetime import timedelta

import httpx
import pytest
from django.test import Client
from django.utils import timezone

from store import services
from store.api import auth, fastjson, fastpath
from store.models import ApiKey, Attempt, Rollout, Span, Worker
from tests.api.conftest import Keys, http
from tests.api.test_api_fastpath import _export
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)
JSON = "application/json"
PROTOBUF = "application/x-protobuf"
DEQUEUE = fastjson.DEQUEUE_PATH


def _headers(key: str, content_type: str) -> dict[bytes, bytes]:
    return {
        b"content-type": content_type.encode(),
        b"host": b"127.0.0.1",
        b"accept": b"*/*",
        b"authorization": f"Bearer {key}".encode(),
    }


def _dequeue(key: str, body: dict | None = None):
    return fastjson.dequeue(
        _headers(key, JSON), DEQUEUE, json.dumps(body or {"limit": 1, "worker_id": "w9"}).encode()
    )


def _update(key: str, rollout_id: str, attempt_id: str, status: str = "running"):
    path = f"/v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}"
    return fastjson.update_attempt(
        _headers(key, JSON), path, json.dumps({"status": status}).encode()
    )


def _otlp(key: str, rollout_id: str, attempt_id: str, name: str = "step"):
    return fastpath.otlp_traces(_headers(key, PROTOBUF), _export(rollout_id, attempt_id, name))


def _client(key: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="127.0.0.1")


def _state() -> tuple:
    """Everything a lean request could write."""
    return (
        list(
            Attempt.objects.order_by("pk").values_list(
                "pk", "status", "last_heartbeat_time", "deadline"
            )
        ),
        list(Rollout.objects.order_by("pk").values_list("pk", "status", "next_span_sequence_id")),
        list(
            Worker.objects.order_by("pk").values_list(
                "pk", "status", "last_dequeue_time", "last_idle_time"
            )
        ),
        Span.objects.count(),
    )


@pytest.fixture
def cached(project):
    """A runner key, used once by each lean path (so its facts are cached), with queued work
    left and an attempt of its own to update and export to."""
    auth.lean_cache_clear()
    enqueue(project, 4)
    rollout, attempt = claim(project)
    key = services.api_key_create(project=project, role="runner")[1]
    assert _dequeue(key)[0] == 200
    assert _update(key, rollout.pk, attempt.attempt_id)[0] == 200
    assert _otlp(key, rollout.pk, attempt.attempt_id)[0] == 200
    # Each path now runs from the cache (its statement checks the key).
    lean = auth.authenticate_key_lean(key)
    assert lean is not None and lean.live_check == (lean.pk, "runner")
    assert _dequeue(key)[0] == 200
    assert _otlp(key, rollout.pk, attempt.attempt_id, "again")[0] == 200
    yield key, rollout.pk, attempt.attempt_id
    auth.lean_cache_clear()


def _refused_by_every_lean_path(key: str, rollout_id: str, attempt_id: str) -> None:
    before = _state()
    assert _dequeue(key) is None
    assert _dequeue(key, {"limit": 1, "worker_id": "w9", "wait_seconds": 2}) is None
    assert _dequeue(key, {"limit": 0, "worker_id": "w9"}) is None
    assert _update(key, rollout_id, attempt_id, "succeeded") is None
    assert _otlp(key, rollout_id, attempt_id, "after") is None
    assert _state() == before  # nothing stored, nothing claimed
    client = _client(key)
    assert client.post(DEQUEUE, data={"limit": 1}, content_type=JSON).status_code == 401
    assert (
        client.post(
            f"/v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}",
            data={"status": "succeeded"},
            content_type=JSON,
        ).status_code
        == 401
    )
    assert (
        client.post(
            "/v1/traces", data=_export(rollout_id, attempt_id), content_type=PROTOBUF
        ).status_code
        == 401
    )
    assert _state() == before


def test_a_key_revoked_after_it_was_cached_is_refused_by_the_next_lean_request(cached):
    key, rollout_id, attempt_id = cached
    ApiKey.objects.filter(prefix=key[:12]).update(revoked_at=timezone.now())
    _refused_by_every_lean_path(key, rollout_id, attempt_id)


def test_a_key_deleted_after_it_was_cached_is_refused_by_the_next_lean_request(cached):
    key, rollout_id, attempt_id = cached
    ApiKey.objects.filter(prefix=key[:12]).delete()
    _refused_by_every_lean_path(key, rollout_id, attempt_id)


def test_a_role_edited_after_caching_is_checked_by_the_statement(cached):
    """The admin may edit a key's role: the cached role no longer holds, so the lean path
    writes nothing and Django answers with the key's role as it is now."""
    key, rollout_id, attempt_id = cached
    ApiKey.objects.filter(prefix=key[:12]).update(role="algorithm")
    before = _state()
    assert _dequeue(key) is None
    assert _update(key, rollout_id, attempt_id, "succeeded") is None
    assert _otlp(key, rollout_id, attempt_id, "after") is None
    assert _state() == before
    answer = _client(key).post(DEQUEUE, data={"limit": 1}, content_type=JSON)
    assert answer.status_code == 200 and len(answer.json()) == 1


def test_the_cached_role_is_checked_against_the_views_roles(cached, monkeypatch):
    key, rollout_id, attempt_id = cached
    monkeypatch.setattr(fastjson, "_DEQUEUE_ROLES", frozenset({"algorithm", "admin"}))
    monkeypatch.setattr(fastjson, "_ATTEMPT_ROLES", frozenset({"algorithm", "admin"}))
    monkeypatch.setattr(
        fastpath.otlp.OtlpTracesView, "post_roles", frozenset({"algorithm"}), raising=False
    )
    before = _state()
    assert _dequeue(key) is None
    assert _update(key, rollout_id, attempt_id, "succeeded") is None
    assert _otlp(key, rollout_id, attempt_id, "after") is None
    assert _state() == before


def test_a_cached_key_is_still_refused_when_its_hash_does_not_match(cached):
    key, _, _ = cached
    wrong = key[:-1] + ("x" if key[-1] != "x" else "y")
    assert _dequeue(wrong) is None


def test_last_used_at_is_written_at_most_once_a_minute_from_the_lean_paths(cached, monkeypatch):
    key, rollout_id, attempt_id = cached
    long_ago = timezone.now() - timedelta(minutes=5)
    ApiKey.objects.filter(prefix=key[:12]).update(last_used_at=long_ago)
    assert _otlp(key, rollout_id, attempt_id, "hit")[0] == 200  # a cache hit: no bookkeeping
    assert ApiKey.objects.get(prefix=key[:12]).last_used_at == long_ago
    monkeypatch.setattr(auth, "LEAN_RECHECK_SECONDS", 0.0)  # the minute has passed
    assert _otlp(key, rollout_id, attempt_id, "full")[0] == 200
    assert ApiKey.objects.get(prefix=key[:12]).last_used_at > long_ago


def test_the_cache_is_bounded(project, monkeypatch):
    auth.lean_cache_clear()
    monkeypatch.setattr(auth, "LEAN_CACHE_SIZE", 3)
    raws = [services.api_key_create(project=project, role="runner")[1] for _ in range(5)]
    for raw in raws:
        assert auth.authenticate_key_lean(raw).live_check is None  # a miss: in full
    assert len(auth._lean_cache) == 3
    assert auth.authenticate_key_lean(raws[-1]).live_check is not None  # a hit
    assert auth.authenticate_key_lean(raws[0]).live_check is None  # evicted
    assert not any(raw.encode() in k for k in auth._lean_cache for raw in raws)
    auth.lean_cache_clear()


def test_every_process_refuses_a_revoked_key_on_each_lean_path_at_once(api_server, keys: Keys):
    """Through the ASGI front's processes (2 workers): each has used the key on the three
    lean paths when it is revoked; the next requests of each kind are all 401."""
    enqueue(keys.project, 80)
    traces = api_server.url + "/v1/traces"
    bearer = {"Authorization": f"Bearer {keys.runner}"}
    with http(api_server, keys.runner) as client:
        claimed = []
        for _ in range(40):
            answer = client.post("/queues/rollouts/dequeue", json={"worker_id": "w", "limit": 1})
            assert answer.status_code == 200, answer.text
            claimed.append(answer.json()[0])
        for item in claimed:
            rid, aid = item["rollout_id"], item["attempt"]["attempt_id"]
            assert (
                client.post(
                    f"/rollouts/{rid}/attempts/{aid}", json={"status": "running"}
                ).status_code
                == 200
            )
            assert (
                httpx.post(
                    traces, content=_export(rid, aid), headers={**bearer, "Content-Type": PROTOBUF}
                ).status_code
                == 200
            )
        ApiKey.objects.filter(project=keys.project, role="runner").update(revoked_at=timezone.now())
        before = _state()
        answers = set()
        for item in claimed:
            rid, aid = item["rollout_id"], item["attempt"]["attempt_id"]
            answers.add(
                client.post(
                    "/queues/rollouts/dequeue", json={"worker_id": "w", "limit": 1}
                ).status_code
            )
            answers.add(
                client.post(
                    f"/rollouts/{rid}/attempts/{aid}", json={"status": "succeeded"}
                ).status_code
            )
            answers.add(
                httpx.post(
                    traces,
                    content=_export(rid, aid, "after"),
                    headers={**bearer, "Content-Type": PROTOBUF},
                ).status_code
            )
    assert answers == {401}
    assert _state() == before
