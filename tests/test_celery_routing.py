"""Routing by queue, and the worker registry (registration, heartbeat, lost, waiting reasons)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from django.utils import timezone

from runners import hardware, selectors, services
from runners.models import CeleryWorker
from tests.celery_fixtures import wait_until
from tests.celery_tasks import record_node

RABBITMQ = pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
FAST = {"WORKERS_HEARTBEAT_SECONDS": "0.3"}


def lines(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@RABBITMQ
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_training_tasks_only_run_on_workers_serving_training(
    broker_url, sending_to, celery_workers, tmp_path
):
    out = tmp_path / "nodes.txt"
    cpu = celery_workers(queues=["rollouts"], broker_url=broker_url, env=FAST,
                         include=["tests.celery_tasks"], name="cpu")
    wait_until(lambda: CeleryWorker.objects.filter(name__startswith="cpu@").exists(), timeout=30)
    for _ in range(4):
        record_node.delay(path=str(out))
    state = selectors.queue_state(queue="training")
    assert state.waiting_reason == "no live worker serves queue 'training'"

    celery_workers(queues=["training"], broker_url=broker_url, concurrency=1, env=FAST,
                   include=["tests.celery_tasks"], name="gpu")
    wait_until(lambda: len(lines(out)) == 4, timeout=60)
    assert {node.split("@")[0] for node in lines(out)} == {"gpu"}
    assert selectors.queue_state(queue="training").waiting_reason is None

    registered = {w.name.split("@")[0]: w for w in CeleryWorker.objects.all()}
    assert registered["cpu"].queues == ["rollouts"] and registered["gpu"].queues == ["training"]
    assert registered["cpu"].cpu_count >= 1 and "celery" in registered["cpu"].versions
    assert registered["cpu"].pid == cpu.pid
    started = registered["cpu"].last_heartbeat
    wait_until(lambda: CeleryWorker.objects.get(name=registered["cpu"].name).last_heartbeat
               > started, timeout=30, message="no heartbeat")

    cpu.stop()  # a clean shutdown says goodbye
    assert CeleryWorker.objects.get(name=registered["cpu"].name).status == "stopped"
    assert selectors.queue_state(queue="rollouts").waiting_reason is not None


@pytest.mark.django_db
def test_silent_workers_are_marked_lost_and_come_back_on_heartbeat():
    now = timezone.now()
    for name in ("a@h", "b@h"):
        services.celery_worker_register(name=name, hostname="h", pid=1, queues=["rollouts"],
                                        concurrency=2, hardware={}, now=now)
    services.celery_worker_heartbeat(name="b@h", pid=1, now=now + timedelta(seconds=100))
    lost = services.celery_workers_mark_lost(lost_after_seconds=60,
                                             now=now + timedelta(seconds=120))
    assert lost == ["a@h"]
    assert [w.name for w in selectors.celery_workers_live()] == ["b@h"]
    assert services.celery_worker_heartbeat(name="a@h", pid=1)
    assert CeleryWorker.objects.get(name="a@h").status == "alive"
    assert not services.celery_worker_heartbeat(name="a@h", pid=2)  # another process's name


@pytest.mark.django_db
def test_cuda_work_waits_with_a_reason_until_a_cuda_worker_serves_training():
    services.celery_worker_register(name="cpu@h", hostname="h", pid=1, queues=["training"],
                                    concurrency=1, hardware={"cpu_count": 8})
    state = selectors.queue_state(queue="training", needs_cuda=True)
    assert state.waiting_reason == (
        "no live worker with CUDA serves queue 'training' (1 CPU-only worker(s) do)"
    )
    gpu = {"cuda_devices": [{"index": 0, "name": "H100", "total_memory": 80 * 2**30}]}
    services.celery_worker_register(name="gpu@h", hostname="h", pid=2, queues=["training"],
                                    concurrency=1, hardware=gpu)
    state = selectors.queue_state(queue="training", needs_cuda=True)
    assert state.waiting_reason is None and state.cuda_workers == ["gpu@h"]


def test_cuda_devices_are_read_through_torch(monkeypatch):
    # The one mock: this machine has no GPU.
    class Props:
        name = "NVIDIA H100"
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props)
    assert hardware.cuda_devices() == [
        {"index": 0, "name": "NVIDIA H100", "total_memory": 80 * 2**30},
        {"index": 1, "name": "NVIDIA H100", "total_memory": 80 * 2**30},
    ]


@pytest.mark.django_db
def test_admin_lists_workers_and_says_what_waits(admin_client):
    services.celery_worker_register(name="cpu@h", hostname="h", pid=1, queues=["rollouts"],
                                    concurrency=4, hardware={"cpu_count": 4})
    response = admin_client.get("/admin/runners/celeryworker/", follow=True)
    assert response.status_code == 200
    page = response.content.decode()
    assert "cpu@h" in page
    assert "no live worker serves queue &#x27;training&#x27;" in page
