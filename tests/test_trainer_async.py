"""Asynchronous training (job config max_staleness > 0) on the real database, rollouts run in
this process in the order each test chooses: steps planned ahead, the bound checked from the
stored rows, stale groups planned again and counted, resume."""

from __future__ import annotations

import uuid

import pytest
import torch

from examples.cipher import job_spec
from store import services as store_services
from store.errors import InvalidInput
from store.models import ResourceVersion, Rollout, Span
from tests.trainer_helpers import capture_sends, drive, run_rollouts
from trainer import conventions as c
from trainer import services
from trainer.algorithms.adapter import Sample
from trainer.algorithms.grpo import GRPO, _Batch, off_policy_correct
from trainer.models import JobStatus, StepStatus, TrainingJob, group_key

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def checkpoint_dir(tmp_path, settings):
    path = tmp_path / "checkpoints"
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(path)}}}
    return path


def make_job(*, steps: int = 4, agent: str | None = None, **config) -> TrainingJob:
    spec = job_spec(seed=0, steps=steps)
    project = store_services.project_create(name=f"async-test-{uuid.uuid4().hex[:8]}")
    spec["config"].update({"tasks_per_step": 2, "group_size": 4, "val_every": 2, **config})
    return services.job_create(
        project=project, agent=agent or spec["agent"], algorithm="grpo", config=spec["config"],
        train_dataset=spec["train_dataset"], val_dataset=spec["val_dataset"][:4],
    )


def stored_lags(job: TrainingJob) -> dict[int, list[int]]:
    """Step n -> for each train rollout it trained on (`trained`, or its own group's when
    the job consumes by step), how many versions the oldest version
    that produced it (its pin, or an older one its LLM spans name) lags the version the step
    trained from (the one step n-1 produced), read from the rows alone."""
    steps = {s.n: s for s in job.steps.all()}
    lags: dict[int, list[int]] = {}
    for n, step in steps.items():
        if step.status != StepStatus.DONE or step.rollout_count == 0:
            continue
        base = steps[n - 1].produced_version if n else 1
        lags[n] = []
        # what it trained on: stored when the job consumes groups, else its own group
        used = (Rollout.objects.filter(pk__in=step.trained) if step.trained else
                Rollout.objects.filter(group_id=step.group_id, mode="train"))
        for rollout in used.filter(status="succeeded"):
            served = [a.get(c.LLM_VERSION) + 1 for a in Span.objects.filter(
                rollout=rollout, attempt_id=rollout.latest_attempt_id,
                name=c.LLM_CALL_SPAN).values_list("attributes", flat=True)]
            lags[n].append(base - min([rollout.resources_version, *served]))
    return lags


def versions(job: TrainingJob) -> list[tuple[int, str, int]]:
    return list(job.steps.values_list("n", "status", "produced_version").order_by("n"))


def test_max_staleness_and_steps_ahead_are_checked_naming_the_field():
    with pytest.raises(InvalidInput, match="config.max_staleness"):
        make_job(max_staleness=-1)
    with pytest.raises(InvalidInput, match="config.max_staleness"):
        make_job(max_staleness="2")
    with pytest.raises(InvalidInput, match="config.steps_ahead"):
        make_job(max_staleness=1, steps_ahead=2)
    assert make_job().config["max_staleness"] == 0  # synchronous by default


def test_an_async_job_plans_ahead_and_trains_steps_in_order_within_the_bound(monkeypatch):
    sent = capture_sends(monkeypatch)
    # consume "step": each step trains on its own planned groups (test_trainer_async_pool.py
    # tests the default, the first complete groups wherever planned)
    job = services.job_start(job_id=make_job(steps=5, max_staleness=2, consume="step").pk)
    # steps 0, 1 and 2 are rolling at once, all against checkpoint 0 (version 1)
    assert list(job.steps.values_list("n", "resources_version").order_by("n")) == [
        (0, 1), (1, 1), (2, 1)]
    slow = store_services.rollout_dequeue(project=job.project, worker_id="slow")
    assert slow is not None and slow[0].group_id == job.steps.get(n=0).group_id
    run_rollouts(job)  # every other rollout of steps 0-2: step 0 waits for its slow one
    assert sent.train_steps == []
    assert set(job.steps.values_list("status", flat=True)) == {StepStatus.ROLLING}
    rollout, attempt = slow
    store_services.attempt_finish(project=job.project, rollout_id=rollout.pk,
                                  attempt_id=attempt.attempt_id, status="succeeded")
    # steps 1 and 2 finished their groups first, but only step 0 may train now
    assert sent.train_steps == [job.steps.get(n=0).pk]
    services.step_train(step_id=sent.train_steps.pop(), worker="w")
    # step 0 produced version 2: step 3 is planned against it; step 1 is ready at once
    assert job.steps.get(n=3).resources_version == 2
    assert sent.train_steps == [job.steps.get(n=1).pk]
    job = drive(job, sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert versions(job) == [(0, "done", 2), (1, "done", 3), (2, "done", 4), (3, "done", 5),
                             (4, "done", 6), (5, "done", 6)]
    lags = stored_lags(job)
    assert max(max(v) for v in lags.values()) == 2  # it did train on older versions...
    assert all(0 <= lag <= 2 for v in lags.values() for lag in v)  # ...never past the bound
    metrics = {s.n: s.metrics for s in job.steps.all()}
    assert metrics[2]["staleness_max"] == 2 and metrics[2]["stale_sample_fraction"] == 1.0
    assert metrics[0]["staleness_max"] == 0
    assert 0 < metrics[2]["is_weight_mean"] <= 2.0
    # the final evaluation ran against the last version
    assert job.steps.get(n=5).resources_version == 6
    count = ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id).count()
    assert count == 6  # one version per training step, none more


def test_an_async_run_without_replans_reproduces_its_checkpoints(monkeypatch):
    sent = capture_sends(monkeypatch)
    shas = []
    for _ in range(2):
        job = drive(services.job_start(job_id=make_job(steps=3, max_staleness=1).pk), sent)
        assert job.status == JobStatus.SUCCEEDED, job.error
        shas.append([v.resources["checkpoint"]["sha256"] for v in
                     ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id)
                     .order_by("version")])
    assert shas[0] == shas[1] and len(shas[0]) == 4


def test_groups_past_the_bound_are_planned_again_and_counted(monkeypatch):
    sent = capture_sends(monkeypatch)
    # A gateway one checkpoint behind: each sample is a version older than its pin, so a
    # group planned a step ahead (pin lag 1) is 2 versions old when its step trains.
    # (consume "step": whole steps planned again; test_trainer_async_pool.py: groups)
    job = make_job(steps=4, max_staleness=1, consume="step",
                   agent="tests.trainer_agents.lagging_gateway_agent")
    job = drive(services.job_start(job_id=job.pk), sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    steps = {s.n: s for s in job.steps.all()}
    # steps 0 and 1 were within the bound; 2 and 3 were planned ahead, aged past it and
    # were planned again against the version they train from
    assert [steps[n].stale_replans for n in range(4)] == [0, 0, 1, 1]
    assert [steps[n].stale_rollouts for n in (2, 3)] == [8, 8]
    assert [steps[n].round for n in (2, 3)] == [1, 1]
    assert steps[2].metrics["samples_replanned"] == 8
    assert steps[2].metrics["staleness_max"] == 1
    assert steps[2].resources_version == steps[1].produced_version
    assert all(lag <= 1 for v in stored_lags(job).values() for lag in v)
    # the stale group's rollouts are kept, not dropped: a group of the step's earlier round
    assert Rollout.objects.filter(group__key=group_key(steps[2].pk, 0), mode="train").count() == 8
    assert [s.produced_version for s in sorted(steps.values(), key=lambda s: s.n)] == [
        2, 3, 4, 5, 5]


def test_cancel_then_resume_keeps_the_bound(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=5, max_staleness=2).pk)
    run_rollouts(job)
    services.step_train(step_id=sent.train_steps.pop(0), worker="w")  # step 0 done
    sent.train_steps.clear()
    services.job_cancel(job_id=job.pk)
    statuses = dict(job.steps.values_list("n", "status"))
    assert statuses == {0: "done", 1: "cancelled", 2: "cancelled", 3: "cancelled"}
    job = services.job_resume(job_id=job.pk)
    assert job.status == JobStatus.RUNNING
    # step 1 trains on its finished group; 2 kept its finished group; 3 (cancelled before
    # its rollouts ran) is planned anew against the current version
    step1, step3 = job.steps.get(n=1), job.steps.get(n=3)
    assert step1.status == StepStatus.READY and set(sent.train_steps) == {step1.pk}
    assert (step3.round, step3.resources_version) == (1, 2)
    job = drive(job, sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert [v for _, _, v in versions(job)] == [2, 3, 4, 5, 6, 6]
    assert all(0 <= lag <= 2 for v in stored_lags(job).values() for lag in v)


def test_a_step_whose_rollouts_run_again_pins_the_current_version(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=3, max_staleness=1).pk)
    run_rollouts(job)
    services.step_train(step_id=sent.train_steps.pop(0), worker="w")  # step 0: version 2
    step1 = job.steps.get(n=1)
    assert step1.resources_version == 1
    claimed = services.step_claim(step_id=sent.train_steps.pop(0), worker="w")
    assert services.step_record_failure(step_id=claimed.pk, attempt=claimed.attempts,
                                        error="boom", rerun_rollouts=True) == "retry"
    step1.refresh_from_db()
    assert (step1.status, step1.round, step1.resources_version) == ("rolling", 1, 2)


def test_importance_weights_are_one_on_policy_and_truncated_at_the_cap():
    config = {**job_spec()["config"], "max_staleness": 1}
    algorithm = GRPO(config)
    state = algorithm.init_state()
    policy = algorithm_policy(algorithm, state)
    obs = [[1.0 if i in (s % 10, 10 + s % 4) else 0.0 for i in range(14)] for s in range(6)]
    with torch.no_grad():
        logp = torch.log_softmax(policy(torch.tensor(obs)), -1)[:, 0]
    # the first three acted with this policy; the last three by one that liked action 0
    # far less (a much older version): their weight pi_prox / pi_behaviour is large
    behaviour = [float(x) for x in logp[:3]] + [float(x) - 3.0 for x in logp[3:]]
    samples = [Sample(rollout_id=f"r{i}", group="g", agent="a", observations=[o],
                      actions=[0], logprobs=[b], reward=float(i % 2))
               for i, (o, b) in enumerate(zip(obs, behaviour, strict=True))]
    batch = _Batch.build(samples, {f"r{i}": 1.0 for i in range(6)}, "cpu")
    stats = off_policy_correct(policy, batch, cap=2.0)
    assert torch.allclose(batch.weights[:3], torch.ones(3), atol=1e-5)
    assert torch.equal(batch.weights[3:], torch.full((3,), 2.0))
    assert stats["is_weight_max"] == pytest.approx(float(torch.exp(torch.tensor(3.0))),
                                                   rel=1e-4)
    assert stats["is_weight_truncated_fraction"] == 0.5
    assert torch.allclose(batch.old_logprobs, logp, atol=1e-6)  # ratio vs the proximal


def algorithm_policy(algorithm: GRPO, state: dict) -> torch.nn.Module:
    from trainer.algorithms.grpo import build_policy

    policy = build_policy(algorithm.config)
    policy.load_state_dict(state["model"])
    return policy
