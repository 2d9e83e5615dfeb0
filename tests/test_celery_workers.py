"""Rollouts through real `celery worker` processes on RabbitMQ and on Redis."""

from __future__ import annotations

import pytest

from runners import services as runner_services
from store.models import Attempt, Rollout, Span
from store.services import Dispatch, RolloutSpec
from tests.celery_fixtures import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
BROKERS = pytest.mark.parametrize("broker", ["rabbitmq", "redis"], indirect=True)
OK_AGENT = "tests.celery_agents:ok_agent"


def statuses(project) -> dict[str, int]:
    rows = Rollout.objects.filter(project=project).values_list("status", flat=True)
    counts: dict[str, int] = {}
    for status in rows:
        counts[status] = counts.get(status, 0) + 1
    return counts


@BROKERS
def test_200_rollouts_all_succeed_with_their_spans(project, broker_url, sending_to,
                                                  celery_workers):
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=2)
    rollouts = runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"i": i}) for i in range(200)], agent=OK_AGENT
    )
    wait_until(lambda: statuses(project).get("succeeded") == 200, timeout=240,
               message=lambda: f"not all succeeded: {statuses(project)}")
    assert Attempt.objects.filter(rollout__project=project).count() == 200
    # ok_agent: its library span, a message, the reward, and the executor's root span.
    assert Span.objects.filter(rollout__project=project).count() == 4 * 200
    rewards = Span.objects.filter(rollout_id=rollouts[7].pk, name="agentlightning.annotation")
    assert rewards.get().attributes["agentlightning.reward.0.value"] == 7.0


@BROKERS
def test_a_duplicated_message_runs_the_rollout_once(project, broker_url, sending_to,
                                                   celery_workers):
    rollout = runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"i": 1})], agent=OK_AGENT
    )[0]
    duplicate = Dispatch(project.pk, rollout.pk, "celery", OK_AGENT)
    runner_services.dispatches_send([duplicate, duplicate])
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=2)
    wait_until(lambda: statuses(project) == {"succeeded": 1}, timeout=60)
    assert Attempt.objects.filter(rollout=rollout).count() == 1
    assert Span.objects.filter(rollout=rollout, name="agentlightning.annotation").count() == 1
