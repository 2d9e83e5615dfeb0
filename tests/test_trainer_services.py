"""The trainer's services on the real database, with rollouts run in this process."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from examples.cipher import job_spec
from store import selectors as store_selectors
from store import services as store_services
from store.errors import InvalidInput
from store.models import ResourceVersion
from tests.trainer_helpers import capture_sends, drive, queued_count, run_rollouts
from trainer import services
from trainer.algorithms import GRPO
from trainer.models import JobStatus, StepStatus, TrainingJob, TrainingStep

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def checkpoint_dir(tmp_path, settings):
    path = tmp_path / "checkpoints"
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(path)}}}
    return path


class ExplodingGRPO(GRPO):
    """Fails every update: the bounded-retry test's algorithm."""

    def update(self, **kwargs):
        raise RuntimeError("boom: the update exploded")


class SlowGRPO(GRPO):
    """Trains longer than its step lease (`update_sleep` seconds per update)."""

    config_keys = GRPO.config_keys | {"update_sleep"}

    def update(self, **kwargs):
        time.sleep(float(self.config["update_sleep"]))
        return super().update(**kwargs)


def make_job(*, steps: int = 2, algorithm: str = "grpo", **config) -> TrainingJob:
    spec = job_spec(seed=0, steps=steps)
    project = store_services.project_create(name=f"trainer-test-{TrainingJob.objects.count()}")
    spec["config"].update({"tasks_per_step": 2, "group_size": 4, "val_every": 1, **config})
    return services.job_create(
        project=project, agent=spec["agent"], algorithm=algorithm, config=spec["config"],
        train_dataset=spec["train_dataset"], val_dataset=spec["val_dataset"][:4],
    )


def test_job_start_writes_checkpoint_zero_and_plans_step_zero(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    assert job.status == JobStatus.RUNNING
    version = store_selectors.resources_get(project=job.project, resources_id=job.resources_id)
    assert version.version == 1
    assert version.resources["checkpoint"]["resource_type"] == "checkpoint"
    step = job.steps.get()
    assert (step.n, step.status, step.resources_version) == (0, StepStatus.ROLLING, 1)
    assert (step.rollout_count, step.val_rollout_count) == (8, 4)
    assert len(sent.rollouts) == 12
    assert services.job_start(job_id=job.pk).steps.count() == 1  # starting twice: no-op


def test_step_becomes_ready_once_all_its_rollouts_finish(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    step = job.steps.get()
    assert step.status == StepStatus.READY
    assert sent.train_steps == [step.pk]
    assert services.step_check_ready(step_id=step.pk) is False


def test_train_step_writes_the_next_version_and_plans_the_next_step(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    step_id = sent.train_steps.pop()
    assert services.step_train(step_id=step_id, worker="w") == "done"
    step = TrainingStep.objects.get(pk=step_id)
    assert (step.status, step.produced_version, step.device) == (StepStatus.DONE, 2, "cpu")
    assert {"train_reward", "val_reward", "loss"} <= set(step.metrics)
    assert job.steps.get(n=1).resources_version == 2
    # A redelivered message for a finished step does nothing.
    assert services.step_train(step_id=step_id, worker="w2") == "skipped"
    assert ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id).count() == 2
    assert job.steps.count() == 2


def test_a_database_lost_while_a_trained_step_finishes_is_retried_in_place(monkeypatch):
    """Postgres restarting while a step trained: the finishing write met a lost connection,
    the task failed, and the step stayed `training`, held by a live process, until its 120 s
    lease ran out (tests/test_chaos.py: redone 125 s after Postgres was up). The try that
    trained retries its writes instead: the step is done once, by that try."""
    from django.db import OperationalError

    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    step_id = sent.train_steps.pop()
    finish, failures = services.step_finish, []

    def lost_once(step, result, *usage):
        if not failures:
            failures.append(1)
            raise OperationalError("server closed the connection unexpectedly")
        return finish(step, result, *usage)

    monkeypatch.setattr(services, "step_finish", lost_once)
    assert services.step_train(step_id=step_id, worker="w") == "done"
    step = TrainingStep.objects.get(pk=step_id)
    assert (step.status, step.attempts, step.produced_version) == (StepStatus.DONE, 1, 2)
    assert failures == [1] and job.steps.count() == 2


def test_a_short_run_learns_to_decode(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = make_job(steps=6, tasks_per_step=8, group_size=8, val_every=6)
    job = drive(services.job_start(job_id=job.pk), sent)
    assert job.status == JobStatus.SUCCEEDED
    first, last = job.steps.get(n=0), job.steps.get(n=6)
    untrained, trained = first.metrics["val_reward"], last.metrics["val_reward"]
    # Guessing scores 0.1 in expectation; a decoder that learned scores near 1.
    assert untrained <= 0.3
    assert trained >= untrained + 0.5, (untrained, trained)
    assert last.metrics.get("loss") is None  # the final step only evaluates
    assert job.best_version == last.resources_version


def test_a_failing_step_is_retried_a_bounded_number_of_times_then_fails_the_job(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = make_job(algorithm="tests.test_trainer_services.ExplodingGRPO", max_step_attempts=2)
    job = drive(services.job_start(job_id=job.pk), sent)
    step = job.steps.get(n=0)
    assert (job.status, step.status, step.attempts) == (JobStatus.FAILED, StepStatus.FAILED, 2)
    assert "boom: the update exploded" in job.error
    assert "step 0 failed after 2 tries" in job.error


@pytest.mark.parametrize("agent, says", [
    ("tests.trainer_specs.spanless_agent", "the algorithm trains on `lightning.decision` spans"),
    ("tests.trainer_specs.unrewarded_agent", "8 of them have no reward (the agent returned None "
                                             "and emitted none"),
])
def test_a_step_whose_rollouts_give_no_samples_fails_the_job_saying_why(monkeypatch, agent, says):
    """Such a job "succeeded", every step training on nothing."""
    sent = capture_sends(monkeypatch)
    job = make_job(max_step_attempts=2)
    TrainingJob.objects.filter(pk=job.pk).update(agent=agent)
    job = drive(services.job_start(job_id=job.pk), sent)
    step = job.steps.get(n=0)
    assert (job.status, step.status, step.attempts) == (JobStatus.FAILED, StepStatus.FAILED, 2)
    assert step.error.startswith("step 0: 8 succeeded train rollouts gave no training samples")
    assert says in step.error and "Traceback" not in step.error
    assert "step 0 failed after 2 tries" in job.error and says in job.error


def test_a_step_whose_worker_died_is_sent_again_and_completes_once(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(step_lease_seconds=30).pk)
    run_rollouts(job)
    step_id = sent.train_steps.pop()
    dead = services.step_claim(step_id=step_id, worker="dead")  # then kill -9
    assert services.step_train(step_id=step_id, worker="early") == "skipped"  # lease held
    assert services.steps_sweep().resent == []
    later = timezone.now() + timedelta(seconds=31)
    assert services.steps_sweep(now=later).resent == [step_id]
    assert services.step_claim(step_id=step_id, worker="heir", now=later) is not None
    step = TrainingStep.objects.get(pk=step_id)
    assert (step.attempts, step.worker) == (2, "heir")
    result = services.train_run(step)
    assert services.step_finish(step, result) == "done"
    assert services.step_finish(dead, result) == "lost"  # the dead try cannot finish it
    assert ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id).count() == 2


def test_cancel_then_resume_goes_on_from_the_last_finished_step(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=3).pk)
    run_rollouts(job)
    services.step_train(step_id=sent.train_steps.pop(), worker="w")  # step 0 done
    services.job_cancel(job_id=job.pk)
    assert job.steps.get(n=1).status == StepStatus.CANCELLED
    assert queued_count(job) == 0
    job = services.job_resume(job_id=job.pk)
    assert job.status == JobStatus.RUNNING
    step = job.steps.get(n=1)
    assert (step.status, step.round, step.resources_version) == (StepStatus.ROLLING, 1, 2)
    job = drive(job, sent)
    assert job.status == JobStatus.SUCCEEDED
    assert job.steps.filter(status=StepStatus.DONE).count() == 4


def test_retention_keeps_the_best_checkpoint_and_the_latest(monkeypatch, checkpoint_dir):
    sent = capture_sends(monkeypatch)
    job = drive(services.job_start(job_id=make_job(steps=4, keep_last=1).pk), sent)
    kept = set(ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id)
               .values_list("version", flat=True))
    assert job.best_version in kept
    assert max(kept) == 5 and len(kept) <= 2
    files = {p.name for p in checkpoint_dir.rglob("*.pt")}
    names = {v.resources["checkpoint"]["name"].rsplit("/", 1)[1]
             for v in ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id)}
    assert files == names  # the files of deleted versions are gone too


def test_a_step_past_its_deadline_trains_on_what_finished_and_cancels_the_rest(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    step = job.steps.get()
    claimed = store_services.rollout_dequeue(project=job.project, worker_id="slow")
    assert claimed is not None  # one rollout stays running, the others queued
    assert services.steps_sweep().ready == []
    later = timezone.now() + timedelta(seconds=job.config["step_timeout_seconds"] + 1)
    assert services.steps_sweep(now=later).ready == [step.pk]
    statuses = set(job.project.rollouts.values_list("status", flat=True))
    assert statuses == {"cancelled"}
    assert services.step_train(step_id=sent.train_steps.pop(), worker="w") == "done"
    step.refresh_from_db()
    assert step.metrics["train_rollouts_failed"] == 8 and "train_reward" not in step.metrics


def test_the_readme_algorithm_example_trains(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = make_job(steps=2, algorithm="examples.reinforce.REINFORCE")
    job = drive(services.job_start(job_id=job.pk), sent)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert "loss" in job.steps.get(n=0).metrics
    assert job.steps.get(n=2).metrics["val_rollouts"] == 4


class UndeclaredAlgorithm(GRPO):
    """A user's algorithm that does not say which keys it reads."""

    config_keys = None


def test_a_config_key_nobody_reads_is_refused_naming_the_nearest():
    """A mistyped key was accepted and ignored: the job trained on the default instead."""
    spec = job_spec(seed=0, steps=1)
    project = store_services.project_create(name="config-keys")

    def create(algorithm: str = "grpo", **config) -> TrainingJob:
        return services.job_create(
            project=project, agent=spec["agent"], algorithm=algorithm,
            config={**spec["config"], **config}, train_dataset=spec["train_dataset"])

    with pytest.raises(InvalidInput) as raised:
        create(lrr=0.1, update_sleep=1)
    assert raised.value.field == "config.lrr"
    assert raised.value.message.startswith(
        "unknown key (did you mean 'lr'?): neither the trainer nor the algorithm 'grpo' reads "
        "it; also unknown: update_sleep")
    with pytest.raises(InvalidInput, match="config.kl_coef: unknown key"):  # grpo_lm's, not grpo's
        create(kl_coef=0.1)
    assert not TrainingJob.objects.exists()
    # the trainer's keys, grpo's, and a subclass's own declared ones are accepted; baseline
    # takes grpo's (it runs on the same spec); an algorithm that declares nothing is not checked
    create("tests.test_trainer_services.SlowGRPO", update_sleep=0, lr=0.1, steps_ahead=0,
           threshold=0.9, resources={"gpus": 0}, agents=["a"])
    create("baseline", epochs=3)
    create("tests.test_trainer_services.UndeclaredAlgorithm", anything=1)
    assert TrainingJob.objects.count() == 3


@pytest.mark.parametrize(("config", "field", "message"), [
    ({"val_every": 0}, "config.val_every", "must be >= 1, got 0"),  # was a ZeroDivisionError
    ({"group_size": 1}, "config.group_size", "must be >= 2, got 1 (a group's rewards are"),
    ({"tasks_per_step": 0}, "config.tasks_per_step", "must be >= 1, got 0"),
    ({"group_size": 2.5}, "config.group_size", "must be an integer, got 2.5"),
    ({"lr": -1}, "config.lr", "must be > 0, got -1"),
    ({"lr": "abc"}, "config.lr", "must be a finite number, got 'abc'"),
    ({"lr": float("nan")}, "config.lr", "must be a finite number, got nan"),
    ({"epochs": True}, "config.epochs", "must be an integer, got True"),
    ({"max_failed_rollout_share": 2}, "config.max_failed_rollout_share",
     "must be >= 0 and <= 1, got 2"),
    ({"keep_last": 0}, "config.keep_last", "must be >= 1, got 0"),
    ({"step_lease_seconds": 0}, "config.step_lease_seconds", "must be > 0, got 0"),
    ({"steps": 0}, "config.steps", "must be >= 1, got 0"),
])
def test_a_config_value_that_cannot_work_is_refused_naming_the_key(config, field, message):
    """`val_every: 0` failed the job with ZeroDivisionError; a group of one rollout, no tasks
    per step, a fractional group: jobs that "succeeded" training on nothing, exit 0."""
    spec = job_spec(seed=0, steps=1)
    with pytest.raises(InvalidInput) as raised:
        services.job_create(
            project=store_services.project_create(name="config-values"), agent=spec["agent"],
            algorithm="grpo", config={**spec["config"], **config},
            train_dataset=spec["train_dataset"])
    assert (raised.value.field, raised.value.message[:len(message)]) == (field, message)
    assert not TrainingJob.objects.exists()


def test_config_rules_are_the_algorithms_own():
    """grpo_lm reads the group keys by the same rules; an algorithm that declares none (a
    REINFORCE on one rollout per task) may run a group of one; baseline only evaluates."""
    spec = job_spec(seed=0, steps=1)
    project = store_services.project_create(name="config-rules")
    for algorithm in ("examples.reinforce.REINFORCE", "baseline"):
        services.job_create(project=project, agent=spec["agent"], algorithm=algorithm,
                            config={**spec["config"], "group_size": 1},
                            train_dataset=spec["train_dataset"])
    from trainer.algorithms.grpo_lm import GRPOLM
    assert GRPOLM.config_rules["kl_coef"].problem(-0.1) == "must be >= 0, got -0.1"
    assert GRPOLM.config_rules["micro_batch"].problem(0) == "must be >= 1, got 0"


def test_the_same_seed_gives_the_same_checkpoints(monkeypatch):
    sent = capture_sends(monkeypatch)
    shas = []
    for _ in range(2):
        job = drive(services.job_start(job_id=make_job(steps=1).pk), sent)
        shas.append([v.resources["checkpoint"]["sha256"] for v in
                     ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id)
                     .order_by("version")])
    assert shas[0] == shas[1] and len(shas[0]) == 2


def test_the_baseline_only_evaluates(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = drive(services.job_start(job_id=make_job(steps=2, algorithm="baseline").pk), sent)
    assert job.status == JobStatus.SUCCEEDED
    steps = list(job.steps.order_by("n"))
    assert [s.produced_version for s in steps] == [1, 1, 1]
    assert {s.rollout_count for s in steps} == {0}
    assert len({s.metrics["val_reward"] for s in steps}) == 1  # same policy, same greedy score


def test_a_step_training_longer_than_its_lease_keeps_it(monkeypatch):
    """The lease is renewed while the step trains: a second claim in the middle finds the
    step held (without renewal the 1.5 s lease would have run out), and the step is done once."""
    sent = capture_sends(monkeypatch)
    job = make_job(algorithm="tests.test_trainer_services.SlowGRPO", update_sleep=4,
                   step_lease_seconds=1.5)
    job = services.job_start(job_id=job.pk)
    run_rollouts(job)
    step_id = sent.train_steps.pop()
    outcome = []

    def train() -> None:
        try:
            outcome.append(services.step_train(step_id=step_id, worker="slow"))
        finally:
            connection.close()  # this thread's own connection

    trainer = threading.Thread(target=train)
    trainer.start()
    time.sleep(3)
    assert services.step_claim(step_id=step_id, worker="thief") is None
    assert services.steps_sweep().resent == []
    trainer.join()
    step = TrainingStep.objects.get(pk=step_id)
    assert outcome == ["done"]
    assert (step.status, step.attempts, step.worker) == (StepStatus.DONE, 1, "slow")



def test_a_step_whose_train_rollouts_failed_runs_them_again_then_fails_the_job(monkeypatch):
    """Finding 5: a job whose 192 rollouts all failed "succeeded"."""
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(max_step_attempts=2).pk)
    run_rollouts(job, fail=True)
    assert services.step_train(step_id=sent.train_steps.pop(), worker="w") == "retry"
    step = job.steps.get(n=0)
    assert (step.status, step.round, step.attempts) == (StepStatus.ROLLING, 1, 1)
    assert queued_count(job) == step.rollout_count + step.val_rollout_count  # run again
    run_rollouts(job, fail=True)
    assert services.step_train(step_id=sent.train_steps.pop(), worker="w") == "failed"
    job.refresh_from_db()
    assert (job.status, job.steps.get(n=0).status) == (JobStatus.FAILED, StepStatus.FAILED)
    assert "8 of 8 train rollouts failed" in job.error
    assert "could not read its checkpoint" in job.error


def test_a_few_failed_rollouts_do_not_fail_the_step(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(max_failed_rollout_share=0.5).pk)
    claimed = store_services.rollout_dequeue(project=job.project, worker_id="w")
    store_services.attempt_finish(project=job.project, rollout_id=claimed[0].pk,
                                  attempt_id=claimed[1].attempt_id, status="failed", error="x")
    run_rollouts(job)
    assert services.step_train(step_id=sent.train_steps.pop(), worker="w") == "done"


def test_a_paused_job_does_not_advance_until_resumed(monkeypatch):
    """Finding 7: an interrupted job silently advanced inside later unrelated commands."""
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=2).pk)
    run_rollouts(job)
    step_id = sent.train_steps.pop()
    held = services.step_claim(step_id=step_id, worker="w")  # a step in flight at Ctrl+C
    assert services.job_pause(job_id=job.pk).status == JobStatus.PAUSED
    assert services.step_finish(held, services.train_run(held)) == "done"
    assert not job.steps.filter(n=1).exists()  # a paused job plans nothing
    assert services.steps_sweep(force=True).resent == []
    job = services.job_resume(job_id=job.pk)
    assert job.status == JobStatus.RUNNING and job.steps.filter(n=1).exists()
    job = drive(job, sent)
    assert job.status == JobStatus.SUCCEEDED


def test_a_redelivered_train_step_takes_over_at_once_from_a_dead_worker_of_its_node(monkeypatch):
    """Fast takeover: a training worker killed mid-step left its step for the whole lease
    (120 s by default) although Celery redelivered its message at once."""
    import os
    import subprocess

    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    step_id = sent.train_steps.pop()
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert services.step_claim(step_id=step_id, worker=f"celery:training@n1:{dead.pid}")
    assert services.step_claim(step_id=step_id, worker="celery:training@n2:1") is None
    heir = services.step_claim(step_id=step_id, worker=f"celery:training@n1:{os.getpid()}")
    assert heir is not None and heir.attempts == 2


def test_reclaim_takes_back_attempts_of_gone_processes_not_of_a_worker_started_since(
        monkeypatch):
    """`train_resume --reclaim` after a restart: a worker started again before the resume had
    already claimed rollouts; reclaim took those attempts back too (every live attempt of the
    job), throwing its work away and spending the rollouts' retries."""
    import os
    import socket
    import subprocess

    from runners import services as runners_services

    capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    node = "rollouts@reclaim-here"
    runners_services.celery_worker_register(
        name=node, hostname=socket.gethostname(), pid=os.getpid(), queues=["rollouts"],
        concurrency=2, hardware={})
    dead = subprocess.Popen(["true"])
    dead.wait()
    holders = {"gone": f"celery:{node}:{dead.pid}", "running": f"celery:{node}:{os.getpid()}",
               "elsewhere": f"celery:rollouts@another-machine:{os.getpid()}",
               "remote": "runner-7"}
    attempts = {}
    for name, holder in holders.items():
        rollout, attempt = store_services.rollout_dequeue(project=job.project, worker_id=holder)
        attempts[name] = (rollout.pk, attempt.attempt_id)
    services.job_resume(job_id=job.pk, reclaim=True)
    status = {name: store_selectors.attempt_get(project=job.project, rollout_id=r,
                                                attempt_id=a).status
              for name, (r, a) in attempts.items()}
    # only the process seen running here keeps its attempt; what cannot be seen from here
    # (another machine, a remote runner) is taken back, as the caller says they are gone
    assert status == {"gone": "unresponsive", "running": "preparing",
                      "elsewhere": "unresponsive", "remote": "unresponsive"}


def test_a_train_step_message_of_a_deleted_job_does_nothing(monkeypatch):
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    step_id = sent.train_steps.pop()
    job.delete()
    assert services.step_train(step_id=step_id, worker="w") == "skipped"
    assert services.step_check_ready(step_id=step_id) is False


def test_ctrl_c_in_the_middle_of_a_read_still_pauses_the_job(monkeypatch, settings):
    """A Ctrl+C lands wherever the main thread is, often inside a query: the interrupt is
    raised as the driver call returns, past Django's cleanup (KeyboardInterrupt is not an
    Exception), and leaves the statement open. On SQLite an open statement holds a read
    snapshot, and once a worker has written since, the pause's write on that connection
    failed at once with "database is locked" (seen in CI: exit 1 and a traceback instead
    of 130 and the resume hint)."""
    from django.db import connections

    from trainer import progress
    from trainer.management.commands.train import run_followed

    settings.EMBEDDED_WORKERS = False
    job = make_job(steps=2)

    def follow_interrupted_mid_read(job_id, **kwargs):
        cursor = connection.cursor()
        cursor.execute("SELECT id FROM store_rollout")  # rows left unread: the read is open

        def worker_writes():
            TrainingStep.objects.filter(job_id=job_id).update(updated_at=timezone.now())
            connections.close_all()

        writer = threading.Thread(target=worker_writes)
        writer.start()
        writer.join()
        raise KeyboardInterrupt

    monkeypatch.setattr(progress, "follow", follow_interrupted_mid_read)
    with pytest.raises(KeyboardInterrupt):
        run_followed(job.pk, start=True)
    assert TrainingJob.objects.get(pk=job.pk).status == JobStatus.PAUSED


def test_a_step_replanned_while_it_is_checked_is_not_made_ready(monkeypatch):
    """The check reads the step outside any lock; a cancel and resume in between plans a new
    round with a new group (0 finished). The move to ready must be for the round it read."""
    capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    step = job.steps.get()
    TrainingStep.objects.filter(pk=step.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    open_ids = services.selectors.step_open_rollout_ids

    def replan_first(*, step):  # runs between the check's read and its move
        with transaction.atomic():
            TrainingJob.objects.select_for_update().get(pk=job.pk)
            services._step_plan(job, GRPO(services.job_config(job)), n=0,
                                resources_version=step.resources_version, round=step.round + 1)
        return open_ids(step=step)

    monkeypatch.setattr(services.selectors, "step_open_rollout_ids", replan_first)
    assert services.step_check_ready(step_id=step.pk) is False
    step.refresh_from_db()
    assert (step.status, step.round) == (StepStatus.ROLLING, 1)
    assert step.group.finished == 0 and step.group.total == 12


def test_a_failing_retention_does_not_make_a_finished_step_lost(monkeypatch):
    """After-commit work follows one policy (robust, as in runners): the step committed, so
    an error in the retention that follows is logged, not reported as the step's outcome."""
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    run_rollouts(job)

    def broken(_job):
        raise RuntimeError("retention exploded")

    monkeypatch.setattr(services, "_retain", broken)
    step_id = sent.train_steps.pop()
    assert services.step_train(step_id=step_id, worker="w") == "done"
    assert TrainingStep.objects.get(pk=step_id).status == StepStatus.DONE


def test_an_evaluation_only_step_whose_rollouts_all_failed_fails_its_job(monkeypatch):
    """Issue 26 finding 2: `max_failed_rollout_share` counted train rollouts only, so a
    baseline job whose 40 of 40 rollouts failed "succeeded"."""
    sent = capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job(steps=1, algorithm="baseline",
                                             max_step_attempts=2).pk)
    for _ in range(2):
        run_rollouts(job, fail=True)
        result = services.step_train(step_id=sent.train_steps.pop(), worker="w")
    assert result == "failed"
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert "4 of 4 validation rollouts failed" in job.error
    assert "could not read its checkpoint" in job.error


@pytest.mark.parametrize(("config", "field", "message"), [
    ({"loss_tokens": "some"}, "config.loss_tokens", "must be one of signal, all, got 'some'"),
    ({"target_kl": 0}, "config.target_kl", "must be > 0, got 0"),
])
def test_grpo_lm_refuses_its_own_settings_that_cannot_work(config, field, message):
    from examples.llm_cipher import job_spec as llm_spec

    spec = llm_spec(seed=0, steps=1)
    with pytest.raises(InvalidInput) as raised:
        services.job_create(
            project=store_services.project_create(name="grpo-lm-settings"),
            agent=spec["agent"], algorithm="grpo_lm", config={**spec["config"], **config},
            train_dataset=spec["train_dataset"])
    assert (raised.value.field, raised.value.message) == (field, message)
