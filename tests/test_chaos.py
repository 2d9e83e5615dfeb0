"""Chaos at default settings: a stream of rollouts through real Celery processes (a prefork
rollout worker, a control worker, beat) while faults hit them one after another. Asserts that
nothing is lost, stuck or duplicated; prints how long each fault took to recover from (run
with -s to see the figures; tests never assert on speed).

Faults: kill -9 of a worker child mid-rollout (Celery redelivers its message: the fast
takeover), a broker this process cannot reach for a few seconds (messages owed by their rows,
re-sent by the next reconcile), kill -9 of the whole worker and a new one started.
Postgres and the broker themselves are shared by the development machine's test runs, so
they are not restarted here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter

import pytest
from django.db.models import Count, Q

from runners import services as runner_services
from store.models import Rollout
from store.services import RolloutSpec
from store.statemachine import ROLLOUT_TERMINAL
from tests.celery_fixtures import use_broker, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow,
              pytest.mark.parametrize("broker", ["rabbitmq", "redis"], indirect=True)]
DEFAULTS = {"RUNNERS_HEARTBEAT_SECONDS": "5"}  # the settings' default, not the tests' 0.5 s
CONFIG = {"max_attempts": 3, "retry_condition": ["timeout", "unresponsive"]}  # the trainer's
DOWN = "redis://127.0.0.1:18603/0"


class Stream:
    """Enqueues a few short rollouts every tick, as an algorithm feeding runners would."""

    def __init__(self, project) -> None:
        self.project = project
        self.ids: list[str] = []

    def tick(self, n: int = 2) -> None:
        rollouts = runner_services.rollouts_enqueue_for_celery(
            project=self.project, agent="tests.celery_agents:looping_agent",
            specs=[RolloutSpec(input={"seconds": 0.3}, config=CONFIG) for _ in range(n)],
        )
        self.ids += [r.pk for r in rollouts]

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()
            time.sleep(0.5)

    def finished(self) -> int:
        return Rollout.objects.filter(pk__in=self.ids, status__in=ROLLOUT_TERMINAL).count()

    def all_finished(self) -> bool:
        return self.finished() == len(self.ids)


def recovery_seconds(project, began: float, fault_at: float,
                     window: float = 3.0) -> float | None:
    """Seconds from `fault_at` until the completion rate (over `window` s) is back to 90% of
    its rate in the 15 s before the fault `began`."""
    ends = sorted(t.timestamp() for t in Rollout.objects.filter(
        project=project, end_time__isnull=False).values_list("end_time", flat=True))
    before = [t for t in ends if began - 15 <= t < began]
    rate = len(before) / 15
    t = fault_at
    while t < (ends[-1] if ends else fault_at):
        if sum(1 for e in ends if t <= e < t + window) / window >= 0.9 * rate:
            return max(0.0, t - fault_at)
        t += 0.5
    return None


def test_nothing_is_lost_stuck_or_duplicated_and_each_fault_recovers(
    project, broker_url, sending_to, celery_workers, capsys
):
    rollouts = celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=2,
                              env=DEFAULTS, name="chaos-rollouts")
    celery_workers(queues=["control"], broker_url=broker_url, concurrency=1, env=DEFAULTS,
                   name="chaos-control")
    celery_workers.beat(broker_url=broker_url, env=DEFAULTS)
    stream = Stream(project)
    stream.run_for(20)  # the pre-fault rate
    faults: list[tuple[str, float, float]] = []  # name, when it began, when it was over

    child = _a_busy_child(rollouts.pid, stream)
    began = time.time()
    os.kill(child, signal.SIGKILL)
    faults.append(("kill -9 of a rollout worker child", began, time.time()))
    stream.run_for(30)

    began = time.time()
    with use_broker(DOWN):
        stream.run_for(5)
    faults.append(("broker unreachable for 5 s (publishing side)", began, time.time()))
    stream.run_for(30)

    _a_busy_child(rollouts.pid, stream)
    began = time.time()
    rollouts.kill()
    # Restarted under its node name, as a supervisor restarts a worker.
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=2, env=DEFAULTS,
                   name="chaos-rollouts")
    faults.append(("kill -9 of the rollout worker mid-rollout, restarted", began, time.time()))
    stream.run_for(30)
    wait_until(stream.all_finished, timeout=400, interval=1,
               message=f"{len(stream.ids) - stream.finished()} rollouts never finished")

    by_status = Counter(Rollout.objects.filter(pk__in=stream.ids)
                        .values_list("status", flat=True))
    duplicated = Rollout.objects.filter(pk__in=stream.ids).annotate(
        wins=Count("attempts", filter=Q(attempts__status="succeeded"))).filter(wins__gt=1)
    with capsys.disabled():
        print(f"\nchaos: {len(stream.ids)} rollouts {dict(by_status)}; lost 0, stuck 0, "
              f"duplicated {duplicated.count()}")
        for name, began, over in faults:
            seconds = recovery_seconds(project, began, over)
            shown = "not within the run" if seconds is None else f"{seconds:.1f} s"
            print(f"  {name}: the rate back to 90% {shown} after the fault was over; every "
                  f"rollout enqueued until then finished {_all_done_after(project, over):.1f} s "
                  f"after it")
    assert by_status == {"succeeded": len(stream.ids)}
    assert not duplicated.exists()


def _all_done_after(project, fault_at: float) -> float:
    ends = Rollout.objects.filter(project=project, start_time__lt=_aware(fault_at)).values_list(
        "end_time", flat=True)
    return max(0.0, max(e.timestamp() for e in ends) - fault_at)


def _aware(seconds: float):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, tz=UTC)


def _a_busy_child(parent: int, stream: Stream) -> int:
    """A pool process of the worker that is running a rollout now (the stream goes on)."""
    def children() -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
        return [int(pid) for pid in out.stdout.split()]

    busy: list[int] = []

    def found() -> bool:
        stream.tick(1)
        workers = {a for a in Rollout.objects.filter(status__in=["preparing", "running"])
                   .values_list("latest_attempt__worker_id", flat=True) if a}
        busy[:] = [pid for pid in children() if any(w.endswith(f":{pid}") for w in workers)]
        return bool(busy)

    wait_until(found, timeout=30, interval=0.1, message="no child was running a rollout")
    return busy[0]
