"""A throwaway Postgres cluster for tests that crash or restart the database (the shared
cluster of the development machine is never stopped): initdb in a temporary folder, its own
port, run as the `postgres` user (initdb refuses root).

- `PrivatePostgres(port)`: `init()`, `start()`, `crash()` (`pg_ctl stop -m immediate`: no
  checkpoint, no WAL flush), `crash_a_backend()` (SIGKILL one backend: the postmaster resets
  and recovers without restarting), `remove()`, `url(database)`.
- `private_postgres_cluster(port, database="lightning")`: a context manager yielding a
  started cluster with `database` created, removed at the end; skips the test where the
  machine cannot run one (not root, no initdb or runuser).
- `using_database(url)`: this process's default Django connection points at `url` while the
  block runs (and back at the test database after it).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class PrivatePostgres:
    """A Postgres cluster of its own, run as the `postgres` user (initdb refuses root)."""

    def __init__(self, port: int, options: str = "") -> None:
        self.port = port
        self.options = options
        self.dir = Path(tempfile.mkdtemp(prefix="lightning-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"

    def _as_postgres(self, *cmd: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *cmd], check=True, capture_output=True, timeout=120
        )

    def init(self) -> None:
        self._as_postgres(
            _bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync"
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 {self.options}"
        self._as_postgres(
            _bin("pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            options,
            "-w",
            "-l",
            str(self.dir / "log"),
            "start",
        )

    def crash(self) -> None:
        self._as_postgres(_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def crash_a_backend(self) -> None:
        """SIGKILL one backend: the postmaster stays up, ends every other backend, resets
        shared memory (WAL not yet written to disk is lost) and recovers from the WAL on disk;
        returns once the cluster accepts connections again."""
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def remove(self) -> None:
        try:
            self.crash()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str = "lightning") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"


@contextmanager
def private_postgres_cluster(
    port: int, *, database: str = "lightning", options: str = ""
) -> Iterator[PrivatePostgres]:
    if os.geteuid() != 0 or not _bin("initdb") or not shutil.which("runuser"):
        pytest.skip("needs root, runuser and Postgres' initdb to run a throwaway cluster")
    cluster = PrivatePostgres(port, options)
    try:
        cluster.init()
        cluster.start()
        with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
        yield cluster
    finally:
        cluster.remove()


def manage(database_url: str, *args: str) -> str:
    """`manage.py ARGS` in a subprocess on `database_url`; its standard output."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SECRET_KEY": "test-suite-only",
        "DJANGO_SETTINGS_MODULE": "lightning_site.settings",
    }
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout


@contextmanager
def using_database(url: str) -> Iterator[None]:
    """This process's default connection on `url` while the block runs."""
    from django.db import connection

    parts = urlsplit(url)
    saved = dict(connection.settings_dict)
    connection.close()
    connection.settings_dict.update(
        NAME=parts.path.lstrip("/"),
        HOST=parts.hostname,
        PORT=str(parts.port or 5432),
        USER=parts.username or "",
        PASSWORD=parts.password or "",
    )
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)
