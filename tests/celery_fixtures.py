"""Fixtures for tests that run real Celery workers on a real broker (reusable by any app).

- `rabbitmq_url` / `redis_url` (session): a private RabbitMQ vhost / a private Redis key prefix
  (and db), created for the test session and removed at its end.
- `broker_url` (function, parametrized by `broker`): either of them; use with
  `@pytest.mark.parametrize("broker", ["rabbitmq", "redis"], indirect=True)`.
- `use_broker(url)`: point this process's Celery app at that broker (for sending).
- `celery_worker_env` (session): the environment a worker subprocess needs to share the test
  database (pytest-django's test DB, passed as DATABASE_URL).
- `celery_workers` (function): a factory `start(queues=..., broker_url=..., concurrency=...,
  pool=..., env=...) -> WorkerProcess`; it waits until the worker is ready and kills every
  worker it started (by its own PIDs and their process groups) when the test ends.

Tests using these need committed data: mark them `@pytest.mark.django_db(transaction=True)`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import kombu.pools
import pytest
import redis
from django.db import connection

from lightning_site.celery import app as celery_app

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
    """This process sends its Celery messages to the test's broker."""
    with use_broker(broker_url, redis_key_prefix):
        yield broker_url


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


@pytest.fixture
def celery_workers(celery_worker_env: dict, tmp_path: Path) -> Iterator:
    started: list[WorkerProcess] = []

    def start(*, queues: list[str], broker_url: str, concurrency: int = 2,
              pool: str = "prefork", env: dict | None = None, name: str | None = None,
              wait: bool = True) -> WorkerProcess:
        name = name or f"w{len(started)}-{'-'.join(queues)}"
        log_path = tmp_path / f"{name}.log"
        cmd = [
            sys.executable, "-m", "celery", "-A", "lightning_site", "worker",
            "-Q", ",".join(queues), "-c", str(concurrency), "-P", pool,
            "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-l", "INFO",
        ]
        full_env = {**os.environ, **celery_worker_env, "CELERY_BROKER_URL": broker_url,
                    **(env or {})}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        worker = WorkerProcess(name, queues, process, log_path)
        started.append(worker)
        if wait:
            wait_ready(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.stop(timeout=10)


def wait_ready(worker: WorkerProcess, timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if " ready." in worker.log():
            return
        if worker.process.poll() is not None:
            raise AssertionError(f"worker {worker.name} exited:\n{worker.log()[-4000:]}")
        time.sleep(0.1)
    raise AssertionError(f"worker {worker.name} not ready in {timeout}s:\n{worker.log()[-4000:]}")


def wait_until(predicate, *, timeout: float, interval: float = 0.2, message: str = "") -> None:
    """Poll until `predicate()` is true; fails with `message` after `timeout` seconds. Waiting
    for an outcome, never asserting on how long it took."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(message or f"condition not met in {timeout}s")
        time.sleep(interval)
