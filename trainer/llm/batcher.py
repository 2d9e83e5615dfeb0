"""Dynamic batching: concurrent requests decode together, tenants served in turn.

Callers `submit` sequences for an engine (and the tenant they are for) and wait; one thread
takes whatever arrived within `window` seconds of the first waiting request and composes a
batch of up to `max_batch` sequences **round-robin over tenants** (one request of each tenant in
turn, each tenant's oldest first), so a tenant with hundreds of requests queued does not push
another's single request out of the next batch; what does not fit waits, ahead of newer
requests of its tenant. The batch is grouped by engine (checkpoint version; LoRA versions of
one base together, adapters.py) and each group decoded in one batch. Requests that arrive
while a batch decodes wait for the next one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from trainer.llm.engine import Engine, Sequence_

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    engine: Engine
    sequences: list[Sequence_]
    tenant: object = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Batcher:
    def __init__(self, *, window: float = 0.005, max_batch: int = 64) -> None:
        self.window, self.max_batch = window, max_batch
        self._queue: queue.Queue[Job] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="llm-batcher", daemon=True)
        self._thread.start()
        self.batches = 0  # decoded batches, for tests and the bench
        self.largest = 0

    def submit(self, engine: Engine, sequences: list[Sequence_], tenant: object = None) -> Job:
        for seq in sequences:
            engine.check_prompt(seq.prompt_ids)
        job = Job(engine, sequences, tenant)
        self._queue.put(job)
        return job

    def run(self, engine: Engine, sequences: list[Sequence_], timeout: float | None = None,
            tenant: object = None) -> None:
        """Submit and wait until every sequence is done; re-raises the decode's error."""
        job = self.submit(engine, sequences, tenant)
        if not job.done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        if job.error is not None:
            raise job.error

    def _loop(self) -> None:
        waiting: dict[object, deque[Job]] = {}  # per tenant, oldest first; insertion = turn
        while True:
            if not waiting:
                self._take(waiting, self._queue.get())
            deadline = time.monotonic() + self.window
            while True:  # everything that arrives within the window is seen before choosing
                left = deadline - time.monotonic()
                try:
                    job = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                self._take(waiting, job)
            jobs = self._compose(waiting)
            by_engine: dict[int, list[Job]] = {}  # LoRA adapters of one base: one batch
            for job in jobs:
                by_engine.setdefault(getattr(job.engine, "batch_key", id(job.engine)),
                                     []).append(job)
            for group in by_engine.values():
                self._decode(group)

    @staticmethod
    def _take(waiting: dict[object, deque[Job]], job: Job) -> None:
        waiting.setdefault(job.tenant, deque()).append(job)

    def _compose(self, waiting: dict[object, deque[Job]]) -> list[Job]:
        """One request per tenant in turn until the batch is full (the first always goes,
        whatever its size); a tenant served moves to the back of the turn."""
        jobs: list[Job] = []
        size = 0
        while waiting:
            progressed = False
            for tenant in list(waiting):
                queue_ = waiting[tenant]
                if jobs and size + len(queue_[0].sequences) > self.max_batch:
                    continue
                job = queue_.popleft()
                jobs.append(job)
                size += len(job.sequences)
                progressed = True
                del waiting[tenant]  # to the back of the turn, or gone if it has no more
                if queue_:
                    waiting[tenant] = queue_
            if not progressed or size >= self.max_batch:
                break
        return jobs

    def _decode(self, jobs: list[Job]) -> None:
        sequences = [seq for job in jobs for seq in job.sequences]
        self.batches += 1
        self.largest = max(self.largest, len(sequences))
        try:
            if len(jobs) > 1 and getattr(jobs[0].engine, "shared", None) is not None:
                jobs[0].engine.generate(sequences, [job.engine.adapter for job in jobs
                                                    for _ in job.sequences])
            else:
                jobs[0].engine.generate(sequences)
        except BaseException as exc:
            if len(jobs) == 1:
                log.exception("a request of %d sequences failed", len(sequences))
                jobs[0].error = exc
            else:  # one bad request must not fail its neighbours: each again, alone
                log.warning("batch of %d requests failed (%s); decoding each alone",
                            len(jobs), exc)
                for job in jobs:
                    self._alone(job)
        finally:
            for job in jobs:
                job.done.set()

    @staticmethod
    def _alone(job: Job) -> None:
        if any(seq.on_token is not None and seq.token_ids for seq in job.sequences):
            # Its tokens were already streamed to the caller: it cannot start over.
            job.error = RuntimeError("the batch this streamed request decoded in failed")
            return
        for seq in job.sequences:
            seq.reset()
        try:
            job.engine.generate(job.sequences)
        except Exception as exc:  # this request's own failure
            log.exception("a request of %d sequences failed", len(job.sequences))
            job.error = exc
