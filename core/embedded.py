"""The embedded default: real Celery workers and the sweep inside this process.

With no DATABASE_URL and no CELERY_BROKER_URL, settings choose SQLite and Celery's in-memory
transport; `embedded_workers()` then starts one real Celery worker (`WorkController`, thread
pool) per queue in threads of this process, and a thread that runs the control work (the
store's watchdog sweep, reconciliation, registered reconcilers) on the configured schedule. The
tasks and services are the distributed mode's; only the transport and the threads differ.

    with embedded_workers() as workers:        # rollouts + training, and the sweep
        rollouts_enqueue_for_celery(...)         # messages go to the in-process workers
        ...wait for the work...

Messages live in memory: those not consumed when the block ends are lost, and the next
`embedded_workers()` re-sends them at start (the rows are the truth).

The control work, the re-send and the workers' bookkeeping are the runners app's: it plugs
them in from its AppConfig.ready() (`register_control`), so this kernel module names no app
and a trainer command can run the workers without importing runners (README "Layout").
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from celery.worker import WorkController
from celery.worker import state as worker_state
from django.conf import settings
from django.db import connections

from core import agl_roles
from core.celery import app as celery_app
from core.queues import Queue

log = logging.getLogger(__name__)

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 120.0


@dataclass(frozen=True)
class Control:
    """What the app that owns the workers and the control work plugs in (runners)."""

    sweep: Callable[[], dict[str, int]]  # one round of the control work: what beat's tasks run
    resend_queued: Callable[[], int]  # send every queued rollout's message again, now
    worker_stopped: Callable[[str, int], None]  # a hosted worker's goodbye: (node name, pid)


_control: list[Control] = []


def register_control(control: Control) -> None:
    """Plug in (or replace) the control work the embedded workers run."""
    _control[:] = [control]


def _plugged() -> Control:
    if not _control:
        raise RuntimeError("no app plugged in the embedded control work (runners does, from "
                           "its AppConfig.ready(): is it in INSTALLED_APPS?)")
    return _control[0]


@dataclass
class EmbeddedWorkers:
    control: Control
    workers: dict[str, WorkController] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)
    stop_sweep: threading.Event = field(default_factory=threading.Event)

    def sweep_now(self) -> dict[str, int]:
        """Run the control work once, now (the sweep thread also runs it on schedule)."""
        return self.control.sweep()


@contextmanager
def embedded_workers(
    *, queues: Sequence[str] | None = None, concurrency: Mapping[str, int] | None = None,
    sweep_seconds: float | None = None, loglevel: str = "WARNING",
) -> Iterator[EmbeddedWorkers]:
    """Run Celery workers for `queues` (one worker per queue, threads) and the sweep in this
    process while the block runs. `queues` defaults to those of the process's AGL role
    (core/agl_roles.py: both queues unless AGL_CURRENT_ROLE says `runner` or
    `algorithm`). `concurrency` maps a queue to its worker's thread count
    (default: EMBEDDED_ROLLOUT_CONCURRENCY for rollouts, 1 for the others); `sweep_seconds`
    defaults to LIGHTNING_SWEEP_SECONDS. Stopping waits for running tasks (warm shutdown)."""
    concurrency = dict(concurrency or {})
    if queues is None:
        queues = agl_roles.embedded_queues(agl_roles.current_role())
    state = EmbeddedWorkers(control=_plugged())
    celery_app.finalize()
    celery_app.set_current()
    try:
        for queue in queues:
            threads = concurrency.get(
                str(queue),
                settings.EMBEDDED_ROLLOUT_CONCURRENCY if queue == Queue.ROLLOUTS else 1,
            )
            _start_worker(state, str(queue), threads, loglevel)
        # What the previous run left queued lost its in-memory messages: send them again.
        state.control.resend_queued()
        sweep = threading.Thread(
            target=_sweep_loop, name="embedded-sweep", daemon=True,
            args=(state, sweep_seconds or settings.LIGHTNING_SWEEP_SECONDS),
        )
        sweep.start()
        state.threads.append(sweep)
        yield state
    finally:
        _stop(state)


def _start_worker(state: EmbeddedWorkers, queue: str, threads: int, loglevel: str) -> None:
    ready = threading.Event()
    worker = WorkController(
        app=celery_app, hostname=f"{queue}@embedded-{os.getpid()}", queues=[queue],
        pool_cls="threads", concurrency=threads, loglevel=loglevel,
        ready_callback=lambda *args: ready.set(),
        without_heartbeat=True, without_mingle=True, without_gossip=True,
    )
    thread = threading.Thread(target=worker.start, name=f"embedded-worker-{queue}", daemon=True)
    thread.start()
    state.workers[queue] = worker
    state.threads.append(thread)
    if not ready.wait(READY_TIMEOUT):
        raise RuntimeError(f"the embedded worker for {queue!r} did not start")


def _sweep_loop(state: EmbeddedWorkers, interval: float) -> None:
    try:
        while not state.stop_sweep.wait(interval):
            try:
                state.sweep_now()
            except Exception:  # a failed sweep is retried at the next interval
                log.exception("embedded sweep failed")
    finally:
        connections.close_all()


def _stop(state: EmbeddedWorkers) -> None:
    state.stop_sweep.set()
    # The consumer loops check this flag and shut down warm (running tasks finish first).
    worker_state.should_terminate = 0
    try:
        for thread in state.threads:
            thread.join(STOP_TIMEOUT)
            if thread.is_alive():
                log.error("embedded thread %s did not stop in %ss", thread.name, STOP_TIMEOUT)
    finally:
        worker_state.should_terminate = None
        _say_goodbye(state)


def _say_goodbye(state: EmbeddedWorkers) -> None:
    """Mark this process's workers stopped. The registry's bootstep does it on a worker's
    own shutdown, which a thread-hosted worker stopped by flag does not always reach: runs
    left rows "alive" with no process behind them."""
    for worker in state.workers.values():
        try:
            state.control.worker_stopped(worker.hostname, os.getpid())
        except Exception:  # bookkeeping: never in the way of stopping
            log.exception("embedded worker %s: goodbye failed", worker.hostname)
