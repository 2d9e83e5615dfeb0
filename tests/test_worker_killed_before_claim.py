"""Issue 23 (seen once in CI, tests/test_chaos.py on Redis: one rollout finished 301.9 s after
the kill): a rollout worker killed -9 after it received a rollout's message but before the
claim committed. Redis keeps that message unacknowledged until its visibility timeout, and the
rollout, still queued with a message counted as sent, waited for the re-send age
(RUNNERS_REDISPATCH_SECONDS, 300 s). The worker restarted under its node name now sends the
oldest queued rollouts' messages again. Made deterministic by holding the rollout's row lock,
so the claim waits, and killing the worker then."""

from __future__ import annotations

import time

import pytest
from django.db import connection, transaction

from runners import services as runner_services
from store.models import Attempt, Rollout
from store.services import RolloutSpec
from tests.celery_fixtures import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
DEFAULTS = {"RUNNERS_HEARTBEAT_SECONDS": "5"}


def _a_claim_waits_for_the_lock() -> bool:
    with connection.cursor() as cursor:
        # Asked inside the test's transaction: Postgres reads pg_stat_activity once per
        # transaction (stats_fetch_consistency), so a snapshot taken before the worker's claim
        # began to wait would be answered again and again (CI, stop 32). Read it afresh.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                       " AND wait_event_type = 'Lock' AND query LIKE '%%store_attempt%%'")
        return cursor.fetchone()[0] > 0


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_message_received_by_a_worker_killed_before_its_claim_is_sent_again(
    project, broker_url, sending_to, celery_workers, capsys
):
    rollout = runner_services.rollouts_enqueue_for_celery(
        project=project, agent="tests.celery_agents:ok_agent",
        specs=[RolloutSpec(input={"i": 1}, config={"max_attempts": 2})])[0]
    with transaction.atomic():  # the claim of the worker's process waits for this lock
        Rollout.objects.select_for_update().get(pk=rollout.pk)
        worker = celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1,
                                env=DEFAULTS, name="received")
        wait_until(_a_claim_waits_for_the_lock, timeout=60, interval=0.05,
                   message="the worker never tried to claim")
        worker.kill()  # the worker and its pool: the message received, nothing claimed
        killed = time.monotonic()
    rollout.refresh_from_db()
    assert rollout.status == "queuing" and not Attempt.objects.filter(rollout=rollout).exists()
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1, env=DEFAULTS,
                   name="received")

    def finished() -> bool:
        rollout.refresh_from_db()
        return rollout.status == "succeeded"

    wait_until(finished, timeout=120, interval=0.2,
               message=lambda: f"the rollout stayed {rollout.status} (its message was with the dead "
                       "worker)")
    with capsys.disabled():
        print(f"\nworker killed between receiving a message and claiming: the rollout "
              f"succeeded {time.monotonic() - killed:.1f} s after the kill (restart included)")
    assert Attempt.objects.filter(rollout=rollout).count() == 1
