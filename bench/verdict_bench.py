"""A runner's "succeeded" verdict in-process, on Postgres: the one-statement final verdict
(store/services/_verdict.py) against the full path (`attempt_update_many`: BEGIN, the locking
read, the write, COMMIT), alternating in rounds over claimed rollouts. Prints the CPU per
verdict of this process (Python) and of its Postgres backend (from /proc; run it on the
database's machine). Prints figures; asserts nothing.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_bench \
        .venv/bin/python bench/verdict_bench.py [--verdicts 2000] [--rounds 4]

Uses (and empties) its own database, whose name must contain "bench".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402

from bench.benchdb import STORE_TABLES, empty_bench_database  # noqa: E402
from store import services  # noqa: E402
from store.services import AttemptUpdate, RolloutSpec  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def claimed(project, n: int) -> list[tuple[str, str]]:
    services.rollout_enqueue_many(project=project, specs=[RolloutSpec(input=i) for i in range(n)])
    pairs = []
    while len(pairs) < n:
        batch = services.rollout_dequeue_many(project=project, worker_id="bench", limit=100)
        pairs += [(r.pk, a.attempt_id) for r, a in batch]
    return pairs


def full(project, rollout_id: str, attempt_id: str) -> None:
    services.attempt_update_many(
        project=project, updates=[AttemptUpdate(rollout_id, attempt_id, "succeeded")])


def common(project, rollout_id: str, attempt_id: str) -> None:
    services.attempt_update(project=project, rollout_id=rollout_id, attempt_id=attempt_id,
                            status="succeeded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verdicts", type=int, default=2000, help="per path and round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if "bench" not in settings.DATABASES["default"]["NAME"]:
        sys.exit("refusing to empty a database whose name does not contain 'bench'")
    empty_bench_database(STORE_TABLES)
    project = services.project_create(name="bench")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    totals: dict[str, list[float]] = {"full path": [0, 0], "one statement": [0, 0]}
    for _ in range(args.rounds):
        for name, verdict in (("full path", full), ("one statement", common)):
            pairs = claimed(project, args.verdicts)
            python, postgres = time.process_time(), backend_cpu(backend)
            for rollout_id, attempt_id in pairs:
                verdict(project, rollout_id, attempt_id)
            totals[name][0] += time.process_time() - python
            totals[name][1] += backend_cpu(backend) - postgres
    count = args.verdicts * args.rounds
    for name, (python, postgres) in totals.items():
        print(f"{name:>14}: Python {1e6 * python / count:6.0f} us, Postgres "
              f"{1e6 * postgres / count:6.0f} us per verdict ({count} verdicts)")


if __name__ == "__main__":
    main()
