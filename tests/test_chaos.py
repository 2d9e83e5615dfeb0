"""Chaos at default settings: a stream of rollouts through real Celery processes (a prefork
rollout worker, a control worker, beat) while faults hit them one after another. Asserts that
nothing is lost, stuck or duplicated; prints how long each fault took to recover from (run
with -s to see the figures; tests never assert on speed).

Faults: kill -9 of a worker child mid-rollout (Celery redelivers its message: the fast
takeover), a broker this process cannot reach for a few seconds (messages owed by their rows,
re-sent by the next reconcile), kill -9 of the whole worker and a new one started; a Postgres
restart mid-stream (`pg_ctl stop -m immediate`, a few seconds down, started again) on a
throwaway cluster of the test's own (tests/private_postgres.py: the development machine's
shared Postgres is never restarted), with the API answering 503 + Retry-After, never 500,
while it is down; kill -9 of the training worker mid-step during a training job and a new one
started (checkpoint versions gapless, one per step). The broker is shared by the development
machine's test runs, so it is not restarted here.

    .venv/bin/pytest tests/test_chaos.py -s   # the figures per fault
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections import Counter

import httpx
import pytest
from django.db import InterfaceError, OperationalError, connection
from django.db.models import Count, Q

from runners import services as runner_services
from store import services as store_services
from store.models import ResourceVersion, Rollout
from store.services import RolloutSpec
from store.statemachine import ROLLOUT_TERMINAL
from tests.api.conftest import Server
from tests.celery_fixtures import use_broker, wait_until
from tests.private_postgres import manage, private_postgres_cluster, using_database
from tests.test_trainer_celery import checkpoint_dir, make_job  # noqa: F401 - a fixture
from trainer import services as trainer_services
from trainer.models import JobStatus, StepStatus

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
BOTH_BROKERS = pytest.mark.parametrize("broker", ["rabbitmq", "redis"], indirect=True)
DEFAULTS = {"RUNNERS_HEARTBEAT_SECONDS": "5"}  # the settings' default, not the tests' 0.5 s
CONFIG = {"max_attempts": 3, "retry_condition": ["timeout", "unresponsive"]}  # the trainer's
DOWN = "redis://127.0.0.1:18603/0"
PG_PORT = 18610  # the throwaway Postgres cluster restarted mid-stream
WEB_PORT = 18611  # the API server on it


class Stream:
    """Enqueues a few short rollouts every tick, as an algorithm feeding runners would."""

    def __init__(self, project) -> None:
        self.project = project
        self.ids: list[str] = []
        self.refused = 0  # ticks the database refused (it was down): the caller tries later

    def tick(self, n: int = 2) -> None:
        try:
            rollouts = runner_services.rollouts_enqueue_for_celery(
                project=self.project, agent="tests.celery_agents:looping_agent",
                specs=[RolloutSpec(input={"seconds": 0.3}, config=CONFIG) for _ in range(n)],
            )
        except (OperationalError, InterfaceError):
            connection.close()  # as Django does at the end of a request that met the error
            self.refused += 1
            return
        self.ids += [r.pk for r in rollouts]

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()
            time.sleep(0.5)

    def outcome(self) -> tuple[Counter, object]:
        """The stream's rollouts by status, and (a queryset) those with two successes."""
        rollouts = Rollout.objects.filter(pk__in=self.ids)
        by_status = Counter(rollouts.values_list("status", flat=True))
        duplicated = rollouts.annotate(
            wins=Count("attempts", filter=Q(attempts__status="succeeded"))).filter(wins__gt=1)
        return by_status, duplicated

    def finished(self) -> int:
        return Rollout.objects.filter(pk__in=self.ids, status__in=ROLLOUT_TERMINAL).count()

    def all_finished(self) -> bool:
        return self.finished() == len(self.ids)


def recovery_seconds(project, began: float, fault_at: float,
                     window: float = 3.0) -> float | None:
    """Seconds from `fault_at` until the completion rate (over `window` s) is back to 90% of
    its rate in the 15 s before the fault `began`."""
    ends = [t.timestamp() for t in Rollout.objects.filter(
        project=project, end_time__isnull=False).values_list("end_time", flat=True)]
    rate = len([t for t in ends if began - 15 <= t < began]) / 15
    return rate_back(ends, fault_at, rate=rate, window=window)


def rate_back(ends: list[float], fault_at: float, *, rate: float,
              window: float) -> float | None:
    """Seconds from `fault_at` until the rate of events at `ends` (over `window` s) is back to
    90% of `rate` (events per second before the fault)."""
    ends = sorted(ends)
    t = fault_at
    while t < (ends[-1] if ends else fault_at):
        if sum(1 for e in ends if t <= e < t + window) / window >= 0.9 * rate:
            return max(0.0, t - fault_at)
        t += 0.5
    return None


@BOTH_BROKERS
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
               message=lambda: f"{len(stream.ids) - stream.finished()} rollouts never finished")

    by_status, duplicated = stream.outcome()
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


class Probe(threading.Thread):
    """Calls the API (enqueue, dequeue, a span batch) in a loop until stopped, as a runner
    and an algorithm would while the database restarts; counts the answers by status."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(name="chaos-probe", daemon=True)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request
        self.client = httpx.Client(base_url=url + "/v1/agl", timeout=30,
                                   headers={"Authorization": f"Bearer {key}"})
        self.answers: Counter = Counter()
        self.bad: list[str] = []  # a 500, or a 503 without Retry-After
        self.halt = threading.Event()

    def run(self) -> None:
        calls = [("/queues/rollouts/enqueue", {"rollouts": [{"input": 1}]}),
                 ("/queues/rollouts/dequeue", {"limit": 1}), ("/spans/batch", {"spans": []})]
        with self.client:
            while not self.halt.is_set():
                for path, body in calls:
                    try:
                        answer = self.client.post(path, json=body)
                    except httpx.HTTPError as error:  # the server itself: never expected
                        self.answers[type(error).__name__] += 1
                        self.bad.append(f"{path}: {error!r}")
                        continue
                    self.answers[answer.status_code] += 1
                    if answer.status_code >= 500 and not (
                            answer.status_code == 503 and answer.headers.get("Retry-After")):
                        self.bad.append(f"{path}: {answer.status_code} {answer.text[:200]}")
                self.halt.wait(0.2)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=60)


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_a_postgres_restart_loses_nothing_and_the_api_answers_503(
    broker_url, sending_to, celery_workers, checkpoint_dir, capsys  # noqa: F811
):
    """The rollout stream, the API and then a training job on a throwaway Postgres of the
    test's own, restarted with `pg_ctl stop -m immediate` (no checkpoint: crash recovery at
    start) mid-stream, and again while a training step trains."""
    with private_postgres_cluster(PG_PORT) as cluster:
        url = cluster.url()
        manage(url, "migrate", "--noinput", "-v0")
        env = {**DEFAULTS, "DATABASE_URL": url, "CHECKPOINT_DIR": str(checkpoint_dir)}
        server = Server(WEB_PORT, workers=1, threads=4, env={"DATABASE_URL": url}).start()
        try:
            with using_database(url):
                for queues in (["rollouts"], ["training"], ["control"]):
                    celery_workers(queues=queues, broker_url=broker_url, env=env,
                                   concurrency=2 if queues == ["rollouts"] else 1,
                                   name=f"pg-{queues[0]}")
                celery_workers.beat(broker_url=broker_url, env=env)
                _postgres_restart_mid_stream(cluster, server, capsys)
                _postgres_restart_mid_step(cluster, capsys)
        finally:
            server.stop()


def _restart(cluster, seconds: float, while_down=time.sleep) -> tuple[float, float]:
    """Postgres stopped -m immediate, `while_down(seconds)`, started (crash recovery, then
    accepting connections): (when it stopped, when it was up)."""
    began = time.time()
    cluster.crash()
    while_down(seconds)
    cluster.start()
    connection.close()  # this process's connection died with the server
    return began, time.time()


def _postgres_restart_mid_stream(cluster, server, capsys) -> None:
    project = store_services.project_create(name="chaos-pg")
    probe_project = store_services.project_create(name="chaos-pg-probe")
    key = store_services.api_key_create(project=probe_project, role="admin")[1]
    stream = Stream(project)
    stream.run_for(20)  # the pre-fault rate
    probe = Probe(server.url, key)
    probe.start()
    held: list[str] = []

    def running() -> bool:  # the stop must cut a rollout mid-flight (claimed, not finished)
        stream.tick(1)
        held[:] = Rollout.objects.filter(
            pk__in=stream.ids, status__in=["preparing", "running"]).values_list("pk", flat=True)
        return bool(held)
    wait_until(running, timeout=30, interval=0.2, message="no rollout was running")
    # Down: the stream's enqueues are refused, the probe's answered 503.
    began, over = _restart(cluster, 5, stream.run_for)
    stream.run_for(3)
    probe.stop()
    stream.run_for(27)
    wait_until(stream.all_finished, timeout=400, interval=1,
               message=lambda: f"{len(stream.ids) - stream.finished()} rollouts never finished")
    by_status, duplicated = stream.outcome()
    seconds = recovery_seconds(project, began, over)
    shown = "not within the run" if seconds is None else f"{seconds:.1f} s"
    # Rollouts a worker held just before Postgres went down: their reports met the outage.
    cut = Counter(Rollout.objects.filter(pk__in=held).annotate(tries=Count("attempts"))
                  .values_list("status", "tries"))
    with capsys.disabled():
        print(f"\nchaos, Postgres restart: {len(stream.ids)} rollouts {dict(by_status)}; "
              f"lost 0, stuck 0, duplicated {duplicated.count()}; "
              f"{stream.refused} enqueue ticks refused while it was down")
        print(f"  Postgres stopped -m immediate for {over - began:.1f} s and started: the rate "
              f"back to 90% {shown} after it was up; the rollouts held by a worker just "
              f"before the stop, (status, attempts): {dict(cut)}; API answers during the "
              f"restart {dict(probe.answers)}")
    assert not probe.bad, probe.bad[:5]
    assert by_status == {"succeeded": len(stream.ids)}
    assert not duplicated.exists()


STEPS = 9
CHILD_KILLED, WORKER_KILLED = 3, 6  # the steps whose training is cut by each fault


def _start_job(steps: int):
    job = make_job(steps=steps, algorithm="tests.trainer_algorithms.SlowGRPO",
                   update_seconds=2)
    return trainer_services.job_start(job_id=job.pk)


def _in_training(job, n: int):
    """Step `n` once it trains (half a second into its 2 s update)."""
    def check() -> bool:
        step = job.steps.filter(n=n).first()
        return step is not None and step.status == StepStatus.TRAINING
    wait_until(check, timeout=300, interval=0.1,
               message=lambda: f"step {n} never trained: {list(job.steps.values('n', 'status'))}")
    time.sleep(0.5)
    return job.steps.get(n=n)


def _job_figures(job, label: str, faults: list[tuple[str, int, float]], capsys) -> list:
    """Waits for the job to finish, prints per fault (name, step cut, when) how long its step
    took to be redone and the step rate to come back, checks what must hold whatever the
    timing (nothing lost or duplicated, checkpoints gapless and one per step); its steps."""
    def finished() -> bool:
        job.refresh_from_db()
        return job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)
    wait_until(finished, timeout=400, interval=0.5,
               message=lambda: f"job did not finish: {list(job.steps.values('n', 'status'))}")
    steps = list(job.steps.order_by("n"))
    done = [_epoch(s.timings["done"]) for s in steps]
    first_cut = min(n for _, n, _ in faults)
    period = (done[first_cut - 1] - done[0]) / (first_cut - 1)  # before any fault
    versions = sorted(ResourceVersion.objects.filter(
        resource_set__resources_id=job.resources_id).values_list("version", flat=True))
    rollouts = Rollout.objects.filter(project=job.project)
    by_status = Counter(rollouts.values_list("status", flat=True))
    duplicated = rollouts.annotate(
        wins=Count("attempts", filter=Q(attempts__status="succeeded"))).filter(wins__gt=1)
    with capsys.disabled():
        print(f"\nchaos, training ({label}): job {job.status}, {len(steps)} steps, tries "
              f"{[s.attempts for s in steps]}; checkpoint versions {versions}; rollouts "
              f"{dict(by_status)}, duplicated {duplicated.count()}; a step took "
              f"{period:.1f} s before the faults")
        for name, n, at in faults:
            back = rate_back(done, at, rate=1 / period, window=2 * period)
            shown = "not within the run" if back is None else f"{back:.1f} s"
            print(f"  {name}, step {n}: done {done[n] - at:.1f} s after; the step rate back "
                  f"to 90% {shown} after")
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert [s.status for s in steps] == ["done"] * (len(steps))
    # Gapless, one checkpoint per training step: 1 (the initial one), then one per step.
    training_steps = job.total_steps
    assert versions == list(range(1, training_steps + 2))
    assert [s.produced_version for s in steps[:training_steps]] == list(
        range(2, training_steps + 2))
    assert set(by_status) <= {"succeeded", "cancelled"} and not duplicated.exists()
    return steps


def _postgres_restart_mid_step(cluster, capsys) -> None:
    job = _start_job(steps=6)
    _in_training(job, 3)
    began, over = _restart(cluster, 5)
    _job_figures(job, "Postgres restart", [
        (f"Postgres stopped -m immediate for {over - began:.1f} s mid-step and started "
         "(from when it was up)", 3, over)], capsys)


@BOTH_BROKERS
def test_a_training_worker_killed_mid_step_is_replaced_and_the_job_goes_on(
    broker_url, sending_to, celery_workers, checkpoint_dir, capsys  # noqa: F811
):
    """A training job at default settings (the 120 s step lease, the 5 s heartbeat), two
    faults while a step trains: kill -9 of the pool process training it (Celery's worker
    forks another), later kill -9 of the whole training worker and a new one started under
    its node name, as a supervisor does."""
    env = {**DEFAULTS, "CHECKPOINT_DIR": str(checkpoint_dir)}
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=2, env=env,
                   name="train-rollouts")
    trainer = celery_workers(queues=["training"], broker_url=broker_url, concurrency=1,
                             env=env, name="train-training")
    celery_workers(queues=["control"], broker_url=broker_url, concurrency=1, env=env,
                   name="train-control")
    celery_workers.beat(broker_url=broker_url, env=env)
    job = _start_job(steps=STEPS)
    step = _in_training(job, CHILD_KILLED)
    child_killed = time.time()
    os.kill(int(step.worker.rsplit(":", 1)[1]), signal.SIGKILL)  # "celery:<node>:<pid>"
    _in_training(job, WORKER_KILLED)
    worker_killed = time.time()
    trainer.kill()
    celery_workers(queues=["training"], broker_url=broker_url, concurrency=1, env=env,
                   name="train-training")
    ready = time.time() - worker_killed
    steps = _job_figures(job, broker_url.split(":")[0], [
        ("kill -9 of the pool process training (from the kill)", CHILD_KILLED, child_killed),
        (f"kill -9 of the training worker, a new one started ({ready:.1f} s to ready; from "
         "the kill)", WORKER_KILLED, worker_killed)], capsys)
    assert [s.attempts for s in steps] == [
        2 if s.n in (CHILD_KILLED, WORKER_KILLED) else 1 for s in steps]


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()
