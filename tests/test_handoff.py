"""lightning_site/handoff.py: the ASGI front's hand-off of a call to a pool thread and of its
result (or exception) back to the awaiting request; a request that went away drops its call."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lightning_site.handoff import Pool


@pytest.mark.parametrize("lifo", [False, True])
def test_a_call_runs_on_a_pool_thread_and_its_result_or_error_comes_back(lifo):
    pool = Pool(2, name="t", lifo=lifo)

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


@pytest.mark.parametrize("lifo", [False, True])
def test_a_call_whose_request_went_away_before_it_ran_is_dropped(lifo):
    pool = Pool(1, name="t", lifo=lifo)
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


@pytest.mark.parametrize("lifo", [False, True])
def test_submit_calls_back_on_the_loop_thread(lifo):
    pool = Pool(2, name="t", lifo=lifo)

    def boom():
        raise ValueError("no")

    async def main():
        loop = asyncio.get_running_loop()
        got = []
        done = asyncio.Event()

        def back(result, exc):
            got.append((result, type(exc), threading.current_thread() is threading.main_thread()))
            if len(got) == 2:
                done.set()

        pool.submit(lambda x: x + 1, (41,), back)
        pool.submit(boom, (), back)
        await asyncio.wait_for(done.wait(), 10)
        assert sorted(got, key=str) == sorted([(42, type(None), True), (None, ValueError, True)],
                                              key=str)
        assert loop.is_running()

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_lifo_hands_a_call_to_the_thread_idle_last():
    pool = Pool(4, name="t", lifo=True)

    async def main():
        await asyncio.sleep(0.2)  # every thread idle
        names = {await pool.run(lambda: threading.current_thread().name) for _ in range(40)}
        assert len(names) == 1  # one after another: always the same, warm, thread
        gate = threading.Event()
        held = [pool.run(gate.wait) for _ in range(6)]  # 4 threads, 2 calls wait in order
        await asyncio.sleep(0.1)
        gate.set()
        await asyncio.gather(*held)

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
