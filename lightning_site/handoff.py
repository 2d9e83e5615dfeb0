"""The ASGI front's threads: a call handed from the event loop to a pool thread, its result
handed back, with as little machinery as the hand-off needs.

`loop.run_in_executor(ThreadPoolExecutor)` builds a concurrent.futures.Future (a Condition
and its lock) per call, chains it to an asyncio future through callbacks, and takes and gives
a semaphore per call to decide whether to start a thread; on the API's hot path that was a
tenth of the server's samples while it held the GIL (py-spy `--gil --native`,
bench/api_bench.py). Here a call is one put on a C queue (queue.SimpleQueue) and one
`call_soon_threadsafe` with its result: the same threads, the same behaviour seen from the
loop (the awaiting request gets the result or the exception; a request cancelled meanwhile
drops it).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = None
_Future = asyncio.Future  # what `run` hands over (the C class: loop.create_future's type)


class Pool:
    """`threads` daemon threads running calls handed over by `run`."""

    def __init__(self, threads: int, name: str = "web") -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """`fn(*args)` on a pool thread; await the future for its result (or exception)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return future

    def submit(self, fn: Callable[..., Any], args: tuple,
               done: Callable[[Any, BaseException | None], None]) -> None:
        """`fn(*args)` on a pool thread, then `done(result, None)` (or `done(None, exc)`) on
        the running loop's thread: `run` without a future, for a caller that is a callback
        itself (lightning_site/leanwire.py)."""
        self._calls.put((asyncio.get_running_loop(), done, fn, args))

    def shutdown(self) -> None:
        """Threads stop once the calls queued before this one are done."""
        for _ in self._threads:
            self._calls.put(_STOP)

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            if call is _STOP:
                return
            loop, future, fn, args = call
            if type(future) is not _Future:  # submit's callback
                try:
                    _call_back(loop, future, fn(*args), None)
                except BaseException as exc:
                    _call_back(loop, future, None, exc)
                del call, future, args
                continue
            if future.cancelled():  # its request went away while it waited
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting request, as an executor would
                _hand_back(loop, future.set_exception, future, exc)
            else:
                _hand_back(loop, future.set_result, future, result)
            del call, future, args  # no reference kept while the thread waits for the next


def _call_back(loop: asyncio.AbstractEventLoop, done: Callable, result: Any,
               exc: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(done, result, exc)
    except RuntimeError:  # the loop closed (the server is stopping): nobody is waiting
        pass


def _hand_back(loop: asyncio.AbstractEventLoop, setter: Callable, future: asyncio.Future,
               value: Any) -> None:
    try:
        loop.call_soon_threadsafe(_settle, setter, future, value)
    except RuntimeError:  # the loop closed (the server is stopping): nobody is waiting
        pass


def _settle(setter: Callable, future: asyncio.Future, value: Any) -> None:
    if not future.cancelled():
        setter(value)
