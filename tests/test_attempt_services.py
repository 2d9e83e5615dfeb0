import pytest

from store import hooks, services
from store.errors import IllegalTransition, InvalidInput, NotFound
from store.models import Rollout, Span, Worker
from store.services import AttemptUpdate, RolloutSpec
from tests.conftest import claim, enqueue

RETRY = {"max_attempts": 2, "retry_condition": ["failed"]}


def finish(project, rollout, attempt, status):
    return services.attempt_update(
        project=project, rollout_id=rollout.pk, attempt_id=attempt.attempt_id, status=status
    )


def test_success_report_finishes_rollout_and_idles_worker(project):
    enqueue(project, 1)
    rollout, attempt = claim(project, "w1")
    attempt = finish(project, rollout, attempt, "succeeded")
    rollout.refresh_from_db()
    assert attempt.status == "succeeded" and attempt.end_time is not None
    assert rollout.status == "succeeded" and rollout.end_time is not None
    worker = Worker.objects.get(worker_id="w1")
    assert worker.status == "idle" and worker.current_rollout_id is None


def test_running_report_moves_rollout_to_running(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    finish(project, rollout, attempt, "running")
    rollout.refresh_from_db()
    assert rollout.status == "running"


def test_failure_with_retry_requeues_then_second_attempt_gets_sequence_two(project):
    enqueue(project, 1, config=RETRY)
    rollout, attempt = claim(project)
    finish(project, rollout, attempt, "failed")
    rollout.refresh_from_db()
    assert rollout.status == "requeuing" and rollout.end_time is None
    again, second = claim(project)
    assert again.pk == rollout.pk and second.sequence_id == 2
    finish(project, again, second, "failed")
    rollout.refresh_from_db()
    assert rollout.status == "failed" and rollout.end_time is not None


def test_failure_without_retry_fails_rollout(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    finish(project, rollout, attempt, "failed")
    rollout.refresh_from_db()
    assert rollout.status == "failed"


def test_late_success_on_cancelled_rollout_is_recorded_on_attempt_only(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.rollout_update(project=project, rollout_id=rollout.pk, status="cancelled")
    attempt = finish(project, rollout, attempt, "succeeded")
    rollout.refresh_from_db()
    assert attempt.status == "succeeded"
    assert rollout.status == "cancelled"


def test_report_on_older_attempt_does_not_move_rollout(project):
    enqueue(project, 1)
    rollout, first = claim(project)
    _, second = services.attempt_start(project=project, rollout_id=rollout.pk)
    finish(project, rollout, first, "succeeded")
    rollout.refresh_from_db()
    assert rollout.status == "preparing" and rollout.latest_attempt_id == second.pk


def test_latest_names_the_latest_attempt(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    updated = services.attempt_update(
        project=project, rollout_id=rollout.pk, attempt_id="latest", status="running"
    )
    assert updated.pk == attempt.pk and updated.status == "running"


def test_finished_attempt_keeps_its_verdict(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    finish(project, rollout, attempt, "succeeded")
    with pytest.raises(IllegalTransition):
        finish(project, rollout, attempt, "failed")
    assert finish(project, rollout, attempt, "succeeded").status == "succeeded"


def test_update_attempt_metadata_worker_and_heartbeat(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    from django.utils import timezone
    when = timezone.now()
    updated = services.attempt_update(
        project=project, rollout_id=rollout.pk, attempt_id=attempt.attempt_id,
        worker_id="w7", metadata={"m": 1}, last_heartbeat_time=when,
    )
    updated.refresh_from_db()
    assert updated.worker_id == "w7" and updated.metadata == {"m": 1}
    assert updated.last_heartbeat_time == when


def test_unknown_attempt_and_bad_status(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    with pytest.raises(NotFound):
        services.attempt_update(project=project, rollout_id=rollout.pk, attempt_id="at-nope",
                                status="running")
    with pytest.raises(InvalidInput):
        finish(project, rollout, attempt, "exploded")


def test_update_many_finishes_a_batch_in_one_call(project):
    enqueue(project, 10)
    claimed = services.rollout_dequeue_many(project=project, worker_id="w", limit=10)
    services.attempt_update_many(project=project, updates=[
        AttemptUpdate(r.pk, a.attempt_id, status="succeeded") for r, a in claimed
    ])
    assert Rollout.objects.filter(status="succeeded").count() == 10


def test_update_many_is_all_or_nothing(project):
    enqueue(project, 2)
    claimed = services.rollout_dequeue_many(project=project, limit=2)
    with pytest.raises(NotFound):
        services.attempt_update_many(project=project, updates=[
            AttemptUpdate(claimed[0][0].pk, claimed[0][1].attempt_id, status="succeeded"),
            AttemptUpdate(claimed[1][0].pk, "at-missing", status="succeeded"),
        ])
    assert Rollout.objects.filter(status="succeeded").count() == 0


def test_rollout_finished_hook_fires_after_commit(project, django_capture_on_commit_callbacks):
    seen = []
    hooks.on_rollouts_finished(seen.extend)
    try:
        enqueue(project, 1)
        rollout, attempt = claim(project)
        with django_capture_on_commit_callbacks(execute=True):
            finish(project, rollout, attempt, "succeeded")
        assert [r.pk for r in seen] == [rollout.pk]
    finally:
        hooks.remove_rollouts_finished(seen.extend)


def test_spec_with_start_rollout_syncs_worker_busy(project):
    rollout, attempt = services.rollout_start(project=project, spec=RolloutSpec(input=1),
                                              worker_id="wx")
    worker = Worker.objects.get(worker_id="wx")
    assert worker.status == "busy" and worker.current_attempt_id == attempt.attempt_id


def test_finish_merges_the_error_into_the_metadata_it_finds_under_the_lock(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.attempt_update(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, metadata={"m": 1})
    finished = services.attempt_finish(project=project, rollout_id=rollout.pk,
                                       attempt_id=attempt.attempt_id, status="failed",
                                       error="boom")
    finished.refresh_from_db()
    assert finished.status == "failed" and finished.metadata == {"m": 1, "error": "boom"}


def test_finish_is_idempotent_per_final_status(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    first = services.attempt_finish(project=project, rollout_id=rollout.pk,
                                    attempt_id=attempt.attempt_id, status="failed", error="a")
    again = services.attempt_finish(project=project, rollout_id=rollout.pk,
                                    attempt_id=attempt.attempt_id, status="failed", error="b")
    assert again.metadata == {"error": "a"} and again.end_time == first.end_time
    with pytest.raises(IllegalTransition):
        services.attempt_finish(project=project, rollout_id=rollout.pk,
                                attempt_id=attempt.attempt_id, status="succeeded")
    with pytest.raises(InvalidInput):
        services.attempt_finish(project=project, rollout_id=rollout.pk,
                                attempt_id=attempt.attempt_id, status="running")


def _last_spans(rollout, attempt, n):
    return [{"rollout_id": rollout.pk, "attempt_id": attempt.attempt_id, "trace_id": "a" * 32,
             "span_id": f"{i:016x}", "name": f"step-{i}", "attributes": {"i": i}}
            for i in range(n)]


def test_finish_stores_the_last_spans_sent_with_the_verdict(project):
    """The executor's last batch travels with the verdict (one write transaction on the
    embedded SQLite default): both land, the spans numbered from the rollout's counter."""
    enqueue(project, 1)
    rollout, attempt = claim(project)
    finished = services.attempt_finish(project=project, rollout_id=rollout.pk,
                                       attempt_id=attempt.attempt_id, status="succeeded",
                                       spans=_last_spans(rollout, attempt, 3))
    rollout.refresh_from_db()
    assert finished.status == "succeeded" and rollout.status == "succeeded"
    stored = Span.objects.filter(attempt_id=attempt.pk).order_by("sequence_id")
    assert [(s.name, s.sequence_id) for s in stored] == [
        ("step-0", 1), ("step-1", 2), ("step-2", 3)]
    assert rollout.next_span_sequence_id == 4


def test_a_refused_verdict_keeps_the_spans_sent_with_it(project):
    """As when the spans came in a request of their own: a verdict another final status
    already ended is refused, and the spans sent with it are stored all the same."""
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.attempt_finish(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, status="failed")
    with pytest.raises(IllegalTransition):
        services.attempt_finish(project=project, rollout_id=rollout.pk,
                                attempt_id=attempt.attempt_id, status="succeeded",
                                spans=_last_spans(rollout, attempt, 2))
    assert Span.objects.filter(attempt_id=attempt.pk).count() == 2
    assert Rollout.objects.get(pk=rollout.pk).status == "failed"


def test_finish_with_spans_of_an_unknown_attempt_stores_nothing(project):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    spans = _last_spans(rollout, attempt, 1)
    spans[0]["attempt_id"] = "at-unknown"
    with pytest.raises(NotFound):
        services.attempt_finish(project=project, rollout_id=rollout.pk,
                                attempt_id=attempt.attempt_id, status="succeeded", spans=spans)
    assert Rollout.objects.get(pk=rollout.pk).status == "preparing"
    assert not Span.objects.filter(rollout_id=rollout.pk).exists()


def test_a_late_failure_keeps_the_watchdogs_verdict(project):
    """Finding 3: the gateways read the metadata, then wrote {**old, "error": ...} with the
    status: the verdict the status change recorded was overwritten."""
    from store import watchdog
    from tests.conftest import backdate

    enqueue(project, 1, config={"unresponsive_seconds": 10})
    rollout, attempt = claim(project)
    backdate(attempt, 11)
    assert watchdog.sweep().unresponsive
    late = services.attempt_finish(project=project, rollout_id=rollout.pk,
                                   attempt_id=attempt.attempt_id, status="failed", error="late")
    late.refresh_from_db()
    assert late.metadata == {"store.watchdog_verdict": "unresponsive", "error": "late"}
    # A status report that replaces the metadata keeps the verdict too.
    enqueue(project, 1, config={"unresponsive_seconds": 10})
    rollout, attempt = claim(project)
    backdate(attempt, 11)
    watchdog.sweep()
    late = services.attempt_update(project=project, rollout_id=rollout.pk,
                                   attempt_id=attempt.attempt_id, status="failed",
                                   metadata={"error": "late"})
    late.refresh_from_db()
    assert late.metadata == {"error": "late", "store.watchdog_verdict": "unresponsive"}


def test_the_deadline_follows_the_servers_clock_not_the_runners(project):
    """A remote runner's heartbeat carried its own clock into the attempt's deadline: a
    runner a day behind was unresponsive at once."""
    from datetime import timedelta

    from django.utils import timezone

    enqueue(project, 1, config={"unresponsive_seconds": 10})
    rollout, attempt = claim(project)
    behind = timezone.now() - timedelta(days=1)
    beat = services.attempt_update(project=project, rollout_id=rollout.pk,
                                   attempt_id=attempt.attempt_id, status="running",
                                   last_heartbeat_time=behind)
    beat.refresh_from_db()
    assert beat.last_heartbeat_time == behind  # stored as sent (AGL)
    assert beat.deadline > timezone.now() + timedelta(seconds=9)


def _statements(queries) -> list[str]:
    return [q["sql"] for q in queries if q["sql"] not in ("BEGIN", "COMMIT")
            and not q["sql"].startswith(("SAVEPOINT", "RELEASE SAVEPOINT"))]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_verdict_on_postgres_is_one_locking_statement_and_one_write_with_its_wakeups(
        project, monkeypatch):
    """Both locks (attempts, then rollouts) in one statement; the writes and the wake-up
    (pg_notify, delivered at commit) in another. A bare final verdict is all of it in one
    statement (store/services/_verdict.py); a failure the config retries is left by that
    statement (nothing written) to those two."""
    # The statements alone: a hurry-only listener (the trainer's) reads the rollout after.
    monkeypatch.setattr(hooks, "has_hurry_callbacks", lambda **_: False)
    import psycopg
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from store import wakeups

    enqueue(project, 2, config=RETRY)
    done, done_attempt = claim(project, "w1")
    retried, retried_attempt = claim(project, "w2")
    settings = connection.settings_dict
    listener = psycopg.connect(host=settings["HOST"] or "127.0.0.1", port=settings["PORT"] or 5432,
                               user=settings["USER"], dbname=settings["NAME"], autocommit=True)
    try:
        listener.execute(f"LISTEN {wakeups.FINISHED}")
        listener.execute(f"LISTEN {wakeups.QUEUED}")
        with CaptureQueriesContext(connection) as captured:
            finish(project, done, done_attempt, "succeeded")
        statements = _statements(captured.captured_queries)
        assert len(statements) == 1, statements
        assert "FOR NO KEY UPDATE" in statements[0] and "pg_notify" in statements[0]
        with CaptureQueriesContext(connection) as captured:
            finish(project, retried, retried_attempt, "failed")  # requeued: QUEUED
        tried, *statements = _statements(captured.captured_queries)
        assert "pg_notify" in tried and len(statements) == 2, statements
        assert statements[0].count("FOR NO KEY UPDATE") == 2
        assert "pg_notify" in statements[1] and "UPDATE" in statements[1]
        heard = [(n.channel, n.payload) for n in listener.notifies(timeout=2, stop_after=2)]
        assert heard == [(wakeups.FINISHED, str(project.pk)), (wakeups.QUEUED, str(project.pk))]
    finally:
        listener.close()
    done.refresh_from_db()
    retried.refresh_from_db()
    assert (done.status, retried.status) == ("succeeded", "requeuing")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_one_locking_statement_locks_every_attempt_before_any_rollout(project):
    """The lock order of every writer (attempts, then rollouts): while another transaction
    holds the rollout, the report waits for it holding the attempt already."""
    import threading

    import psycopg
    from django.db import connection

    enqueue(project, 1)
    rollout, attempt = claim(project, "w1")
    settings = connection.settings_dict
    params = {"host": settings["HOST"] or "127.0.0.1", "port": settings["PORT"] or 5432,
              "user": settings["USER"], "dbname": settings["NAME"]}
    holder = psycopg.connect(**params)
    prober = psycopg.connect(**params, autocommit=True)
    try:
        holder.execute("SELECT 1 FROM store_rollout WHERE id = %s FOR NO KEY UPDATE",
                       [rollout.pk])
        errors: list = []

        def report() -> None:
            try:
                finish(project, rollout, attempt, "succeeded")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                connection.close()

        thread = threading.Thread(target=report)
        thread.start()
        import time

        deadline = time.monotonic() + 10
        while True:  # until the report waits for the rollout, holding the attempt
            try:
                prober.execute("SELECT 1 FROM store_attempt WHERE id = %s "
                               "FOR NO KEY UPDATE NOWAIT", [attempt.pk])
            except psycopg.errors.LockNotAvailable:
                break
            assert time.monotonic() < deadline, "the report never locked the attempt"
            time.sleep(0.05)
        assert thread.is_alive()
        holder.rollback()
        thread.join(10)
        assert not thread.is_alive() and not errors
    finally:
        holder.close()
        prober.close()
    rollout.refresh_from_db()
    assert rollout.status == "succeeded"


@pytest.mark.postgres
def test_a_reports_locking_read_keeps_its_generic_plan(project):
    """Prepared, the locking read of a report over one attempt is planned once and kept (a
    generic plan), not planned anew each time as it was over a one-element array."""
    from django.db import connection

    enqueue(project, 3000)
    claimed = services.rollout_dequeue_many(project=project, worker_id="w", limit=3000)[:12]
    with connection.cursor() as cursor:  # statistics of a store in use, as the planner sees
        cursor.execute("ANALYZE store_attempt, store_rollout")
    for rollout, attempt in claimed:
        services.attempt_update(project=project, rollout_id=rollout.pk,
                                attempt_id=attempt.attempt_id, status="succeeded")
    with connection.cursor() as cursor:
        cursor.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                       "WHERE statement LIKE 'WITH la AS MATERIALIZED%%'")
        plans = cursor.fetchall()
    assert len(plans) == 1
    generic, custom = plans[0]
    assert generic >= 1 and custom <= 5, plans


def test_an_older_attempts_verdict_may_change_and_the_rollout_follows_the_latest(project):
    """AGL's store suite (test_status_propagation_latest_changes_when_new_attempt_added)."""
    rollout, first = services.rollout_start(project=project, spec=RolloutSpec(input=1))
    finish(project, rollout, first, "succeeded")
    _, second = services.attempt_start(project=project, rollout_id=rollout.pk)
    changed = services.attempt_update(project=project, rollout_id=rollout.pk,
                                      attempt_id=first.attempt_id, status="failed")
    rollout.refresh_from_db()
    assert changed.status == "failed" and rollout.status == "preparing"
    assert rollout.latest_attempt_id == second.pk
    finish(project, rollout, second, "succeeded")
    with pytest.raises(IllegalTransition):  # the latest attempt keeps its runner's verdict
        services.attempt_update(project=project, rollout_id=rollout.pk,
                                attempt_id=second.attempt_id, status="failed")


def test_not_found_is_worded_as_agl_words_it(project):
    with pytest.raises(NotFound, match="^Rollout ro-nope not found$"):
        services.attempt_update(project=project, rollout_id="ro-nope", attempt_id="at-1",
                                status="running")
    queued = enqueue(project, 1)[0]
    with pytest.raises(NotFound, match=f"^No attempts found for rollout {queued.pk}$"):
        services.attempt_update(project=project, rollout_id=queued.pk, attempt_id="at-1",
                                status="running")
    with pytest.raises(NotFound, match="^Item does not exist with primary key"):
        services.rollout_update(project=project, rollout_id="ro-nope", status="failed")
