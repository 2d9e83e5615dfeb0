"""The training loop through real `celery worker` processes on RabbitMQ: rollouts on the
`rollouts` queue, train steps on the `training` queue, workers killed with SIGKILL."""

from __future__ import annotations

import pytest

from examples.cipher import job_spec
from store import services as store_services
from store.models import ResourceVersion, Rollout
from store.statemachine import ROLLOUT_TERMINAL
from tests.celery_fixtures import use_broker, wait_until
from trainer import selectors, services
from trainer.models import JobStatus, StepStatus, TrainingJob

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def checkpoint_dir(tmp_path, settings):
    path = tmp_path / "checkpoints"
    settings.STORAGES = {
        **settings.STORAGES,
        "checkpoints": {"BACKEND": "django.core.files.storage.FileSystemStorage",
                        "OPTIONS": {"location": str(path)}},
    }
    return path


def make_job(*, steps: int, algorithm: str = "grpo", **config) -> TrainingJob:
    spec = job_spec(seed=1, steps=steps)
    spec["config"].update({"tasks_per_step": 2, "group_size": 4, "val_every": 1, **config})
    return services.job_create(
        project=store_services.project_create(name="trainer-celery"), agent=spec["agent"],
        algorithm=algorithm, config=spec["config"],
        train_dataset=spec["train_dataset"], val_dataset=spec["val_dataset"][:4],
    )


def finished(job: TrainingJob, sweep: bool = False) -> bool:
    if sweep:
        services.steps_sweep()  # celery-beat's part in production
    job.refresh_from_db()
    return job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)


def where(job: TrainingJob) -> str:
    """The job's steps and its unfinished rollouts with their attempts: what a timeout shows."""
    open_rollouts = selectors.job_rollouts(job=job).exclude(status__in=ROLLOUT_TERMINAL)
    rows = open_rollouts.values_list("pk", "status", "latest_attempt__status",
                                     "latest_attempt__worker_id", "dispatched_at")
    return f"steps {list(job.steps.values_list('n', 'status'))}; open rollouts {list(rows)}"


def test_a_killed_training_worker_step_is_sent_again_and_completes_once(
    rabbitmq_url, celery_workers, checkpoint_dir, tmp_path
):
    env = {"CHECKPOINT_DIR": str(checkpoint_dir)}
    marker = tmp_path / "blocked"
    celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2, env=env)
    trainer = celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, env=env)
    with use_broker(rabbitmq_url):
        job = make_job(steps=2, algorithm="tests.trainer_algorithms.BlockOnceGRPO",
                       block_marker=str(marker), step_lease_seconds=2)
        job = services.job_start(job_id=job.pk)
        wait_until(marker.exists, timeout=120, message="step 0 never reached its update")
        trainer.kill()  # SIGKILL mid-step, with the step claimed
        celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, env=env)
        wait_until(lambda: finished(job, sweep=True), timeout=180,
                   message=lambda: f"job did not finish: {where(job)}")
    assert job.status == JobStatus.SUCCEEDED, job.error
    step0 = job.steps.get(n=0)
    assert step0.attempts == 2 and step0.status == StepStatus.DONE
    assert list(job.steps.values_list("n", "status", "produced_version").order_by("n")) == [
        (0, "done", 2), (1, "done", 3), (2, "done", 3),
    ]
    # Exactly once: checkpoint 0 plus one version per training step, no more.
    assert ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id).count() == 3


def test_stopping_every_process_mid_job_then_starting_again_goes_on(
    rabbitmq_url, celery_workers, checkpoint_dir
):
    env = {"CHECKPOINT_DIR": str(checkpoint_dir)}
    start = lambda: [  # noqa: E731
        celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2, env=env),
        celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, env=env),
    ]
    workers = start()
    with use_broker(rabbitmq_url):
        job = services.job_start(job_id=make_job(steps=3).pk)
        wait_until(lambda: job.steps.filter(n=1).exists(), timeout=120,
                   message="step 0 did not finish")
        for worker in workers:
            worker.kill()
        done_before = set(job.steps.filter(status="done").values_list("n", flat=True))
        start()
        services.job_resume(job_id=job.pk, reclaim=True)
        wait_until(lambda: finished(job, sweep=True), timeout=180,
                   message=lambda: f"job did not finish: {where(job)}")
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert 0 in done_before
    steps = list(job.steps.values_list("n", "status", "produced_version").order_by("n"))
    assert steps == [(0, "done", 2), (1, "done", 3), (2, "done", 4), (3, "done", 4)]
    assert ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id).count() == 4


def test_an_async_job_whose_training_worker_is_killed_loses_nothing(
    rabbitmq_url, celery_workers, checkpoint_dir, tmp_path
):
    env = {"CHECKPOINT_DIR": str(checkpoint_dir)}
    marker = tmp_path / "blocked"
    celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2, env=env)
    trainer = celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, env=env)
    with use_broker(rabbitmq_url):
        job = make_job(steps=3, algorithm="tests.trainer_algorithms.BlockOnceGRPO",
                       block_marker=str(marker), step_lease_seconds=2, max_staleness=1,
                       spare_groups=1)
        job = services.job_start(job_id=job.pk)
        wait_until(marker.exists, timeout=120, message="step 0 never reached its update")
        trainer.kill()  # SIGKILL mid-step, with step 0 claimed and step 1's rollouts running
        celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, env=env)
        wait_until(lambda: finished(job, sweep=True), timeout=180,
                   message=lambda: f"job did not finish: {where(job)}")
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.steps.get(n=0).attempts == 2
    steps = list(job.steps.order_by("n"))
    assert [(s.n, s.status, s.produced_version) for s in steps] == [
        (0, "done", 2), (1, "done", 3), (2, "done", 4), (3, "done", 4)]
    assert ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id).count() == 4
    # every train rollout a step trained on (stored, wherever planned) was pinned at most
    # one version behind its step's base, and none was trained on twice
    trained = [i for step in steps[:3] for i in step.trained]
    assert len(trained) == len(set(trained))
    for step in steps[:3]:
        base = steps[step.n - 1].produced_version if step.n else 1
        pins = set(Rollout.objects.filter(pk__in=step.trained)
                   .values_list("resources_version", flat=True))
        assert pins and all(0 <= base - pin <= 1 for pin in pins), (step.n, base, pins)
    # 3 steps x 2 groups trained of the 7 planned (one spare): one left, counted, none open
    assert (job.surplus_groups, job.surplus_rollouts) == (1, 4)
    untrained = selectors.job_rollouts(job=job).filter(mode="train").exclude(pk__in=trained)
    assert untrained.count() == sum(s.stale_rollouts for s in steps) + job.surplus_rollouts
    assert not untrained.exclude(status__in=ROLLOUT_TERMINAL).exists()
