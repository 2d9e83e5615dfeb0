"""The scaling signal (README "Scaling"): per-queue backlog gauges and
lightning_desired_workers, the KEDA file that reads it, and queue_watch showing it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from django.core.management import call_command
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from core.queues import Queue
from core.scaling import desired_workers
from runners import services as runner_services
from runners.models import CeleryWorker
from store import services
from store.services import RolloutSpec
from tests.celery_fixtures import wait_until
from tests.conftest import claim, enqueue
from trainer.models import StepStatus, TrainingJob, TrainingStep

ROOT = Path(__file__).resolve().parent.parent
KEDA_FILE = ROOT / "deploy" / "keda-scaledobjects.yaml"
KEDA_SCHEMA = json.loads((ROOT / "tests" / "schemas" / "keda_scaledobject.schema.json")
                         .read_text())
SLOW_AGENT = "tests.celery_agents:looping_agent"


def test_desired_workers_is_the_ceiling_of_the_backlog_per_worker_within_bounds():
    assert desired_workers(queued=7, running=0, slots_per_worker=2, minimum=0, maximum=20) == 4
    assert desired_workers(queued=3, running=3, slots_per_worker=2, minimum=0, maximum=20) == 3
    assert desired_workers(queued=0, running=0, slots_per_worker=4, minimum=1, maximum=20) == 1
    assert desired_workers(queued=100, running=0, slots_per_worker=4, minimum=1, maximum=5) == 5
    assert desired_workers(queued=1, running=0, slots_per_worker=0, minimum=0, maximum=5) == 1


def _keda_documents() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(KEDA_FILE.read_text()) if doc]


def test_the_keda_file_is_a_valid_scaledobject_per_worker_queue_reading_the_gauge(settings):
    docs = _keda_documents()
    for doc in docs:
        jsonschema.validate(doc, KEDA_SCHEMA)
    by_queue = {}
    for doc in docs:
        (trigger,) = doc["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        # threshold 1 with AverageValue: the HPA's replica count is the gauge's value.
        assert trigger["metadata"]["threshold"] == "1"
        query = trigger["metadata"]["query"]
        assert query.startswith("max(lightning_desired_workers{queue=")
        by_queue[query.split('"')[1]] = doc["spec"]
    assert set(by_queue) == {Queue.ROLLOUTS.value, Queue.TRAINING.value}
    for queue, spec in by_queue.items():
        prefix = f"SCALE_{queue.upper()}_"
        assert spec["minReplicaCount"] == getattr(settings, prefix + "MIN_WORKERS")
        assert spec["maxReplicaCount"] == getattr(settings, prefix + "MAX_WORKERS")


def test_the_schema_refuses_a_misspelt_or_incomplete_scaledobject():
    doc = _keda_documents()[0]
    typo = json.loads(json.dumps(doc))
    typo["spec"]["triggers"][0]["metadata"]["treshold"] = "1"
    missing = json.loads(json.dumps(doc))
    del missing["spec"]["scaleTargetRef"]
    wrong_api = {**doc, "apiVersion": "keda.k8s.io/v1alpha1"}
    for bad in (typo, missing, wrong_api):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, KEDA_SCHEMA)


def _scrape(client) -> dict[tuple[str, str], float]:
    text = client.get("/metrics", headers={"Authorization": "Bearer t"}).text
    return {(s.name, s.labels.get("queue", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(("lightning_queue_", "lightning_desired_workers"))}


def _load(client, queue: str) -> tuple[float, ...]:
    samples = _scrape(client)
    return tuple(samples[(name, queue)] for name in (
        "lightning_queue_queued", "lightning_queue_running", "lightning_queue_slots_live",
        "lightning_desired_workers"))


def _worker(name: str, queues: list[str], concurrency: int) -> CeleryWorker:
    return CeleryWorker.objects.create(name=name, hostname="h", pid=1, queues=queues,
                                       concurrency=concurrency, started_at=timezone.now(),
                                       last_heartbeat=timezone.now())


@pytest.mark.django_db(transaction=True)
def test_the_gauges_follow_the_celery_backlog_and_the_bounds(staff, settings, project):
    client = staff
    settings.METRICS_TOKEN = "t"
    settings.SCALE_ROLLOUTS_SLOTS_PER_WORKER = 0
    assert _load(client, "rollouts") == (0, 0, 0, 1)  # SCALE_ROLLOUTS_MIN_WORKERS
    _worker("rollouts@a", ["rollouts"], 2)
    _worker("rollouts@b", ["rollouts"], 2)
    specs = [RolloutSpec(input={"i": i}) for i in range(7)]
    rollouts = services.rollout_enqueue_many(project=project, specs=specs)
    services.rollout_dispatch_set(project=project, rollout_ids=[r.pk for r in rollouts],
                                  dispatch="celery", target="x:y")
    enqueue(project, 5)  # a remote runner's rollouts: not the Celery workers' to scale for
    assert _load(client, "rollouts") == (12 - 5, 0, 4, 4)  # ceil(7 / 2)
    for _ in range(3):
        claim(project)  # highest priority then oldest: three of the Celery ones
    assert _load(client, "rollouts") == (4, 3, 4, 4)
    settings.SCALE_ROLLOUTS_MAX_WORKERS = 3
    assert _load(client, "rollouts")[3] == 3
    settings.SCALE_ROLLOUTS_SLOTS_PER_WORKER = 7
    assert _load(client, "rollouts")[3] == 1
    job = TrainingJob.objects.create(project=project, agent="a:b", algorithm="baseline")
    TrainingStep.objects.create(job=job, n=0, status=StepStatus.READY, resources_version=1)
    TrainingStep.objects.create(job=job, n=1, status=StepStatus.TRAINING, resources_version=1)
    assert _load(client, "training") == (1, 1, 0, 2)
    TrainingStep.objects.filter(job=job).update(status=StepStatus.DONE)
    assert _load(client, "training") == (0, 0, 0, 0)  # SCALE_TRAINING_MIN_WORKERS
    page = client.get(f"/jobs/{job.pk}/").text  # the test's client is staff from here
    assert '<td class="desired-workers">1</td>' in page  # rollouts: ceil((4 + 3) / 7)
    out = io.StringIO()
    call_command("queue_watch", project.name, "--once", stdout=out)
    assert "load: 4 queued, 3 running, 4 live slots: 1 worker(s) wanted" in out.getvalue()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_desired_workers_rises_with_a_backlog_and_falls_as_a_real_worker_drains_it(
        client, settings, project, broker_url, sending_to, celery_workers):
    settings.METRICS_TOKEN = "t"
    settings.SCALE_ROLLOUTS_SLOTS_PER_WORKER = 0
    assert _load(client, "rollouts")[3] == 1
    runner_services.rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"i": i, "seconds": 0.3}) for i in range(9)],
        agent=SLOW_AGENT)
    assert _load(client, "rollouts") == (9, 0, 0, 9)  # no live worker: 1 slot per worker
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=3)
    seen = []

    def drained() -> bool:
        seen.append(_load(client, "rollouts"))
        return seen[-1][:2] == (0, 0)

    wait_until(drained, timeout=120, interval=0.1)
    assert _load(client, "rollouts") == (0, 0, 3, 1)
    assert any(slots == 3 and 1 < desired <= 3 for _, _, slots, desired in seen), seen
