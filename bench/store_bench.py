"""Service-layer benchmark of the store on Postgres. Prints figures; asserts nothing.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_bench \
        .venv/bin/python bench/store_bench.py [--quick]

Uses (and empties) its own database, whose name must contain "bench". Figures:
enqueue_many; claim+complete in batches of 10 (target >= 2,000 rollouts/s); spans of ~1 KB
attributes in batches (target >= 20,000 spans/s); dequeue latency at queue depth 1,000 vs
1,000,000 (target within 2x); one sweep over 1,000,000 live attempts of which 1,000 are
overdue (target < 1 s). The throughput figures are given for one process and for several
(as several API or worker processes write at once in a deployment), timed from the moment
all start together; the spans are built before the clock starts (the caller's work). Bulk
fixtures for the last two are written with SQL, not measured.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench")

import django  # noqa: E402

django.setup()

from django.db import connection  # noqa: E402

from bench.benchdb import STORE_TABLES, empty_bench_database  # noqa: E402
from store import services, watchdog  # noqa: E402
from store.models import Attempt, Project, Rollout  # noqa: E402
from store.services import AttemptUpdate, RolloutSpec  # noqa: E402

TABLES = STORE_TABLES


def reset() -> None:
    empty_bench_database(TABLES)


def analyze() -> None:
    """Fresh planner statistics: TRUNCATE leaves the last run's, which describe other data."""
    with connection.cursor() as cursor:
        for table in TABLES:
            cursor.execute(f"ANALYZE {table}")


def rate(label: str, count: int, seconds: float, unit: str, target: float | None = None) -> None:
    goal = f"  (target >= {target:,.0f})" if target else ""
    print(f"{label:<44} {count / seconds:>12,.0f} {unit}/s{goal}")


def bench_enqueue(project, n: int) -> None:
    specs = [RolloutSpec(input={"task": i, "pad": "x" * 64}, mode="train") for i in range(n)]
    start = time.perf_counter()
    for i in range(0, n, 1000):
        services.rollout_enqueue_many(project=project, specs=specs[i : i + 1000])
    rate("enqueue_many (batches of 1,000)", n, time.perf_counter() - start, "rollouts")


# The start line of the multi-process runs (set before forking, inherited by the workers).
_barrier = None


def _in_worker(call) -> tuple[int, float, float]:
    loop, args = call
    connection.close()  # a fresh connection per process
    return loop(*args, barrier=_barrier)


def timed_runs(loop, args_list: list[tuple]) -> tuple[int, float]:
    """Run `loop(*args, barrier=...)` once per args: here for one, else in as many processes
    that start together. Each run returns (count, start, end); the answer is the total count
    and the seconds from the first start to the last end."""
    global _barrier
    if len(args_list) == 1:
        results = [loop(*args_list[0])]
    else:
        connection.close()
        context = multiprocessing.get_context("fork")
        _barrier = context.Barrier(len(args_list))
        with context.Pool(len(args_list)) as pool:
            results = pool.map(_in_worker, [(loop, args) for args in args_list])
    done = sum(count for count, _, _ in results)
    return done, max(end for _, _, end in results) - min(start for _, start, _ in results)


def _claim_complete_loop(project_id: int, worker: str, n: int, barrier=None
                         ) -> tuple[int, float, float]:
    """Claim and complete up to n rollouts in batches of 10; (count, start, end)."""
    project = Project.objects.get(pk=project_id)
    if barrier is not None:
        barrier.wait()  # every process starts at once
    start = time.time()
    done = 0
    while done < n:
        claimed = services.rollout_dequeue_many(project=project, worker_id=worker, limit=10)
        if not claimed:
            break
        services.attempt_update_many(project=project, updates=[
            AttemptUpdate(r.pk, a.attempt_id, status="succeeded") for r, a in claimed
        ])
        done += len(claimed)
    return done, start, time.time()


def bench_claim_complete(project, n: int, processes: int) -> None:
    runs = [(project.pk, f"bench{i}", n) for i in range(processes)]
    done, elapsed = timed_runs(_claim_complete_loop, runs)
    label = f"claim + complete (batches of 10, {processes} proc)"
    rate(label, done, elapsed, "rollouts", 2000)


def _spans_loop(project_id: int, n: int, batch: int, barrier=None) -> tuple[int, float, float]:
    """Add n spans of ~1 KB in batches over 20 attempts of a fresh rollout batch; each span's
    attributes are its own dict (as spans parsed from a request are). The spans are built
    first (the caller's work, not the store's); returns (count, start, end) of the adding."""
    project = Project.objects.get(pk=project_id)
    services.rollout_enqueue_many(project=project, specs=[RolloutSpec(input=i) for i in range(20)])
    claimed = services.rollout_dequeue_many(project=project, worker_id="spans", limit=20)
    batches, seq = [], 0
    while seq < n:
        rollout, attempt = claimed[(seq // batch) % len(claimed)]
        spans = []
        for _ in range(batch):
            seq += 1
            spans.append({
                "rollout_id": rollout.pk, "attempt_id": attempt.attempt_id, "sequence_id": seq,
                "trace_id": f"{seq:032x}", "span_id": f"{seq:016x}", "name": "llm.call",
                "attributes": {f"attr.{k}": f"{seq:08d}" + "v" * 32 for k in range(20)},
                "start_time": 1.0, "end_time": 2.0,
            })
        batches.append(spans)
    if barrier is not None:
        barrier.wait()  # every process starts adding at once
    start = time.time()
    for spans in batches:
        services.spans_add(project=project, spans=spans)
    return seq, start, time.time()


def bench_spans(project, n: int, batch: int, processes: int) -> None:
    done, elapsed = timed_runs(_spans_loop, [(project.pk, n, batch)] * processes)
    label = f"spans_add (~1 KB, batches of {batch}, {processes} proc)"
    rate(label, done, elapsed, "spans", 20000)


def clone_rows(model, template_pk, count: int, overrides: dict[str, str], params: list) -> None:
    """Insert `count` copies of one row with SQL, overriding some columns by expressions of
    the series index `g`; every other column (including ones added later) is copied."""
    fields = [f for f in model._meta.concrete_fields if not (f.primary_key and f.column == "id"
              and f.get_internal_type() == "BigAutoField")]
    columns = ", ".join(f'"{f.column}"' for f in fields)
    values = ", ".join(overrides.get(f.column, f't."{f.column}"') for f in fields)
    table = model._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f'INSERT INTO "{table}" ({columns}) SELECT {values} '
            f'FROM "{table}" t, generate_series(1, %s) g WHERE t."{model._meta.pk.column}" = %s '
            "ON CONFLICT DO NOTHING",
            params + [count, template_pk],
        )
        cursor.execute(f'ANALYZE "{table}"')


def fill_queue(project, depth: int) -> None:
    template = services.rollout_enqueue(project=project, spec=RolloutSpec(input={}))
    clone_rows(Rollout, template.pk, depth - 1, {
        "id": "'ro-' || substr(md5(random()::text || g::text), 1, 12)",
        "enqueue_time": "now() - make_interval(secs => %s - g)",
    }, [depth])


def dequeue_latency(project, samples: int) -> float:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        services.rollout_dequeue(project=project, worker_id="lat")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_dequeue_depth(big: int, samples: int) -> None:
    small_p = services.project_create(name="depth-small")
    big_p = services.project_create(name="depth-big")
    fill_queue(small_p, 1000)
    t0 = time.perf_counter()
    fill_queue(big_p, big)
    print(f"(fixture: {big:,} queued rollouts written in {time.perf_counter() - t0:.1f}s)")
    small = dequeue_latency(small_p, samples)
    large = dequeue_latency(big_p, samples)
    print(f"{'dequeue latency, depth 1,000 (median)':<44} {small * 1000:>12.2f} ms")
    print(f"{f'dequeue latency, depth {big:,} (median)':<44} {large * 1000:>12.2f} ms"
          f"  ratio {large / small:.2f}x (target <= 2x)")


def bench_sweep(total: int, overdue: int) -> None:
    project = services.project_create(name="sweep")
    fill_queue(project, total)
    t0 = time.perf_counter()
    claimed = services.rollout_dequeue(project=project)
    assert claimed is not None
    template = claimed[1]
    fields = [f for f in Attempt._meta.concrete_fields if f.column != "id"]
    columns = ", ".join(f'"{f.column}"' for f in fields)
    overrides = {
        "rollout_id": "r.id",
        "attempt_id": "'at-' || substr(md5(r.id), 1, 8)",
        "status": "'running'",
        "start_time": "now() - interval '10 seconds'",
        "deadline": "CASE WHEN row_number() OVER (ORDER BY r.id) <= %s "
                    "THEN now() - interval '1 second' ELSE now() + interval '1 hour' END",
    }
    values = ", ".join(overrides.get(f.column, f't."{f.column}"') for f in fields)
    with connection.cursor() as cursor:
        # One live attempt per queued rollout; `overdue` of them past their deadline.
        cursor.execute(
            f"INSERT INTO store_attempt ({columns}) SELECT {values} FROM store_rollout r, "
            "store_attempt t WHERE t.id = %s AND r.project_id = %s AND r.status = 'queuing'",
            [overdue, template.pk, project.pk],
        )
        cursor.execute(
            """
            UPDATE store_rollout r SET status = 'running', latest_attempt_id = a.id,
                attempt_count = 1, config = '{"timeout_seconds": 5, "max_attempts": 1}'::jsonb
            FROM store_attempt a WHERE a.rollout_id = r.id AND r.project_id = %s
            """,
            [project.pk],
        )
        cursor.execute("ANALYZE store_attempt")
        cursor.execute("ANALYZE store_rollout")
    print(f"(fixture: {total:,} live attempts written in {time.perf_counter() - t0:.1f}s)")
    start = time.perf_counter()
    result = watchdog.sweep(batch_size=1000)
    elapsed = time.perf_counter() - start
    print(f"{f'sweep: {total:,} live attempts, {overdue:,} overdue':<44} {elapsed:>12.3f} s"
          f"  changed {result.changed:,} (target < 1 s)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--processes", type=int, default=4,
                        help="concurrent claimers in the parallel claim+complete run")
    args = parser.parse_args()
    big = 20_000 if args.quick else 1_000_000
    reset()
    print(f"store benchmark on {connection.vendor} {connection.settings_dict['NAME']}, "
          f"{os.cpu_count()} CPUs")
    project = services.project_create(name="bench")
    n = 2_000 if args.quick else 20_000
    bench_enqueue(project, 3 * n)
    analyze()
    bench_claim_complete(project, n, processes=1)
    bench_claim_complete(project, 2 * n, processes=args.processes)
    spans_project = services.project_create(name="spans")
    bench_spans(spans_project, n=n * 2, batch=500, processes=1)
    bench_spans(spans_project, n=n, batch=500, processes=2)
    bench_dequeue_depth(big, samples=50 if args.quick else 200)
    bench_sweep(big, 1000 if not args.quick else 100)


if __name__ == "__main__":
    main()
