"""What the LLM benchmarks share (bench/llm_bench.py sets Django up before importing this)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from store import services
from store.services import RolloutSpec

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "user", "content": "abc 7"}]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_sessions(call, per_session: int, sessions: int) -> tuple[list[float], float]:
    """`sessions` threads, each calling `call(i, j)` `per_session` times in a row."""
    latencies: list[float] = []
    lock = threading.Lock()

    def session(i: int) -> None:
        mine = []
        for j in range(per_session):
            t = time.perf_counter()
            call(i, j)
            mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float = 180.0, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not start")


def start_gateway(model: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`manage.py llm_serve` serving `model` as "tiny" in its own process, as deployed."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "llm_serve", "--port", str(port),
         "--model", f"tiny={model}"], env={**os.environ, **(env or {})}, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
    except BaseException:
        server.kill()
        raise
    return server, url


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User + system CPU time of a process (Linux /proc), its threads included, and with
    `children` its live child processes' (the gateway's engine process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if children:
        for kid in _children(pid):
            try:
                total += cpu_seconds(kid)
            except OSError:  # it ended meanwhile
                pass
    return total


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (/proc/<n>/stat's 4th field)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def running_attempts(project, n: int) -> list[tuple[str, str]]:
    """n rollouts of `project`, each with a running attempt: (rollout id, attempt id)."""
    services.rollout_enqueue_many(project=project, specs=[RolloutSpec(input={})
                                                          for _ in range(n)])
    out = []
    for _ in range(n):
        rollout, attempt = services.rollout_dequeue(project=project, worker_id="bench")
        out.append((rollout.pk, attempt.attempt_id))
    return out
