"""Celery execution benchmark: rollouts/s through the `rollouts` queue with 2 worker processes
and a no-op agent, and the per-rollout overhead of Celery delivery compared with calling the
executor directly, on RabbitMQ and on Redis. Prints figures; asserts nothing.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_celery_bench \
        .venv/bin/python bench/celery_bench.py [--rollouts 400] [--latency 40]

Uses (and empties) its own database, whose name must contain "bench". Starts its own
`celery worker -Q rollouts -c 2` (prefork) per broker, on a private RabbitMQ vhost / Redis key
prefix, and removes them at the end. Settings are the defaults (task events on, for Flower).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench")

import django  # noqa: E402

django.setup()

import kombu.pools  # noqa: E402
import redis  # noqa: E402
from django.db import connection  # noqa: E402

from bench.bench_agents import noop_agent  # noqa: E402
from bench.benchdb import STORE_TABLES, empty_bench_database  # noqa: E402
from core.celery import app  # noqa: E402
from runners import executor  # noqa: E402
from runners.local_gateway import LocalGateway  # noqa: E402
from runners.models import CeleryWorker  # noqa: E402
from runners.services import executor_options, rollouts_enqueue_for_celery  # noqa: E402
from store import services  # noqa: E402
from store.models import Project, Rollout  # noqa: E402
from store.services import RolloutSpec  # noqa: E402

AGENT = "bench.bench_agents:noop_agent"


def reset() -> Project:
    empty_bench_database(STORE_TABLES + ["runners_celeryworker"])
    return services.project_create(name="celery-bench")


def direct(project: Project, n: int) -> float:
    """Seconds per rollout: claim + executor + finish in this process, no broker."""
    rollouts = services.rollout_enqueue_many(
        project=project, specs=[RolloutSpec(input={"i": i}) for i in range(n)]
    )
    gateway = LocalGateway(project)
    start = time.perf_counter()
    for rollout in rollouts:
        claim = gateway.claim_rollout(rollout_id=rollout.pk, worker_id="bench")
        executor.execute(gateway=gateway, claim=claim, agent=noop_agent, worker_id="bench",
                         options=executor_options())
    return (time.perf_counter() - start) / n


@contextmanager
def broker(kind: str) -> Iterator[tuple[str, dict]]:
    """A private vhost / key prefix; this process sends there while the block runs."""
    tag = f"bench-{uuid.uuid4().hex[:8]}"
    saved = app.conf.broker_url, dict(app.conf.broker_transport_options)
    if kind == "rabbitmq":
        subprocess.run(["rabbitmqctl", "-q", "add_vhost", tag], check=True)
        subprocess.run(["rabbitmqctl", "-q", "set_permissions", "-p", tag, "guest",
                        ".*", ".*", ".*"], check=True)
        url, env = f"amqp://guest:guest@127.0.0.1:5672/{tag}", {}
    else:
        url, env = "redis://127.0.0.1:6379/14", {"CELERY_REDIS_KEY_PREFIX": tag + ":"}
        app.conf.broker_transport_options = {**saved[1], "global_keyprefix": tag + ":"}
    kombu.pools.reset()
    app._after_fork()
    app.conf.broker_url = url
    try:
        yield url, env
    finally:
        kombu.pools.reset()
        app._after_fork()
        app.conf.broker_url, app.conf.broker_transport_options = saved
        if kind == "rabbitmq":
            subprocess.run(["rabbitmqctl", "-q", "delete_vhost", tag], check=True)
        else:
            client = redis.Redis.from_url(url)
            keys = list(client.scan_iter(match=tag + ":*"))
            if keys:
                client.delete(*keys)


@contextmanager
def worker(url: str, extra_env: dict) -> Iterator[None]:
    db = connection.settings_dict
    env = {
        **os.environ, **extra_env, "CELERY_BROKER_URL": url, "PYTHONPATH": str(ROOT),
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT'] or 5432}/{db['NAME']}",
    }
    with open(f"/tmp/celery_bench_worker_{os.getpid()}.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "lightning_site", "worker", "-Q", "rollouts",
             "-c", "2", "-P", "prefork", "-n", f"bench-{uuid.uuid4().hex[:6]}@%h",
             "--without-gossip", "--without-mingle", "-l", "WARNING"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not CeleryWorker.objects.filter(pid=process.pid, status="alive").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit("the bench worker did not start")
            time.sleep(0.2)
        yield
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def through_celery(project: Project, n: int) -> float:
    """Seconds from enqueueing `n` rollouts to all of them succeeded."""
    start = time.perf_counter()
    rollouts = rollouts_enqueue_for_celery(
        project=project, specs=[RolloutSpec(input={"i": i}) for i in range(n)], agent=AGENT
    )
    ids = [r.pk for r in rollouts]
    while Rollout.objects.filter(pk__in=ids, status="succeeded").count() < n:
        time.sleep(0.005 if n == 1 else 0.05)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=400, help="batch for the throughput run")
    parser.add_argument("--latency", type=int, default=40, help="rollouts sent one at a time")
    args = parser.parse_args()
    project = reset()
    direct_s = direct(project, args.latency)
    print(f"direct executor (this process, one at a time): {direct_s * 1000:.1f} ms/rollout")
    for kind in ("rabbitmq", "redis"):
        with broker(kind) as (url, env), worker(url, env):
            through_celery(project, 20)  # warm up: pool processes import, connect
            elapsed = through_celery(project, args.rollouts)
            rate = args.rollouts / elapsed
            single = sum(through_celery(project, 1) for _ in range(args.latency)) / args.latency
            print(f"{kind}: {args.rollouts} rollouts in {elapsed:.2f} s = {rate:.0f} rollouts/s "
                  f"(2 worker processes, no-op agent)")
            print(f"{kind}: one at a time {single * 1000:.1f} ms end to end (enqueue to "
                  f"succeeded) = {(single - direct_s) * 1000:.1f} ms/rollout over the direct "
                  f"executor; at full load {2000 / rate:.1f} ms of worker process time/rollout")


if __name__ == "__main__":
    main()
