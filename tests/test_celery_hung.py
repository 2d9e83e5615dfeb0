"""A hung agent never holds a worker slot after the store ended its attempt (issue 26.1):
real `celery worker` processes, agents blocked in time.sleep past their rollout's timeout."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command

from core.processes import process_alive
from runners import services as runner_services
from runners.held_slots import held_slots
from runners.models import HeldSlot
from store.models import Attempt, Rollout
from store.services import RolloutSpec
from tests.celery_fixtures import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
FAST = {"RUNNERS_HEARTBEAT_SECONDS": "0.2", "RUNNERS_STOP_GRACE_SECONDS": "1"}
HANG = "tests.celery_agents:die_once_agent"  # first run: sleeps `seconds`; later runs: 1.0


def enqueue_hung(project, markers, **config):
    specs = [RolloutSpec(input={"marker": str(m), "seconds": 600},
                         config={"timeout_seconds": 3, **config}) for m in markers]
    return runner_services.rollouts_enqueue_for_celery(project=project, specs=specs, agent=HANG)


def started(markers) -> list[int]:
    wait_until(lambda: all(m.exists() and m.read_text() for m in markers), timeout=60,
               message="the hung agents never started")
    return [int(m.read_text()) for m in markers]


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"], indirect=True)
def test_two_hung_agents_at_c2_free_their_slots_and_six_more_rollouts_finish(
    project, broker_url, sending_to, celery_workers, tmp_path
):
    worker = celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=2, env=FAST)
    markers = [tmp_path / "a.pid", tmp_path / "b.pid"]
    hung = enqueue_hung(project, markers, max_attempts=2, retry_condition=["timeout"])
    pids = started(markers)  # both slots of the worker are blocked in time.sleep(600)
    runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"i": i}) for i in range(6)],
        agent="tests.celery_agents:ok_agent")

    def all_succeeded() -> bool:
        # what beat runs: the watchdog, and the reconcile that sends a retry's message (a
        # rollout requeued after its timeout has none until then, unless a later rollout
        # of its project ended after the requeue; under CI's load one did not, and waited)
        runner_services.control_sweep()
        runner_services.control_reconcile()
        rows = Rollout.objects.filter(project=project).values_list("status", flat=True)
        return list(rows).count("succeeded") == 8

    wait_until(all_succeeded, timeout=90, interval=0.3,
               message=lambda: f"rollouts stuck: {list(Rollout.objects.values_list('status', flat=True))}")
    for rollout in hung:  # the store's verdict stood, and the retry the config asks for ran
        attempts = Attempt.objects.filter(rollout=rollout).order_by("sequence_id")
        assert [a.status for a in attempts] == ["timeout", "succeeded"]
    assert worker.process.poll() is None  # the same worker: no restart
    assert not any(process_alive(pid) for pid in pids)  # its pool replaced the two processes
    assert worker.log().count("exits to free its slot") == 2
    assert not HeldSlot.objects.exists()


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_threads_pool_is_not_killed_and_shows_the_held_slot(
    project, broker_url, sending_to, celery_workers, tmp_path
):
    worker = celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=2,
                            pool="threads", env=FAST)
    marker = tmp_path / "a.pid"
    rollout = enqueue_hung(project, [marker])[0]
    assert started([marker]) == [worker.pid]  # a thread of the worker process itself

    def held() -> bool:
        runner_services.control_sweep()
        return len(held_slots()) == 1

    wait_until(held, timeout=60, message="the held slot was never shown")
    assert Attempt.objects.get(rollout=rollout).status == "timeout"
    slot = held_slots()[0]
    assert (slot.rollout_id, slot.attempt_status) == (rollout.pk, "timeout")
    wait_until(lambda: "it is abandoned" in worker.log(), timeout=30)
    assert worker.process.poll() is None  # abandoned, not killed
    out = StringIO()
    call_command("queue_watch", project.name, "--once", stdout=out)
    assert "(1 slots held by attempts that already ended" in out.getvalue()
    assert f"held: {rollout.pk}/" in out.getvalue()
    # Another rollout still runs on the other thread.
    ok = runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"i": 1})],
        agent="tests.celery_agents:ok_agent")[0]
    wait_until(lambda: Rollout.objects.get(pk=ok.pk).status == "succeeded", timeout=60)


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_the_rollout_task_time_limit_follows_the_rollout_timeout(
    project, broker_url, sending_to, celery_workers, tmp_path, settings
):
    """The backstop with no sweep at all: the task's soft limit (timeout + a sweep + a
    heartbeat + twice the grace, here 1 + 1 + 0.2 + 1 -> 4 s) ends the hung agent."""
    settings.LIGHTNING_SWEEP_SECONDS = 1
    settings.RUNNERS_HEARTBEAT_SECONDS = 0.2
    settings.RUNNERS_STOP_GRACE_SECONDS = 0.5
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1, env=FAST)
    marker = tmp_path / "a.pid"
    rollout = runner_services.rollouts_enqueue_for_celery(
        project=project, agent=HANG,
        specs=[RolloutSpec(input={"marker": str(marker), "seconds": 600},
                           config={"timeout_seconds": 1})])[0]
    started([marker])
    wait_until(lambda: Rollout.objects.get(pk=rollout.pk).status == "failed", timeout=60,
               message="the task's time limit never ended the agent")
    attempt = Attempt.objects.get(rollout=rollout)
    assert "SoftTimeLimitExceeded" in attempt.metadata["error"]
