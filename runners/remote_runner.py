"""The remote runner: claims rollouts over HTTP and runs them through the shared executor.

One dispatcher (the main thread) claims as many rollouts as there are free slots, in one
dequeue that long-polls while the queue is empty; a thread pool runs each claimed attempt with
`runners.executor.execute` over an `HttpGateway`. The store being unreachable (a restart, a
network blip) is waited out with backoff; nothing held is dropped. `stop()` (SIGTERM) stops
claiming and lets the attempts already held finish and report before returning.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from runners.client import ApiError, StoreClient, StoreUnavailable
from runners.executor import ExecutorOptions, execute
from runners.gateway import Claim
from runners.remote import HttpGateway

log = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def default_server() -> str | None:
    """AGL users set AGL_SERVER_HOST / AGL_SERVER_PORT; we read them too."""
    host = os.environ.get("AGL_SERVER_HOST")
    if not host:
        return None
    return f"http://{host}:{os.environ.get('AGL_SERVER_PORT', '4747')}"


@dataclass
class RunnerOptions:
    agent: str
    concurrency: int = 1
    worker_id: str = ""
    wait_seconds: float = 5.0
    heartbeat_seconds: float = 5.0
    span_batch_size: int = 100
    max_rollouts: int | None = None  # stop after claiming this many (tests, one-off jobs)
    retry_pause: float = 1.0


class RemoteRunner:
    def __init__(self, client: StoreClient, options: RunnerOptions) -> None:
        self.client = client
        self.options = options
        self.worker_id = options.worker_id or default_worker_id()
        self.gateway = HttpGateway(client, wait_seconds=options.wait_seconds)
        self.executor_options = ExecutorOptions(
            heartbeat_seconds=options.heartbeat_seconds,
            span_batch_size=options.span_batch_size,
        )
        self._stop = threading.Event()
        self._slots = threading.Semaphore(options.concurrency)
        self.claimed = 0
        self.finished: dict[str, str] = {}  # rollout id -> outcome status

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        with ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="rollout") as pool:
            while not self._stop.is_set() and not self._reached_max():
                free = self._acquire_free_slots()
                if not free:
                    continue
                claims = self._claim(free)
                for _ in range(free - len(claims)):
                    self._slots.release()
                for claim in claims:
                    self.claimed += 1
                    pool.submit(self._execute, claim).add_done_callback(self._release)
            log.info("runner %s: stopping; waiting for attempts in hand", self.worker_id)
        log.info("runner %s: stopped after %d rollouts", self.worker_id, self.claimed)

    def _reached_max(self) -> bool:
        return self.options.max_rollouts is not None and self.claimed >= self.options.max_rollouts

    def _acquire_free_slots(self) -> int:
        if not self._slots.acquire(timeout=0.5):
            return 0
        free = 1
        while self._slots.acquire(blocking=False):
            free += 1
        if self.options.max_rollouts is not None:
            allowed = max(self.options.max_rollouts - self.claimed, 0)
            for _ in range(free - min(free, allowed)):
                self._slots.release()
            free = min(free, allowed)
        return free

    def _claim(self, limit: int) -> list[Claim]:
        try:
            return self.gateway.claim(worker_id=self.worker_id, limit=limit)
        except (StoreUnavailable, ApiError) as exc:
            if isinstance(exc, ApiError) and exc.status < 500:
                raise  # a bad key or a bad request: retrying will not help
            log.warning("runner %s: cannot claim (%s); retrying", self.worker_id, exc)
            self._stop.wait(self.options.retry_pause)
            return []

    def _execute(self, claim: Claim) -> None:
        try:
            outcome = execute(gateway=self.gateway, claim=claim, agent=self.options.agent,
                              worker_id=self.worker_id, options=self.executor_options)
        except Exception:  # the store kept failing: the watchdog will retry or fail it
            log.exception("runner %s: attempt %s/%s could not be reported", self.worker_id,
                          claim.rollout_id, claim.attempt_id)
            self.finished[claim.rollout_id] = "lost"
            return
        self.finished[claim.rollout_id] = outcome.status

    def _release(self, _future: Future) -> None:
        self._slots.release()
