"""Asynchronous training consuming groups (job config consume "groups", the default with
max_staleness > 0): a step trains on the first complete groups within the bound, oldest first,
wherever planned, so a slow episode does not hold its step; a group that aged past the bound
is planned again and counted. Real database, rollouts run in this process in the order each
test chooses; the bound is checked from the stored rows (`TrainingStep.trained`, pins, spans)."""

from __future__ import annotations

import pytest

from store import services as store_services
from store.errors import InvalidInput
from store.models import Rollout, Span
from tests.test_trainer_async import checkpoint_dir, make_job  # noqa: F401 (fixture)
from tests.trainer_helpers import capture_sends, drive, run_rollouts
from trainer import conventions as c
from trainer import selectors, services, staleness
from trainer.models import JobStatus, StepStatus, TrainingJob, group_key

pytestmark = pytest.mark.django_db(transaction=True)


def trained_lags(job: TrainingJob) -> dict[int, list[int]]:
    """Step n -> for each rollout it trained on (its stored `trained` ids), how many versions
    the oldest version that produced it (its pin, or an older one its LLM spans name) lags the
    version the step trained from, read from the rows alone."""
    steps = {s.n: s for s in job.steps.all()}
    lags: dict[int, list[int]] = {}
    for n, step in steps.items():
        if step.status != StepStatus.DONE or not step.trained:
            continue
        base = steps[n - 1].produced_version if n else 1
        lags[n] = []
        for rollout in Rollout.objects.filter(pk__in=step.trained):
            served = [a.get(c.LLM_VERSION) + 1 for a in Span.objects.filter(
                rollout=rollout, attempt_id=rollout.latest_attempt_id,
                name=c.LLM_CALL_SPAN).values_list("attributes", flat=True)]
            lags[n].append(base - min([rollout.resources_version, *served]))
    return lags


def trained_ids(job: TrainingJob) -> list[str]:
    return [i for trained in job.steps.order_by("n").values_list("trained", flat=True)
            for i in trained]


def assert_none_dropped(job: TrainingJob) -> None:
    """Every train rollout the job planned was trained on by exactly one step, or it was
    planned again (its input in a later round of the same step, counted on the step) or left
    in its step's last round when the last training step was done (counted on the job as
    surplus: the spare groups' worth)."""
    ids = trained_ids(job)
    assert len(ids) == len(set(ids))
    untrained = selectors.job_rollouts(job=job).filter(mode="train").exclude(pk__in=ids)
    job.refresh_from_db()
    assert untrained.count() == (sum(s.stale_rollouts for s in job.steps.all())
                                 + job.surplus_rollouts)
    for rollout in untrained.select_related("group"):
        step = job.steps.get(n=rollout.metadata["trainer.step"])
        later = Rollout.objects.filter(group__key__in=step.group_keys(), mode="train",
                                       start_time__gt=rollout.start_time)
        assert (rollout.group_id == step.group_id
                or any(r.input == rollout.input for r in later)), rollout.pk


def finish(job: TrainingJob, claimed) -> None:
    rollout, attempt = claimed
    store_services.attempt_finish(project=job.project, rollout_id=rollout.pk,
                                  attempt_id=attempt.attempt_id, status="succeeded")


def test_a_slow_group_does_not_hold_its_step_a_later_step_trains_on_it(monkeypatch):
    sent = capture_sends(monkeypatch)
    # no spare groups: the pool holds only the steps' own (test_trainer_async_spare.py)
    job = services.job_start(job_id=make_job(steps=4, max_staleness=2, spare_groups=0).pk)
    step0 = job.steps.get(n=0)
    slow = store_services.rollout_dequeue(project=job.project, worker_id="slow")
    assert slow is not None and slow[0].group_id == step0.group_id
    slow_task = slow[0].input["group"]
    run_rollouts(job)  # every other rollout of steps 0-2
    # step 0 did not wait for its slow episode: one of its groups and one of step 1's did
    assert sent.train_steps == [step0.pk]
    services.step_train(step_id=sent.train_steps.pop(), worker="w")
    step0.refresh_from_db()
    trained = Rollout.objects.filter(pk__in=step0.trained)
    assert trained.count() == 8 and slow[0].pk not in step0.trained
    assert {r.group_id for r in trained} == {step0.group_id, job.steps.get(n=1).group_id}
    assert step0.metrics["groups_trained"] == 2 and step0.metrics["groups_borrowed"] == 1
    finish(job, slow)  # the slow episode ends: its group is the oldest complete one
    job = drive(job, sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    step1 = job.steps.get(n=1)
    assert slow[0].pk in step1.trained  # trained by the next step, one version old
    assert step1.metrics["staleness_max"] == 1
    assert {r.input["group"] for r in Rollout.objects.filter(pk__in=step1.trained)
            if r.group_id == step0.group_id} == {slow_task}
    # every train rollout planned was trained on exactly once, never past the bound
    assert_none_dropped(job)
    lags = trained_lags(job)
    assert all(0 <= lag <= 2 for v in lags.values() for lag in v)
    assert sum(s.stale_replans for s in job.steps.all()) == 0
    assert [n for n, _, v in job.steps.values_list("n", "status", "produced_version")
            .order_by("n")] == [0, 1, 2, 3, 4]


def test_a_group_past_the_bound_is_planned_again_counted_and_never_trained(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=4, max_staleness=1, spare_groups=0).pk)
    step0 = job.steps.get(n=0)
    slow = store_services.rollout_dequeue(project=job.project, worker_id="slow")
    assert slow is not None and slow[0].group_id == step0.group_id
    run_rollouts(job)
    # step 0 trains on its complete group and one of step 1's; step 1 on the rest and one
    # of step 2's: the slow group (version 1) would be 2 versions old for step 2
    for _ in range(2):
        assert len(sent.train_steps) == 1
        services.step_train(step_id=sent.train_steps.pop(), worker="w")
        run_rollouts(job)
    step0.refresh_from_db()
    # planned again against the current version (a new round of step 0), counted there
    assert (step0.round, step0.stale_replans, step0.stale_rollouts) == (1, 1, 4)
    replanned = Rollout.objects.filter(group_id=step0.group_id)
    assert replanned.count() == 4 and {r.resources_version for r in replanned} == {3}
    # the old group is kept, its open rollout cancelled: no step trains on it
    old = Rollout.objects.filter(group__key=group_key(step0.pk, 0), mode="train")
    assert old.count() == 8
    assert Rollout.objects.get(pk=slow[0].pk).status == "cancelled"
    job = drive(job, sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert_none_dropped(job)
    ids = trained_ids(job)
    assert not set(ids) & {r.pk for r in old if r.input["group"] == slow[0].input["group"]}
    assert set(replanned.values_list("pk", flat=True)) <= set(job.steps.get(n=2).trained)
    lags = trained_lags(job)
    assert max(max(v) for v in lags.values()) == 1  # it did train on older versions...
    assert all(0 <= lag <= 1 for v in lags.values() for lag in v)  # ...never past the bound
    assert [v for v in job.steps.order_by("n").values_list("produced_version", flat=True)] == [
        2, 3, 4, 5, 5]


def test_with_a_lagging_gateway_no_sample_past_the_bound_is_trained(monkeypatch):
    sent = capture_sends(monkeypatch)
    # every sample is a version older than its pin (an LLM span says so): groups planned a
    # step ahead are past the bound by their spans, not by their pins
    job = make_job(steps=4, max_staleness=1, agent="tests.trainer_agents.lagging_gateway_agent")
    job = drive(services.job_start(job_id=job.pk), sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert sum(s.stale_replans for s in job.steps.all()) >= 1
    assert_none_dropped(job)
    lags = trained_lags(job)
    assert all(0 <= lag <= 1 for v in lags.values() for lag in v)
    assert [v for v in job.steps.order_by("n").values_list("produced_version", flat=True)] == [
        2, 3, 4, 5, 5]


def test_partial_rollouts_are_marked_for_the_gateway_and_need_an_async_job(monkeypatch):
    capture_sends(monkeypatch)
    with pytest.raises(InvalidInput, match="config.partial_rollouts"):
        make_job(partial_rollouts=True)  # a synchronous job's rollouts run on one version
    job = services.job_start(job_id=make_job(max_staleness=1, partial_rollouts=True).pk)
    rollouts = selectors.job_rollouts(job=job)
    assert rollouts.count() and all(r.metadata[c.LLM_LATEST] is True for r in rollouts)
    plain = services.job_start(job_id=make_job(max_staleness=1).pk)
    assert not any(c.LLM_LATEST in r.metadata for r in selectors.job_rollouts(job=plain))


def test_a_partial_rollouts_version_is_its_oldest_token_not_its_pin():
    spans = [{"name": c.LLM_CALL_SPAN, "attributes": {c.LLM_VERSION: v}} for v in (2, 3)]
    # served by checkpoints 2 and 3 (resources versions 3 and 4), pinned at version 1
    assert staleness.rollout_version(1, spans, partial=True) == 3
    assert staleness.rollout_version(1, spans) == 1  # pinned: the pin counts too
    assert staleness.rollout_version(1, [], partial=True) == 1  # no LLM call: the pin
