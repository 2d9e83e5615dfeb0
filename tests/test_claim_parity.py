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
from store.models import Party, Rollout, Worker
from store.services import RolloutSpec
from store.services._claim import Scope, _claim_orm, _claim_sql
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


def _world(tag: str, dispatch: str, now) -> dict:
    """Two projects, weights 2:1; the first has two jobs (1:1) with some usage already, the
    second one party; a third project at its cap; priorities 0 and 3 mixed."""
    a = services.project_create(name=f"fair-a-{tag}")
    b = services.project_create(name=f"fair-b-{tag}")
    capped = services.project_create(name=f"fair-c-{tag}")
    services.share_set(project=a, weight=2)
    services.share_set(project=capped, max_concurrent_rollouts=1)
    labels = {}
    for project, party, n, priority in [(a, "j1", 6, 0), (a, "j2", 6, 0), (b, "", 8, 0),
                                        (b, "", 2, 3), (capped, "", 3, 0)]:
        specs = [RolloutSpec(input=f"{party}-{priority}-{i}", priority=priority)
                 for i in range(n)]
        for r in services.rollout_enqueue_many(project=project, specs=specs, party=party):
            labels[r.pk] = (project.name.split("-")[1], r.input)
        services.rollout_dispatch_set(project=project, rollout_ids=list(labels),
                                      dispatch=dispatch, target="x")
    Party.objects.filter(project=a, key="j1").update(usage=3.0, usage_at=now)
    return {"labels": labels, "projects": [a, b, capped]}


def test_the_fair_choice_is_the_same_in_the_statement_and_the_orm():
    """Ticket claims one at a time across projects (priority first, then the project, then
    the job with the least usage per weight), and a project's dequeue in batches: the same
    rollouts in the same order on both paths, the same usage left."""
    seeded = timezone.now()
    sql_world, orm_world = _world("sql", "d-sql", seeded), _world("orm", "d-orm", seeded)
    sql_order, orm_order = [], []
    for _ in range(18):
        now = timezone.now()
        got = _claim_sql(Scope(None, "d-sql"), "w", 1, now, None, False)
        sql_order += [sql_world["labels"][r.pk] for r, _ in got]
        with transaction.atomic():
            got = _claim_orm(Scope(None, "d-orm"), "w", 1, now, None)
        orm_order += [orm_world["labels"][r.pk] for r, _ in got]
    assert sql_order == orm_order
    assert sql_order[:2] == [("b", "-3-0"), ("b", "-3-1")]  # priority first
    assert sum(1 for p, _ in sql_order if p == "c") == 1  # the cap holds
    now = timezone.now()
    sql = _claim_sql(sql_world["projects"][0], "w", 3, now, None, True)
    with transaction.atomic():
        orm = _claim_orm(orm_world["projects"][0], "w", 3, now, None)
    assert [r.input for r, _ in sql] == [r.input for r, _ in orm]

    def usage(world):
        return sorted((p.key, round(p.usage, 6)) for p in Party.objects.filter(
            project__in=world["projects"]))
    assert usage(sql_world) == usage(orm_world)
