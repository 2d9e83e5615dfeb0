"""What Agent Lightning 0.3's own runners send, against our server and AGL's, in one run.
Prints figures; asserts nothing. Not a test.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_aglmix_bench \
        .venv/bin/python bench/agl_mix_bench.py [--seconds 30] [--agent returns-reward]

For each server in turn, (a) ours (`python -m lightning_site.web`, uvicorn and the ASGI front,
on Postgres, as bench/api_bench.py starts it, with the server's own default number of
processes unless `--workers` says otherwise) and (b) AGL 0.3's `agl store --backend memory`
(bench/agl_mix_side.py `store`: AGL's own server and store, plus a route counter): resources
are added, `--rollouts` rollouts enqueued, then `--runners` unmodified AGL runner processes
start (bench/agl_mix_side.py `runners`, in .venv-agl: AGL's `LitAgentRunner` with its default
`AgentOpsTracer` and `LightningStoreClient`, what AGL's `Trainer` runs per runner). Once every
runner is set up and `--warmup` seconds have passed, the bench measures for `--seconds`:

- rollouts/s: rollouts that became `succeeded` in the window (counted by the server);
- the request mix, from the server side (ours: `/metrics`' `lightning_http_requests_total`;
  AGL: the counter around its app), per rollout and route;
- server CPU per rollout (bench/serverstats.py, from /proc: the server's processes as "web",
  the Postgres backends of the benchmark database; AGL has none);
- commits per rollout (ours: `pg_stat_database.xact_commit`, read at the window's edges:
  backends report at most once a second, so it is approximate);
- p50/p99 per route as the runners saw them (time to the response's headers);
- the ratios ours/AGL.

Uses (and empties) its own database, whose name must contain "bench"; ports BENCH_PORT_BASE
(default 18090) and the next one. The machine's load at the start is printed: the runners,
both servers and Postgres share its cores.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import api_bench as ab  # noqa: E402 - sets Django up
from bench.serverstats import CpuMeter, commits, percentiles  # noqa: E402
from lightning_site.web import default_workers  # noqa: E402

SIDE = ab.ROOT / "bench" / "agl_mix_side.py"
AGL_PYTHON = ab.ROOT / ".venv-agl" / "bin" / "python"
AGL_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "AGENTOPS_API_ENDPOINT": "http://127.0.0.1:9",
           "AGENTOPS_EXPORTER_ENDPOINT": "http://127.0.0.1:9",
           "AGENTOPS_APP_URL": "http://127.0.0.1:9"}
METRICS_TOKEN = "agl-mix-bench"
BENCH_ROUTES = {"GET /metrics", "GET /v1/agl/rollouts", "GET /v1/agl/health"}
RESOURCES = {"llm": {"resource_type": "llm", "endpoint": "http://127.0.0.1:9/v1",
                     "model": "bench-model"}}
# Our route labels (URL patterns) written as the AGL side writes a path.
_KINDS = {"rollout_id": "<ro>", "attempt_id": "<at>", "resources_id": "<rs>",
          "worker_id": "<id>"}
_PATTERN = re.compile(r"<(?:\w+:)?(\w+)>")
_SAMPLE = re.compile(r'^lightning_http_requests_total\{(.*)\} ([0-9.e+]+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _our_route(method: str, route: str) -> str:
    return f"{method} " + _PATTERN.sub(lambda m: _KINDS.get(m.group(1), f"<{m.group(1)}>"),
                                       route)


def route_counts(url: str, ours: bool) -> Counter:
    """Requests answered so far, per "METHOD /route", from the server's own counters."""
    if not ours:
        return Counter(ab.httpx.get(url + "/__bench/counts", timeout=30).json())
    text = ab.httpx.get(url + "/metrics", timeout=30,
                        headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
    counts: Counter = Counter()
    for labels, value in _SAMPLE.findall(text):
        fields = dict(_LABEL.findall(labels))
        counts[_our_route(fields["method"], fields["route"])] += int(float(value))
    return counts


def succeeded(client: ab.httpx.Client) -> int:
    answer = client.get("/rollouts", params={"status_in": "succeeded", "limit": 1})
    answer.raise_for_status()
    return int(answer.json()["total"])


def start_agl_counted(port: int) -> subprocess.Popen:
    if not AGL_PYTHON.exists():
        sys.exit("no .venv-agl: run tests/agl/setup_venv.sh first")
    proc = subprocess.Popen([str(AGL_PYTHON), str(SIDE), "store", str(port)],
                            env={**os.environ, **AGL_ENV}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ab.wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


def scratch(prefix: str) -> str:
    """A temporary folder, removed when the bench exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def start_runner_parent(args) -> subprocess.Popen:
    """AGL's imports, paid once while the servers start; it forks the runners per server."""
    if not AGL_PYTHON.exists():
        sys.exit("no .venv-agl: run tests/agl/setup_venv.sh first")
    return subprocess.Popen(
        [str(AGL_PYTHON), str(SIDE), "runners", "--runners", str(args.runners),
         "--rounds", str(args.rounds), "--agent", args.agent],
        env={**os.environ, **AGL_ENV}, start_new_session=True, stdin=subprocess.PIPE,
        cwd=scratch("agl-mix-runners-"),  # AgentOps writes agentops.log here
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def tell(parent: subprocess.Popen, command: str, answer: str) -> None:
    parent.stdin.write(command + "\n")
    parent.stdin.flush()
    while True:  # the runners share the parent's stdout: lines they print are passed on
        line = parent.stdout.readline()
        if not line:
            sys.exit(f"the AGL runners did not answer {answer!r} to {command!r} "
                     f"({parent.poll()})")
        if line.startswith(answer):
            return
        print(f"  (AGL runner) {line.rstrip()}")


def latencies(out_dir: str, start: float, end: float) -> dict[str, list[float]]:
    """The runners' request times that ended inside the window, per route."""
    by_route: dict[str, list[float]] = {}
    for path in Path(out_dir).glob("runner-*.jsonl"):
        for line in path.read_text().splitlines():
            at, route, seconds = json.loads(line)
            if start <= at <= end:
                by_route.setdefault(route, []).append(seconds)
    return by_route


def analyze(database: str) -> None:
    """The store's tables' statistics after the enqueue, as autovacuum would gather them on a
    default Postgres (this machine's has it off; the bench empties the tables each run)."""
    with psycopg.connect(**ab._dsn(), dbname=database, autocommit=True) as conn:
        conn.execute(f"ANALYZE {', '.join(ab.TABLES)}")


def measure(name: str, url: str, key: str, server: subprocess.Popen, database: str | None,
            parent: subprocess.Popen, args) -> dict:
    ours = database is not None
    headers = {"Authorization": f"Bearer {key}"}
    with ab.httpx.Client(base_url=url + "/v1/agl", timeout=120, headers=headers) as client:
        client.post("/resources", json=RESOURCES).raise_for_status()
    ab.enqueue(url, key, args.rollouts)
    if ours and args.analyze:
        analyze(database)
    runner_url = url.replace("http://", f"http://runner:{key}@") if ours else url
    out_dir = scratch("agl-mix-")
    tell(parent, f"run {runner_url} {out_dir}", "ready")
    try:
        time.sleep(args.warmup)
        with ab.httpx.Client(base_url=url + "/v1/agl", timeout=120, headers=headers) as client:
            counts0, done0 = route_counts(url, ours), succeeded(client)
            commits0 = commits(ab._dsn(), database) if ours else 0
            meter = CpuMeter(server.pid, database)
            start = time.time()
            meter.start()
            time.sleep(args.seconds)
            cpu = meter.stop()
            end = time.time()
            done1, counts1 = succeeded(client), route_counts(url, ours)
            commits1 = commits(ab._dsn(), database) if ours else 0
            left = args.rollouts - done1
    finally:
        tell(parent, "stop", "stopped")
    done = max(done1 - done0, 1)
    mix = Counter({route: n for route, n in (counts1 - counts0).items()
                   if route not in BENCH_ROUTES})
    figures = {"rate": (done1 - done0) / (end - start), "web_ms": 1000 * cpu["web"] / done,
               "pg_ms": 1000 * cpu["postgres"] / done, "commits": (commits1 - commits0) / done,
               "mix": {route: n / done for route, n in mix.items()}}
    print(f"({name}) {done1 - done0} rollouts in {end - start:.1f} s by {args.runners} AGL "
          f"runners -> {figures['rate']:.2f} rollouts/s; server CPU per rollout "
          f"{figures['web_ms'] + figures['pg_ms']:.1f} ms (web {figures['web_ms']:.1f}, "
          f"Postgres {figures['pg_ms']:.1f})" + (
              f"; commits per rollout {figures['commits']:.2f}" if ours else ""))
    if left <= 0:
        print("  WARNING: the queue ran dry in the window; raise --rollouts")
    timed = latencies(out_dir, start, end)
    print(f"  {'requests per rollout (server side)':<52} {'p50 ms':>8} {'p99 ms':>8}")
    for route, n in sorted(mix.items(), key=lambda item: -item[1]):
        p50, p99 = percentiles(timed.get(route, []))
        print(f"  {route:<44} {n / done:7.2f} {p50:8.1f} {p99:8.1f}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20, help="measured window per server")
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--runners", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4,
                        help="agent rounds: 3 spans each, a reward every other round")
    parser.add_argument("--agent", choices=["returns-reward", "emits-reward"],
                        default="returns-reward")
    parser.add_argument("--rollouts", type=int, default=8000,
                        help="enqueued per server (enough for the warm-up and the window at "
                             "about 250 rollouts/s: the queue must not run dry)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="our server's processes (default: its own, $WEB_WORKERS or half "
                             "the CPUs; AGL's is one process)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--skip-agl", action="store_true")
    parser.add_argument("--analyze", action="store_true",
                        help="ANALYZE our store's tables after the enqueue")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; "
          f"agent {args.agent}, {args.rounds} rounds")
    parent = start_runner_parent(args)
    try:
        ours, agl = run_both(args, parent)
    finally:
        ab.stop(parent)
    if agl is None:
        return
    cpu_ours, cpu_agl = ours["web_ms"] + ours["pg_ms"], agl["web_ms"] + agl["pg_ms"]
    print(f"ratio ours/agl: throughput {ours['rate'] / agl['rate']:.2f}x (target >= 1.1x), "
          f"server CPU per rollout {cpu_ours / cpu_agl:.2f}x (target <= 0.7x)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


def run_both(args, parent: subprocess.Popen) -> tuple[dict, dict | None]:
    key = ab.prepare_database()
    database = ab.settings.DATABASES["default"]["NAME"]
    ab.connection.close()
    metrics_dir = scratch("agl-mix-metrics-")
    os.environ.update(PROMETHEUS_MULTIPROC_DIR=metrics_dir, METRICS_TOKEN=METRICS_TOKEN)
    server = ab.start_ours("uvicorn", args.workers, args.threads)
    try:
        ours = measure(f"ours, {args.workers} workers x {args.threads} threads",
                       f"http://127.0.0.1:{ab.OURS_PORT}", key, server, database, parent, args)
    finally:
        ab.stop(server)
    if args.skip_agl:
        return ours, None
    server = start_agl_counted(ab.AGL_PORT)
    try:
        agl = measure("AGL 0.3 memory store", f"http://127.0.0.1:{ab.AGL_PORT}", key, server,
                      None, parent, args)
    finally:
        ab.stop(server)
    return ours, agl


if __name__ == "__main__":
    main()
