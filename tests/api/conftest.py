"""Fixtures for the API tests: a real server on the test database (the ASGI front under
uvicorn, as deployed; gunicorn on request), project keys.

The server is one subprocess per test
session on a free port in 18000-18099; it reads the rows the tests commit (tests that talk
to it use `transactional_db`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from store import services
from store.models import Project

ROOT = Path(__file__).resolve().parents[2]
# Under pytest-xdist (`./lightning test` runs two worker processes) each worker scans its own
# slice of the range first: two workers probing the same free port at once would both take it.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
PORTS = [18000 + (i + 25 * _WORKER) % 100 for i in range(100)]


def free_port(exclude: set[int] | frozenset[int] = frozenset()) -> int:
    for port in PORTS:
        if port in exclude:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 18000-18099")


def database_url_for_tests() -> str:
    db = settings.DATABASES["default"]
    if "postgresql" not in db["ENGINE"]:
        # Server processes share the test database over the network; the SQLite run tests the
        # store's services in process (./lightning test_sqlite), not servers.
        pytest.skip("a server process needs the Postgres test database")
    user, host = db["USER"] or "postgres", db["HOST"] or "127.0.0.1"
    return f"postgres://{user}@{host}:{db['PORT'] or 5432}/{db['NAME']}"


class Server:
    """A server process serving lightning_site on 127.0.0.1:port: `kind` "uvicorn" (the ASGI
    front, lightning_site/asgi.py, as `./lightning serve` and compose run it) or "gunicorn"
    (Django's WSGI application under gthread); `args` are added to its command line."""

    def __init__(self, port: int, *, workers: int = 2, threads: int = 8,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 kind: str = "uvicorn") -> None:
        self.port, self.kind = port, kind
        self.args = args
        self.url = f"http://127.0.0.1:{port}"
        self.workers, self.threads = workers, threads
        self.env = {**os.environ, "DATABASE_URL": database_url_for_tests(),
                    "DJANGO_SECRET_KEY": "test-suite-only", "LOG_LEVEL": "WARNING",
                    **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = ROOT / "var" / f"test-{kind}-{port}.log"

    def start(self) -> Server:
        self.log.parent.mkdir(exist_ok=True)
        if self.kind == "gunicorn":
            cmd = [sys.executable, "-m", "gunicorn", "lightning_site.wsgi",
                   "-b", f"127.0.0.1:{self.port}", "-k", "gthread", "-w", str(self.workers),
                   "--threads", str(self.threads), "--graceful-timeout", "5", "--timeout", "90",
                   *self.args]
        else:
            cmd = [sys.executable, "-m", "lightning_site.web", "--host", "127.0.0.1",
                   "--port", str(self.port), "--workers", str(self.workers),
                   "--threads", str(self.threads), *self.args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=log,
                                         start_new_session=True)
        self.wait_ready()
        return self

    def wait_ready(self, attempts: int = 300) -> None:
        for _ in range(attempts):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited; see {self.log}")
            try:
                if httpx.get(self.url + "/v1/agl/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.kind} did not come up; see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


def start_server(**kwargs) -> Server:
    """A server on a free port; another process may take the port between our check and
    the server's bind (parallel test sessions), so try a few."""
    tried: set[int] = set()
    for _ in range(5):
        server = Server(free_port(exclude=tried), **kwargs)
        tried.add(server.port)
        try:
            return server.start()
        except RuntimeError:
            server.stop()
    raise RuntimeError(f"the server could not start on any of {sorted(tried)}")


@pytest.fixture(scope="session")
def api_server(django_db_setup: None) -> Iterator[Server]:
    server = start_server()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Keys:
    project: Project
    runner: str
    algorithm: str
    admin: str
    other_project: Project
    other: str  # an algorithm key of the other project


@pytest.fixture
def keys(transactional_db: None) -> Keys:
    project = services.project_create(name="api")
    other = services.project_create(name="api-other")
    raw = {
        role: services.api_key_create(project=project, role=role)[1]
        for role in ("runner", "algorithm", "admin")
    }
    return Keys(project, raw["runner"], raw["algorithm"], raw["admin"], other,
                services.api_key_create(project=other, role="algorithm")[1])


def http(server: Server, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url + "/v1/agl", headers=headers, timeout=30)


@pytest.fixture
def algo(api_server: Server, keys: Keys) -> Iterator[httpx.Client]:
    with http(api_server, keys.algorithm) as client:
        yield client


@pytest.fixture
def runner(api_server: Server, keys: Keys) -> Iterator[httpx.Client]:
    with http(api_server, keys.runner) as client:
        yield client
