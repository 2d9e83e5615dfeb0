"""Races on real Postgres connections (one per thread)."""

import threading
from collections import Counter

import pytest
from django.db import connection

from store import services, watchdog
from store.models import Attempt, Rollout
from store.services import AttemptUpdate, RolloutSpec
from tests.conftest import backdate

pytestmark = pytest.mark.django_db(transaction=True)


def run_threads(n, target):
    errors = []

    def wrapped(i):
        try:
            target(i)
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def test_eight_workers_claim_two_thousand_rollouts_each_exactly_once():
    project = services.project_create(name="race")
    services.rollout_enqueue_many(project=project,
                                  specs=[RolloutSpec(input=i) for i in range(2000)])
    claimed: list[list[str]] = [[] for _ in range(8)]

    def worker(i):
        while True:
            batch = services.rollout_dequeue_many(project=project, worker_id=f"w{i}", limit=7)
            if not batch:
                return
            claimed[i].extend(r.pk for r, _ in batch)

    run_threads(8, worker)
    counts = Counter(rid for ids in claimed for rid in ids)
    assert len(counts) == 2000 and set(counts.values()) == {1}
    assert sum(1 for ids in claimed if ids) > 1  # the work really was shared
    assert Attempt.objects.count() == 2000
    assert not Rollout.objects.exclude(status="preparing").exists()


def test_concurrent_enqueues_with_one_idempotency_key_create_one_rollout():
    project = services.project_create(name="idem")
    ids = []

    def enqueue(i):
        rollout = services.rollout_enqueue(project=project,
                                           spec=RolloutSpec(input=i, idempotency_key="same"))
        ids.append(rollout.pk)

    run_threads(6, enqueue)
    assert len(set(ids)) == 1 and Rollout.objects.count() == 1


def test_concurrent_sweeps_change_each_attempt_once():
    project = services.project_create(name="sweeps")
    services.rollout_enqueue_many(project=project, specs=[
        RolloutSpec(input=i, config={"timeout_seconds": 1}) for i in range(300)
    ])
    for _, attempt in services.rollout_dequeue_many(project=project, limit=300):
        backdate(attempt, 2)
    results = []

    def sweep(i):
        results.append(watchdog.sweep(batch_size=20))

    run_threads(4, sweep)
    timed_out = Counter(key for r in results for key in r.timed_out)
    assert len(timed_out) == 300 and set(timed_out.values()) == {1}
    assert Rollout.objects.filter(status="failed").count() == 300


def test_runner_reports_racing_the_sweep_lose_no_update():
    project = services.project_create(name="cas")
    services.rollout_enqueue_many(project=project, specs=[
        RolloutSpec(input=i, config={"timeout_seconds": 1}) for i in range(200)
    ])
    claimed = services.rollout_dequeue_many(project=project, limit=200)
    for _, attempt in claimed:
        backdate(attempt, 2)

    def act(i):
        if i == 0:
            watchdog.sweep(batch_size=10)
            return
        for rollout, attempt in claimed[i - 1 :: 3]:
            services.attempt_update_many(project=project, updates=[
                AttemptUpdate(rollout.pk, attempt.attempt_id, status="succeeded")
            ])

    run_threads(4, act)
    # Every attempt holds exactly one verdict, and its rollout agrees with it.
    for rollout in Rollout.objects.select_related("latest_attempt"):
        verdict = rollout.latest_attempt.status
        assert verdict in ("timeout", "succeeded")
        if rollout.status == "succeeded":
            assert verdict == "succeeded"
        else:
            assert rollout.status == "failed"
