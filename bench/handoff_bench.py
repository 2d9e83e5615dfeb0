"""Microbenchmark of the ASGI front's hand-off of a call to a pool thread and back
(lightning_site/handoff.py) against `loop.run_in_executor(ThreadPoolExecutor)`, which the
front used before: CPU per call, on uvloop, 8 threads, 16 calls in flight. Prints figures;
asserts nothing.

    .venv/bin/python bench/handoff_bench.py [--calls 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_site.handoff import Pool  # noqa: E402

IN_FLIGHT = 16


def work(x: int) -> int:
    return x


async def through_executor(pool: ThreadPoolExecutor, calls: int) -> None:
    loop = asyncio.get_running_loop()
    for start in range(0, calls, IN_FLIGHT):
        await asyncio.gather(*(loop.run_in_executor(pool, work, i)
                               for i in range(start, start + IN_FLIGHT)))


async def through_pool(pool: Pool, calls: int) -> None:
    for start in range(0, calls, IN_FLIGHT):
        await asyncio.gather(*(pool.run(work, i) for i in range(start, start + IN_FLIGHT)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for name in ("run_in_executor", "handoff.Pool"):
            cpu, wall = time.process_time(), time.perf_counter()
            if name == "run_in_executor":
                executor = ThreadPoolExecutor(8)
                uvloop.run(through_executor(executor, args.calls))
                executor.shutdown()
            else:
                pool = Pool(8)
                uvloop.run(through_pool(pool, args.calls))
                pool.shutdown()
            cpu_us = 1e6 * (time.process_time() - cpu) / args.calls
            wall_us = 1e6 * (time.perf_counter() - wall) / args.calls
            print(f"{name:>16}: {cpu_us:5.1f} us CPU per call ({wall_us:.1f} us wall)")


if __name__ == "__main__":
    main()
