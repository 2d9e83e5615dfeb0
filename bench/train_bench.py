"""Benchmark of the training loop on the cipher example. Prints figures; asserts nothing.

    .venv/bin/python bench/train_bench.py [--steps 10] [--mode both|embedded|distributed]

- embedded: the embedded default (SQLite in a temporary LIGHTNING_DATA_DIR, Celery's in-memory
  transport, in-process workers for `rollouts` and `training`, in-process sweep);
- distributed: Postgres (database `lightning_trainer_bench`, recreated) and RabbitMQ (a private
  vhost, removed afterwards) with 2 worker processes: `celery worker -Q rollouts -c 2` and
  `celery worker -Q training -c 1`.

Figures: steps/minute, rollouts/s over the whole job, and per step the time spent waiting for
rollouts (planned -> all terminal) against the time spent in the train step (ready -> done,
and the pure torch/IO part of it).

    .venv/bin/python bench/train_bench.py --mode world-size [--tasks 8 --group-size 8]

- world-size: one training step's update of the cipher MLP (GRPO, the example's config) on
  samples its policy acted, at world size 1 (in this process, as the worker runs it) and 2
  (trainer/distributed.py: two spawned ranks, gloo on the CPU, rank 0 hands back the state),
  as the training worker sees it: launch, rendezvous, update, hand-back. Prints samples/s of
  each, the scaling efficiency (samples/s at 2 / (2 x samples/s at 1)) and the launch cost
  alone (world size 2 with epochs=0). The median of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PG = "postgres://postgres@127.0.0.1:5432/lightning_trainer_bench"


def child(mode: str, steps: int) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from examples.cipher import job_spec
    from trainer.models import JobStatus

    spec = job_spec(seed=0, steps=steps)
    job_id = _create(spec)
    started = time.perf_counter()
    if mode == "embedded":
        from core.embedded import embedded_workers

        with embedded_workers():
            _run(job_id)
            elapsed = time.perf_counter() - started
    else:
        workers = _start_workers()
        try:
            started = time.perf_counter()
            _run(job_id)
            elapsed = time.perf_counter() - started
        finally:
            for process in workers:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=60)
    _report(mode, job_id, elapsed, JobStatus.SUCCEEDED)


def _create(spec: dict) -> int:
    from store import services as store_services
    from trainer import services

    project = store_services.project_create(name=f"bench-{uuid.uuid4().hex[:8]}")
    return services.job_create(
        project=project, agent=spec["agent"], algorithm="grpo", config=spec["config"],
        train_dataset=spec["train_dataset"], val_dataset=spec["val_dataset"],
    ).pk


def _run(job_id: int) -> None:
    from trainer import services
    from trainer.models import JOB_TERMINAL, TrainingJob

    services.job_start(job_id=job_id)
    while TrainingJob.objects.get(pk=job_id).status not in JOB_TERMINAL:
        time.sleep(0.2)


def _start_workers() -> list[subprocess.Popen]:
    processes = []
    for queue, concurrency in (("rollouts", 2), ("training", 1)):
        log = open(Path(tempfile.gettempdir()) / f"train-bench-{queue}.log", "wb")  # noqa: SIM115
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "lightning_site", "worker", "-Q", queue,
             "-c", str(concurrency), "-n", f"bench-{queue}@%h", "--without-gossip",
             "--without-mingle", "-l", "WARNING"],
            cwd=ROOT, env=os.environ.copy(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        ))
    time.sleep(8)  # let both workers connect before the first message (not measured)
    return processes


def _report(mode: str, job_id: int, elapsed: float, ok: str) -> None:
    from datetime import datetime

    from trainer.models import TrainingJob

    job = TrainingJob.objects.get(pk=job_id)
    steps = list(job.steps.order_by("n"))
    rollouts = sum(s.rollout_count + s.val_rollout_count for s in steps)

    def span(step, a, b):
        t = step.timings
        return (datetime.fromisoformat(t[b]) - datetime.fromisoformat(t[a])).total_seconds()

    waiting = sum(span(s, "planned", "ready") for s in steps)
    train_total = sum(span(s, "ready", "done") for s in steps)
    torch_part = sum(s.timings.get("train_seconds", 0.0) for s in steps)
    first = steps[0].metrics.get("val_reward")
    last = steps[-1].metrics.get("val_reward")
    print(f"[{mode}] job {job_id} {job.status} ({'ok' if job.status == ok else job.error})")
    print(f"[{mode}] {len(steps) - 1} training steps + final evaluation, {rollouts} rollouts "
          f"in {elapsed:.1f}s")
    print(f"[{mode}] steps/minute: {len(steps) / elapsed * 60:.1f}   "
          f"rollouts/s: {rollouts / elapsed:.1f}")
    print(f"[{mode}] per step: waiting for rollouts {waiting / len(steps):.3f}s, "
          f"train step (ready->done, incl. queue) {train_total / len(steps):.3f}s, "
          f"of which training compute+IO {torch_part / len(steps):.3f}s")
    print(f"[{mode}] validation reward {first} -> {last}")


def world_size_bench(tasks: int, group_size: int, repeat: int) -> None:
    from statistics import median

    from examples.cipher import job_spec
    from examples.cipher.task import act_samples
    from trainer import distributed
    from trainer.algorithms.grpo import GRPO

    algorithm = GRPO({**job_spec(seed=0)["config"], "tasks_per_step": tasks,
                      "group_size": group_size})
    state = algorithm.init_state()
    samples = act_samples(state["model"], tasks=tasks, group_size=group_size, seed=1)

    def timed(world_size: int, algo: GRPO = algorithm) -> float:
        started = time.perf_counter()
        if world_size == 1:
            algo.update(step=1, state=state, samples=samples, device="cpu")
        else:
            distributed.update(algo, step=1, state=state, samples=samples,
                               world_size=world_size)
        return time.perf_counter() - started

    timed(1)  # warm-up: first-call costs of torch in this process
    one = median(timed(1) for _ in range(repeat))
    two = median(timed(2) for _ in range(repeat))
    idle = GRPO({**algorithm.config, "epochs": 0})
    launch = median(timed(2, idle) for _ in range(repeat))
    count = len(samples)
    print(f"[world-size] cipher MLP, GRPO, {count} samples x {algorithm.config['epochs']} "
          f"epochs per step, {os.cpu_count()} CPUs, gloo; median of {repeat}")
    print(f"[world-size] world size 1: {one:.3f}s/step  {count / one:.1f} samples/s")
    print(f"[world-size] world size 2: {two:.3f}s/step  {count / two:.1f} samples/s  "
          f"(of which launch+rendezvous+hand-back {launch:.3f}s)")
    print(f"[world-size] scaling efficiency at 2: {one / (2 * two):.1%}")


def parent(mode: str, steps: int) -> None:
    base = {k: v for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "LIGHTNING_DATA_DIR")}
    base.update(LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT))
    if mode in ("both", "embedded"):
        with tempfile.TemporaryDirectory() as data:
            _spawn("embedded", steps, {**base, "LIGHTNING_DATA_DIR": data})
    if mode in ("both", "distributed"):
        vhost = f"bench-{uuid.uuid4().hex[:8]}"
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc",
                        "DROP DATABASE IF EXISTS lightning_trainer_bench"], check=True)
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc",
                        "CREATE DATABASE lightning_trainer_bench"], check=True)
        subprocess.run(["rabbitmqctl", "-q", "add_vhost", vhost], check=True)
        try:
            subprocess.run(["rabbitmqctl", "-q", "set_permissions", "-p", vhost, "guest",
                            ".*", ".*", ".*"], check=True)
            with tempfile.TemporaryDirectory() as media:
                _spawn("distributed", steps, {
                    **base, "DATABASE_URL": PG, "DJANGO_SECRET_KEY": "bench",
                    "CELERY_BROKER_URL": f"amqp://guest:guest@127.0.0.1:5672/{vhost}",
                    "CHECKPOINT_DIR": media, "CELERY_EVENTS": "0",
                })
        finally:
            subprocess.run(["rabbitmqctl", "-q", "delete_vhost", vhost], check=False)


def _spawn(mode: str, steps: int, env: dict) -> None:
    subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(steps)],
                   env=env, check=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mode", default="both",
                        choices=["both", "embedded", "distributed", "world-size"])
    parser.add_argument("--child", choices=["embedded", "distributed"])
    parser.add_argument("--tasks", type=int, default=8, help="world-size: tasks per step")
    parser.add_argument("--group-size", type=int, default=8, help="world-size: rollouts/task")
    parser.add_argument("--repeat", type=int, default=3, help="world-size: runs per figure")
    args = parser.parse_args()
    if args.mode == "world-size":
        world_size_bench(args.tasks, args.group_size, args.repeat)
    elif args.child:
        child(args.child, args.steps)
    else:
        parent(args.mode, args.steps)
