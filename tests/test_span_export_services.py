"""`services.spans_export`, the OTLP export's service: its one-statement common case (Postgres,
outside a transaction, one attempt whose heartbeat is not due) answers as the full path does,
and everything else falls back to the full path. Real transactions (`transaction=True`): the
common case runs only outside one. Also run on SQLite (`./lightning test_sqlite`), where
everything takes the full path."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from store import services
from store.errors import InvalidInput
from store.models import Attempt, Rollout, Span
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)


def otel(rollout, attempt, name: str, seq: int | None = None, **extra) -> dict:
    """A span as the OTLP export hands it over (no sequence id unless the sender gave one)."""
    return {"rollout_id": rollout.pk, "attempt_id": attempt.attempt_id, "sequence_id": seq,
            "trace_id": "ab" * 16, "span_id": name.encode().hex().rjust(16, "0")[:16],
            "parent_id": None, "name": name, "status": {"status_code": "OK", "description": None},
            "attributes": {"n": name, "x": 1.5}, "events": [{"name": "e", "attributes": {},
                                                              "timestamp": 1.0}],
            "links": [], "start_time": 1.0, "end_time": 2.0,
            "context": {"trace_id": "ab" * 16, "span_id": "0" * 16, "is_remote": False,
                        "trace_state": {}},
            "parent": None, "resource": {"attributes": {"service.name": "t"}, "schema_url": ""},
            **extra}


def _state(rollout: Rollout, attempt: Attempt) -> tuple:
    attempt.refresh_from_db()
    rollout.refresh_from_db()
    return (attempt.status, attempt.last_heartbeat_time, attempt.deadline, attempt.metadata,
            rollout.status, rollout.next_span_sequence_id, rollout.queue_deadline)


def _stored(attempt: Attempt) -> list[tuple]:
    return list(Span.objects.filter(attempt=attempt).order_by("sequence_id", "pk").values_list(
        "sequence_id", "span_id", "name", "status", "attributes", "events", "links",
        "start_time", "end_time", "context", "parent", "resource", "extra"))


def _uses_common_case() -> bool:
    return connection.vendor == "postgresql"


@pytest.mark.parametrize("config", [
    None, {"timeout_seconds": 30.5}, {"unresponsive_seconds": 7.25},
    {"timeout_seconds": 0.1 + 0.2, "unresponsive_seconds": 1e-7},
    {"timeout_seconds": 2e8},  # beyond the statement's limit: the full path revives
])
def test_the_common_case_answers_as_the_full_path_does(project, config):
    enqueue(project, 2, config=config)
    ours = claim(project, "w1")
    theirs = claim(project, "w2")
    # One start time for both (a deadline counts from it).
    Attempt.objects.filter(pk=theirs[1].pk).update(start_time=ours[1].start_time)
    t0 = timezone.now()
    # (spans by name and explicit sequence id, seconds after t0)
    exports = [
        ([("a", None)], 0.0),  # preparing: revived (deadline), rollout -> running
        ([("b", None), ("c", None)], 0.1),  # heartbeat not due
        ([("d", 10), ("e", None)], 0.2),  # an explicit id raises the counter
        ([("b", None), ("f", None)], 0.3),  # a stored span is skipped (its id is still used)
        ([("g", None)], 1.5),  # heartbeat due
        ([("h", 2)], 1.6),  # an explicit id below the counter
        ([("i", None), ("i", None)], 1.7),  # twice in one batch: the first is kept
        ([("j", None)], 1.8),
    ]
    for names, offset in exports:
        now = t0 + timedelta(seconds=offset)
        got = services.spans_export(
            project=project, now=now,
            spans=[otel(*ours, name, seq, custom=[k]) for k, (name, seq) in enumerate(names)])
        ingested = services.spans_ingest(
            project=project, now=now,
            spans=[otel(*theirs, name, seq, custom=[k]) for k, (name, seq) in enumerate(names)])
        assert (got.cancelled, got.unknown) == (ingested.cancelled, 0)
        assert _stored(ours[1]) == _stored(theirs[1])
        state, expected = _state(*ours), _state(*theirs)
        assert state == expected
    assert state[0] == "running" and state[4] == "running"
    assert state[1] == t0 + timedelta(seconds=1.5)  # heartbeats: at t0 and t0 + 1.5 only
    # A stored span's id is still used up (b, the second i), as in the full path.
    assert {row[2]: row[0] for row in _stored(ours[1])} == {
        "a": 1, "b": 2, "c": 3, "d": 10, "e": 11, "f": 13, "g": 14, "h": 2, "i": 15, "j": 17}
    assert Span.objects.get(attempt=ours[1], name="i").extra == {"custom": [0]}


@pytest.mark.postgres
def test_the_common_case_is_one_statement_and_commits_asynchronously(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    for names in (["a"], ["b", "c"]):  # preparing (revived), then heartbeat not due
        with CaptureQueriesContext(connection) as common:
            services.spans_export(project=project,
                                  spans=[otel(rollout, attempt, name) for name in names])
        sql = [q["sql"] for q in common.captured_queries]
        assert len(sql) == 1 and "set_config('synchronous_commit', 'off', true)" in sql[0], sql
    attempt.refresh_from_db()
    rollout.refresh_from_db()
    assert (attempt.status, rollout.status) == ("running", "running")
    assert list(Span.objects.order_by("sequence_id").values_list("name", "sequence_id")) == [
        ("a", 1), ("b", 2), ("c", 3)]
    # Inside a caller's transaction: the full path, and the caller's commit stays synchronous.
    with CaptureQueriesContext(connection) as nested, transaction.atomic():
        services.spans_export(project=project, spans=[otel(rollout, attempt, "d")])
    assert not any("synchronous_commit" in q["sql"] for q in nested.captured_queries)
    assert Span.objects.count() == 4


def test_a_cancelled_rollout_is_reported_by_the_common_case(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.spans_export(project=project, spans=[otel(rollout, attempt, "a")])
    services.rollout_update(project=project, rollout_id=rollout.pk, status="cancelled")
    got = services.spans_export(project=project, spans=[otel(rollout, attempt, "b")])
    assert got.cancelled == {rollout.pk} and Span.objects.count() == 2
    rollout.refresh_from_db()
    assert rollout.status == "cancelled"


def test_an_unresponsive_attempt_with_a_fresh_heartbeat_is_revived(project):
    enqueue(project, 1, config={"unresponsive_seconds": 10, "max_attempts": 2,
                                "retry_condition": ["unresponsive"]})
    rollout, attempt = claim(project)
    services.spans_export(project=project, spans=[otel(rollout, attempt, "a")])
    Attempt.objects.filter(pk=attempt.pk).update(status="unresponsive")
    Rollout.objects.filter(pk=rollout.pk).update(status="requeuing")
    with CaptureQueriesContext(connection) as fallback:
        services.spans_export(project=project, spans=[otel(rollout, attempt, "b")])
    if _uses_common_case():  # the statement left it to the full path
        assert [q["sql"] for q in fallback.captured_queries][1] == "BEGIN"
    attempt.refresh_from_db()
    rollout.refresh_from_db()
    assert attempt.status == "running" and rollout.status == "running"
    assert attempt.metadata["store.watchdog_verdict"] == "unresponsive"
    assert attempt.deadline > timezone.now() + timedelta(seconds=9)


@pytest.mark.parametrize("ended", ["timeout", "failed", "succeeded"])
def test_an_ended_attempt_keeps_its_status(project, ended):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.spans_export(project=project, spans=[otel(rollout, attempt, "a")])
    Attempt.objects.filter(pk=attempt.pk).update(status=ended)
    before = _state(rollout, attempt)
    services.spans_export(project=project, spans=[otel(rollout, attempt, "b")])
    after = _state(rollout, attempt)
    assert after[0] == ended and after[1] == before[1]  # heartbeat not due: not rewritten
    assert Span.objects.filter(attempt=attempt).count() == 2


def test_spans_of_unknown_attempts_are_set_aside(project, other_project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.spans_export(project=project, spans=[otel(rollout, attempt, "a")])
    bad = otel(rollout, attempt, "b")
    bad["attempt_id"] = "at-00000000"
    got = services.spans_export(project=project, spans=[bad])
    assert (got.unknown, got.cancelled) == (1, set())
    got = services.spans_export(project=other_project, spans=[otel(rollout, attempt, "c")])
    assert got.unknown == 1
    got = services.spans_export(project=project, spans=[bad, otel(rollout, attempt, "d")])
    assert got.unknown == 1
    assert sorted(Span.objects.values_list("name", flat=True)) == ["a", "d"]
    assert services.spans_export(project=project, spans=[]).unknown == 0


@pytest.mark.postgres
@pytest.mark.parametrize("bad", ["a\x00b", "\ud800"])
def test_text_the_database_cannot_keep_is_invalid_input_in_the_common_case(project, bad):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.spans_export(project=project, spans=[otel(rollout, attempt, "a")])
    spans = [otel(rollout, attempt, "b"), otel(rollout, attempt, "c")]
    spans[1]["attributes"] = {"gen_ai.prompt": bad}
    with pytest.raises(InvalidInput) as caught:
        services.spans_export(project=project, spans=spans)
    assert caught.value.loc == ("spans[1]", "attributes", "gen_ai.prompt")
    assert Span.objects.count() == 1
    rollout.refresh_from_db()
    assert rollout.next_span_sequence_id == 2  # as after "a": rolled back with the rest


@pytest.mark.postgres
@pytest.mark.parametrize("prepared", [True, False])
def test_the_statement_is_prepared_once_per_connection_unless_told_not_to(
        project, prepared, monkeypatch):
    """DATABASE_URL's `prepared_statements=false` (a pooler that cannot keep them) still
    binds server-side, unprepared; both answer alike."""
    enqueue(project, 1)
    rollout, attempt = claim(project)
    connection.close()
    monkeypatch.setitem(connection.settings_dict, "PREPARED_STATEMENTS", prepared)
    for name in "abcd":
        services.spans_export(project=project, spans=[otel(rollout, attempt, name)])
    with connection.cursor() as cursor:
        cursor.execute("SELECT generic_plans + custom_plans FROM pg_prepared_statements "
                       "WHERE statement LIKE 'WITH a AS (%%'")
        runs = [row[0] for row in cursor.fetchall()]
    assert runs == ([4] if prepared else [])
    assert list(Span.objects.order_by("sequence_id").values_list("name", flat=True)) == list(
        "abcd")
    connection.close()
