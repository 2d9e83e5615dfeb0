"""Slots held by attempts the store already ended: recorded, shown (queue_watch, the job page,
/metrics), forgotten when stale; the rollout task's time limits; a wait that ends with rollouts
unfinished exits non-zero. The real-worker behaviour is in test_celery_hung.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from core.publish import Message
from examples.cipher import job_spec
from runners import services as runner_services
from runners.held_slots import HeldSlotRecorder, held_slots, held_slots_forget
from runners.models import HeldSlot
from runners.stopping import Stopper, task_time_limits
from store import services as store_services
from store.services import RolloutSpec
from tests.conftest import claim, enqueue
from tests.trainer_helpers import capture_sends
from trainer import services as trainer_services

pytestmark = pytest.mark.django_db
GAUGE = "lightning_worker_slots_held_by_ended_attempts"


def hold(project) -> HeldSlot:
    rollout, attempt = claim(project)
    HeldSlotRecorder(project.pk, "celery:w1@host:42").mark(
        rollout_id=rollout.pk, attempt_id=attempt.attempt_id)
    return HeldSlot.objects.get(rollout_id=rollout.pk)


def gauge(client, settings) -> float:
    settings.METRICS_TOKEN = "t"
    text = client.get("/metrics", headers={"Authorization": "Bearer t"}).text
    return {s.labels["queue"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == GAUGE}["rollouts"]


def test_a_held_slot_is_shown_until_released_or_stale(project, client, settings):
    enqueue(project, 2)
    assert gauge(client, settings) == 0
    slot = hold(project)
    assert slot.attempt_status == "preparing" and held_slots() == [slot]
    assert gauge(client, settings) == 1
    out = StringIO()
    call_command("queue_watch", project.name, "--once", stdout=out)
    assert "queue rollouts: - (waiting: no live worker serves queue 'rollouts') (1 slots held" \
        in out.getvalue()
    assert f"held: {slot.rollout_id}/{slot.attempt_id} (preparing) on celery:w1@host:42" \
        in out.getvalue()
    HeldSlotRecorder(project.pk, "x").release(rollout_id=slot.rollout_id,
                                              attempt_id=slot.attempt_id)
    assert held_slots() == [] and gauge(client, settings) == 0
    # A process that died leaves its row: no longer counted, then forgotten.
    slot = hold(project)
    HeldSlot.objects.update(seen=timezone.now() - timedelta(seconds=120))
    assert held_slots() == [] and held_slots_forget() == 0
    HeldSlot.objects.update(seen=timezone.now() - timedelta(seconds=3600))
    assert held_slots_forget() == 1


def test_the_job_page_shows_slots_held_by_ended_attempts(staff, project, monkeypatch):
    capture_sends(monkeypatch)
    spec = job_spec(seed=0, steps=2)
    job = trainer_services.job_create(
        project=store_services.project_create(name="held"), agent=spec["agent"],
        algorithm="grpo", config=spec["config"], train_dataset=spec["train_dataset"],
        val_dataset=spec["val_dataset"][:4], name="cipher")
    enqueue(project, 1)
    hold(project)
    html = staff.get(f"/jobs/{job.pk}/").text
    assert "Slots held by ended attempts" in html
    assert '<td class="held-by-ended">1</td>' in html


def test_the_stopper_abandons_a_thread_and_never_exits_outside_a_pool_process():
    release = threading.Event()
    stopper = Stopper(rollout_id="ro-1", attempt_id="at-1", grace=0.05,
                      running=lambda: not release.is_set(), may_exit=False)
    stopper.ended()
    deadline = time.monotonic() + 5
    while not stopper.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stopper.abandoned  # and this process is still here
    stopper.close()
    # An agent that returns within the grace is not given up on.
    quick = Stopper(rollout_id="ro-2", attempt_id="at-2", grace=0.05, running=lambda: True,
                    may_exit=True, before_exit=lambda: pytest.fail("must not exit"))
    quick.ended()
    quick.close()
    time.sleep(0.2)
    assert not quick.abandoned


def test_rollout_tasks_carry_time_limits_from_the_rollout_timeout(project, settings):
    settings.LIGHTNING_SWEEP_SECONDS = 5
    settings.RUNNERS_HEARTBEAT_SECONDS = 5.0
    settings.RUNNERS_STOP_GRACE_SECONDS = 5.0
    assert task_time_limits(None) is None and task_time_limits(0) is None
    assert task_time_limits(10) == (30, 60)
    assert task_time_limits(10_000) == (3600, 3630)  # capped by the global soft limit
    with_timeout, without = store_services.rollout_enqueue_many(project=project, specs=[
        RolloutSpec(input=1, config={"timeout_seconds": 2.5}), RolloutSpec(input=2)])
    messages = [Message(runner_services.RUN_ROLLOUT_TASK,
                        {"project_id": project.pk, "rollout_id": r.pk}, "rollouts")
                for r in (with_timeout, without)]
    assert runner_services.rollout_task_options(messages) == [
        {"soft_time_limit": 23, "time_limit": 53}, {}]


def test_a_wait_that_ends_with_rollouts_queued_exits_non_zero(project, settings):
    """Issue 26: `rollouts_enqueue --wait-timeout 60` exited 0 with {"queuing": 6}. No worker
    runs here (and the messages are never sent: the test's transaction never commits)."""
    out = StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("rollouts_enqueue", project.name, "--agent", "tests.celery_agents:ok_agent",
                     "--count", "6", "--wait", "--wait-timeout", "0.2", stdout=out,
                     stderr=StringIO())
    assert str(caught.value) == (f"the wait ended with 6 of 6 rollouts not finished "
                                 f"(queuing=6); see `queue_watch {project.name}`")
    assert out.getvalue().splitlines()[-1] == '{"queuing": 6}'
