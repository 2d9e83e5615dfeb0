"""A Celery worker restarted under its node name takes over, at start, the attempts its dead
processes held (Redis keeps a killed worker's unacknowledged messages until the visibility
timeout, so no redelivery triggers the takeover there)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from core import control
from core import processes as control_processes
from runners import services
from runners.models import CeleryWorker
from store import services as store_services
from store.models import Rollout
from store.services import RolloutSpec

pytestmark = pytest.mark.django_db


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _held_by(project, worker_id: str, **config) -> Rollout:
    rollout = services.rollouts_enqueue_for_celery(
        project=project, agent="examples.hello:agent",
        specs=[RolloutSpec(input="x", config={"max_attempts": 2, "retry_condition": ["unresponsive"], **config})])[0]
    claimed = store_services.rollout_claim(project=project, rollout_id=rollout.pk,
                                           worker_id=worker_id)
    assert claimed is not None
    return rollout


def test_a_restarted_worker_takes_over_from_its_dead_processes_at_once(project, monkeypatch):
    sent = []
    monkeypatch.setattr(services, "dispatches_send", sent.extend)
    dead = _held_by(project, f"celery:node@h:{_dead_pid()}")
    alive = _held_by(project, f"celery:node@h:{os.getppid()}")  # a live process: its own
    other_node = _held_by(project, f"celery:other@h:{_dead_pid()}")  # not this node's
    taken = services.celery_worker_take_over(name="node@h", pid=os.getpid())
    assert taken == [dead.pk]
    statuses = dict(Rollout.objects.values_list("pk", "status"))
    assert statuses[dead.pk] == "requeuing"
    assert statuses[alive.pk] == statuses[other_node.pk] == "preparing"
    dead.refresh_from_db()
    assert dead.latest_attempt.status == "unresponsive"
    assert [d.rollout_id for d in sent] == [dead.pk]  # its message goes out now


def test_a_rollout_without_tries_left_fails_and_gets_no_message(project, monkeypatch):
    sent = []
    monkeypatch.setattr(services, "dispatches_send", sent.extend)
    dead = _held_by(project, f"celery:node@h:{_dead_pid()}", max_attempts=1)
    assert services.celery_worker_take_over(name="node@h", pid=os.getpid()) == [dead.pk]
    assert Rollout.objects.get(pk=dead.pk).status == "failed" and sent == []


@pytest.mark.django_db(transaction=True)
def test_a_restarted_training_worker_takes_its_dead_processes_steps_back(
        monkeypatch, tmp_path, settings):
    from tests.test_trainer_services import make_job
    from tests.trainer_helpers import capture_sends, run_rollouts
    from trainer import services as trainer_services

    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    sent = capture_sends(monkeypatch)
    job = trainer_services.job_start(job_id=make_job().pk)
    run_rollouts(job)
    step = job.steps.get()
    sent.train_steps.clear()
    assert trainer_services.step_claim(step_id=step.pk, worker=f"celery:node@h:{_dead_pid()}")
    assert trainer_services.step_claim(step_id=step.pk, worker="celery:other@h:1") is None
    counts = control.run_takeovers("node@h", os.getpid())
    assert counts["training_steps"] == 1 and counts["rollouts"] == 0
    assert sent.train_steps == [step.pk]  # sent again now, not after the lease
    assert trainer_services.step_claim(step_id=step.pk, worker="celery:other@h:1") is not None


def _zombie() -> int:
    """A child that has exited and is not reaped yet, as a killed worker's pool processes are
    until whoever inherits them reaps them."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    for _ in range(500):
        with open(f"/proc/{pid}/stat", "rb") as stat:
            if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return pid
        time.sleep(0.01)
    raise AssertionError("the child never became a zombie")


def test_a_zombie_is_dead_and_its_work_is_taken_over(project, monkeypatch):
    """A worker killed with -9 with its pool leaves zombies for a while (the init of this
    machine reaps them 1.4 s later); a worker restarted meanwhile took them for alive and
    left a training step to its 120 s lease (tests/test_chaos.py, Redis)."""
    monkeypatch.setattr(services, "dispatches_send", lambda dispatches: None)
    zombie = _zombie()
    try:
        assert not control_processes.process_alive(zombie)
        assert control_processes.process_alive(os.getpid())
        held = _held_by(project, f"celery:node@h:{zombie}")
        assert services.celery_worker_take_over(name="node@h", pid=os.getpid()) == [held.pk]
    finally:
        os.waitpid(zombie, 0)


def test_a_rollout_worker_starting_or_lost_sends_the_oldest_queued_messages_again(
    project, monkeypatch, django_capture_on_commit_callbacks
):
    """Issue 23: messages a killed worker had received but not claimed stay with Redis until
    the visibility timeout; they were the oldest the queue held, so those are sent again, as
    many as the worker could hold (concurrency x prefetch)."""
    sent = []
    monkeypatch.setattr(services, "dispatches_send", sent.extend)
    queued = services.rollouts_enqueue_for_celery(
        project=project, agent="examples.hello:agent",
        specs=[RolloutSpec(input=i) for i in range(3)])
    for name, queues in (("node@h", ["rollouts"]), ("gpu@h", ["training"])):
        services.celery_worker_register(name=name, hostname="h", pid=os.getpid(), queues=queues,
                                        concurrency=2, hardware={})
    with django_capture_on_commit_callbacks(execute=True):
        services.celery_worker_take_over(name="gpu@h", pid=os.getpid())
    assert sent == []  # a worker that serves no rollouts held none of their messages
    with django_capture_on_commit_callbacks(execute=True):
        services.celery_worker_take_over(name="node@h", pid=os.getpid())
    assert [d.rollout_id for d in sent] == [r.pk for r in queued[:2]]
    sent.clear()
    CeleryWorker.objects.update(last_heartbeat=timezone.now() - timedelta(seconds=600))
    with django_capture_on_commit_callbacks(execute=True):
        counts = services.control_reconcile()  # both marked lost: the rollouts worker's two
    assert counts["workers_lost"] == 2 and counts["rollouts_resent"] == 2
    # The one never re-sent first, then one of the two re-sent at the same moment.
    assert sent[0].rollout_id == queued[2].pk and len(sent) == 2
    assert sent[1].rollout_id in {queued[0].pk, queued[1].pk}
