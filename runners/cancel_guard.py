"""Stopping an agent's thread when its rollout is cancelled, only where it is safe to.

`AttemptCancelled` is raised in the agent's thread with `PyThreadState_SetAsyncExc`: Python
raises it at the thread's next bytecode, wherever that is. Landing inside a library the agent
called, it can leave that library's shared state broken: raised inside httpx's connection pool
it left every later request of every thread sharing the client (the usual module-level OpenAI
or httpx client) waiting forever, no timeout firing; an asynchronous LLM job's worker stalled
with all 64 slots held that way (five injections into 64 threads sharing one `httpx.Client`
were enough; tests/test_cancel_guard.py). So the stop is raised only while the
thread runs the agent's own code: the innermost Python frame of the thread is a file of the
agent's top-level package (its directory). Python checks for a pending exception when a
function starts, so it is raised in the agent's code or at the entry of the next function
the agent calls, before that function has taken anything. The frame is looked at just before
the stop is raised and just after (taken back if the thread ran meanwhile and left its code:
the GIL can change hands between the two). A thread that is elsewhere (in a
library's call, blocked in a socket read) is tried again every `RETRY_SECONDS` until it comes
back to its own code or returns; one that never does is left to the grace of
runners/stopping.py (a prefork process exits; a thread is abandoned, its slot shown held).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from typing import Any

from runners.agent import RolloutInfo

RETRY_SECONDS = 0.02


class AttemptCancelled(BaseException):
    """Raised in the agent's thread when its rollout is cancelled. A BaseException, so that an
    agent's `except Exception` does not swallow it."""


def agent_home(fn: Any) -> str | None:
    """The directory of the agent's top-level package (or its module's file, for a top-level
    module): the code the stop may land in. None when it cannot be told (not stopped then)."""
    target = getattr(fn, "__func__", fn)
    module = getattr(target, "__module__", None) or type(target).__module__
    top = (module or "").split(".")[0]
    try:
        spec = importlib.util.find_spec(top) if top else None
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.join(list(spec.submodule_search_locations)[0], "")
    return spec.origin if spec.origin and os.path.isabs(spec.origin) else None  # not 'built-in'


class CancelGuard:
    """Stops the agent's thread at most once, only while the agent runs and only at a point
    of its own code."""

    def __init__(self, info: RolloutInfo) -> None:
        self.info = info
        self.thread_id = threading.get_ident()
        self.stop_requested = False
        self.ended = False  # the stop came because the store ended the attempt
        self._lock = threading.Lock()
        self._running = False
        self._injected = False
        self._home: str | None = None

    def enter(self, fn: Any) -> None:
        with self._lock:
            self._home = agent_home(fn)
            self._running = not self.stop_requested
        if self.stop_requested:
            raise AttemptCancelled()

    def leave(self) -> None:
        with self._lock:
            self._running = False
            if self._injected:
                # Drop a stop that was raised too late to land inside the agent.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)

    def running(self) -> bool:
        return self._running

    def cancel(self, *, ended: bool = False) -> None:
        """Ask the agent to stop: `rollout.cancelled` is set now (an agent may poll it), and
        `AttemptCancelled` is raised in its thread once it runs its own code."""
        self.ended = self.ended or ended
        self.info.cancelled.set()
        with self._lock:
            first = not self.stop_requested
            self.stop_requested = True
        if first and not self._try_stop():
            threading.Thread(target=self._stop_when_safe, name="cancel-guard",
                             daemon=True).start()

    def _stop_when_safe(self) -> None:
        event = threading.Event()
        while not self._try_stop():
            event.wait(RETRY_SECONDS)

    def _try_stop(self) -> bool:
        """True when done: the stop is raised, or the agent no longer runs."""
        with self._lock:
            if not self._running or self._injected:
                return True
            if not self._at_home():
                return False
            thread = ctypes.c_ulong(self.thread_id)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(thread, ctypes.py_object(AttemptCancelled))
            if not self._at_home():  # it ran meanwhile (the GIL changed hands) and left
                ctypes.pythonapi.PyThreadState_SetAsyncExc(thread, None)  # taken back
                return False
            self._injected = True
            return True

    def _at_home(self) -> bool:
        frame = sys._current_frames().get(self.thread_id)
        return (frame is not None and self._home is not None
                and frame.f_code.co_filename.startswith(self._home))
