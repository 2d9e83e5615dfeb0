"""Routing a training step by what it needs (job config `resources`, core/devices.py):
the config's check, the claim filter, the waiting reason, and real Celery training workers
whose registered devices (WORKERS_CUDA_DEVICES: this machine has no GPU) differ."""

from __future__ import annotations

import html
import json

import pytest
from django.core.management import call_command

from core import devices
from core.devices import GIB, Resources
from examples.cipher import job_spec
from runners import services as runners_services
from store.errors import InvalidInput
from store.models import Project
from tests.celery_fixtures import use_broker, wait_until
from trainer import selectors, services
from trainer.models import JobStatus, StepStatus

L4 = {"name": "NVIDIA L4", "total_memory": 24 * GIB}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "total_memory": 80 * GIB}
H100 = {"name": "NVIDIA H100 80GB HBM3", "total_memory": 80 * GIB}


def test_parse_names_the_bad_field():
    assert devices.resources_parse(None) == Resources()
    assert devices.resources_parse({"gpus": 2, "gpu_memory_gb": 40, "gpu_type": "A100"}) == \
        Resources(2, 40.0, "A100")
    for value, field, message in [
        ({"gpus": -1}, "resources.gpus", "integer from 0 to 64"),
        ({"gpus": True}, "resources.gpus", "integer"),
        ({"gpu_memory_gb": "40"}, "resources.gpu_memory_gb", "number of GB"),
        ({"gpu_type": ["A100", "H100"]}, "resources.gpu_type", "mixed types are refused"),
        ({"gpu_type": 3}, "resources.gpu_type", "must be a string"),
        ({"gpu": 1}, "resources.gpu", "unknown field"),
        ([1], "resources", "must be an object"),
    ]:
        with pytest.raises(devices.ResourcesError, match=message) as error:
            devices.resources_parse(value)
        assert error.value.field == field


def test_fits_counts_devices_of_one_type_with_the_memory():
    need = Resources(gpus=2, gpu_memory_gb=40)
    assert devices.fits([A100, A100], need)
    assert not devices.fits([A100], need)
    assert not devices.fits([L4, L4], need)  # too small
    assert not devices.fits([A100, H100], need)  # two GPUs, but of two types
    assert devices.fits([L4, A100, H100, H100], need)
    assert devices.fits([H100], Resources(gpu_type="h100"))
    assert not devices.fits([A100], Resources(gpu_type="H100"))
    assert not devices.fits([], Resources(gpus=1))
    assert devices.fits([], Resources())


def test_unmet_reason_says_what_is_needed_and_what_the_live_workers_have():
    need = Resources(gpus=2, gpu_memory_gb=40)
    assert devices.unmet_reason(need, [("training@a", [L4])]) == (
        "needs 2 GPUs with >= 40 GB; live training workers: training@a: 1 x 24 GB NVIDIA L4")
    assert devices.unmet_reason(need, []) == "needs 2 GPUs with >= 40 GB; no live training worker"
    assert devices.unmet_reason(need, [("a", [L4]), ("b", [A100, A100])]) is None


def test_override_of_the_registered_devices():
    assert devices.parse_override(None) is None
    assert devices.parse_override("[]") == []
    assert devices.parse_override('[{"name": "NVIDIA L4", "memory_gb": 24}]') == [
        {"index": 0, "name": "NVIDIA L4", "total_memory": 24 * GIB}]
    for raw in ("{", '{"name": "x"}', '[{"memory_gb": 2}]', '[{"name": "x", "memory_gb": -1}]'):
        with pytest.raises(ValueError):
            devices.parse_override(raw)


def create(resources, **config):
    spec = job_spec(seed=1, steps=1)
    return services.job_create(
        project=Project.objects.get_or_create(name="routing")[0], agent=spec["agent"],
        algorithm="grpo", train_dataset=spec["train_dataset"],
        val_dataset=spec["val_dataset"][:4],
        config={**spec["config"], "tasks_per_step": 2, "group_size": 4,
                "resources": resources, **config})


@pytest.mark.django_db
def test_job_create_refuses_bad_resources_with_the_field_named():
    with pytest.raises(InvalidInput, match="config.resources.gpu_type: one job's GPUs are one "
                                           "type .* mixed types are refused"):
        create({"gpus": 2, "gpu_type": ["A100", "H100"]})
    with pytest.raises(InvalidInput, match="config.resources.gpu_memory_gb: must be a number"):
        create({"gpu_memory_gb": "lots"})
    with pytest.raises(InvalidInput, match="config.resources.gpus: each of the 2 ranks of a "
                                           "node takes one GPU"):
        create({"gpus": 1}, world_size=2)
    assert create({"gpus": 2}, world_size=2).config["resources"] == {"gpus": 2}


@pytest.mark.django_db
def test_a_worker_without_the_devices_does_not_claim_the_step(admin_client):
    job = create({"gpus": 1, "gpu_memory_gb": 40})
    step = job.steps.create(n=0, status=StepStatus.READY, resources_version=1)
    job.status = JobStatus.RUNNING
    job.save()
    assert services.step_claim(step_id=step.pk, worker="celery:small@h:1",
                               worker_devices=[L4]) is None
    step.refresh_from_db()
    assert (step.status, step.attempts, step.worker) == (StepStatus.READY, 0, "")
    reason = selectors.step_waiting_reason(step=step, workers=[("small@h", [L4])])
    assert reason == ("needs 1 GPU with >= 40 GB; live training workers: small@h: "
                      "1 x 24 GB NVIDIA L4")
    # The job page reads the registry: one live training worker with 24 GB.
    runners_services.celery_worker_register(
        name="small@h", hostname="h", pid=1, queues=["training"], concurrency=1,
        hardware={"cuda_devices": [L4]})
    page = admin_client.get(f"/jobs/{job.pk}/").content.decode()
    assert f"Step 0 is waiting: {html.escape(reason)}" in page
    claimed = services.step_claim(step_id=step.pk, worker="celery:big@h:2",
                                  worker_devices=[A100])
    assert claimed is not None and claimed.worker == "celery:big@h:2"
    assert selectors.step_waiting_reason(step=claimed, workers=[]) is None  # training now


def step_of(job):
    return job.steps.order_by("n").first()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_routing_by_need_with_real_training_workers(rabbitmq_url, celery_workers, tmp_path,
                                                     settings, capsys):
    """A training worker registered with 1 x 24 GB never trains the step that needs 40 GB:
    while it is the only one, the step waits with the reason (train_show, queue_watch); a
    worker with 80 GB that starts then trains every step of the job."""
    path = tmp_path / "checkpoints"
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(path)}}}
    env = {"CHECKPOINT_DIR": str(path)}
    small = json.dumps([{"name": "NVIDIA L4", "memory_gb": 24}])
    big = json.dumps([{"name": "NVIDIA A100-SXM4-80GB", "memory_gb": 80}])
    celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2, env=env)
    celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, name="small",
                   env={**env, "WORKERS_CUDA_DEVICES": small})
    with use_broker(rabbitmq_url):
        job = create({"gpus": 1, "gpu_memory_gb": 40}, resend_seconds=1)
        services.job_start(job_id=job.pk)

        def declined() -> bool:
            services.steps_sweep()
            step = step_of(job)
            return step.status == StepStatus.READY and step.sent_at is not None and \
                "left for another worker" in small_worker.log()

        small_worker = celery_workers.started[-1]
        wait_until(declined, timeout=180, message="step 0 never reached the small worker")
        # Sent again (resend_seconds=1) and declined again: the small worker never claims it.
        def declined_again() -> bool:
            services.steps_sweep()
            return small_worker.log().count("left for another worker") >= 2

        wait_until(declined_again, timeout=60, message="step 0 was not sent again")
        step = step_of(job)
        assert (step.status, step.attempts, step.worker) == (StepStatus.READY, 0, "")
        reason = ("needs 1 GPU with >= 40 GB; live training workers: "
                  f"small@{_host()}: 1 x 24 GB NVIDIA L4")
        assert selectors.waiting_steps(job_id=job.pk) == [(step, reason)]
        call_command("train_show", str(job.pk))
        assert f"waiting: {reason}" in capsys.readouterr().out
        call_command("queue_watch", "routing", "--once")
        assert f"training step 0 of job {job.pk}: waiting: {reason}" in capsys.readouterr().out

        celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, name="big",
                       env={**env, "WORKERS_CUDA_DEVICES": big})

        def finished() -> bool:
            services.steps_sweep()
            job.refresh_from_db()
            return job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)

        wait_until(finished, timeout=300, message="the job did not finish")
    assert job.status == JobStatus.SUCCEEDED, job.error
    workers = list(job.steps.values_list("worker", flat=True))
    assert workers and all(w.startswith(f"celery:big@{_host()}:") for w in workers), workers
    assert selectors.waiting_steps(job_id=job.pk) == []


def _host() -> str:
    import socket

    return socket.gethostname()
