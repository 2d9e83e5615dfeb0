"""Fair capacity: one tenant saturates the server with waits and slow uploads; how long do
another tenant's requests take? Prints figures; asserts nothing. Not a test.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_fair_bench \\
        .venv/bin/python bench/fair_bench.py [--seconds 15] [--server uvicorn|gunicorn|both]

Tenant A (one runner key) keeps 48 `waits/rollouts` requests going (10 s each, on a rollout
that never finishes; after a 429 it asks again 50 ms later, ignoring Retry-After), and 16
clients without any key upload a body at 1 byte/s. Tenant B, meanwhile, sends one request
after another (statistics, a dequeue, a rollout query) and we print its p50/p99/max. Servers:
"gunicorn" is Django under gunicorn gthread, 2 workers x 8 threads (the server before the
ASGI front); "uvicorn" is the ASGI front (lightning_site/asgi.py), 2 processes x 8 threads,
default caps (16 waits per key, 64 per project, per process).
"""

from __future__ import annotations

import argparse
import os
import socket
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

import httpx  # noqa: E402
from django.db import connection  # noqa: E402

from bench.api_bench import OURS_PORT, start_ours, stop  # noqa: E402
from bench.benchdb import STORE_TABLES, empty_bench_database  # noqa: E402
from bench.serverstats import percentiles  # noqa: E402
from store import services  # noqa: E402

WAITERS, SLOW_UPLOADS = 48, 16


def tenants() -> tuple[str, str]:
    empty_bench_database(STORE_TABLES)
    noisy = services.project_create(name="noisy")
    quiet = services.project_create(name="quiet")
    keys = (services.api_key_create(project=noisy, role="algorithm")[1],
            services.api_key_create(project=quiet, role="algorithm")[1])
    connection.close()
    return keys


def noisy_waiter(url: str, key: str, rollout_id: str, stop_at: float, counts: dict) -> None:
    with httpx.Client(base_url=url + "/v1/agl", timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < stop_at:
            try:
                answer = client.post("/waits/rollouts",
                                     json={"rollout_ids": [rollout_id], "timeout": 10})
            except httpx.HTTPError:
                counts["errors"] += 1
                continue
            counts[answer.status_code] = counts.get(answer.status_code, 0) + 1
            if answer.status_code == 429:
                time.sleep(0.05)


def slow_upload(port: int, stop_at: float) -> None:
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/agl/queues/rollouts/dequeue HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        while time.monotonic() < stop_at:
            sock.sendall(b" ")
            time.sleep(1)
    except OSError:
        pass  # the server ended it (408): a fresh slow client takes its place
    finally:
        sock.close()
    if time.monotonic() < stop_at:
        slow_upload(port, stop_at)


def quiet_tenant(url: str, key: str, stop_at: float, samples: list[float]) -> int:
    failures = 0
    with httpx.Client(base_url=url + "/v1/agl", timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < stop_at:
            for method, path, body in (("GET", "/statistics", None),
                                       ("POST", "/queues/rollouts/dequeue", {"limit": 1}),
                                       ("GET", "/rollouts", None)):
                started = time.perf_counter()
                try:
                    answer = client.request(method, path, json=body)
                    failures += answer.status_code != 200
                except httpx.HTTPError:
                    failures += 1
                samples.append(time.perf_counter() - started)
    return failures


def scenario(server: str, seconds: float) -> None:
    noisy_key, quiet_key = tenants()
    proc = start_ours(server, 2, 8)
    url = f"http://127.0.0.1:{OURS_PORT}"
    try:
        with httpx.Client(base_url=url + "/v1/agl", timeout=30,
                          headers={"Authorization": f"Bearer {noisy_key}"}) as client:
            rollout_id = client.post("/rollouts", json={"input": {}}).json()["rollout_id"]
        with httpx.Client(base_url=url + "/v1/agl", timeout=30,
                          headers={"Authorization": f"Bearer {quiet_key}"}) as client:
            for _ in range(20):  # warm: the processes connect and import lazily
                client.get("/statistics")
        alone: list[float] = []
        quiet_tenant(url, quiet_key, time.monotonic() + 3, alone)
        stop_at = time.monotonic() + seconds
        counts: dict = {"errors": 0}
        noise = [threading.Thread(target=noisy_waiter, args=(url, noisy_key, rollout_id,
                                                             stop_at, counts))
                 for _ in range(WAITERS)]
        noise += [threading.Thread(target=slow_upload, args=(OURS_PORT, stop_at))
                  for _ in range(SLOW_UPLOADS)]
        for thread in noise:
            thread.start()
        time.sleep(1)  # the noise takes its hold
        loaded: list[float] = []
        failures = quiet_tenant(url, quiet_key, stop_at, loaded)
        for thread in noise:
            thread.join(timeout=30)
    finally:
        stop(proc)
    for name, samples in (("alone", alone), ("under saturation", loaded)):
        p50, p99 = percentiles(samples)
        print(f"  tenant B {name:>16}: {len(samples)} requests, p50 {p50:.1f} ms, "
              f"p99 {p99:.1f} ms, max {max(samples) * 1000:.1f} ms")
    print(f"  tenant B failures under saturation: {failures}; tenant A's waits answered: "
          f"{ {k: v for k, v in counts.items() if v} }")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--server", choices=["uvicorn", "gunicorn", "both"], default="both")
    args = parser.parse_args()
    for server in (["gunicorn", "uvicorn"] if args.server == "both" else [args.server]):
        print(f"{server}: tenant A runs {WAITERS} waits and {SLOW_UPLOADS} slow uploads for "
              f"{args.seconds:.0f} s")
        scenario(server, args.seconds)


if __name__ == "__main__":
    main()
