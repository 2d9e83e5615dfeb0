"""The cost of looking at a project's GPU quota (README "Quotas"): `gpu_quotas` on a project
whose last 24 h hold many attempts' ledger rows (no GPU) and some training steps' (GPU), past
its cap, as a train-step message (`reached_only`) and the admin page (every capped project)
ask it. Prints the median of repeated calls; asserts nothing.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_quota_bench \
        .venv/bin/python bench/quota_bench.py [--attempts 100000] [--steps 2000]

Uses (and empties) its own database, whose name must contain "bench".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench")

import django  # noqa: E402

django.setup()

from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.benchdb import STORE_TABLES, empty_bench_database  # noqa: E402
from store import selectors, services  # noqa: E402
from store.models import UsageEntry  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=100_000, help="rows without GPU")
    parser.add_argument("--steps", type=int, default=2_000, help="rows with GPU-seconds")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    empty_bench_database(["store_usageentry", *STORE_TABLES])
    project = services.project_create(name="quota-bench")
    now = timezone.now()
    day = 86_000.0
    rows = [UsageEntry(project=project, kind="attempt", cpu_seconds=1.0,
                       created_at=now - timedelta(seconds=day * i / args.attempts))
            for i in range(args.attempts)]
    rows += [UsageEntry(project=project, kind="step", gpu_seconds=10.0, gpu_type="H100",
                        created_at=now - timedelta(seconds=day * i / args.steps))
             for i in range(args.steps)]
    UsageEntry.objects.bulk_create(rows, batch_size=5_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE store_usageentry")
    services.project_quota_set(project=project, gpu_seconds_per_day=args.steps * 5.0)
    for label, reached_only in (("a train-step message (reached_only)", True),
                                ("the admin page (every capped project)", False)):
        seconds = []
        for _ in range(args.calls):
            started = time.perf_counter()
            quota = selectors.gpu_quotas(project_ids=[project.pk], reached_only=reached_only)
            seconds.append(time.perf_counter() - started)
        print(f"{label}: median {statistics.median(seconds) * 1000:.2f} ms over {args.calls} "
              f"calls; {quota[project.pk].describe()}")
    print(f"rows in the window: {args.attempts} without GPU, {args.steps} with; load "
          f"{open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
