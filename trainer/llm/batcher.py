"""Continuous batching: concurrent requests decode together, tenants served in turn.

Callers `submit` sequences for an engine (and the tenant they are for) and wait. One thread
decodes: a batch advances one token per step for every sequence in it (decoding.py), and
between steps the requests that arrived **join** it (new sequences start at the next step,
finished ones leave at once), so a request never waits for another's whole generation. When
nothing decodes, the first request waits `window` seconds for others to start with it.

At most `max_batch` sequences decode at once. Waiting requests join **round-robin over
tenants** (one request of each tenant in turn, each tenant's oldest first), so a tenant with
hundreds of requests queued does not keep another's single request out; and a tenant with
nothing decoding always joins at the next step, even when the batch is full (it then holds
more than `max_batch` by that tenant's request until sequences leave): one tenant's long
generations never hold every slot against another. While more than one tenant has work, a
tenant decodes at most `tenant_rows` sequences (`LLM_GATEWAY_PROJECT_BATCH_ROWS`): its
requests past that wait, and its rows past that are **set aside** with their caches (not
stepped, `Decoding.split`) and join again when the others' work is done; so another tenant's
call decodes in a batch about `tenant_rows` wide, not one the flood filled (each step's time
grows with its width). A tenant counts as having work until `idle` seconds after its last
sequence left (`LLM_GATEWAY_PROJECT_IDLE_MS`): one making calls one after another keeps the
flood capped between its calls, instead of the flood filling the batch (and the gateway's
event loop with its streamed tokens) in each gap. Alone, a tenant may fill the batch.
Requests of one engine (checkpoint version; LoRA versions of one base together, adapters.py)
decode in one batch; batches of different engines take steps in turn.

A decode failure fails only its own request: a request whose start fails with others is
started again alone, and a sampling error ends only its sequence's request. A step's forward
pass failing fails the requests of that batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.llm.decoding import Decoding, Row
from trainer.llm.engine import Engine, Sequence_

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    engine: Engine
    sequences: list[Sequence_]
    tenant: object = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)  # in a batch
    on_done: Callable[[Job], None] | None = None  # called on the decoding thread
    # perf_counter times (one clock for every process of the machine): submitted, joined a
    # batch, finished (the gateway's Server-Timing)
    submitted: float = field(default_factory=time.perf_counter)
    joined: float = 0.0
    finished: float = 0.0


class Batcher:
    def __init__(self, *, window: float = 0.005, max_batch: int = 64,
                 tenant_rows: int = 0, idle: float = 0.0) -> None:
        if tenant_rows < 0:
            raise ValueError(f"tenant_rows must be 0 (no cap) or positive, not {tenant_rows}")
        if idle < 0:
            raise ValueError(f"idle must be 0 or more seconds, not {idle}")
        self.window, self.max_batch = window, max_batch
        self.tenant_rows, self.idle = tenant_rows, idle  # 0: no cap while others have work
        self._seen: dict[object, float] = {}  # tenant: when it last had work (monotonic)
        self._queue: queue.Queue[Job] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="llm-batcher", daemon=True)
        self._thread.start()
        self.batches = 0  # starts (requests that joined together), for tests and the bench
        self.largest = 0  # most sequences decoding at once
        self.steps = 0
        self.set_aside = 0  # rows set aside for another tenant's work (for tests and the bench)
        self.widest_shared = 0  # most rows in a step of more than one tenant's rows
        self.width = 0  # rows in the step decoding now (or last)

    def submit(self, engine: Engine, sequences: list[Sequence_], tenant: object = None,
               on_done: Callable[[Job], None] | None = None) -> Job:
        for seq in sequences:
            engine.check_prompt(seq.prompt_ids)
        job = Job(engine, sequences, tenant, on_done=on_done)
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

    # --- the decoding thread ------------------------------------------------------------------
    def _loop(self) -> None:
        waiting: dict[object, deque[Job]] = {}  # per tenant, oldest first; insertion = turn
        running: dict[object, Decoding] = {}  # per batch key
        aside: list[tuple[object, object, Decoding]] = []  # (tenant, batch key, rows) set aside
        while True:
            try:
                if not running and not aside:  # (rows aside join again in _balance)
                    if not waiting:
                        self._take(waiting, self._queue.get())
                    self._gather(waiting, time.monotonic() + self.window)
                else:
                    self._gather(waiting, 0.0)
                self._join(self._compose(waiting, running, aside), running)
                self._balance(waiting, running, aside)
                for key in list(running):
                    self._step(running, key)
            except Exception:  # never let the decoding thread die
                log.exception("the batcher's loop failed")

    def _gather(self, waiting: dict[object, deque[Job]], deadline: float) -> None:
        while True:  # everything that arrived (or arrives before the deadline)
            left = deadline - time.monotonic()
            try:
                job = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                return
            self._take(waiting, job)

    @staticmethod
    def _take(waiting: dict[object, deque[Job]], job: Job) -> None:
        waiting.setdefault(job.tenant, deque()).append(job)

    def _compose(self, waiting: dict[object, deque[Job]], running: dict[object, Decoding],
                 aside: list) -> list[Job]:
        """The waiting requests that join now: one per tenant in turn while they fit in
        max_batch and the tenant's cap; a tenant with nothing decoding joins whatever the size.
        A tenant served moves to the back of the turn."""
        held = _held(running)
        size = sum(held.values())
        cap = self._cap(waiting, held, aside)
        jobs: list[Job] = []
        while waiting:
            progressed = False
            for tenant in list(waiting):
                queue_ = waiting[tenant]
                more = len(queue_[0].sequences)
                fits = size + more <= self.max_batch and held.get(tenant, 0) + more <= cap
                if not fits and held.get(tenant, 0):
                    continue
                job = queue_.popleft()
                jobs.append(job)
                size += len(job.sequences)
                held[tenant] = held.get(tenant, 0) + len(job.sequences)
                progressed = True
                del waiting[tenant]  # to the back of the turn, or gone if it has no more
                if queue_:
                    waiting[tenant] = queue_
            if not progressed:
                break
        return jobs

    def _cap(self, waiting: dict, held: dict[object, int], aside: list) -> float:
        """How many rows one tenant may decode now: `tenant_rows` while more than one tenant
        has work (decoding, waiting or set aside; or had, under `idle` seconds ago), else no
        cap."""
        if not self.tenant_rows:
            return float("inf")
        now = time.monotonic()
        for tenant in {t for t, n in held.items() if n} | set(waiting) | {t for t, _, _ in aside}:
            self._seen[tenant] = now
        for tenant in [t for t, seen in self._seen.items() if now - seen > self.idle]:
            del self._seen[tenant]
        return self.tenant_rows if len(self._seen) > 1 else float("inf")

    def _balance(self, waiting: dict, running: dict[object, Decoding], aside: list) -> None:
        """Rows set aside join again while their tenant is under its cap; a tenant over its
        cap has its latest rows set aside (merge caches only)."""
        for entry in list(aside):  # oldest first; the rows of finished (failed) requests go
            entry[2].drop(lambda row: row.owner.done.is_set())
            if not entry[2].rows:
                aside.remove(entry)
        held = _held(running)
        cap = self._cap(waiting, held, aside)
        for entry in list(aside):
            tenant, key, decoding = entry
            room = cap - held.get(tenant, 0)
            if room <= 0:
                continue
            if room < len(decoding.rows):  # the oldest `room` rows join, the rest stay aside
                joining = set(map(id, decoding.rows[:int(room)]))
                decoding = decoding.split(lambda row, ids=joining: id(row) in ids)
            else:
                aside.remove(entry)
            held[tenant] = held.get(tenant, 0) + len(decoding.rows)
            self._run(key, decoding, running)
        for tenant, count in held.items():
            over = count - cap
            for key, decoding in list(running.items()):
                if over <= 0 or not decoding.joinable():
                    continue
                mine = [row for row in decoding.rows if row.owner.tenant == tenant]
                leaving = set(map(id, mine[max(0, len(mine) - over):]))
                if not leaving:
                    continue
                if len(leaving) == len(decoding.rows):
                    del running[key]  # the whole batch: set aside as it is
                    parked = decoding
                else:
                    parked = decoding.split(lambda row, ids=leaving: id(row) in ids)
                aside.append((tenant, key, parked))
                self.set_aside += len(leaving)
                over -= len(leaving)

    def _join(self, jobs: list[Job], running: dict[object, Decoding]) -> None:
        groups: dict[object, list[Job]] = {}  # LoRA adapters of one base: one batch
        for job in jobs:
            groups.setdefault(_key(job.engine), []).append(job)
        for key, group in groups.items():
            self.batches += 1
            started = self._start(group)
            if started is not None:
                self._run(key, started, running)

    def _run(self, key: object, started: Decoding, running: dict[object, Decoding]) -> None:
        """`started`'s rows decode from the next step: in the batch of their key if caches
        merge, else in a batch of their own stepped in turn."""
        current = running.get(key)
        if current is not None and current.rows and current.joinable() and started.joinable():
            current.join(started)
        elif current is None or not current.rows:
            running[key] = started
        else:
            running[(key, id(started))] = started
        self.largest = max(self.largest, sum(len(d.rows) for d in running.values()))

    def _start(self, jobs: list[Job]) -> Decoding | None:
        """The jobs' prompts through the model together; if that fails, each alone (only the
        job at fault fails). None when nothing is left decoding."""
        rows = [Row(seq, adapter=job.engine.adapter, owner=job)
                for job in jobs for seq in job.sequences]
        engine = jobs[0].engine
        try:
            with engine.lock:
                decoding, failures = Decoding.start(engine, rows)
        except Exception as exc:
            if len(jobs) == 1:
                log.warning("a request of %d sequences failed: %s", len(rows), exc)
                self._finish(jobs[0], exc)
                return None
            log.warning("%d requests failed to start together (%s); starting each alone",
                        len(jobs), exc)
            started = None
            for job in jobs:
                one = self._start([job])
                if one is None:
                    continue
                if started is None:
                    started = one
                elif started.joinable() and one.joinable():
                    started.join(one)
                else:  # cannot merge: decode this one to its end now
                    self._drain(one)
            return started
        joined = time.perf_counter()
        for job in jobs:
            job.joined = joined
            job.started.set()
        self._settle(decoding, failures, jobs)
        return decoding if decoding.rows else None

    def _step(self, running: dict[object, Decoding], key: object) -> None:
        decoding = running[key]
        jobs = {id(r.owner): r.owner for r in decoding.rows}
        self.steps += 1
        self.width = len(decoding.rows)
        if len({job.tenant for job in jobs.values()}) > 1:
            self.widest_shared = max(self.widest_shared, len(decoding.rows))
        try:
            with decoding.engine.lock:
                failures = decoding.step()
        except Exception as exc:
            log.exception("a decode step of %d sequences failed", len(decoding.rows))
            for job in jobs.values():
                self._finish(job, exc)
            del running[key]
            return
        self._settle(decoding, failures, list(jobs.values()))
        if not decoding.rows:
            del running[key]

    def _drain(self, decoding: Decoding) -> None:
        while decoding.rows:
            jobs = list({id(r.owner): r.owner for r in decoding.rows}.values())
            with decoding.engine.lock:
                failures = decoding.step()
            self._settle(decoding, failures, jobs)

    def _settle(self, decoding: Decoding, failures: list, jobs: list[Job]) -> None:
        """Jobs with a failed sequence fail (their other rows leave); jobs whose sequences
        are all done are done."""
        failed = {}
        for failure in failures:
            failed.setdefault(id(failure.row.owner), failure.error)
        if failed:
            decoding.drop(lambda row: id(row.owner) in failed)
        for job in jobs:
            if job.done.is_set():
                continue
            if id(job) in failed:
                log.warning("a request of %d sequences failed: %s", len(job.sequences),
                            failed[id(job)])
                self._finish(job, failed[id(job)])
            elif all(seq.done for seq in job.sequences):
                self._finish(job, None)

    @staticmethod
    def _finish(job: Job, error: BaseException | None) -> None:
        job.error = error
        job.finished = time.perf_counter()
        job.started.set()
        job.done.set()
        if job.on_done is not None:
            try:
                job.on_done(job)
            except Exception:  # e.g. the caller's event loop closed: nobody waits any more
                log.warning("a finished request's callback failed", exc_info=True)


def _held(running: dict[object, Decoding]) -> dict[object, int]:
    """Rows decoding per tenant."""
    held: dict[object, int] = {}
    for decoding in running.values():
        for row in decoding.rows:
            held[row.owner.tenant] = held.get(row.owner.tenant, 0) + 1
    return held


def _key(engine: Engine) -> object:
    return getattr(engine, "batch_key", id(engine))
