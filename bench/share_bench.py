"""Fair share, priority and the claim's cost (README "Scheduling"). Prints figures; asserts
nothing. Not a test.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_share_bench \\
        .venv/bin/python bench/share_bench.py [--seconds 30] [--rollout 0.3]

Uses (and empties) its own database, whose name must contain "bench"; one real
`celery worker -Q rollouts -c 2` (prefork) on a private RabbitMQ vhost.

1. Fair share: project A (weight 2) with jobs a1, a2 (1:1) and project B (weight 1) enqueue far
   more rollouts of `--rollout` seconds than the workers can run (A's first: in send order B
   would get nothing); for `--seconds` the workers are saturated. Worker-seconds per party
   (attempt wall time, clipped to the window) against its entitlement (a1 1/3, a2 1/3, B 1/3).
2. Priority: while the backlog still saturates the workers, 10 times a batch of priority-10
   rollouts (one per slot) of project B is enqueued; the wait of each (enqueue to claim) is at
   most one rollout's length once a slot frees, whatever the backlog. p95 of the 20 waits.
3. Claim rate, same run, workers stopped: the old claim of a message (named: the rollout it
   was sent for) and the new one (a ticket: the fair choice across projects), alternating,
   claims/s each, on a backlog of 3 projects x 2 parties.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench")

import django  # noqa: E402

django.setup()

from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.benchdb import STORE_TABLES, empty_bench_database  # noqa: E402
from bench.celery_bench import broker, worker  # noqa: E402
from runners.services import CELERY, rollouts_enqueue_for_celery  # noqa: E402
from store import services  # noqa: E402
from store.models import Attempt, Rollout  # noqa: E402
from store.services import RolloutSpec  # noqa: E402

AGENT = "bench.bench_agents:sleep_agent"
SLOTS = 2  # bench.celery_bench.worker: -c 2


def reset() -> None:
    empty_bench_database(STORE_TABLES + ["store_party", "runners_celeryworker"])


def enqueue(project, n, seconds, party="", priority=0):
    specs = [RolloutSpec(input={"seconds": seconds}, priority=priority,
                         config={"timeout_seconds": 60}) for _ in range(n)]
    return rollouts_enqueue_for_celery(project=project, specs=specs, agent=AGENT, party=party)


def worker_seconds(parties: dict, start, end) -> dict[str, float]:
    totals = dict.fromkeys(parties, 0.0)
    claims = dict.fromkeys(parties, 0)
    for name, (project, key) in parties.items():
        attempts = Attempt.objects.filter(rollout__project=project, rollout__party__key=key,
                                          start_time__lt=end)
        for a in attempts.values("start_time", "end_time"):
            stop = min(a["end_time"] or end, end)
            begin = max(a["start_time"], start)
            totals[name] += max((stop - begin).total_seconds(), 0.0)
            claims[name] += a["start_time"] >= start
    print(f"claims in the window: {claims}")
    return totals


def fair_and_priority(seconds: float, rollout: float) -> tuple[float, float]:
    a = services.project_create(name="share-a")
    b = services.project_create(name="share-b")
    services.share_set(project=a, weight=2)
    backlog = int(seconds * SLOTS / rollout * 1.5) + 50
    enqueue(a, backlog, rollout, party="a1")
    enqueue(a, backlog, rollout, party="a2")
    enqueue(b, backlog, rollout)
    parties = {"A/a1": (a, "a1"), "A/a2": (a, "a2"), "B": (b, "")}
    entitled = {"A/a1": 1 / 3, "A/a2": 1 / 3, "B": 1 / 3}
    while not Attempt.objects.exists():  # the worker took its first ticket
        time.sleep(0.05)
    start = timezone.now()
    time.sleep(seconds)
    end = timezone.now()
    used = worker_seconds(parties, start, end)
    total = sum(used.values())
    errors = {}
    for name, value in used.items():
        share = value / total if total else 0.0
        errors[name] = abs(share - entitled[name]) / entitled[name] * 100
        print(f"{name}: {value:.2f} worker-s = {share:.3f} of {total:.2f} "
              f"(entitled {entitled[name]:.3f}; error {errors[name]:.1f}%)")
    waits = []
    for _ in range(10):
        batch = enqueue(b, SLOTS, rollout, priority=10)
        ids = [r.pk for r in batch]
        while Rollout.objects.filter(pk__in=ids, status__in=["queuing", "requeuing"]).exists():
            time.sleep(0.01)
        for r in Rollout.objects.filter(pk__in=ids).select_related("latest_attempt"):
            waits.append((r.latest_attempt.start_time - r.enqueue_time).total_seconds())
        time.sleep(rollout * 3)
    queued = Rollout.objects.filter(status__in=["queuing", "requeuing"]).count()
    p95 = statistics.quantiles(waits, n=20)[-1]
    print(f"priority-10 waits (enqueue to claim), {len(waits)} rollouts, {queued} lower ones "
          f"still queued: p50 {statistics.median(waits):.3f} s, p95 {p95:.3f} s, "
          f"max {max(waits):.3f} s (a {rollout} s rollout holds a slot)")
    return max(errors.values()), p95


def claim_rates(rounds: int, per_round: int) -> float:
    projects = [services.project_create(name=f"rate-{i}") for i in range(3)]
    named: list[str] = []
    for project in projects:
        for party in ("p1", "p2"):
            named += [r.pk for r in enqueue(project, rounds * per_round, 1.0, party=party)]
    by_id = dict(Rollout.objects.filter(pk__in=named).values_list("pk", "project_id"))
    # Statistics of the filled tables, as autovacuum keeps them (migration 0003): without
    # them the planner reads every queued rollout to lock one (3x slower, measured).
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE store_rollout, store_party")
    old, new = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(per_round):  # the old claim: the message's own rollout, FIFO
            rid = named.pop(0)
            project = next(p for p in projects if p.pk == by_id[rid])
            services.rollout_claim(project=project, rollout_id=rid, worker_id="bench")
        old.append(per_round / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(per_round):  # the new claim: a ticket
            claimed = services.rollout_claim_next(dispatch=CELERY, max_timeout=60.0,
                                                  worker_id="bench")
            if claimed:
                named.remove(claimed[0].pk)
        new.append(per_round / (time.perf_counter() - start))
    before, after = statistics.median(old), statistics.median(new)
    print(f"claim rate, {rounds} alternating rounds of {per_round}: named (before) "
          f"{before:.0f}/s, fair ticket (after) {after:.0f}/s")
    return after / before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0, help="fair-share window")
    parser.add_argument("--rollout", type=float, default=0.3, help="seconds per rollout")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=150)
    args = parser.parse_args()
    reset()
    with broker("rabbitmq") as (url, env), worker(url, env):
        error, p95 = fair_and_priority(args.seconds, args.rollout)
    reset()
    ratio = claim_rates(args.rounds, args.per_round)
    print(f"load: {open('/proc/loadavg').read().split()[:3]}")
    print(f"fair share error={error:.1f}% priority_p95_wait_s={p95:.3f} "
          f"claim_rate_ratio={ratio:.2f}")


if __name__ == "__main__":
    main()
