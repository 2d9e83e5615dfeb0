"""The lean routes the ASGI front answers on its event loop's thread (lightning_site/asgi.py,
INLINE_ROUTES: OTLP export, `spans`, `spans/next`, the resources read): through a real one-process server,
the same answers as with the pool's threads (WEB_INLINE=0), and a row lock held by another
transaction holds the loop up for at most INLINE_LOCK_TIMEOUT_MS: the request then goes to
Django's path on a thread (which waits for the lock and answers), and other requests are
answered meanwhile."""

from __future__ import annotations

import json
import os
import threading
import time

import psycopg
import pytest

from lightning_site import asgi
from store import services
from store.api import fastjson, fastpath
from store.models import Span
from tests.api.conftest import database_url_for_tests, http, start_server
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)
_SERVER_ONLY = ("content-length", "date", "server")


def _span(rollout_id: str, attempt_id: str) -> dict:
    return {"rollout_id": rollout_id, "attempt_id": attempt_id, "trace_id": "ab" * 16,
            "span_id": os.urandom(8).hex(), "parent_id": None, "name": "llm.call",
            "status": {"status_code": "OK", "description": None},
            "attributes": {"n": 3}, "events": [], "links": [], "start_time": 1700000000.5,
            "end_time": 1700000001, "context": {"trace_id": "ab" * 16}, "parent": None,
            "resource": {"attributes": {"service.name": "agl"}, "schema_url": ""}}


def _comparable(answer) -> tuple:
    headers = {k.lower(): v for k, v in answer.headers.items() if k.lower() not in _SERVER_ONLY}
    return answer.status_code, headers, answer.content


@pytest.fixture
def key(project) -> str:
    return services.api_key_create(project=project, role="runner")[1]


def test_the_inline_routes_are_the_lean_span_writes_span_ids_and_the_resources_read():
    assert asgi.INLINE_ROUTES == {fastpath.TRACES_PATH, fastjson.SPANS_PATH,
                                  fastjson.NEXT_SPAN_PATH, fastjson.RESOURCE_ROUTE}
    assert asgi.application.inline_routes == asgi.INLINE_ROUTES


def test_inline_and_pooled_answers_are_the_same(project, key):
    resources_id = services.resources_add(
        project=project, resources={"llm": {"resource_type": "llm"}}).resource_set.resources_id
    enqueue(project, 2)
    claimed = [claim(project) for _ in range(2)]
    answers = []
    for inline, (rollout, attempt) in zip(("1", "0"), claimed, strict=True):
        server = start_server(workers=1, env={"WEB_INLINE": inline})
        try:
            with http(server, key) as client:
                resources = client.get(f"/resources/{resources_id}")
                span = _span(rollout.pk, attempt.attempt_id)
                span_id = span["span_id"]
                added = client.post("/spans", json=span)
                again = client.post("/spans", json=span)  # a duplicate: null
                reserved = client.post("/spans/next", json={
                    "rollout_id": rollout.pk, "attempt_id": attempt.attempt_id})
        finally:
            server.stop()
        body = added.content.replace(rollout.pk.encode(), b"R").replace(
            attempt.attempt_id.encode(), b"A").replace(span_id.encode(), b"S")
        answers.append((_comparable(resources), added.status_code, body, _comparable(again),
                        _comparable(reserved)))
    assert answers[0][1] == 201
    assert answers[0] == answers[1]
    assert Span.objects.count() == 2


@pytest.mark.parametrize("protocol", ["1", "0"])  # uvicorn's protocol (leanwire), the front
def test_a_span_id_that_must_be_durable_is_answered_on_a_thread(project, key, protocol):
    """Past its rollout's reserve the loop's call stores nothing (OnThread) and a thread
    reserves it with a synchronous commit, moving the reserve; the next is the loop's again."""
    from django.db.models import F

    from store.models import Rollout
    from store.rules import SPAN_ID_BLOCK

    enqueue(project, 1)
    rollout, attempt = claim(project)
    Rollout.objects.filter(pk=rollout.pk).update(next_span_sequence_id=F("span_ids_reserved"))
    server = start_server(workers=1, env={"WEB_LEAN_PROTOCOL": protocol})
    try:
        with http(server, key) as client:
            ids = [client.post("/spans/next", json={
                "rollout_id": rollout.pk, "attempt_id": attempt.attempt_id}).json()
                for _ in range(2)]
    finally:
        server.stop()
    reserve = 1 + SPAN_ID_BLOCK
    assert ids == [{"sequence_id": reserve}, {"sequence_id": reserve + 1}]
    rollout.refresh_from_db()
    assert rollout.span_ids_reserved == reserve + 1 + SPAN_ID_BLOCK


def test_a_locked_attempt_holds_the_loop_up_only_briefly(project, key):
    resources_id = services.resources_add(
        project=project, resources={"llm": {"resource_type": "llm"}}).resource_set.resources_id
    enqueue(project, 1)
    rollout, attempt = claim(project)
    server = start_server(workers=1, threads=2)
    answers: dict = {}
    try:
        with http(server, key) as client:  # the key cached, the loop's connection open
            assert client.get(f"/resources/{resources_id}").status_code == 200
        with psycopg.connect(database_url_for_tests()) as locker:
            locker.execute("SELECT 1 FROM store_attempt WHERE id = %s FOR UPDATE",
                           [attempt.pk])

            def write() -> None:
                with http(server, key) as client:
                    answers["span"] = client.post(
                        "/spans", json=_span(rollout.pk, attempt.attempt_id))

            writer = threading.Thread(target=write)
            writer.start()
            time.sleep(0.5)  # the span waits for the lock (on a thread, by now)
            assert "span" not in answers
            with http(server, key) as client:  # a loop held up by the lock would never answer
                assert client.get(f"/resources/{resources_id}").status_code == 200
            assert "span" not in answers  # still waiting for the lock, on a thread
            locker.rollback()
        writer.join(timeout=30)
    finally:
        server.stop()
    assert answers["span"].status_code == 201, answers["span"].text
    assert json.loads(answers["span"].content)["rollout_id"] == rollout.pk
    assert Span.objects.filter(attempt_id=attempt.pk).count() == 1


def _sessions_opened() -> int:
    """Sessions ever opened on the test database (counted by Postgres, flushed within 1 s)."""
    time.sleep(1.5)
    with psycopg.connect(database_url_for_tests(), autocommit=True) as db:
        return db.execute("SELECT sessions FROM pg_stat_database WHERE datname = "
                          "current_database()").fetchone()[0]


def test_the_loop_keeps_one_connection_across_requests_and_clients(project, key):
    """Django's connections are per context in an event loop (asgiref's Local): the inline
    path must reuse the loop thread's connection, not open one per request."""
    resources_id = services.resources_add(
        project=project, resources={"llm": {"resource_type": "llm"}}).resource_set.resources_id
    server = start_server(workers=1, threads=2, env={"WEB_INLINE": "1"})
    try:
        with http(server, key) as client:  # the key cached, the loop's connection open
            assert client.get(f"/resources/{resources_id}").status_code == 200
        before = _sessions_opened()
        for _ in range(30):  # each on a new HTTP connection (a new task and context)
            with http(server, key) as client:
                assert client.get(f"/resources/{resources_id}").status_code == 200
        opened = _sessions_opened() - before
    finally:
        server.stop()
    assert opened <= 3, f"{opened} database sessions opened for 30 requests"
