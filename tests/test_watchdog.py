from datetime import timedelta

import pytest
from django.utils import timezone

from store import services, watchdog
from store.models import Rollout, Worker
from store.services import RolloutSpec
from tests.conftest import backdate, claim, enqueue

RETRY_ALL = ["failed", "timeout", "unresponsive"]


def test_attempt_past_timeout_times_out_and_fails_rollout(project):
    enqueue(project, 1, config={"timeout_seconds": 30})
    rollout, attempt = claim(project, "w1")
    backdate(attempt, 31)
    result = watchdog.sweep()
    attempt.refresh_from_db()
    rollout.refresh_from_db()
    assert attempt.status == "timeout" and attempt.end_time
    assert rollout.status == "failed" and result.failed == [rollout.pk]
    assert result.timed_out == [f"{rollout.pk}/{attempt.attempt_id}"]
    assert Worker.objects.get(worker_id="w1").status == "unknown"


def test_attempt_within_limits_is_left_alone(project):
    enqueue(project, 1, config={"timeout_seconds": 30, "unresponsive_seconds": 10})
    rollout, attempt = claim(project)
    backdate(attempt, 5)
    assert watchdog.sweep().changed == 0
    attempt.refresh_from_db()
    assert attempt.status == "preparing"


def test_silent_attempt_goes_unresponsive_and_rollout_requeues(project):
    enqueue(project, 1, config={"unresponsive_seconds": 10, "max_attempts": 2,
                                "retry_condition": RETRY_ALL})
    rollout, attempt = claim(project)
    backdate(attempt, 11)
    result = watchdog.sweep()
    attempt.refresh_from_db()
    rollout.refresh_from_db()
    assert attempt.status == "unresponsive" and rollout.status == "requeuing"
    assert result.requeued == [rollout.pk]
    again, second = claim(project)
    assert again.pk == rollout.pk and second.sequence_id == 2


def test_a_report_moves_the_deadline_so_the_sweep_leaves_the_attempt(project):
    enqueue(project, 1, config={"unresponsive_seconds": 10})
    rollout, attempt = claim(project)
    backdate(attempt, 11)
    services.attempt_update(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, last_heartbeat_time=timezone.now())
    assert watchdog.sweep().changed == 0
    attempt.refresh_from_db()
    assert attempt.status == "preparing" and attempt.deadline > timezone.now()


def test_a_silent_runner_whose_clock_runs_ahead_still_goes_unresponsive(project):
    """The runner's last_heartbeat_time is stored as sent; the verdict is by our clock."""
    enqueue(project, 1, config={"unresponsive_seconds": 10})
    rollout, attempt = claim(project)
    services.attempt_update(project=project, rollout_id=rollout.pk, attempt_id=attempt.attempt_id,
                            last_heartbeat_time=timezone.now() + timedelta(hours=1))
    backdate(attempt, 11)  # then it went silent for 11 s by our clock
    assert watchdog.sweep().unresponsive == [f"{rollout.pk}/{attempt.attempt_id}"]


@pytest.mark.django_db(transaction=True)  # the export's one statement runs in autocommit
@pytest.mark.parametrize("path", ["spans_add", "spans_export"])
def test_spans_keep_alive_an_attempt_whose_runner_clock_runs_ahead(project, path):
    """Spans are heartbeats even when the stored time (the runner's) is ahead of ours."""
    enqueue(project, 1, config={"unresponsive_seconds": 10})
    rollout, attempt = claim(project)
    services.attempt_update(project=project, rollout_id=rollout.pk, attempt_id=attempt.attempt_id,
                            status="running",
                            last_heartbeat_time=timezone.now() + timedelta(hours=1))
    backdate(attempt, 11)
    span = {"rollout_id": rollout.pk, "attempt_id": attempt.attempt_id, "trace_id": "a" * 32,
            "span_id": "0" * 15 + "1", "parent_id": None, "name": "s",
            "status": {"status_code": "OK", "description": None}, "attributes": {},
            "events": [], "links": [], "start_time": 1.0, "end_time": 2.0, "context": None,
            "parent": None, "resource": {"attributes": {}, "schema_url": ""}}
    if path == "spans_add":
        services.spans_add(project=project, spans=[{**span, "sequence_id": 1}])
    else:
        services.spans_export(project=project, spans=[span])
    assert watchdog.sweep().changed == 0
    attempt.refresh_from_db()
    assert attempt.status == "running" and attempt.deadline > timezone.now()


def test_late_report_after_timeout_is_recorded_but_rollout_stays_failed(project):
    enqueue(project, 1, config={"timeout_seconds": 5})
    rollout, attempt = claim(project)
    backdate(attempt, 6)
    watchdog.sweep()
    late = services.attempt_update(project=project, rollout_id=rollout.pk,
                                   attempt_id=attempt.attempt_id, status="succeeded")
    rollout.refresh_from_db()
    assert late.status == "succeeded" and late.metadata["store.watchdog_verdict"] == "timeout"
    assert rollout.status == "failed"


def test_queue_wait_expiry_fails_rollout(project):
    services.rollout_enqueue(project=project, spec=RolloutSpec(input=1, queue_timeout_seconds=5))
    keep = services.rollout_enqueue(project=project, spec=RolloutSpec(input=2))
    result = watchdog.sweep(now=timezone.now() + timedelta(seconds=6))
    assert len(result.queue_expired) == 1
    expired = Rollout.objects.get(pk=result.queue_expired[0])
    assert expired.status == "failed" and expired.metadata["store.failure"] == watchdog.QUEUE_EXPIRED
    keep.refresh_from_db()
    assert keep.status == "queuing"


def test_requeued_rollouts_are_watched_by_the_queue_bound(project):
    services.rollout_enqueue(project=project, spec=RolloutSpec(
        input=1, queue_timeout_seconds=5,
        config={"timeout_seconds": 1, "max_attempts": 3, "retry_condition": RETRY_ALL},
    ))
    rollout, attempt = claim(project)
    backdate(attempt, 2)
    watchdog.sweep()
    rollout.refresh_from_db()
    assert rollout.status == "requeuing" and rollout.queue_deadline is not None
    result = watchdog.sweep(now=timezone.now() + timedelta(seconds=6))
    assert result.queue_expired == [rollout.pk]


def test_sweep_works_in_bounded_batches(project):
    enqueue(project, 7, config={"timeout_seconds": 1})
    claimed = services.rollout_dequeue_many(project=project, limit=7)
    for _, attempt in claimed:
        backdate(attempt, 2)
    result = watchdog.sweep(batch_size=3, max_batches=2)
    assert len(result.timed_out) == 6
    assert len(watchdog.sweep(batch_size=3).timed_out) == 1


def test_sweep_notifies_finished_rollouts(project, django_capture_on_commit_callbacks):
    from store import hooks
    seen = []
    hooks.on_rollouts_finished(seen.extend)
    try:
        enqueue(project, 1, config={"timeout_seconds": 1})
        rollout, attempt = claim(project)
        backdate(attempt, 2)
        with django_capture_on_commit_callbacks(execute=True):
            watchdog.sweep()
        assert [r.pk for r in seen] == [rollout.pk]
    finally:
        hooks.remove_rollouts_finished(seen.extend)


def test_sweep_on_call_reads_once_when_nothing_is_due_and_sweeps_when_something_is(
        project, django_assert_num_queries):
    enqueue(project, 2, config={"timeout_seconds": 30})
    rollout, attempt = claim(project, "w1")
    watchdog._last_call_sweep.pop(project.pk, None)
    with django_assert_num_queries(1):  # the probe, no transaction
        assert watchdog.sweep_on_call(project.pk) is None
    assert watchdog.sweep_on_call(project.pk) is None  # throttled: no query at all
    backdate(attempt, 31)
    Rollout.objects.filter(pk__in=Rollout.objects.filter(project=project, status="queuing")
                           .values("pk")).update(queue_deadline=timezone.now()
                                                 - timedelta(seconds=1))
    watchdog._last_call_sweep.pop(project.pk, None)
    result = watchdog.sweep_on_call(project.pk)
    assert result.timed_out == [f"{rollout.pk}/{attempt.attempt_id}"]
    assert len(result.queue_expired) == 1


def test_sweep_on_call_sees_only_its_own_project(project):
    other = services.project_create(name="other-project")
    enqueue(other, 1, config={"timeout_seconds": 30})
    _, attempt = claim(other, "w1")
    backdate(attempt, 31)
    watchdog._last_call_sweep.pop(project.pk, None)
    assert watchdog.sweep_on_call(project.pk) is None
    attempt.refresh_from_db()
    assert attempt.status == "preparing"


@pytest.mark.parametrize("config", [{}, {"timeout_seconds": 3600}])
def test_a_claim_never_reported_on_goes_unresponsive_after_the_first_report_window(
        project, config):
    """A dequeue answer lost on the way (or a runner killed right after its claim) left a
    rollout without limits `preparing` forever: a claim has STORE_FIRST_REPORT_SECONDS."""
    enqueue(project, 2, config=config)
    rollout, attempt = claim(project)
    reported, other = claim(project)
    services.attempt_update(project=project, rollout_id=reported.pk,
                            attempt_id=other.attempt_id, status="running")
    backdate(attempt, 299)
    backdate(other, 301)
    assert watchdog.sweep().changed == 0
    backdate(attempt, 2)
    result = watchdog.sweep()
    assert result.unresponsive == [f"{rollout.pk}/{attempt.attempt_id}"]
    rollout.refresh_from_db()
    other.refresh_from_db()
    assert rollout.status == "failed" and other.status == "running"
    attempt.refresh_from_db()
    assert attempt.metadata["error"].startswith("unresponsive: no report in the 300 s since")


def test_the_first_report_window_can_be_turned_off(project, settings):
    settings.STORE_FIRST_REPORT_SECONDS = 0
    enqueue(project, 1)
    _, attempt = claim(project)
    attempt.refresh_from_db()
    assert attempt.deadline is None


def test_a_verdict_records_its_error_and_the_jobs_first_error_quotes_it(project):
    """Issue 26 finding 3: a timed-out attempt had no error of its own."""
    from store import selectors

    enqueue(project, 1, config={"timeout_seconds": 30})
    rollout, attempt = claim(project)
    backdate(attempt, 31)
    watchdog.sweep()
    attempt.refresh_from_db()
    assert attempt.metadata["error"].startswith("timeout: the attempt ran 3")
    assert attempt.metadata["error"].endswith("past its timeout_seconds=30 (ended by the watchdog)")
    assert selectors.rollouts_first_error(rollout_ids=[rollout.pk]) == (
        f"rollout {rollout.pk}: {attempt.metadata['error']}")


def test_a_revived_unresponsive_attempt_drops_the_watchdogs_error_and_keeps_its_verdict(project):
    enqueue(project, 1, config={"unresponsive_seconds": 10, "max_attempts": 2,
                                "retry_condition": RETRY_ALL})
    rollout, attempt = claim(project)
    backdate(attempt, 11)
    watchdog.sweep()
    attempt.refresh_from_db()
    assert attempt.status == "unresponsive"
    assert attempt.metadata["error"].startswith("unresponsive: no heartbeat for 1")
    assert "past its unresponsive_seconds=10 (ended by the watchdog)" in attempt.metadata["error"]
    revived = services.attempt_update(project=project, rollout_id=rollout.pk,
                                      attempt_id=attempt.attempt_id, status="running",
                                      last_heartbeat_time=timezone.now())
    assert revived.status == "running"
    assert revived.metadata == {"store.watchdog_verdict": "unresponsive"}
