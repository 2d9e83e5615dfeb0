"""Server CPU per request of single lean routes over HTTP, through uvicorn and the ASGI front
(lightning_site/asgi.py), with the front's settings alternated in one run: what
bench/lean_routes_bench.py leaves out (HTTP parsing and writing, the hand-off to a thread),
without bench/agl_mix_bench.py's runners (whose CPU, on a shared 2-core machine, moves the
figures more than the server's changes do). Prints figures; asserts nothing. Not a test.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_front_bench \
        .venv/bin/python bench/front_bench.py [--requests 3000] [--rounds 2] \
        [--variants WEB_INLINE=0,WEB_INLINE=1]

For each round and each variant (environment settings of the server), it starts the server
(one process, `--threads` threads), and for each route (the resources read, a 16-span OTLP
export, a `spans` write, a worker heartbeat) sends `--requests` requests over `--connections`
keep-alive connections from an asyncio client in another process (raw HTTP/1.1: the client
costs little), then prints the server's CPU (its process, from /proc) and its Postgres
backends' per request. Uses (and empties) its own database, whose name must contain "bench".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from multiprocessing import Process
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import api_bench as ab  # noqa: E402 - sets Django up
from bench.lean_routes_bench import otlp_export  # noqa: E402
from bench.serverstats import CpuMeter  # noqa: E402
from bench.span_routes_bench import agl_span  # noqa: E402
from store.models import Project  # noqa: E402
from store.services import RolloutSpec  # noqa: E402

ROUTES = ("resources", "OTLP export", "spans", "heartbeat", "spans/next", "verdict")


def requests_for(route: str, key: str, resources_id: str, claimed: list, count: int
                 ) -> list[bytes]:
    """`count` raw HTTP/1.1 requests of one route (distinct spans: each one is stored; a
    verdict each for `count` claimed attempts)."""
    head = f"Host: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"

    def post(path: str, kind: str, body: bytes) -> bytes:
        return (f"POST {path} HTTP/1.1\r\n{head}Content-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    made = []
    for index in range(count):
        rollout_id, attempt_id = claimed[index % len(claimed)]
        if route == "resources":
            made.append(f"GET /v1/agl/resources/{resources_id} HTTP/1.1\r\n{head}\r\n".encode())
        elif route == "OTLP export":
            made.append(post("/v1/traces", "application/x-protobuf",
                             otlp_export(rollout_id, attempt_id, 16)))
        elif route == "spans/next":
            made.append(post("/v1/agl/spans/next", "application/json", json.dumps(
                {"rollout_id": rollout_id, "attempt_id": attempt_id}).encode()))
        elif route == "verdict":
            made.append(post(f"/v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}",
                             "application/json", b'{"status": "succeeded"}'))
        elif route == "spans":
            span = agl_span(rollout_id, attempt_id, index)
            span["sequence_id"] = 1000 + index
            made.append(post("/v1/agl/spans", "application/json", json.dumps(span).encode()))
        else:
            body = json.dumps({"heartbeat_stats": {"sent": index}}).encode()
            made.append(post(f"/v1/agl/workers/bench-{index % 16}", "application/json", body))
    return made


async def _connection(requests: list[bytes], failures: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", ab.OURS_PORT)
    for request in requests:
        writer.write(request)
        status = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        await reader.readexactly(length)
        if not status.startswith(b"HTTP/1.1 20"):
            failures.append(status)
    writer.close()


def send(requests: list[bytes], connections: int) -> None:
    """In a process of its own: the requests over `connections` connections."""
    failures: list = []

    async def run() -> None:
        await asyncio.gather(*(_connection(requests[i::connections], failures)
                               for i in range(connections)))

    asyncio.run(run())
    if failures:
        sys.exit(f"{len(failures)} requests failed, e.g. {failures[0]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="per route and variant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--variants", default="WEB_INLINE=0,WEB_INLINE=1",
                        help="comma-separated settings of the server, one variant each: "
                        "NAME=VALUE, or several joined by +")
    parser.add_argument("--routes", default=",".join(ROUTES),
                        help=f"comma-separated, of: {', '.join(ROUTES)}")
    args = parser.parse_args()
    routes = args.routes.split(",")
    key = ab.prepare_database()
    project = Project.objects.get()
    added = ab.services.resources_add(project=project, resources={"llm": {"resource_type": "llm"}})
    resources_id = added.resource_set.resources_id
    database = ab.settings.DATABASES["default"]["NAME"]
    variants = args.variants.split(",")  # each NAME=VALUE[+NAME=VALUE...]
    totals = {(v, r): [0.0, 0.0] for v in variants for r in routes}
    for _ in range(args.rounds):
        for variant in variants:
            ab.services.rollout_enqueue_many(project=project,
                                             specs=[RolloutSpec(input=i) for i in range(16)])
            claimed = [(r.pk, a.attempt_id) for r, a in ab.services.rollout_dequeue_many(
                project=project, worker_id="bench", limit=16)]
            verdicts = []
            if "verdict" in routes:
                # A claimed attempt per verdict, of one worker per client connection (as
                # runners have: a verdict writes its worker's row); connection i sends
                # requests i, i + connections, ...
                per = args.requests // args.connections + 1
                ab.services.rollout_enqueue_many(project=project, specs=[
                    RolloutSpec(input=i) for i in range(per * args.connections)])
                by_worker: list[list] = [[] for _ in range(args.connections)]
                for w, mine in enumerate(by_worker):
                    while len(mine) < per:  # a dequeue's limit is capped
                        mine += [(r.pk, a.attempt_id) for r, a in
                                 ab.services.rollout_dequeue_many(
                                     project=project, worker_id=f"bench-{w}",
                                     limit=per - len(mine))]
                verdicts = [by_worker[j % args.connections][j // args.connections]
                            for j in range(args.requests)]
            for setting in variant.split("+"):
                name, value = setting.split("=", 1)
                os.environ[name] = value
            server = ab.start_ours("uvicorn", 1, args.threads)
            try:
                for route in routes:
                    made = requests_for(route, key, resources_id,
                                        verdicts if route == "verdict" else claimed,
                                        args.requests)
                    warm = Process(target=send, args=(made[:200], args.connections))
                    warm.start()
                    warm.join()
                    meter = CpuMeter(server.pid, database)
                    meter.start()
                    client = Process(target=send, args=(made[200:], args.connections))
                    client.start()
                    client.join()
                    time.sleep(0.3)
                    used = meter.stop()
                    if client.exitcode:
                        sys.exit(f"{route}: the client failed")
                    totals[(variant, route)][0] += used.get("web", 0.0)
                    totals[(variant, route)][1] += used.get("postgres", 0.0)
            finally:
                ab.stop(server)
    count = (args.requests - 200) * args.rounds
    print(f"{count} requests per route and variant over {args.connections} connections, "
          f"1 server process x {args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    width = max(24, *(len(v) for v in variants))
    print(f"  {'per request, us':<16} " + " ".join(f"{v:>{width}}" for v in variants))
    for route in routes:
        cells = [f"{1e6 * totals[(v, route)][0] / count:9.0f} + "
                 f"{1e6 * totals[(v, route)][1] / count:5.0f} PG"
                 for v in variants]
        print(f"  {route:<16} " + " ".join(f"{c:>{width}}" for c in cells))


if __name__ == "__main__":
    main()
