"""CPU per request of each route AGL 0.3's runners send, in process: the lean handlers the
ASGI front calls (store/api/fastjson.py, fastpath.py), called directly, without HTTP. Prints
figures; asserts nothing. Not a test.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_lean_bench \
        .venv/bin/python bench/lean_routes_bench.py [--rollouts 1000] [--rounds 3]

Each round enqueues `--rollouts` rollouts, then runs one phase per route over all of them, in
the order a runner sends them (bench/agl_mix_bench.py counts that mix from the server side):
dequeue (limit 1), the resources read, one OTLP export of 16 spans of ~1 KB of attributes
each (`--spans`), `spans/next`, `spans` (the reward a rollout function returns, with that
id), the "succeeded" verdict. For each route: this process's CPU (`time.process_time`: the
handler's Python, psycopg included) and its Postgres backend's (from /proc: run it on the
database's machine) per request, and the statements it ran (`pg_stat_database`'s commits in
autocommit, approximate). What it leaves out is what bench/agl_mix_bench.py measures beside
it: HTTP parsing and writing (uvicorn), the front's hand-off to a thread, the runners.

Uses (and empties) its own database, whose name must contain "bench".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import api_bench as ab  # noqa: E402 - sets Django up
from bench.serverstats import commits  # noqa: E402
from bench.span_routes_bench import agl_span  # noqa: E402
from bench.verdict_bench import backend_cpu  # noqa: E402
from store.api import fastjson, fastpath  # noqa: E402
from store.models import Project  # noqa: E402
from store.services import RolloutSpec  # noqa: E402

ROUTES = ("dequeue", "resources", "OTLP export", "spans/next", "spans", "verdict")
ATTRIBUTES = {f"bench.attr.{i}": f"value {i} " + "x" * 100 for i in range(8)}


def otlp_export(rollout_id: str, attempt_id: str, spans: int) -> bytes:
    """One OTLP export of a rollout's spans, as AGL's tracer sends it (one request)."""
    request = ab.ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend([
        ab._kv("service.name", "bench"), ab._kv("agentlightning.rollout_id", rollout_id),
        ab._kv("agentlightning.attempt_id", attempt_id),
    ])
    scope = resource_spans.scope_spans.add()
    now = time.time_ns()
    for index in range(spans):
        span = scope.spans.add()
        span.trace_id, span.span_id = os.urandom(16), os.urandom(8)
        span.name = f"round{index}"
        span.start_time_unix_nano, span.end_time_unix_nano = now, now + 1000
        span.attributes.extend(ab._kv(k, v) for k, v in ATTRIBUTES.items())
    return request.SerializeToString()


def requests_for(key: str, resources_id: str, claimed: tuple[str, str], spans: int) -> dict:
    """route -> (handler, headers, path, body) for one claimed rollout (`spans`: the body is
    made when its phase comes, with the id `spans/next` handed out)."""
    rollout_id, attempt_id = claimed
    base = {b"host": b"127.0.0.1", b"authorization": f"Bearer {key}".encode()}
    as_json = {**base, b"content-type": b"application/json"}
    return {
        "resources": (fastjson.get_resources, base, f"/v1/agl/resources/{resources_id}", b""),
        "OTLP export": (lambda headers, path, body: fastpath.otlp_traces(headers, body),
                        {**base, b"content-type": b"application/x-protobuf"}, "/v1/traces",
                        otlp_export(rollout_id, attempt_id, spans)),
        "spans/next": (fastjson.next_span_sequence_id, as_json, fastjson.NEXT_SPAN_PATH,
                       json.dumps({"rollout_id": rollout_id, "attempt_id": attempt_id}).encode()),
        "spans": (fastjson.add_span, as_json, fastjson.SPANS_PATH, None),
        "verdict": (fastjson.update_attempt, as_json,
                    f"/v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}",
                    json.dumps({"status": "succeeded"}).encode()),
        "claimed": claimed,
    }


class Meter:
    """This process's CPU, its Postgres backend's, and the database's commits (the
    backend's statistics flushed first: pg_stat_force_next_flush)."""

    def __init__(self, database: str) -> None:
        self.database = database
        with ab.connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            self.backend = cursor.fetchone()[0]

    def read(self) -> tuple[float, float, int]:
        with ab.connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")
        time.sleep(0.05)
        return (time.process_time(), backend_cpu(self.backend),
                commits(ab._dsn(), self.database))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spans", type=int, default=16, help="spans per OTLP export")
    args = parser.parse_args()
    key = ab.prepare_database()
    project = Project.objects.get()
    added = ab.services.resources_add(project=project, resources={"llm": {"resource_type": "llm"}})
    resources_id = added.resource_set.resources_id
    meter = Meter(ab.settings.DATABASES["default"]["NAME"])
    headers = {b"host": b"127.0.0.1", b"authorization": f"Bearer {key}".encode(),
               b"content-type": b"application/json"}
    dequeue_body = json.dumps({"limit": 1, "worker_id": "bench"}).encode()
    totals = {route: [0.0, 0.0, 0] for route in ROUTES}
    for _ in range(args.rounds):
        ab.services.rollout_enqueue_many(
            project=project, specs=[RolloutSpec(input=i) for i in range(args.rollouts)])
        plans = []
        before = meter.read()
        for _ in range(args.rollouts):
            answer = fastjson.dequeue(headers, fastjson.DEQUEUE_PATH, dequeue_body)
            plans.append(json.loads(answer[2])[0])
        _add(totals["dequeue"], before, meter.read())
        plans = [requests_for(key, resources_id,
                              (body["rollout_id"], body["attempt"]["attempt_id"]), args.spans)
                 for body in plans]
        for route in ROUTES[1:]:
            if route == "spans":  # the reward, with the id spans/next handed out for it
                for plan in plans:
                    span = agl_span(*plan["claimed"], 0)
                    span["sequence_id"] = plan["sequence_id"]
                    plan["spans"] = plan["spans"][:3] + (json.dumps(span).encode(),)
            before = meter.read()
            for plan in plans:
                handler, route_headers, path, body = plan[route]
                answer = handler(route_headers, path, body)
                if answer is None or answer[0] >= 300:
                    sys.exit(f"{route}: the lean path did not answer ({answer})")
                plan["answer"] = answer
            _add(totals[route], before, meter.read())
            if route == "spans/next":
                for plan in plans:
                    plan["sequence_id"] = json.loads(plan["answer"][2])["sequence_id"]
    count = args.rollouts * args.rounds
    print(f"in process, {count} rollouts ({args.rounds} rounds of {args.rollouts}), "
          f"{args.spans} spans per export; load average {os.getloadavg()[0]:.2f}")
    print(f"  {'per request':<14} {'Python us':>10} {'Postgres us':>12} {'commits':>8}")
    for route, (python, postgres, done) in totals.items():
        print(f"  {route:<14} {1e6 * python / count:10.0f} {1e6 * postgres / count:12.0f} "
              f"{done / count:8.2f}")
    python, postgres = (sum(t[i] for t in totals.values()) for i in (0, 1))
    print(f"  {'a rollout':<14} {1e6 * python / count:10.0f} {1e6 * postgres / count:12.0f}")


def _add(total: list, before: tuple, after: tuple) -> None:
    """One phase: CPU and commits between two readings (less the reading's own commit)."""
    total[0] += after[0] - before[0]
    total[1] += after[1] - before[1]
    total[2] += after[2] - before[2] - 1


if __name__ == "__main__":
    main()
