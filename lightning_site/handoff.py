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
import collections
import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()
_Future = asyncio.Future  # what `run` hands over (the C class: loop.create_future's type)


class Pool:
    """`threads` daemon threads running calls handed over by `run`.

    `lifo`: a call goes to the thread that became idle last (each idle thread waits on a
    queue of its own), so a light load keeps to the same few threads and their database
    connections, warm, instead of every thread in turn; with none idle, calls wait in order
    for the next thread to finish."""

    def __init__(self, threads: int, name: str = "web", lifo: bool = False) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lifo = lifo
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # idle threads' own queues, the last on top
        self._backlog: collections.deque = collections.deque()  # calls no thread was idle for
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _put(self, call: Any) -> None:
        if not self._lifo:
            self._calls.put(call)
            return
        with self._lock:
            if not self._idle:
                self._backlog.append(call)
                return
            inbox = self._idle.pop()
        inbox.put(call)

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """`fn(*args)` on a pool thread; await the future for its result (or exception)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._put((loop, future, fn, args))
        return future

    def submit(self, fn: Callable[..., Any], args: tuple,
               done: Callable[[Any, BaseException | None], None]) -> None:
        """`fn(*args)` on a pool thread, then `done(result, None)` (or `done(None, exc)`) on
        the running loop's thread: `run` without a future, for a caller that is a callback
        itself (lightning_site/leanwire.py)."""
        self._put((asyncio.get_running_loop(), done, fn, args))

    def shutdown(self) -> None:
        """Threads stop once the calls queued before this one are done."""
        for _ in self._threads:
            self._put(_STOP)

    def _ready(self, inbox: queue.SimpleQueue | None) -> Any:
        """With `lifo`: the oldest call no thread was idle for, or None having put this
        thread on top of the idle ones (before its result goes back: the caller's next call
        finds it idle)."""
        if inbox is None:
            return None
        with self._lock:
            if self._backlog:
                return self._backlog.popleft()
            self._idle.append(inbox)
        return None

    def _work(self) -> None:
        inbox = queue.SimpleQueue() if self._lifo else None
        call = self._ready(inbox)
        while True:
            if call is None:
                call = inbox.get() if inbox is not None else self._calls.get()
            if call is _STOP:
                return
            loop, future, fn, args = call
            back: tuple | None = None
            if type(future) is not _Future:  # submit's callback
                try:
                    back = (_call_back, loop, future, fn(*args), None)
                except BaseException as exc:
                    back = (_call_back, loop, future, None, exc)
            elif not future.cancelled():  # else its request went away while it waited
                try:
                    back = (_hand_back, loop, future.set_result, future, fn(*args))
                except BaseException as exc:  # to the awaiting request, as an executor would
                    back = (_hand_back, loop, future.set_exception, future, exc)
            del call, future, args
            call = self._ready(inbox)
            if back is not None:
                back[0](*back[1:])
            del back  # no reference kept while the thread waits for the next


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
