"""Issue 23: a claim that never reported whose worker went silent (a runner killed right after
its claim) is judged at once, STORE_SILENT_WORKER_SECONDS after the worker's last sign of
life, instead of at its limit (60.7 s in the chaos run) or the first-report window (300 s).
Backdated rows, no sleeping."""

from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from store import services, watchdog
from store.models import Rollout, Worker
from tests.conftest import backdate, claim, enqueue

CONFIG = {"timeout_seconds": 60, "max_attempts": 2, "retry_condition": ["unresponsive"]}


def quiet_worker(worker_id: str, seconds: float) -> None:
    """Move a worker's signs of life `seconds` into the past."""
    shift = timedelta(seconds=seconds)
    Worker.objects.filter(worker_id=worker_id).update(**{
        name: F(name) - shift for name in ("last_dequeue_time", "last_busy_time",
                                           "last_idle_time", "last_heartbeat_time")})


def test_a_claim_whose_worker_went_silent_is_unresponsive_before_its_limit(project):
    enqueue(project, 1, config=CONFIG)
    rollout, attempt = claim(project, "runner-killed")
    backdate(attempt, 21)
    quiet_worker("runner-killed", 21)
    result = watchdog.sweep()
    assert result.unresponsive == [f"{rollout.pk}/{attempt.attempt_id}"]
    assert result.requeued == [rollout.pk]
    attempt.refresh_from_db()
    rollout.refresh_from_db()
    assert attempt.status == "unresponsive" and rollout.status == "requeuing"
    assert "STORE_SILENT_WORKER_SECONDS" in attempt.metadata["error"]
    assert "'runner-killed'" in attempt.metadata["error"]
    again, second = claim(project, "rescuer")
    assert again.pk == rollout.pk and second.sequence_id == 2


def test_a_worker_that_dequeued_since_keeps_its_unreported_claim(project):
    """A runner with a free slot long-polls the dequeue: alive, its slow agent is not judged."""
    enqueue(project, 1, config=CONFIG)
    rollout, attempt = claim(project, "runner-alive")
    backdate(attempt, 25)
    quiet_worker("runner-alive", 25)
    assert services.rollout_dequeue(project=project, worker_id="runner-alive") is None
    assert watchdog.sweep().changed == 0
    attempt.refresh_from_db()
    assert attempt.status == "preparing"


def test_a_worker_heartbeat_keeps_its_unreported_claim(project):
    """An AGL runner calls update_worker every 10 s."""
    enqueue(project, 1, config=CONFIG)
    _, attempt = claim(project, "agl-runner")
    backdate(attempt, 25)
    quiet_worker("agl-runner", 25)
    services.worker_update(project=project, worker_id="agl-runner")
    assert watchdog.sweep().changed == 0


def test_a_claim_that_reported_is_left_to_its_limits(project):
    enqueue(project, 1, config=CONFIG)
    rollout, attempt = claim(project, "runner-busy")
    services.attempt_update(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, status="running")
    backdate(attempt, 25)
    quiet_worker("runner-busy", 25)
    assert watchdog.sweep().changed == 0
    attempt.refresh_from_db()
    assert attempt.status == "running"


def test_within_the_window_the_claim_is_left_alone(project):
    enqueue(project, 1, config=CONFIG)
    _, attempt = claim(project, "runner-slow")
    backdate(attempt, 19)
    quiet_worker("runner-slow", 19)
    assert watchdog.sweep().changed == 0


@pytest.mark.parametrize("window", [0, 40])
def test_the_window_is_a_setting(project, settings, window):
    settings.STORE_SILENT_WORKER_SECONDS = window
    enqueue(project, 1, config=CONFIG)
    rollout, attempt = claim(project, "runner-killed")
    backdate(attempt, 30)
    quiet_worker("runner-killed", 30)
    assert watchdog.sweep().changed == 0
    assert Rollout.objects.get(pk=rollout.pk).status == "preparing"
    if window:
        backdate(attempt, 11)
        quiet_worker("runner-killed", 11)
        assert watchdog.sweep(now=timezone.now()).unresponsive
