"""Span-only transactions commit asynchronously (store/services/spans.py,
`_commit_asynchronously`); an attempt's completion commits synchronously and so flushes them.

The crash test runs its own throwaway Postgres (initdb in a temporary folder, its own port,
never the shared cluster), serves it with the API server, posts spans and the completion over
HTTP, and kills Postgres (`pg_ctl stop -m immediate`: no checkpoint, no WAL flush) the moment
the completion is acknowledged; after recovery, the spans and the verdict are there. The
WAL writer is slowed to its maximum (10 s), so the completion's own flush is what saves them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psycopg
import pytest
from django.db import transaction
from django.test.utils import CaptureQueriesContext

from store import services
from tests.api.conftest import start_server
from tests.conftest import claim, enqueue
from tests.private_postgres import manage, private_postgres_cluster

ASYNC = "synchronous_commit"  # `SET LOCAL synchronous_commit = off`, or set_config's form


def _span(rollout_id: str, attempt_id: str, index: int) -> dict:
    return {"rollout_id": rollout_id, "attempt_id": attempt_id, "trace_id": "a" * 32,
            "span_id": f"{index:016x}", "name": f"step.{index}", "start_time": 1.0,
            "end_time": 2.0, "attributes": {"i": index}}


@pytest.mark.django_db(transaction=True)
def test_a_span_only_transaction_commits_asynchronously_unless_inside_another(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    from django.db import connection

    with CaptureQueriesContext(connection) as alone:
        services.spans_ingest(project=project, spans=[_span(rollout.pk, attempt.attempt_id, 0)])
    assert any(ASYNC in q["sql"] for q in alone.captured_queries)
    with CaptureQueriesContext(connection) as nested, transaction.atomic():
        services.spans_ingest(project=project, spans=[_span(rollout.pk, attempt.attempt_id, 1)])
    assert not any(ASYNC in q["sql"] for q in nested.captured_queries)
    with CaptureQueriesContext(connection) as finish:
        services.attempt_update(project=project, rollout_id=rollout.pk,
                                attempt_id=attempt.attempt_id, status="succeeded")
    assert not any("synchronous_commit" in q["sql"] for q in finish.captured_queries)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_spans_next_commits_asynchronously_only_within_the_rollouts_reserve(project):
    """`spans/next`'s statement sets its own commit's mode (its second column): off while
    the ids stay below the rollout's reserve in the span epoch it was enqueued in; on,
    moving the reserve, past it or in another epoch (after a crash), whose first
    reservation also skips to the reserve (what a crash may have lost lies below it)."""
    from datetime import UTC, datetime

    from django.db import connection

    from store.models import Rollout
    from store.rules import SPAN_ID_BLOCK
    from store.services._rows import server_epoch

    assert server_epoch() is not None  # started in autocommit (as a lean request's first call)
    enqueue(project, 1)
    rollout, _ = claim(project)
    assert rollout.span_epoch == server_epoch()

    def reserve(count: int = 1, durable_ok: bool = True):
        sql, params = services.span_next_sequence_statement(
            project=project, rollout_id=rollout.pk, count=count, durable_ok=durable_ok)
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()

    with connection.cursor() as cursor:
        cursor.execute("SELECT started FROM store_span_epoch")
        now = cursor.fetchone()[0]
    reserved = 1 + SPAN_ID_BLOCK
    assert reserve() == (1, False, "off")  # (the first id, no epoch found?, the commit)
    assert reserve(count=reserved - 2) == (2, False, "off")  # up to the reserve itself
    assert reserve(durable_ok=False) is None  # past it: not where a flush may not wait
    assert reserve() == (reserved, False, "on")
    rollout.refresh_from_db()
    assert rollout.span_ids_reserved == reserved + 1 + SPAN_ID_BLOCK
    assert reserve() == (reserved + 1, False, "off")
    Rollout.objects.filter(pk=rollout.pk).update(span_epoch=datetime(2000, 1, 1, tzinfo=UTC))
    assert reserve() == (reserved + 1 + SPAN_ID_BLOCK, False, "on")
    rollout.refresh_from_db()
    assert rollout.span_epoch == now
    # No epoch (a crash emptied it, and nobody started one yet): durable, and started again.
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM store_span_epoch")
    assert reserve() == (reserved + 2 + 2 * SPAN_ID_BLOCK, True, "on")  # skipped again
    services.span_next_sequence_id(project=project, rollout_id=rollout.pk, attempt_id="a")
    assert server_epoch() not in (None, now)
    # In a caller's transaction the statement leaves the caller's commit alone.
    with transaction.atomic(), CaptureQueriesContext(connection) as inside:
        services.span_next_sequence_id(project=project, rollout_id=rollout.pk, attempt_id="a")
    assert not any(ASYNC in q["sql"] for q in inside.captured_queries)


@pytest.fixture
def private_postgres():
    # The WAL writer slowed to its maximum, so the completion's own flush is what saves spans.
    with private_postgres_cluster(18472, options="-c fsync=on -c synchronous_commit=on "
                                  "-c wal_writer_delay=10000ms -c autovacuum=off") as cluster:
        yield cluster


def _migrated_with_a_key(cluster) -> tuple[str, str]:
    """The private cluster's database migrated, with a project and its algorithm key."""
    url = cluster.url()
    manage(url, "migrate", "--noinput", "-v0")
    out = manage(url, "project_create", "durable", "--key", "algorithm")
    return url, out.strip().rsplit(" ", 1)[-1]


@contextmanager
def _served(url: str, key: str) -> Iterator[tuple]:
    """The API server on the private cluster, and a client of its AGL routes with `key`."""
    server = start_server(workers=1, threads=2, env={"DATABASE_URL": url})
    try:
        with httpx.Client(base_url=server.url + "/v1/agl", timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            yield server, client
    finally:
        server.stop()


def _wal_not_on_disk(url: str) -> bool:
    """Whether WAL was written that is not flushed yet (asynchronous commits since the last
    flush: the WAL writer is slowed to 10 s)."""
    with psycopg.connect(url, autocommit=True) as conn:
        written, flushed = conn.execute(
            "SELECT pg_current_wal_insert_lsn(), pg_current_wal_flush_lsn()").fetchone()
        return conn.execute("SELECT pg_wal_lsn_diff(%s, %s) > 0",
                            [written, flushed]).fetchone()[0]


def _otlp(rid: str, aid: str, index: int) -> bytes:
    from tests.api.test_api_otlp import export_request

    request = export_request([{"name": f"step.{index}"}], resource={
        "agentlightning.rollout_id": rid, "agentlightning.attempt_id": aid})
    request.resource_spans[0].scope_spans[0].spans[0].span_id = bytes.fromhex(f"{index:016x}")
    return request.SerializeToString()


@pytest.mark.slow
@pytest.mark.parametrize("route", ["spans", "otlp"])  # otlp: its one-statement common case too
def test_spans_of_a_completed_attempt_survive_a_crash_right_after_the_answer(
        private_postgres, route):
    url, key = _migrated_with_a_key(private_postgres)
    with _served(url, key) as (server, client):
        started = client.post("/rollouts", json={"input": {"x": 1}}).json()
        rid, aid = started["rollout_id"], started["attempt"]["attempt_id"]
        for index in range(4):
            if route == "spans":
                answer = client.post("/spans", json=_span(rid, aid, index))
                assert answer.status_code == 201, answer.text
            else:
                answer = client.post(server.url + "/v1/traces", content=_otlp(rid, aid, index),
                                     headers={"Content-Type": "application/x-protobuf"})
                assert answer.status_code == 200, answer.text
        assert _wal_not_on_disk(url)  # the spans' commits were asynchronous
        done = client.post(f"/rollouts/{rid}/attempts/{aid}", json={"status": "succeeded"})
        assert done.status_code == 200, done.text
        private_postgres.crash()  # the moment the completion is acknowledged
    private_postgres.start()  # recovery replays the WAL that reached the disk
    with psycopg.connect(url) as conn:
        spans = conn.execute("SELECT count(*) FROM store_span WHERE rollout_id = %s",
                             [rid]).fetchone()[0]
        status = conn.execute("SELECT status FROM store_attempt WHERE attempt_id = %s",
                              [aid]).fetchone()[0]
    assert (spans, status) == (4, "succeeded")


@pytest.mark.slow
@pytest.mark.parametrize("crash", ["stop", "backend"])  # the server stopped; a backend killed
def test_ids_handed_out_asynchronously_are_not_handed_out_again_after_a_crash(
        private_postgres, crash):
    """`spans/next` within a rollout's reserve commits asynchronously: a crash may lose the
    reservations that were answered, whether Postgres stops (`pg_ctl stop -m immediate`) or
    a backend dies (the postmaster stays up and resets: an OOM kill). The first one after
    the recovery (a new span epoch) skips to the reserve, past every id handed out before."""
    url, key = _migrated_with_a_key(private_postgres)
    with _served(url, key) as (_, client):
        started = client.post("/rollouts", json={"input": {"x": 1}}).json()
        ids = {"rollout_id": started["rollout_id"],
               "attempt_id": started["attempt"]["attempt_id"]}
        handed = [client.post("/spans/next", json=ids).json()["sequence_id"]
                  for _ in range(5)]
        assert handed == [1, 2, 3, 4, 5]
        assert _wal_not_on_disk(url)  # the reservations' commits were asynchronous
        if crash == "backend":
            private_postgres.crash_a_backend()
        else:
            private_postgres.crash()
    if crash == "stop":
        private_postgres.start()
    with psycopg.connect(url) as conn:
        counter, reserved = conn.execute(
            "SELECT next_span_sequence_id, span_ids_reserved FROM store_rollout WHERE id = %s",
            [ids["rollout_id"]]).fetchone()
    assert counter <= 6 < reserved  # the reservations lost (some or all), the reserve kept
    with _served(url, key) as (_, client):
        after = client.post("/spans/next", json=ids).json()["sequence_id"]
        again = client.post("/spans/next", json=ids).json()["sequence_id"]
    assert after == reserved > max(handed)
    assert again == after + 1
