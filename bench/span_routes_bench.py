"""Server CPU per span of AGL 0.3's per-span JSON requests against the OTLP export. Prints
figures; asserts nothing. Not a test.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_span_bench \
        .venv/bin/python bench/span_routes_bench.py [--spans 3200] [--rounds 4] \
        [--server uvicorn|gunicorn]

Our server (as bench/api_bench.py starts it, with its own default number of processes unless
`--workers` says otherwise), 16 runner threads, each on a rollout of its own (claimed before
the measurement) with a keep-alive client of its own, each span one request or two, in four
phases of `--spans` spans each, run in turn in `--rounds` rounds (a machine whose speed
drifts by a fifth within a minute, as shared ones do, then slows every phase alike, not the
one that ran during the slow spell): (1) OTLP/HTTP protobuf to `/v1/traces` (one span per
request, as AGL's exporter sends them); (2) `POST /v1/agl/spans/next` alone; (3) `POST
/v1/agl/spans` alone (the span as AGL's client sends it, its sequence id left to the store);
(4) what AGL's client sends per span it adds as JSON (`add_otel_span`): `spans/next`, then
`spans` with that id; and (5) the floor of a second request per span: `GET
/v1/agl/resources/{id}`, the cheapest lean request (one short SELECT, nothing written),
whose cost plus (3)'s is what any pair of requests per span costs at least. For each: server
CPU per span (web processes + the benchmark database's Postgres backends,
bench/serverstats.py), spans/s, p50/p99 per request. `--server gunicorn` runs Django alone
(no lean paths): the figures before them.

Uses (and empties) its own database, whose name must contain "bench"; port BENCH_PORT_BASE
(default 18090).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import api_bench as ab  # noqa: E402 - sets Django up
from bench.serverstats import CpuMeter, percentiles  # noqa: E402
from lightning_site.web import default_workers  # noqa: E402

RUNNERS = 16


def agl_span(rollout_id: str, attempt_id: str, index: int) -> dict:
    """A span as AGL 0.3's client posts it (`Span.model_dump`), of bench/api_bench.py's size."""
    now = time.time()
    return {
        "rollout_id": rollout_id, "attempt_id": attempt_id, "sequence_id": None,
        "trace_id": os.urandom(16).hex(), "span_id": os.urandom(8).hex(), "parent_id": None,
        "name": f"bench.step.{index}", "status": {"status_code": "UNSET", "description": None},
        "attributes": {"step": index, "gen_ai.prompt": "question " * 8},
        "events": [], "links": [], "start_time": now, "end_time": now + 1e-6,
        "context": {"trace_id": "", "span_id": "", "is_remote": False, "trace_state": {}},
        "parent": None,
        "resource": {"attributes": {"service.name": "bench"}, "schema_url": ""},
    }


def add_resources(url: str, key: str) -> str:
    """A resources version to read (the floor phase's request)."""
    with ab.httpx.Client(base_url=url + "/v1/agl", timeout=60,
                         headers={"Authorization": f"Bearer {key}"}) as client:
        answer = client.post("/resources", json={"llm": {"resource_type": "llm",
                                                          "endpoint": "http://x",
                                                          "model": "m"}})
        answer.raise_for_status()
        return answer.json()["resources_id"]


def claim_all(url: str, key: str) -> list[tuple[str, str]]:
    with ab.httpx.Client(base_url=url + "/v1/agl", timeout=60,
                         headers={"Authorization": f"Bearer {key}"}) as client:
        claimed = client.post("/queues/rollouts/dequeue",
                              json={"limit": RUNNERS, "worker_id": "bench"}).json()
    return [(r["rollout_id"], r["attempt"]["attempt_id"]) for r in claimed]


class Tally:
    """One phase's figures, summed over its rounds."""

    def __init__(self) -> None:
        self.web = self.pg = self.elapsed = 0.0
        self.done = 0
        self.latencies: dict[str, list[float]] = {"otlp": [], "next": [], "spans": [],
                                                  "read": []}
        self.errors: list[str] = []


def phase(name: str, clients: list, server, database: str, targets: list, spans: int,
          tally: Tally, resources_id: str = "") -> None:
    """Run one round of one phase (`spans` spans over the runners), adding to `tally`."""
    per_runner = spans // RUNNERS
    latencies, errors = tally.latencies, tally.errors
    clock = time.perf_counter

    def runner(client, rollout_id: str, attempt_id: str) -> None:
        try:
            for index in range(per_runner):
                seq = None
                if name == "read":
                    started = clock()
                    client.get(f"/v1/agl/resources/{resources_id}").raise_for_status()
                    latencies["read"].append(clock() - started)
                    continue
                if name == "otlp":
                    started = clock()
                    client.post("/v1/traces", content=ab.otlp_span(rollout_id, attempt_id,
                                                                    index),
                                headers={"Content-Type": "application/x-protobuf"}
                                ).raise_for_status()
                    latencies["otlp"].append(clock() - started)
                    continue
                if name in ("next", "pair"):
                    started = clock()
                    answer = client.post("/v1/agl/spans/next", json={
                        "rollout_id": rollout_id, "attempt_id": attempt_id})
                    latencies["next"].append(clock() - started)
                    answer.raise_for_status()
                    seq = answer.json()["sequence_id"]
                if name in ("spans", "pair"):
                    span = agl_span(rollout_id, attempt_id, index)
                    span["sequence_id"] = seq
                    started = clock()
                    client.post("/v1/agl/spans", json=span).raise_for_status()
                    latencies["spans"].append(clock() - started)
        except ab.httpx.HTTPError as exc:
            errors.append(repr(exc))

    meter = CpuMeter(server.pid, database)
    meter.start()
    tally.elapsed += ab.run_threads(runner, [(client, *target) for client, target
                                             in zip(clients, targets[:RUNNERS], strict=True)])
    cpu = meter.stop()
    tally.web += cpu["web"]
    tally.pg += cpu["postgres"]
    tally.done += per_runner * RUNNERS


def report(name: str, tally: Tally) -> float:
    """Print one phase's figures; return its server CPU per span (us)."""
    web, pg = (1e6 * cpu / tally.done for cpu in (tally.web, tally.pg))
    label = {"otlp": "OTLP export (1 span/request)", "next": "spans/next alone",
             "spans": "spans alone (id from the store)",
             "pair": "AGL add_otel_span: spans/next + spans",
             "read": "floor: a resources read per span"}[name]
    errors = tally.errors
    print(f"{label:>40}: {web + pg:6.0f} us server CPU per span (web {web:.0f}, "
          f"Postgres {pg:.0f}); {tally.done / tally.elapsed:.0f} spans/s" + (
              f"; {len(errors)} errors, first {errors[0]}" if errors else ""))
    for route, samples in tally.latencies.items():
        if samples:
            p50, p99 = percentiles(samples)
            print(f"{'':>42}{route}: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    return web + pg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spans", type=int, default=3200, help="spans per phase")
    parser.add_argument("--rounds", type=int, default=4,
                        help="the phases run in turn this many times, each round with "
                             "spans/rounds spans: a drift in the machine's speed falls on "
                             "every phase alike")
    parser.add_argument("--server", choices=["uvicorn", "gunicorn"], default="uvicorn")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="our server's processes (default: its own, $WEB_WORKERS or half "
                             "the CPUs)")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    key = ab.prepare_database()
    database = ab.settings.DATABASES["default"]["NAME"]
    url = f"http://127.0.0.1:{ab.OURS_PORT}"
    server = ab.start_ours(args.server, args.workers, args.threads)
    try:
        ab.warm_up(url, key)
        ab.enqueue(url, key, RUNNERS)
        targets = claim_all(url, key)
        ab.connection.close()
        print(f"ours: {args.server} {args.workers} workers x {args.threads} threads, "
              f"{RUNNERS} runner threads, {args.spans} spans per phase in {args.rounds} "
              "rounds")
        names = ("otlp", "next", "spans", "pair", "read")
        resources_id = add_resources(url, key)
        tallies = {name: Tally() for name in names}
        clients = [ab.httpx.Client(base_url=url, timeout=60,
                                   headers={"Authorization": f"Bearer {key}"})
                   for _ in range(RUNNERS)]
        try:
            for _ in range(args.rounds):
                for name in names:
                    phase(name, clients, server, database, targets,
                          args.spans // args.rounds, tallies[name], resources_id)
        finally:
            for client in clients:
                client.close()
        cost = {name: report(name, tallies[name]) for name in names}
        print(f"per span, AGL's pair / the OTLP export: {cost['pair'] / cost['otlp']:.2f}x "
              f"(issue 27's target: <= 1.5x); its floor, `spans` plus the cheapest lean "
              f"request: {(cost['spans'] + cost['read']) / cost['otlp']:.2f}x")
    finally:
        ab.stop(server)


if __name__ == "__main__":
    main()
