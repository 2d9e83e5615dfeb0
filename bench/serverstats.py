"""What a server costs while a benchmark runs: CPU time of its processes and of the Postgres
backends of one database (from /proc/<pid>/stat, user + system), and commits in that database
(pg_stat_database.xact_commit). Linux only; Postgres on the same machine."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psycopg

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _session_of(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2:].split()[3])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


class CpuMeter:
    """Samples, every `interval` seconds, the CPU time of (a) every process in the session of
    `session_id` (a server started with start_new_session=True: its master and workers) and
    (b) every Postgres backend serving `database` (by its process title). A process seen for
    the first time after `start()` counts from zero; one that exits counts up to its last
    sample (sampled often, so little is lost)."""

    def __init__(self, session_id: int, database: str | None, interval: float = 0.2) -> None:
        self.session_id, self.database, self.interval = session_id, database, interval
        self._marker = f" {database} " if database else None
        self._base: dict[tuple[str, int], float] = {}
        self._last: dict[tuple[str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _groups(self) -> dict[tuple[str, int], float]:
        seen: dict[tuple[str, int], float] = {}
        for pid in _pids():
            if _session_of(pid) == self.session_id:
                group = "web"
            elif self._marker and self._marker in _cmdline(pid) and \
                    _cmdline(pid).startswith("postgres:"):
                group = "postgres"
            else:
                continue
            cpu = _cpu_seconds(pid)
            if cpu is not None:
                seen[(group, pid)] = cpu
        return seen

    def start(self) -> None:
        self._base = self._groups()
        self._last = dict(self._base)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._last.update(self._groups())

    def stop(self) -> dict[str, float]:
        """CPU seconds spent since `start()`, per group ("web", "postgres")."""
        self._stop.set()
        self._thread.join()
        self._last.update(self._groups())
        totals = {"web": 0.0, "postgres": 0.0}
        for key, cpu in self._last.items():
            totals[key[0]] += cpu - self._base.get(key, 0.0)
        return totals


def commits(dsn: dict, database: str) -> int:
    """xact_commit of `database`. Backends report their counts at most once a second while
    busy and within 10 s once idle (or when they exit): read it after they went idle or quit."""
    with psycopg.connect(**dsn, dbname="postgres", autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                           [database]).fetchone()
    return int(row[0]) if row else 0


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of `samples` (seconds), in milliseconds."""
    if not samples:
        return 0.0, 0.0
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return at(0.50), at(0.99)


def wait_backends_gone(database: str, timeout: float = 20.0) -> None:
    """Until no backend serves `database` but the caller's own (after a server stopped: they
    report their statistics when they exit)."""
    deadline = time.monotonic() + timeout
    marker = f" {database} "
    while time.monotonic() < deadline:
        if not any(marker in _cmdline(pid) and _cmdline(pid).startswith("postgres:")
                   for pid in _pids()):
            return
        time.sleep(0.1)
