"""The lean routes whose one statement commits synchronously and that the ASGI front awaits on
its own asynchronous connections (lightning_site/asgi.py `_awaited`, lightning_site/awaited.py,
store/api/fastjson.py AWAITED_ROUTES: `spans/next`, a bare verdict): through a real
one-process server, the same answers as on the pool's threads (WEB_AWAITED=0), good and bad;
a row lock held by another transaction holds neither the loop nor a thread while the
statement waits for it (with one thread, a request on that thread is answered meanwhile);
and the statement commits in autocommit, synchronously, once answered."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import psycopg
import pytest
from django.utils import timezone

from lightning_site import asgi, awaited
from store import services
from store.api import fastjson
from store.models import ApiKey, Attempt, Rollout
from store.services._rows import native_sql
from tests.api.conftest import database_url_for_tests, http, start_server
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)
_SERVER_ONLY = ("content-length", "date", "server")


def _comparable(answer, *ids: str) -> tuple:
    headers = {k.lower(): v for k, v in answer.headers.items() if k.lower() not in _SERVER_ONLY}
    body = answer.content
    for n, value in enumerate(ids):
        body = body.replace(value.encode(), f"<id{n}>".encode())
    return answer.status_code, headers, body


@pytest.fixture
def key(project) -> str:
    return services.api_key_create(project=project, role="runner")[1]


def test_the_awaited_routes_are_span_next_and_the_verdict_and_off_by_default():
    assert set(fastjson.AWAITED_ROUTES) == {fastjson.NEXT_SPAN_PATH, fastjson.ATTEMPT_ROUTE}
    if os.environ.get("WEB_AWAITED", "0") == "0":
        assert asgi.application.awaited_routes == {}


def _timeless(answer) -> tuple:
    """A verdict's answer without its times (they differ between the two servers' runs)."""
    body = json.loads(answer.content)
    assert body["status"] == "succeeded" and body["end_time"] is not None
    headers = {k.lower(): v for k, v in answer.headers.items() if k.lower() not in _SERVER_ONLY}
    return answer.status_code, headers, {k: v for k, v in body.items()
                                         if k not in ("start_time", "end_time", "rollout_id",
                                                      "attempt_id")}


def _session(server, key: str, other_key: str, rollout: Rollout, attempt: Attempt) -> list:
    """What one server answers to the awaited routes' requests, good and bad."""
    ids = (rollout.pk, attempt.attempt_id)
    with http(server, key) as client:
        pair = {"rollout_id": rollout.pk, "attempt_id": attempt.attempt_id}
        answers = [_comparable(client.post("/spans/next", json=pair), *ids) for _ in range(2)]
        answers.append(_comparable(client.post(
            "/spans/next", json={"rollout_id": "ro-unknown", "attempt_id": "at-x"}), *ids))
        answers.append(_comparable(client.post("/spans/next", json={"rollout_id": 3}), *ids))
        answers.append(_comparable(client.post(
            f"/rollouts/ro-unknown/attempts/{attempt.attempt_id}",
            json={"status": "succeeded"}), *ids))
        path = f"/rollouts/{rollout.pk}/attempts/{attempt.attempt_id}"
        for _ in range(2):  # the verdict, then the same again (the full path's no-op)
            answers.append(_timeless(client.post(path, json={"status": "succeeded"})))
        answers.append(_comparable(client.post(path, json={"status": "failed"}), *ids))
    with http(server, other_key) as client:  # another project's key: Django's 404
        answers.append(_comparable(client.post("/spans/next", json=pair), *ids))
    ApiKey.objects.filter(prefix=key[:12]).update(revoked_at=timezone.now())
    with http(server, key) as client:  # a revoked key, cached by the server: Django's 401
        answers.append(_comparable(client.post("/spans/next", json=pair), *ids))
    ApiKey.objects.filter(prefix=key[:12]).update(revoked_at=None)
    return answers


def test_awaited_and_pooled_answers_are_the_same(project, other_project, key):
    other_key = services.api_key_create(project=other_project, role="runner")[1]
    enqueue(project, 2)
    claimed = [claim(project) for _ in range(2)]
    answers = []
    for setting, (rollout, attempt) in zip(("1", "0"), claimed, strict=True):
        server = start_server(workers=1, threads=2, env={"WEB_AWAITED": setting})
        try:
            answers.append(_session(server, key, other_key, rollout, attempt))
        finally:
            server.stop()
    awaited_answers, pooled = answers
    assert awaited_answers[0][0] == 200 and awaited_answers[0][2] == b'{"sequence_id":1}'
    assert awaited_answers[1][2] == b'{"sequence_id":2}'
    assert [a[0] for a in awaited_answers] == [200, 200, 404, 422, 404, 200, 200, 409, 404,
                                               401]
    assert awaited_answers == pooled
    for rollout, _ in claimed:
        rollout.refresh_from_db()
        assert rollout.status == "succeeded" and rollout.next_span_sequence_id == 3


def _held(server, key: str, lock_sql: str, lock_id, request) -> tuple:  # noqa: ANN001
    """`request(client)` sent while another transaction holds a row lock (`lock_sql`): with
    the server's one thread free, a heartbeat (answered on that thread) is answered while the
    request waits for the lock; the request's answer once the lock is released."""
    answers: dict = {}
    with http(server, key) as client:  # the key cached, the loop's connections open
        assert client.post("/workers/warm", json={}).status_code == 200
    with psycopg.connect(database_url_for_tests()) as locker:
        locker.execute(lock_sql, [lock_id])

        def send() -> None:
            with http(server, key) as client:
                answers["held"] = request(client)

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.5)  # the request is waiting for the lock by now
        assert "held" not in answers
        with http(server, key) as client:
            # On the one thread: it would wait behind the held request if that had the thread.
            heartbeat = client.post("/workers/w-free", json={"heartbeat_stats": {"n": 1}})
            assert heartbeat.status_code == 200, heartbeat.text
        assert "held" not in answers  # still waiting for the lock, on its awaited connection
        locker.rollback()
    sender.join(timeout=30)
    return answers["held"]


def test_a_span_id_waiting_for_a_row_lock_holds_no_thread(project, key):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    # WEB_INLINE=0: else `spans/next` is answered on the loop (an asynchronous commit)
    server = start_server(workers=1, threads=1, env={"WEB_AWAITED": "1", "WEB_INLINE": "0"})
    try:
        answer = _held(server, key, "SELECT 1 FROM store_rollout WHERE id = %s FOR UPDATE",
                       rollout.pk, lambda client: client.post("/spans/next", json={
                           "rollout_id": rollout.pk, "attempt_id": attempt.attempt_id}))
    finally:
        server.stop()
    assert (answer.status_code, answer.content) == (200, b'{"sequence_id":1}')
    rollout.refresh_from_db()
    assert rollout.next_span_sequence_id == 2


def test_a_verdict_waiting_for_a_row_lock_holds_no_thread(project, key):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    server = start_server(workers=1, threads=1, env={"WEB_AWAITED": "1"})
    try:
        answer = _held(server, key, "SELECT 1 FROM store_attempt WHERE id = %s FOR UPDATE",
                       attempt.pk, lambda client: client.post(
                           f"/rollouts/{rollout.pk}/attempts/{attempt.attempt_id}",
                           json={"status": "succeeded"}))
    finally:
        server.stop()
    assert answer.status_code == 200, answer.text
    assert json.loads(answer.content)["status"] == "succeeded"
    rollout.refresh_from_db()
    assert rollout.status == "succeeded"


def test_awaited_connections_commit_each_statement_synchronously(project):
    """The awaited connections run in autocommit with the database's synchronous commit (a
    verdict is durable once answered, as on the threads; `spans/next`'s statement sets its
    own commit's mode: off within the rollout's reserve, README "Span sequence ids and
    crashes"), and a statement's write is committed when it returns (another connection
    sees it)."""
    enqueue(project, 1)
    rollout, attempt = claim(project)
    sql, params = services.span_next_sequence_statement(project=project, rollout_id=rollout.pk)

    async def run() -> tuple:
        connections = awaited.AwaitedConnections(1)
        try:
            setting = await connections.fetch_one(
                b"SELECT current_setting('synchronous_commit'), "
                b"pg_current_xact_id_if_assigned() IS NULL", [])
            row = await connections.fetch_one(native_sql(sql), params)
            with psycopg.connect(database_url_for_tests(), autocommit=True) as other:
                seen = other.execute("SELECT next_span_sequence_id FROM store_rollout "
                                     "WHERE id = %s", [rollout.pk]).fetchone()[0]
            # Prepared at its first run, as fetch_one_prepared's (parsed and planned once).
            prepared = await connections.fetch_one(
                b"SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'UPDATE %'",
                [])
            return setting, row, seen, prepared
        finally:
            await connections.close()

    setting, row, seen, prepared = asyncio.run(run())
    assert setting == ("on", True)
    assert (row[0], row[-1]) == (1, "off")  # the first id, ..., the commit's mode
    assert seen == 2
    assert prepared == (1,)


def test_a_busy_pool_says_so():
    """With every awaited connection in use, a statement raises Busy (the front hands the
    request to a thread) instead of queueing behind them."""

    async def run() -> None:
        connections = awaited.AwaitedConnections(1)
        try:
            slow = asyncio.ensure_future(connections.fetch_one(b"SELECT pg_sleep(0.5)", []))
            await asyncio.sleep(0.2)
            with pytest.raises(awaited.Busy):
                await connections.fetch_one(b"SELECT 1", [])
            await slow
            assert await connections.fetch_one(b"SELECT 1", []) == (1,)
        finally:
            await connections.close()

    asyncio.run(run())
