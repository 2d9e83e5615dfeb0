"""Spare groups (job config `spare_groups`, asynchronous jobs consuming groups): the job plans
that many groups beyond what its steps train on, so the last steps take the first complete
ones instead of waiting for the slowest; what is left when training ends is counted on the
job and its open rollouts cancelled, never dropped silently. Real database, rollouts run in
this process in the order each test chooses; the bound is checked from the stored rows."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from store import services as store_services
from store.errors import InvalidInput
from store.models import Rollout
from tests.test_trainer_async import checkpoint_dir, make_job  # noqa: F401 (fixture)
from tests.test_trainer_async_pool import assert_none_dropped, trained_ids, trained_lags
from tests.trainer_helpers import capture_sends, drive, run_rollouts
from trainer import pool, selectors, services, staleness
from trainer.models import JobStatus, StepStatus, TrainingJob

pytestmark = pytest.mark.django_db(transaction=True)


def spare_rollouts(job: TrainingJob):
    return selectors.job_rollouts(job=job).filter(**{f"metadata__{staleness.SPARE}": True})


def test_spare_groups_are_checked_naming_the_field():
    for bad in (-1, "2", True, staleness.MAX_SPARE + 1):
        with pytest.raises(InvalidInput, match="config.spare_groups"):
            make_job(max_staleness=2, spare_groups=bad)
    with pytest.raises(InvalidInput, match="config.spare_groups"):
        make_job(spare_groups=1)  # a synchronous job
    with pytest.raises(InvalidInput, match="config.spare_groups"):
        make_job(max_staleness=2, consume="step", spare_groups=1)


def test_by_default_an_async_job_consuming_groups_plans_half_a_steps_groups_spare(
        monkeypatch):
    capture_sends(monkeypatch)
    assert staleness.spare_groups({"max_staleness": 1}, planned=8) == 4
    assert staleness.spare_groups({"max_staleness": 1}, planned=5) == 3
    assert staleness.spare_groups({"max_staleness": 1, "consume": "step"}, planned=8) == 0
    assert staleness.spare_groups({}, planned=8) == 0  # synchronous
    job = services.job_start(job_id=make_job(max_staleness=1).pk)  # 2 groups a step
    assert job.config["spare_groups"] is None and spare_rollouts(job).count() == 4
    assert not spare_rollouts(services.job_start(job_id=make_job().pk)).exists()


def test_step_0_plans_the_spare_groups_beside_its_own_the_same_ones_every_run(monkeypatch):
    capture_sends(monkeypatch)
    inputs = []
    for _ in range(2):
        job = services.job_start(job_id=make_job(max_staleness=1, spare_groups=2).pk)
        step0 = job.steps.get(n=0)
        spares = list(spare_rollouts(job).order_by("start_time", "pk"))
        assert len(spares) == 8 and {r.group_id for r in spares} == {step0.group_id}
        own = {r.input["group"] for r in Rollout.objects.filter(group_id=step0.group_id,
                                                                 mode="train")} - {
            r.input["group"] for r in spares}
        assert len(own) == 2 and len({r.input["group"] for r in spares}) == 2
        # the step counts them among its rollouts, but trains on as many groups as it planned
        assert step0.rollout_count == 16 and pool.planned_units(step0) == 2
        inputs.append(sorted((r.input["group"], r.input["seed"]) for r in spares))
    assert inputs[0] == inputs[1]


def run_with_one_slow_group(monkeypatch, spare: int) -> tuple[TrainingJob, list, tuple]:
    """Two training steps, bound 1; the first rollout of step 0 is held, every other one runs.
    Returns the job, the train steps sent and the held (rollout, attempt)."""
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=2, max_staleness=1,
                                             spare_groups=spare).pk)
    slow = store_services.rollout_dequeue(project=job.project, worker_id="slow")
    assert slow is not None and slow[0].group_id == job.steps.get(n=0).group_id
    run_rollouts(job)
    assert len(sent.train_steps) == 1
    services.step_train(step_id=sent.train_steps.pop(), worker="w")  # step 0
    run_rollouts(job)
    return job, sent, slow


def test_without_spare_groups_the_last_step_waits_for_the_slowest_group(monkeypatch):
    job, sent, slow = run_with_one_slow_group(monkeypatch, spare=0)
    assert sent.train_steps == []  # step 1 needs the slow group: every other one is trained
    assert job.steps.get(n=1).status == StepStatus.ROLLING


def test_the_last_step_trains_on_a_spare_group_and_the_slow_one_is_counted_and_cancelled(
        monkeypatch):
    job, sent, slow = run_with_one_slow_group(monkeypatch, spare=1)
    step1 = job.steps.get(n=1)
    assert sent.train_steps == [step1.pk]  # it did not wait for the slow group
    job = drive(job, sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    # the slow group was left: counted on the job, its open rollout cancelled, its finished
    # ones kept in the store; no step trained on any of it
    assert (job.surplus_groups, job.surplus_rollouts) == (1, 4)
    assert Rollout.objects.get(pk=slow[0].pk).status == "cancelled"
    left = Rollout.objects.filter(group_id=slow[0].group_id, input__group=slow[0].input["group"],
                                  mode="train")
    assert left.count() == 4 and not set(left.values_list("pk", flat=True)) & set(
        trained_ids(job))
    # each step trained on as many groups as it planned, within the bound, one version each
    steps = {s.n: s for s in job.steps.all()}
    assert [steps[n].metrics["groups_trained"] for n in (0, 1)] == [2, 2]
    assert all(0 <= lag <= 1 for v in trained_lags(job).values() for lag in v)
    assert_none_dropped(job)
    assert [steps[n].produced_version for n in range(3)] == [2, 3, 3]
    out = io.StringIO()
    call_command("train_show", str(job.pk), stdout=out)
    assert "spare groups left untrained: 1 (4 rollouts, open ones cancelled)" in out.getvalue()


def test_a_cancelled_job_cancels_its_spare_groups_and_a_resume_plans_them_again(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=3, max_staleness=1, spare_groups=1).pk)
    services.job_cancel(job_id=job.pk)
    spares = spare_rollouts(job)
    assert spares.count() == 4 and set(spares.values_list("status", flat=True)) == {
        "cancelled"}
    job = services.job_resume(job_id=job.pk)
    step0 = job.steps.get(n=0)
    assert step0.round == 1  # planned anew, its spare groups with it
    assert spare_rollouts(job).filter(group_id=step0.group_id, status="queuing").count() == 4
    job = drive(job, sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.surplus_groups == 1  # one group left untrained: the spare groups' worth
    ids = trained_ids(job)
    cancelled = spare_rollouts(job).filter(status="cancelled").values_list("pk", flat=True)
    assert len(cancelled) == 4  # the first round's
    assert len(ids) == len(set(ids)) and not set(ids) & set(cancelled)
    assert all(0 <= lag <= 1 for v in trained_lags(job).values() for lag in v)
