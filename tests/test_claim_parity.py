"""The claim written twice: one statement on Postgres (`_claim_sql`) and the ORM steps the
embedded SQLite default runs (`_claim_orm` + `worker_mark_dequeued`). Both, on the same rows
at the same instant, must claim the same rollouts in the same order and leave the same rows
(issue 23: parity for the claim, as for the verdict and the export)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from store import services
from store.models import Rollout, Worker
from store.services import RolloutSpec
from store.services._claim import _claim_orm, _claim_sql
from store.services._common import worker_mark_dequeued

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

CONFIGS = [None, {"timeout_seconds": 30}, {"unresponsive_seconds": 10},
           {"timeout_seconds": 5, "unresponsive_seconds": 10}, {"timeout_seconds": 3.2e9},
           {"max_attempts": 3, "retry_condition": ["failed"], "unresponsive_seconds": 1}]


def _seed(name: str, now) -> services.Project:
    """Rollouts of every config, priorities, an expired queue wait and a requeued one."""
    project = services.project_create(name=name)
    specs = [RolloutSpec(input=i, config=c, priority=i % 3) for i, c in enumerate(CONFIGS)]
    specs.append(RolloutSpec(input="expired", queue_timeout_seconds=1))
    specs.append(RolloutSpec(input="retried", config=CONFIGS[-1], priority=5))
    rollouts = services.rollout_enqueue_many(project=project, specs=specs)
    Rollout.objects.filter(pk=rollouts[-2].pk).update(
        queue_deadline=now - timedelta(seconds=1))
    retried = rollouts[-1]
    _, attempt = services.rollout_claim(project=project, rollout_id=retried.pk, worker_id="old")
    services.attempt_finish(project=project, rollout_id=retried.pk,
                            attempt_id=attempt.attempt_id, status="failed")
    return project


def _rows(project, claimed, now, worker) -> tuple:
    """What the claim left, keyed by input (ids are random), times relative to `now`."""
    def at(value):
        return None if value is None else (value - now).total_seconds()

    order = [r.input for r, _ in claimed]
    rollouts = {}
    for r in Rollout.objects.filter(project=project).select_related("latest_attempt"):
        a = r.latest_attempt
        mine = r.input in order  # an attempt of this claim (others were seeded earlier)
        rollouts[str(r.input)] = (
            r.status, r.attempt_count, at(r.queue_deadline),
            None if a is None or not mine else (
                a.status, a.sequence_id, a.worker_id, at(a.start_time), at(a.deadline),
                at(a.last_heartbeat_time)))
    workers = {}
    for w in Worker.objects.filter(project=project, worker_id=worker):
        current = Rollout.objects.filter(pk=w.current_rollout_id).values_list(
            "input", flat=True).first()
        workers[w.worker_id] = (w.status, at(w.last_dequeue_time), at(w.last_busy_time),
                                at(w.last_idle_time), current)
    return order, rollouts, workers


@pytest.mark.parametrize("limit,named,worker", [
    (3, None, "w"), (10, None, "w"), (1, 0, "w"), (1, "retried", "w"), (2, None, None),
])
def test_the_claim_statement_and_the_orm_leave_the_same_rows(limit, named, worker):
    start = timezone.now()
    sql_project, orm_project = _seed("claim-sql", start), _seed("claim-orm", start)
    now = timezone.now()

    def named_id(project):
        if named is None:
            return None
        return Rollout.objects.get(project=project, input=named).pk

    sql = _claim_sql(sql_project, worker, limit, now, named_id(sql_project), True)
    with transaction.atomic():
        orm = _claim_orm(orm_project, worker, limit, now, named_id(orm_project))
        if worker:
            worker_mark_dequeued(orm_project.pk, worker, [a for _, a in orm], now)
    sql.sort(key=lambda pair: (-pair[0].priority, pair[0].enqueue_time))
    orm.sort(key=lambda pair: (-pair[0].priority, pair[0].enqueue_time))
    assert _rows(sql_project, sql, now, worker) == _rows(orm_project, orm, now, worker)
    assert sql  # each case claims something
