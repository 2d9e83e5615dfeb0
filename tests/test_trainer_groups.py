"""A step's rollouts are its rollout group's members: the trainer reacts to the group's
completion event, not to idempotency keys or an in-process callback; progress reads counters."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test.utils import CaptureQueriesContext

from store import hooks
from store import services as store_services
from store.models import GroupCompletion, Rollout
from store.services import RolloutSpec
from tests.test_trainer_services import checkpoint_dir, make_job  # noqa: F401 - fixture
from tests.trainer_helpers import capture_sends, run_rollouts
from trainer import progress, reactions, services
from trainer.models import StepStatus

pytestmark = pytest.mark.django_db(transaction=True)


def test_rollouts_a_client_keyed_like_a_step_are_not_the_steps(monkeypatch):
    """A client of the project enqueues with the keys the trainer used to give its rollouts
    (what `Idempotency-Key: job/<id>/step/0` makes of a batch): the trainer neither adopts them
    nor counts them for its step."""
    capture_sends(monkeypatch)
    job = make_job()
    squatted = store_services.rollout_enqueue_many(project=job.project, specs=[
        RolloutSpec(input=i, idempotency_key=f"job/{job.pk}/step/0/{i}") for i in range(12)])
    for rollout in squatted:
        store_services.rollout_update(project=job.project, rollout_id=rollout.pk,
                                      status="succeeded")
    services.job_start(job_id=job.pk)
    step = job.steps.get()
    mine = set(Rollout.objects.filter(group=step.group).values_list("pk", flat=True))
    assert len(mine) == 12 and not mine & {r.pk for r in squatted}
    assert step.status == StepStatus.ROLLING  # the squatters' success readies nothing
    assert services.step_check_ready(step_id=step.pk) is False
    assert run_rollouts(job) == 12
    step.refresh_from_db()
    assert step.status == StepStatus.READY


def test_a_completion_whose_nudge_was_lost_is_taken_by_the_sweep(monkeypatch):
    sent = capture_sends(monkeypatch)
    monkeypatch.setitem(hooks._completed_callbacks, "trainer", [])  # the process died
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    step = job.steps.get()
    assert step.status == StepStatus.ROLLING and sent.train_steps == []
    assert GroupCompletion.objects.filter(group=step.group).count() == 1
    assert reactions.groups_completed() == 1
    step.refresh_from_db()
    assert step.status == StepStatus.READY and sent.train_steps == [step.pk]
    assert reactions.groups_completed() == 0  # taken once
    assert not GroupCompletion.objects.exists()  # and gone: consumed events leave no rows


def test_the_finishing_process_reacts_at_once(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    step = job.steps.get()
    assert step.status == StepStatus.READY and sent.train_steps == [step.pk]
    assert not GroupCompletion.objects.exists()


def test_a_progress_poll_reads_counters_not_rollouts(monkeypatch):
    capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    with CaptureQueriesContext(connection) as queries:
        snap = progress.snapshot(job.pk)
    assert snap.rollouts_finished == 12
    sql = " ".join(q["sql"] for q in queries.captured_queries)
    assert "LIKE" not in sql.upper() and "store_rollout\"" not in sql


def test_the_migration_moves_step_membership_forward_and_back(monkeypatch):
    """Forward: rollouts keyed job/<id>/step/<n>/[r<round>/]<i> become the members of their
    round's group with its counts. Backward: members planned without a key get that key."""
    capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)  # step 0 ready, its 12 rollouts planned without keys
    step = job.steps.get()
    members = list(Rollout.objects.filter(group=step.group).order_by("start_time", "pk"))
    executor = MigrationExecutor(connection)
    target = [("trainer", "0002_job_paused"), ("store", "0006_rollout_span_sequence")]
    try:
        executor.migrate(target)
        with connection.cursor() as cursor:
            cursor.execute('SELECT id, idempotency_key FROM store_rollout')
            keys = dict(cursor.fetchall())
        assert [keys[r.pk] for r in members] == [f"job/{job.pk}/step/0/{i}" for i in range(12)]
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes())
    step.refresh_from_db()
    group = step.group
    assert (group.key, group.total, group.finished) == (f"trainer/step/{step.pk}/r0", 12, 12)
    assert set(group.rollouts.values_list("pk", flat=True)) == {r.pk for r in members}
