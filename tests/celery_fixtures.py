"""Fixtures for tests that run real Celery workers on a real broker (reusable by any app).

- `rabbitmq_url` / `redis_url` (session): a private RabbitMQ vhost / a private Redis key prefix
  (and db), created for the test session and removed at its end.
- `broker_url` (function, parametrized by `broker`): either of them; use with
  `@pytest.mark.parametrize("broker", ["rabbitmq", "redis"], indirect=True)`.
- `use_broker(url)`: point this process's Celery app at that broker (for sending).
- `celery_worker_env` (session): the environment a worker subprocess needs to share the test
  database (pytest-django's test DB, passed as DATABASE_URL).
- `celery_workers` (function): a `CeleryProcesses`; `celery_workers(queues=..., broker_url=...,
  concurrency=..., pool=..., env=..., include=[modules]) -> WorkerProcess` starts a worker and
  waits until it is ready; `celery_workers.beat(broker_url=..., env=...)` starts celery beat.
  Every process it started is stopped when the test ends (SIGTERM, then SIGKILL of its own
  process group: only processes it started).
- `wait_until(predicate, timeout=...)`: poll for an outcome (never an assertion on time).

Tests using these need committed data: mark them `@pytest.mark.django_db(transaction=True)`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import kombu
import kombu.pools
import pytest
import redis
from django.db import connection

from core.celery import app as celery_app
from core.queues import Queue

ROOT = Path(__file__).resolve().parent.parent
RABBITMQ_HOST = os.environ.get("TEST_RABBITMQ_HOST", "127.0.0.1:5672")
REDIS_HOST = os.environ.get("TEST_REDIS_HOST", "127.0.0.1:6379")
READY_TIMEOUT = 90.0


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    vhost = f"test-{uuid.uuid4().hex[:12]}"
    _rabbitmqctl("add_vhost", vhost)
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(scope="session")
def redis_key_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="session")
def redis_url(redis_key_prefix: str) -> Iterator[str]:
    # A db other than 0 and a key prefix: two layers between us and anyone else on this Redis.
    db = 1 + uuid.uuid4().int % 15
    url = f"redis://{REDIS_HOST}/{db}"
    yield url
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=redis_key_prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def broker(request) -> str:
    return getattr(request, "param", "rabbitmq")


@pytest.fixture
def broker_url(request, broker: str) -> str:
    return request.getfixturevalue("rabbitmq_url" if broker == "rabbitmq" else "redis_url")


@contextmanager
def use_broker(url: str, key_prefix: str | None = None) -> Iterator[None]:
    """Send this process's Celery messages to `url` while the block runs."""
    conf = celery_app.conf
    saved = conf.broker_url, dict(conf.broker_transport_options or {})
    options = dict(saved[1])
    if url.startswith("redis") and key_prefix:
        options["global_keyprefix"] = key_prefix
    _reset_pools()
    conf.broker_url, conf.broker_transport_options = url, options
    try:
        yield
    finally:
        _reset_pools()
        conf.broker_url, conf.broker_transport_options = saved


def _reset_pools() -> None:
    # Connections are pooled per process, keyed by broker: drop them all and start afresh.
    kombu.pools.reset()
    celery_app._after_fork()


@pytest.fixture
def sending_to(broker_url: str, redis_key_prefix: str) -> Iterator[str]:
    """This process sends its Celery messages to the test's broker, whose queues start empty
    (an earlier test of the session may have left a message behind)."""
    with use_broker(broker_url, redis_key_prefix):
        purge_queues()
        yield broker_url


def purge_queues() -> int:
    """Empty our queues on the broker this process sends to; returns how many were dropped."""
    dropped = 0
    with celery_app.connection_for_write() as conn:
        for queue in Queue:
            bound = kombu.Queue(queue.value, kombu.Exchange(queue.value), routing_key=queue.value)
            bound = bound(conn.default_channel)
            bound.declare()
            dropped += bound.purge() or 0
    return dropped


@pytest.fixture(scope="session")
def celery_worker_env(django_db_setup, django_db_blocker, redis_key_prefix: str) -> dict:
    db = connection.settings_dict
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT'] or 5432}/{db['NAME']}"
    return {
        "DATABASE_URL": url,
        "DJANGO_SECRET_KEY": "test-suite-only",
        "DJANGO_SETTINGS_MODULE": "lightning_site.settings",
        "CELERY_REDIS_KEY_PREFIX": redis_key_prefix,
        "RUNNERS_HEARTBEAT_SECONDS": "0.5",
        "CELERY_EVENTS": "0",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }


@dataclass
class WorkerProcess:
    name: str
    queues: list[str]
    process: subprocess.Popen
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the worker and everything it forked (its own process group)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL of the group if it lingers."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # pool children left behind, if any
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


class CeleryProcesses:
    """Starts `celery worker` / `celery beat` subprocesses; `stop_all()` ends every one."""

    def __init__(self, env: dict, logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.started: list[WorkerProcess] = []

    def __call__(self, *, queues: list[str], broker_url: str, concurrency: int = 2,
                 pool: str = "prefork", env: dict | None = None, name: str | None = None,
                 include: list[str] | None = None, wait: bool = True,
                 python: list[str] | None = None) -> WorkerProcess:
        """A worker serving `queues`; waits until it is ready (unless wait=False). `python`:
        the command that runs Python (default: this interpreter)."""
        name = name or f"w{len(self.started)}-{'-'.join(queues)}"
        args = [
            "worker", "-Q", ",".join(queues), "-c", str(concurrency), "-P", pool,
            "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-l", "INFO",
        ]
        if include:
            args += ["-I", ",".join(include)]
        worker = self._start(name, queues, args, broker_url, env, python)
        if wait:
            wait_ready(worker, " ready.")
        return worker

    def beat(self, *, broker_url: str, env: dict | None = None) -> WorkerProcess:
        """celery beat with the settings' scheduler (django-celery-beat's DatabaseScheduler)."""
        beat = self._start(f"beat{len(self.started)}", [], ["beat", "-l", "INFO"], broker_url, env)
        wait_ready(beat, "beat: Starting...")
        return beat

    def _start(self, name: str, queues: list[str], args: list[str], broker_url: str,
               env: dict | None, python: list[str] | None = None) -> WorkerProcess:
        log_path = self.logs / f"{name}.log"
        cmd = [*(python or [sys.executable]), "-m", "celery", "-A", "lightning_site", *args]
        full_env = {**os.environ, **self.env, "CELERY_BROKER_URL": broker_url, **(env or {})}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        worker = WorkerProcess(name, queues, process, log_path)
        self.started.append(worker)
        return worker

    def stop_all(self) -> None:
        for worker in self.started:
            worker.stop(timeout=10)


@pytest.fixture
def celery_workers(celery_worker_env: dict, tmp_path: Path) -> Iterator[CeleryProcesses]:
    processes = CeleryProcesses(celery_worker_env, tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()


def wait_ready(worker: WorkerProcess, marker: str, timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker in worker.log():
            return
        if worker.process.poll() is not None:
            raise AssertionError(f"worker {worker.name} exited:\n{worker.log()[-4000:]}")
        time.sleep(0.1)
    raise AssertionError(f"worker {worker.name} not ready in {timeout}s:\n{worker.log()[-4000:]}")


def wait_until(predicate, *, timeout: float, interval: float = 0.2,
               message: str | Callable[[], str] = "") -> None:
    """Poll until `predicate()` is true; fails with `message` after `timeout` seconds (a
    callable is called then: the state at the timeout, not at the start). Waiting for an
    outcome, never asserting on how long it took."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            raise AssertionError(text or f"condition not met in {timeout}s")
        time.sleep(interval)
