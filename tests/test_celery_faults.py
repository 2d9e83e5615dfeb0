"""Faults with real workers: kill -9 mid-rollout, a lost broker message, a duplicated one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from core.celery import app as celery_app
from runners import services as runner_services
from store.models import Attempt, Rollout
from store.services import RolloutSpec
from tests.celery_fixtures import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
BROKERS = pytest.mark.parametrize("broker", ["rabbitmq", "redis"], indirect=True)
FAST = {"RUNNERS_HEARTBEAT_SECONDS": "0.2"}


def enqueue_die_once(project, marker: Path, **config):
    spec = RolloutSpec(input={"marker": str(marker), "seconds": 60},
                       config={"unresponsive_seconds": 2, **config})
    return runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[spec], agent="tests.celery_agents:die_once_agent"
    )[0]


def kill_the_agent(marker: Path) -> None:
    """SIGKILL the pool process running the agent (its pid is in the marker)."""
    wait_until(lambda: marker.exists() and marker.read_text(), timeout=60,
               message="the agent never started")
    os.kill(int(marker.read_text()), signal.SIGKILL)


def sweep_until(rollout, statuses: set[str], timeout: float = 90) -> Rollout:
    """Run the control work (what beat schedules) until the rollout reaches a status."""
    def done() -> bool:
        runner_services.control_sweep()
        runner_services.control_reconcile()
        rollout.refresh_from_db()
        return rollout.status in statuses

    wait_until(done, timeout=timeout, interval=0.3,
               message=lambda: f"rollout stuck in {rollout.status}")
    return rollout


@BROKERS
def test_kill_9_mid_rollout_is_retried_and_succeeds(project, broker_url, sending_to,
                                                    celery_workers, tmp_path):
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1, env=FAST)
    marker = tmp_path / "agent.pid"
    rollout = enqueue_die_once(project, marker, max_attempts=2,
                               retry_condition=["unresponsive"])
    kill_the_agent(marker)
    rollout = sweep_until(rollout, {"succeeded", "failed"})
    assert rollout.status == "succeeded"
    attempts = list(Attempt.objects.filter(rollout=rollout).order_by("sequence_id"))
    assert [a.status for a in attempts] == ["unresponsive", "succeeded"]
    assert not Rollout.objects.exclude(status__in=["succeeded"]).filter(project=project).exists()


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_kill_9_without_retry_fails_visibly(project, broker_url, sending_to, celery_workers,
                                            tmp_path):
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1, env=FAST)
    marker = tmp_path / "agent.pid"
    rollout = enqueue_die_once(project, marker)
    kill_the_agent(marker)
    rollout = sweep_until(rollout, {"succeeded", "failed"})
    assert rollout.status == "failed"
    assert Attempt.objects.get(rollout=rollout).status == "unresponsive"


@BROKERS
def test_a_deleted_message_is_sent_again_by_beat(project, broker_url, sending_to,
                                                 celery_workers):
    rollout = runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"i": 5})],
        agent="tests.celery_agents:ok_agent",
    )[0]
    with celery_app.connection_for_write() as conn:
        assert conn.default_channel.queue_purge("rollouts") == 1  # the message is gone
    env = {**FAST, "LIGHTNING_SWEEP_SECONDS": "1", "LIGHTNING_RECONCILE_SECONDS": "1",
           "RUNNERS_REDISPATCH_SECONDS": "1"}
    celery_workers(queues=["rollouts", "control"], broker_url=broker_url, env=env)
    celery_workers.beat(broker_url=broker_url, env=env)
    wait_until(lambda: Rollout.objects.get(pk=rollout.pk).status == "succeeded", timeout=90,
               message="the lost rollout was never sent again")
    rollout.refresh_from_db()
    assert rollout.dispatch_count >= 2
    assert Attempt.objects.filter(rollout=rollout).count() == 1


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_the_soft_time_limit_fails_the_attempt_with_the_reason(project, broker_url, sending_to,
                                                               celery_workers):
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1,
                   env={**FAST, "CELERY_TASK_SOFT_TIME_LIMIT": "2"})
    rollout = runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"seconds": 60})],
        agent="tests.celery_agents:looping_agent",
    )[0]
    wait_until(lambda: Rollout.objects.get(pk=rollout.pk).status == "failed", timeout=60)
    attempt = Attempt.objects.get(rollout=rollout)
    assert attempt.status == "failed"
    assert "SoftTimeLimitExceeded" in attempt.metadata["error"]


def test_a_timed_out_attempt_ends_timeout_and_its_task_fails(project, client, settings,
                                                             rabbitmq_url, sending_to,
                                                             celery_workers):
    """Issue 26 finding 3: the worker stopped the agent and then reported the attempt
    `failed` ("cancelled: the rollout was cancelled while running") over the watchdog's
    `timeout`; the task returned normally (SUCCESS in Flower); no timeout in /metrics."""
    worker = celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=1,
                            env=FAST)
    rollout = runner_services.rollouts_enqueue_for_celery(
        project=project, agent="tests.celery_agents:looping_agent",
        specs=[RolloutSpec(input={"seconds": 60}, config={"timeout_seconds": 2})],
    )[0]
    rollout = sweep_until(rollout, {"failed", "succeeded"})
    wait_until(lambda: "RolloutFailed" in worker.log(), timeout=60,
               message="the rollout task did not fail")
    attempt = Attempt.objects.get(rollout=rollout)
    assert (rollout.status, attempt.status) == ("failed", "timeout")
    assert attempt.metadata["error"].startswith("timeout: the attempt ran ")
    assert "past its timeout_seconds=2 (ended by the watchdog)" in attempt.metadata["error"]
    assert "store.watchdog_verdict" not in attempt.metadata  # no runner report came after
    failure = next(line for line in worker.log().splitlines() if "RolloutFailed" in line)
    assert "timeout: the attempt ran" in failure and "(timeout)" in failure
    settings.METRICS_TOKEN = "t"
    scrape = client.get("/metrics", headers={"Authorization": "Bearer t"}).text
    assert 'lightning_attempts{status="timeout"} 1.0' in scrape
