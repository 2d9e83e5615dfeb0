"""The LLM path distributed, as deployed: `manage.py llm_serve` in its own process, rollouts on
a `celery worker` process, train steps on another, RabbitMQ between them, Postgres as the
store. Agents get their llm resource routed to their attempt with an attempt token."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from examples.llm_cipher import job_spec
from store import services as store_services
from store.models import ResourceVersion, Span
from tests.api.conftest import free_port
from tests.celery_fixtures import ROOT, use_broker, wait_until
from trainer import conventions as c
from trainer import services
from trainer.models import JobStatus

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_an_llm_job_runs_on_worker_processes_and_a_gateway_process(
    rabbitmq_url, celery_workers, celery_worker_env, settings, tmp_path, model_dir
):
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    checkpoints = tmp_path / "checkpoints"
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(checkpoints)}}}
    settings.LLM_GATEWAY_URL = url  # what job_start publishes in the llm resource
    env = {"CHECKPOINT_DIR": str(checkpoints), "LLM_GATEWAY_URL": url,
           "LIGHTNING_MODELS_DIR": str(settings.MODELS_DIR)}
    log = open(tmp_path / "gateway.log", "wb")
    gateway = subprocess.Popen(
        [sys.executable, "manage.py", "llm_serve", "--port", str(port)], cwd=ROOT,
        env={**celery_worker_env, **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _healthy(port), timeout=120, message="llm_serve did not start")
        celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=4, env=env)
        celery_workers(queues=["training"], broker_url=rabbitmq_url, concurrency=1, env=env)
        spec = job_spec(steps=2)
        spec["config"].update({"tasks_per_step": 2, "group_size": 4})
        with use_broker(rabbitmq_url):
            job = services.job_create(
                project=store_services.project_create(name="llm-distributed"),
                agent=spec["agent"], algorithm=spec["algorithm"], config=spec["config"],
                train_dataset=spec["train_dataset"], val_dataset=spec["val_dataset"][:4])
            services.job_start(job_id=job.pk)
            wait_until(lambda: _finished(job), timeout=300,
                       message="the job did not finish")
    finally:
        gateway.terminate()
        gateway.wait(30)
        log.close()
    assert job.status == JobStatus.SUCCEEDED, job.error
    spans = Span.objects.filter(rollout__project=job.project, name=c.LLM_CALL_SPAN)
    # 2 train steps of 8 rollouts and 3 validations of 4, one recorded call each
    assert spans.count() == 2 * 8 + 3 * 4
    assert {s.attributes[c.LLM_VERSION] for s in spans} == {0, 1, 2}
    versions = ResourceVersion.objects.filter(resource_set__resources_id=job.resources_id)
    assert sorted(v.resources["llm"]["version"] for v in versions) == [0, 1, 2]
    assert all(v.resources["llm"]["endpoint"] == url for v in versions)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _finished(job) -> bool:
    services.steps_sweep()
    job.refresh_from_db()
    return job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)
