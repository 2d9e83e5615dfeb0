"""lightning_site/handoff.py: the ASGI front's hand-off of a call to a pool thread and of its
result (or exception) back to the awaiting request; a request that went away drops its call."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lightning_site.handoff import Pool


def test_a_call_runs_on_a_pool_thread_and_its_result_or_error_comes_back():
    pool = Pool(2, name="t")

    def where(x):
        return x * 2, threading.current_thread().name

    def boom():
        raise ValueError("no")

    async def main():
        doubled, thread = await pool.run(where, 21)
        assert doubled == 42 and thread.startswith("t_")
        with pytest.raises(ValueError, match="no"):
            await pool.run(boom)
        results = await asyncio.gather(*(pool.run(where, i) for i in range(50)))
        assert [r[0] for r in results] == [2 * i for i in range(50)]

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_a_call_whose_request_went_away_before_it_ran_is_dropped():
    pool = Pool(1, name="t")
    gate, ran = threading.Event(), []

    async def main():
        busy = pool.run(gate.wait)  # holds the only thread
        dropped = pool.run(ran.append, "ran")
        dropped.cancel()
        gate.set()
        await busy
        await pool.run(lambda: None)  # queued after the dropped one: it has been passed

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
    assert ran == []
