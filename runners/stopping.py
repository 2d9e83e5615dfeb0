"""Freeing the slot of an agent whose attempt the store already ended (README "Hung agents").

The executor's watcher learns from its heartbeat that the store ended the attempt (timeout,
unresponsive, cancelled). It raises `AttemptCancelled` in the agent's thread, which stops an
agent running Python code; an agent blocked in a long call (`time.sleep`, a socket read, native
code) never sees it. `RUNNERS_STOP_GRACE_SECONDS` later, if the agent still runs:

- in a Celery prefork pool process, whose main thread runs the agent, the process ships the
  spans it holds and exits (`os._exit`); the pool replaces it, the slot is free. Nothing is
  reported: the store's verdict stands (a timeout stays a timeout, its retry happens as the
  rollout's config says). The task shows as failed (WorkerLostError) and its message goes back
  to the queue (task_reject_on_worker_lost), to find its rollout finished or to claim its retry;
- anywhere else (the threads or solo pool, the embedded default, the remote runner) the process
  serves other work and a thread cannot be stopped safely: the agent is abandoned to finish on
  its own and its slot stays held until then.

While the agent runs on after its attempt ended, the slot is recorded (runners.models.HeldSlot)
at each heartbeat, so queue_watch, the job page and /metrics show it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from collections.abc import Callable
from typing import Protocol

from celery.signals import worker_process_init
from django.conf import settings

log = logging.getLogger(__name__)

# The exit status of a pool process that gave up on its agent (EX_SOFTWARE): the worker logs
# "Worker exited prematurely: exitcode 70" for the task.
EXIT_STATUS = 70

_in_pool_process = False


@worker_process_init.connect
def _mark_pool_process(**kwargs: object) -> None:
    # Sent in prefork pool processes only (not by the threads or solo pool, nor in-process).
    global _in_pool_process
    _in_pool_process = True


def may_exit_process() -> bool:
    """Whether the calling thread may end its process to stop an agent: the main thread of a
    prefork pool process (the pool replaces it), and nothing else."""
    return _in_pool_process and threading.current_thread() is threading.main_thread()


def task_time_limits(timeout_seconds: float | None) -> tuple[int, int] | None:
    """The backstop: (soft, hard) Celery time limits of the task running a rollout with this
    timeout, for when the store's verdict never reaches the process (no sweep, or an agent that
    holds the GIL). Soft: the timeout plus a sweep, a heartbeat and twice the grace, by when the
    heartbeat path has acted; hard: 30 s later (the pool kills the process). Capped by the
    global CELERY_TASK_SOFT_TIME_LIMIT / CELERY_TASK_TIME_LIMIT. None without a timeout."""
    if not timeout_seconds or timeout_seconds <= 0:
        return None
    soft = math.ceil(timeout_seconds + settings.LIGHTNING_SWEEP_SECONDS
                     + settings.RUNNERS_HEARTBEAT_SECONDS + 2 * settings.RUNNERS_STOP_GRACE_SECONDS)
    soft = min(soft, settings.CELERY_TASK_SOFT_TIME_LIMIT)
    return soft, min(soft + 30, settings.CELERY_TASK_TIME_LIMIT)


class HeldSlots(Protocol):
    def mark(self, *, rollout_id: str, attempt_id: str) -> None: ...

    def release(self, *, rollout_id: str, attempt_id: str) -> None: ...


class Stopper:
    """One attempt's: `ended()` at each heartbeat that finds the attempt ended, `close()` when
    the agent returned."""

    def __init__(self, *, rollout_id: str, attempt_id: str, grace: float,
                 running: Callable[[], bool], may_exit: bool, held: HeldSlots | None = None,
                 before_exit: Callable[[], None] | None = None) -> None:
        self.rollout_id, self.attempt_id = rollout_id, attempt_id
        self.grace = grace
        self.running = running
        self.may_exit = may_exit
        self.held = held
        self.before_exit = before_exit
        self.abandoned = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._marked = False
        self._closed = False

    def ended(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._timer is None:
                self._timer = threading.Timer(self.grace, self._give_up)
                self._timer.name = f"stop-{self.attempt_id}"
                self._timer.daemon = True
                self._timer.start()
        if self.running() and self.held is not None:
            try:
                self.held.mark(rollout_id=self.rollout_id, attempt_id=self.attempt_id)
                self._marked = True
            except Exception:  # bookkeeping: the next heartbeat tries again
                log.exception("could not record the held slot of %s", self._key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
        self._release()

    @property
    def _key(self) -> str:
        return f"{self.rollout_id}/{self.attempt_id}"

    def _release(self) -> None:
        if self._marked and self.held is not None:
            try:
                self.held.release(rollout_id=self.rollout_id, attempt_id=self.attempt_id)
                self._marked = False
            except Exception:  # a stale row is removed by the reconcile
                log.exception("could not clear the held slot of %s", self._key)

    def _give_up(self) -> None:
        with self._lock:
            if self._closed or not self.running():
                return
        if not self.may_exit:
            self.abandoned = True
            log.warning(
                "attempt %s was ended by the store but its agent still runs %.0fs later; "
                "a thread cannot be stopped: it is abandoned and holds its slot until it returns",
                self._key, self.grace)
            return
        log.warning(
            "attempt %s was ended by the store but its agent still runs %.0fs later; this pool "
            "process (pid %d) exits to free its slot, and the pool replaces it",
            self._key, self.grace, os.getpid())
        if self.before_exit is not None:
            try:
                self.before_exit()
            except Exception:
                log.exception("attempt %s: could not ship its last spans", self._key)
        self._release()
        _exit_now()


def _exit_now() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(EXIT_STATUS)
