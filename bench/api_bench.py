"""HTTP benchmark of the store API. Prints figures; asserts nothing. Not a test.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_api_bench \
        .venv/bin/python bench/api_bench.py [--rollouts 480] [--skip-agl]

Same run, same workload, against (a) our server (gunicorn, Postgres) and (b) Agent Lightning
0.3's own `agl store --backend memory` (from .venv-agl; tests/agl/setup_venv.sh makes it):
16 concurrent AGL-style runners, each looping dequeue -> 4 spans over OTLP/HTTP protobuf (one
request per span, as AGL's exporter sends them) -> update_attempt(succeeded), until the queue
is empty. For each server: rollouts/s; server CPU per rollout over the runners' phase, split
into the server's own processes (web) and the Postgres backends of the benchmark database
(bench/serverstats.py, from /proc); commits per rollout (pg_stat_database.xact_commit of the
benchmark database); p50/p99 latency per route as the runners saw it. Then, on our server
only: our batched client (dequeue 250 at a time, their spans in one batch, their completions
in one batch) in rollouts/s, and span ingest of ~1 KB spans over HTTP (batches of 1,000) in
spans/s.

Uses (and empties) its own database, whose name must contain "bench". Servers listen on
127.0.0.1 ports BENCH_PORT_BASE (default 18090) and BENCH_PORT_BASE + 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench")

import django  # noqa: E402

django.setup()
logging.getLogger("httpx").setLevel(logging.WARNING)

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue  # noqa: E402

from bench.benchdb import STORE_TABLES, empty_bench_database  # noqa: E402
from bench.serverstats import CpuMeter, commits, percentiles, wait_backends_gone  # noqa: E402
from runners.client import StoreClient  # noqa: E402
from store import services  # noqa: E402

# Ours on BENCH_PORT_BASE, AGL on the next port (several benchmarks may share a machine).
PORT_BASE = int(os.environ.get("BENCH_PORT_BASE", "18090"))
OURS_PORT, AGL_PORT = PORT_BASE, PORT_BASE + 1
RUNNERS = 16
TABLES = STORE_TABLES


def prepare_database() -> str:
    name = settings.DATABASES["default"]["NAME"]
    if "bench" not in name:
        sys.exit(f"refusing to empty database {name!r}: its name must contain 'bench'")
    empty_bench_database(TABLES)
    project = services.project_create(name="bench")
    return services.api_key_create(project=project, role="admin")[1]


def wait_healthy(url: str, proc: subprocess.Popen, attempts: int = 600) -> None:
    for _ in range(attempts):
        if proc.poll() is not None:
            sys.exit(f"server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/agl/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    sys.exit(f"server at {url} did not come up")


def start_ours(server: str, workers: int, threads: int) -> subprocess.Popen:
    if server == "gunicorn":
        cmd = [sys.executable, "-m", "gunicorn", "lightning_site.wsgi", "-b",
               f"127.0.0.1:{OURS_PORT}", "-k", "gthread", "-w", str(workers),
               "--threads", str(threads), "--log-level", "warning", "--preload"]
    else:
        # What `manage.py serve` and docker-compose run (lightning_site/web.py).
        cmd = [sys.executable, "-m", "lightning_site.web", "--host", "127.0.0.1", "--port",
               str(OURS_PORT), "--workers", str(workers), "--threads", str(threads)]
    env = {**os.environ, "LOG_LEVEL": "WARNING", "WEB_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    wait_healthy(f"http://127.0.0.1:{OURS_PORT}", proc)
    return proc


def start_agl() -> subprocess.Popen:
    agl = ROOT / ".venv-agl" / "bin" / "agl"
    if not agl.exists():
        sys.exit("no .venv-agl: run tests/agl/setup_venv.sh first (or pass --skip-agl)")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "AGENTOPS_API_ENDPOINT": "http://127.0.0.1:9",
           "AGENTOPS_EXPORTER_ENDPOINT": "http://127.0.0.1:9"}
    proc = subprocess.Popen([str(agl), "store", "--backend", "memory", "--host", "127.0.0.1",
                             "--port", str(AGL_PORT), "--log-level", "WARNING"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    wait_healthy(f"http://127.0.0.1:{AGL_PORT}", proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _kv(key: str, value: str | int) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def otlp_span(rollout_id: str, attempt_id: str, index: int) -> bytes:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend([
        _kv("service.name", "bench"), _kv("agentlightning.rollout_id", rollout_id),
        _kv("agentlightning.attempt_id", attempt_id),
    ])
    span = resource_spans.scope_spans.add().spans.add()
    span.trace_id = os.urandom(16)
    span.span_id = os.urandom(8)
    span.name = f"bench.step.{index}"
    now = time.time_ns()
    span.start_time_unix_nano, span.end_time_unix_nano = now, now + 1000
    span.attributes.extend([_kv("step", index), _kv("gen_ai.prompt", "question " * 8)])
    return request.SerializeToString()


def warm_up(url: str, key: str, requests: int = 60) -> None:
    """First requests of a process import and connect lazily: keep them out of the figures."""
    with httpx.Client(base_url=url + "/v1/agl", timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(requests):
            client.post("/queues/rollouts/dequeue", json={"limit": 1, "worker_id": "warm"})
            client.get("/rollouts", params={"limit": 1})


def enqueue(url: str, key: str, count: int) -> None:
    with httpx.Client(base_url=url + "/v1/agl", timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as client:
        for start in range(0, count, 500):
            body = {"rollouts": [{"input": {"i": i}, "mode": "train"}
                                 for i in range(start, min(start + 500, count))]}
            client.post("/queues/rollouts/enqueue", json=body).raise_for_status()


ROUTES = ("dequeue", "otlp span", "complete")


def agl_style_runner(url: str, key: str, worker: str, counts: list[int], errors: list,
                     latencies: dict[str, list[float]]) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    clock = time.perf_counter
    with httpx.Client(base_url=url, timeout=60, headers=headers) as client:
        while True:
            try:
                started = clock()
                claimed = client.post("/v1/agl/queues/rollouts/dequeue",
                                      json={"limit": 1, "worker_id": worker})
                latencies["dequeue"].append(clock() - started)
                claimed.raise_for_status()
                if not claimed.json():
                    return
                rollout = claimed.json()[0]
                rid, aid = rollout["rollout_id"], rollout["attempt"]["attempt_id"]
                for index in range(4):
                    body = otlp_span(rid, aid, index)
                    started = clock()
                    answer = client.post("/v1/traces", content=body,
                                         headers={"Content-Type": "application/x-protobuf"})
                    latencies["otlp span"].append(clock() - started)
                    answer.raise_for_status()
                started = clock()
                answer = client.post(f"/v1/agl/rollouts/{rid}/attempts/{aid}",
                                     json={"status": "succeeded"})
                latencies["complete"].append(clock() - started)
                answer.raise_for_status()
                counts.append(1)
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                return


def run_threads(target, args_list: list[tuple]) -> float:
    threads = [threading.Thread(target=target, args=args) for args in args_list]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def agl_workload(url: str, key: str, rollouts: int, server: subprocess.Popen,
                 database: str | None) -> dict:
    """Runs the workload; measures the server's CPU (its processes, and the Postgres backends
    of `database` when it has one) over the runners' phase only. The caller reads commits."""
    warm_up(url, key)
    enqueue(url, key, rollouts)
    figures: dict = {}
    if database:
        connection.close()  # the benchmark's own backend: out of the way, its counts reported
        time.sleep(11)  # idle backends report their commit counts within 10 s
        figures["commits_before"] = commits(_dsn(), database)
    counts: list[int] = []
    errors: list[str] = []
    latencies: dict[str, list[float]] = {route: [] for route in ROUTES}
    meter = CpuMeter(server.pid, database)
    meter.start()
    elapsed = run_threads(agl_style_runner, [(url, key, f"runner-{i}", counts, errors,
                                              latencies) for i in range(RUNNERS)])
    cpu = meter.stop()
    if errors:
        print(f"  errors: {len(errors)}, first: {errors[0]}")
    done = len(counts)
    print(f"  {done} rollouts (dequeue + 4 OTLP spans + complete) by {RUNNERS} runners "
          f"in {elapsed:.2f} s")
    figures.update(rollouts=done, rate=done / elapsed,
                   web_ms=1000 * cpu["web"] / max(done, 1),
                   pg_ms=1000 * cpu["postgres"] / max(done, 1))
    print(f"  -> {figures['rate']:.1f} rollouts/s; server CPU per rollout "
          f"{figures['web_ms'] + figures['pg_ms']:.1f} ms (web {figures['web_ms']:.1f}, "
          f"Postgres {figures['pg_ms']:.1f})")
    for route in ROUTES:
        p50, p99 = percentiles(latencies[route])
        print(f"  {route:>10}: p50 {p50:.1f} ms, p99 {p99:.1f} ms ({len(latencies[route])})")
    return figures


def _dsn() -> dict:
    db = settings.DATABASES["default"]
    return {"user": db["USER"] or "postgres", "password": db["PASSWORD"] or None,
            "host": db["HOST"] or "127.0.0.1", "port": db["PORT"] or 5432}


def report_commits(figures: dict, database: str) -> None:
    """After the server stopped: its backends reported their counts as they exited."""
    wait_backends_gone(database)
    made = commits(_dsn(), database) - figures["commits_before"]
    figures["commits"] = made / max(figures["rollouts"], 1)
    print(f"  commits per rollout: {figures['commits']:.2f} ({made} in {database})")


def batched_client(url: str, key: str, rollouts: int, threads: int = 4, batch: int = 250
                   ) -> float:
    warm_up(url, key)
    enqueue(url, key, rollouts)
    done: list[int] = []

    def work(worker: str) -> None:
        with StoreClient(url, key) as client:
            while True:
                claimed = client.dequeue(worker_id=worker, limit=batch)
                if not claimed:
                    return
                spans = [
                    {"rollout_id": r["rollout_id"], "attempt_id": r["attempt"]["attempt_id"],
                     "sequence_id": i, "trace_id": os.urandom(16).hex(),
                     "span_id": os.urandom(8).hex(), "name": f"bench.step.{i}",
                     "attributes": {"step": i}, "start_time": time.time(),
                     "end_time": time.time()}
                    for r in claimed for i in range(4)
                ]
                client.add_spans(spans)
                client.update_attempts([
                    {"rollout_id": r["rollout_id"], "attempt_id": r["attempt"]["attempt_id"],
                     "status": "succeeded"} for r in claimed
                ])
                done.append(len(claimed))

    elapsed = run_threads(work, [(f"batch-{i}",) for i in range(threads)])
    print(f"  {sum(done)} rollouts (dequeue {batch}, spans and completions in batches) by "
          f"{threads} client threads in {elapsed:.2f} s")
    return sum(done) / elapsed


def span_ingest(url: str, key: str, batches: int, threads: int = 4, per_batch: int = 1000
                ) -> float:
    enqueue(url, key, threads)
    with StoreClient(url, key) as client:
        claimed = client.dequeue(worker_id="ingest", limit=threads)
    payload = "x" * 900  # with the other fields, about 1 KB of JSON per span
    bodies = []
    for t, rollout in enumerate(claimed):
        rid, aid = rollout["rollout_id"], rollout["attempt"]["attempt_id"]
        per_thread = []
        for b in range(batches):
            spans = [{"rollout_id": rid, "attempt_id": aid, "sequence_id": b * per_batch + i,
                      "trace_id": f"{t:032x}", "span_id": f"{b * per_batch + i:016x}",
                      "name": "llm.call", "attributes": {"gen_ai.prompt": payload, "i": i},
                      "start_time": 1.7e9, "end_time": 1.7e9 + 1}
                     for i in range(per_batch)]
            per_thread.append(httpx.Request("POST", "x", json={"spans": spans}).content)
        bodies.append(per_thread)
    sizes = sum(len(body) for body in bodies[0]) / (batches * per_batch)

    def send(thread_bodies: list[bytes]) -> None:
        with httpx.Client(base_url=url + "/v1/agl", timeout=120,
                          headers={"Authorization": f"Bearer {key}",
                                   "Content-Type": "application/json"}) as http:
            for body in thread_bodies:
                http.post("/spans/batch", content=body).raise_for_status()

    elapsed = run_threads(send, [(b,) for b in bodies])
    total = len(claimed) * batches * per_batch
    print(f"  {total} spans of ~{sizes:.0f} bytes in batches of {per_batch} by {threads} "
          f"client threads in {elapsed:.2f} s")
    return total / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=480)
    parser.add_argument("--batched-rollouts", type=int, default=6000)
    parser.add_argument("--span-batches", type=int, default=15)
    parser.add_argument("--server", choices=["uvicorn", "gunicorn"], default="uvicorn",
                        help="ours: the ASGI server (lightning_site/asgi.py) under uvicorn, "
                             "or Django under gunicorn gthread (the server before it)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--skip-agl", action="store_true")
    args = parser.parse_args()
    key = prepare_database()
    ours_url = f"http://127.0.0.1:{OURS_PORT}"
    figures: dict[str, dict] = {}

    database = settings.DATABASES["default"]["NAME"]
    ours = start_ours(args.server, args.workers, args.threads)
    try:
        print(f"(a) ours: {args.server} {args.workers} workers x {args.threads} threads, "
              f"Postgres {database}")
        figures["ours"] = agl_workload(ours_url, key, args.rollouts, ours, database)
    finally:
        stop(ours)
    report_commits(figures["ours"], database)
    if not args.skip_agl:
        agl = start_agl()
        try:
            print("(b) Agent Lightning 0.3: agl store --backend memory")
            figures["agl"] = agl_workload(f"http://127.0.0.1:{AGL_PORT}", key, args.rollouts,
                                          agl, None)
        finally:
            stop(agl)
        ours_f, agl_f = figures["ours"], figures["agl"]
        cpu_ours = ours_f["web_ms"] + ours_f["pg_ms"]
        cpu_agl = agl_f["web_ms"] + agl_f["pg_ms"]
        print(f"ratio ours/agl: throughput {ours_f['rate'] / agl_f['rate']:.2f}x "
              f"(target >= 1.3x), server CPU per rollout {cpu_ours / cpu_agl:.2f}x "
              f"(target <= 0.7x)")

    ours = start_ours(args.server, args.workers, args.threads)
    try:
        print("(c) ours, batched client")
        batched = batched_client(ours_url, key, args.batched_rollouts)
        print(f"  -> {batched:.0f} rollouts/s (target >= 1,000)")
        print("(d) ours, span ingest over HTTP")
        spans = span_ingest(ours_url, key, args.span_batches)
        print(f"  -> {spans:.0f} spans/s (target >= 15,000)")
    finally:
        stop(ours)


if __name__ == "__main__":
    main()
