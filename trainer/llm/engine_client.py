"""The gateway's side of the engine process (engine_process.py): started, fed and supervised
from here, so that the gateway's process does HTTP, authentication, attribution and recording
only, and the decode loop runs under a GIL of its own.

`EngineProcess` stands where the in-process `Batcher` does (`submit`, `run`, `close`) and makes
the registry's engines (`engine(path, ...)`): a `RemoteEngine` holds what the gateway needs
here (the tokenizer, the context, name and version: prompts are rendered and checked in the
gateway) while the model lives in the engine process. Tokens stream back per request as they
are generated (the sequences here are updated, their `on_token` called, as in process), and the
final state of each sequence comes with the request's end.

If the engine process dies (killed, out of memory), every request it was decoding or had
queued fails with 503 `engine_unavailable` (nothing of it is recorded: recording follows a
generation that succeeded), and a new engine process is started at once, loading every engine
the registry still holds under the same ids; requests submitted meanwhile wait for their engine
there. An engine the registry drops (and no request holds) is unloaded there too.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.llm import engine_process
from trainer.llm.batcher import Batcher
from trainer.llm.engine import Engine, PromptTooLong, Sequence_
from trainer.llm.openai_api import BadRequest

log = logging.getLogger(__name__)


class EngineLoadFailed(ValueError):
    """The engine process could not load a checkpoint (its message says why: the error
    there, e.g. `ModelError: ...`)."""


class EngineStopped(BadRequest):
    """The engine process died under a request or a load (503: retry)."""


def engine_unavailable() -> EngineStopped:
    return EngineStopped("the engine process stopped while this call was being generated; it is "
                      "being restarted: retry the call", status=503, code="engine_unavailable",
                      kind="server_error", headers={"Retry-After": "1"})


class RemoteEngine:
    """An engine loaded in the engine process, as the gateway sees it."""

    check_prompt = Engine.check_prompt
    decode = Engine.decode

    def __init__(self, eid: int, path: str, kwargs: dict[str, Any], facts: dict[str, Any],
                 tokenizer: Any) -> None:
        self.eid, self.spec = eid, (path, kwargs)
        self.path = facts["path"]
        self.version, self.name = kwargs.get("version", 0), kwargs.get("name", "model")
        self.tokenizer = tokenizer
        self.context, self.vocab_size = facts["context"], facts["vocab_size"]
        self.eos_ids, self.pad_id = set(facts["eos_ids"]), facts["pad_id"]
        self.dtype_name, self.device = facts["dtype_name"], facts["device"]
        # runtime_lora.py asks whether an engine is an adapter on a shared base
        self.shared = True if facts["shared"] else None
        self.adapter = None


@dataclass(eq=False)
class RemoteJob:
    engine: RemoteEngine
    sequences: list[Sequence_]
    tenant: object = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[[RemoteJob], None] | None = None
    # perf_counter times (batcher.Job's): submitted here; in the engine process, arrived
    # there, joined a batch, decoded; finished: its end handled here
    submitted: float = field(default_factory=time.perf_counter)
    received: float = 0.0
    joined: float = 0.0
    decoded: float = 0.0
    finished: float = 0.0


@dataclass(eq=False)
class _Load:
    done: threading.Event = field(default_factory=threading.Event)
    facts: dict[str, Any] | None = None
    error: BaseException | None = None


class EngineProcess:
    def __init__(self, *, window: float = 0.005, max_batch: int = 64, tenant_rows: int = 0,
                 idle: float = 0.0, torch_threads: int = 1, load_timeout: float = 600.0,
                 switch_interval_ms: float = 0.0) -> None:
        self.config = {"window": window, "max_batch": max_batch, "tenant_rows": tenant_rows,
                       "idle": idle, "torch_threads": torch_threads,
                       "switch_interval_ms": switch_interval_ms}
        self.load_timeout = load_timeout
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.RLock()  # RLock: an engine collected under it unloads
        self._jobs: dict[int, RemoteJob] = {}
        self._loads: dict[int, _Load] = {}
        self._engines: weakref.WeakValueDictionary[int, RemoteEngine] = \
            weakref.WeakValueDictionary()
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.generation = 0
        self.restarts = 0  # engine processes started again after one died
        self._last_start = 0.0
        with self._lock:
            self._spawn()
        threading.Thread(target=self._write_loop, name="llm-engine-write", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    # --- the registry's engines --------------------------------------------------------------
    def engine(self, path: str, **kwargs: Any) -> RemoteEngine:
        """Load a checkpoint in the engine process (Engine's arguments); blocks until loaded."""
        from transformers import AutoTokenizer

        eid, waiter = next(self._ids), _Load()
        with self._lock:
            self._loads[eid] = waiter
            self._send(("load", eid, str(path), kwargs))
            generation = self.generation
        if not waiter.done.wait(self.load_timeout):
            with self._lock:
                self._loads.pop(eid, None)
            raise EngineLoadFailed(f"{path} did not load within {self.load_timeout:g} s")
        if waiter.error is not None:
            raise waiter.error
        tokenizer = AutoTokenizer.from_pretrained(waiter.facts["tokenizer_dir"])
        engine = RemoteEngine(eid, str(path), kwargs, waiter.facts, tokenizer)
        with self._lock:
            self._engines[eid] = engine
            if self.generation != generation:  # restarted since it loaded: load it there too
                self._send(("load", eid, str(path), kwargs))
        weakref.finalize(engine, self._unload, eid)
        return engine

    def _unload(self, eid: int) -> None:
        if not self._closed:
            with self._lock:
                self._send(("unload", eid))

    # --- requests (the batcher's interface) --------------------------------------------------
    def submit(self, engine: RemoteEngine, sequences: list[Sequence_], tenant: object = None,
               on_done: Callable[[RemoteJob], None] | None = None) -> RemoteJob:
        for seq in sequences:
            engine.check_prompt(seq.prompt_ids)
        job = RemoteJob(engine, sequences, tenant, on_done=on_done)
        jid = next(self._ids)
        # each token sent back as it comes only where someone streams it
        specs = [(list(s.prompt_ids), s.params, s.index, s.on_token is not None)
                 for s in sequences]
        with self._lock:
            if self._closed:
                raise engine_unavailable()
            self._jobs[jid] = job
            self._send(("submit", jid, engine.eid, tenant, specs))
        return job

    def run(self, engine: RemoteEngine, sequences: list[Sequence_],
            timeout: float | None = None, tenant: object = None) -> None:
        job = self.submit(engine, sequences, tenant)
        if not job.done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        if job.error is not None:
            raise job.error

    def pending(self) -> int:
        """Requests submitted and not finished (tests and the bench)."""
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._send(("stop",))
        self._outbox.put(None)
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    # --- the pipe ----------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        """Queued for the writer thread (never blocks a caller on a full pipe); under the lock,
        tagged with the engine process it is for."""
        self._outbox.put((self.generation, self._conn, message))

    def _spawn(self) -> None:
        """A new engine process (under the lock)."""
        wait = self._last_start + 1.0 - time.monotonic()  # one that dies at once: not a spin
        if wait > 0:
            time.sleep(wait)
        self._last_start = time.monotonic()
        mine, theirs = self._context.Pipe()
        process = self._context.Process(target=engine_process.main, args=(theirs, self.config),
                                        name="llm-engine", daemon=True)
        process.start()
        theirs.close()  # so that its death reads as EOF here
        self.generation += 1
        self.process, self._conn = process, mine
        threading.Thread(target=self._read_loop, args=(mine, self.generation),
                         name="llm-engine-read", daemon=True).start()

    def _write_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            generation, conn, message = item
            if generation != self.generation:
                continue  # for an engine process that died; its callers were failed
            try:
                conn.send(message)
            except (OSError, ValueError):  # it died: the reader restarts it
                pass

    def _read_loop(self, conn: Any, generation: int) -> None:
        while True:
            try:
                messages = conn.recv()
            except (EOFError, OSError):
                break
            for message in messages:
                try:
                    self._handle(message)
                except Exception:
                    log.exception("the engine process's message %s failed", message[:2])
        conn.close()
        self._restart(generation)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "token":
            _, jid, position, token, logprob, top, text, finish_reason = message
            job = self._jobs.get(jid)
            if job is None:
                return
            seq = job.sequences[position]
            seq.token_ids.append(token)
            seq.logprobs.append(logprob if math.isfinite(logprob) else -1e9)
            seq.top.append(top)
            seq.text, seq.finish_reason = text, finish_reason
            job.started.set()
            if seq.on_token is not None:
                seq.on_token(seq, token, logprob, top)
        elif kind == "done":
            _, jid, error, final, *times = message
            with self._lock:
                job = self._jobs.pop(jid, None)
            if job is None:
                return
            if times:
                job.received, job.joined, job.decoded = times[0]
            for seq, state in zip(job.sequences, final or (), strict=False):
                (seq.token_ids, seq.logprobs, seq.top, seq.text, seq.finish_reason,
                 seq.logprobs_of) = state
            self._finish(job, _exception(error) if error is not None else None)
        elif kind in ("loaded", "load_failed"):
            with self._lock:
                waiter = self._loads.pop(message[1], None)
            if waiter is None:  # a reload after a restart
                if kind == "load_failed":
                    log.warning("engine %s did not load again: %s", message[1], message[2])
                return
            if kind == "loaded":
                waiter.facts = message[2]
            else:
                waiter.error = EngineLoadFailed(f"{message[2][0]}: {message[2][1]}")
            waiter.done.set()

    def _restart(self, generation: int) -> None:
        with self._lock:
            if generation != self.generation or self._closed:
                return
            old = self.process
            old.join(1)
            if old.is_alive():  # the pipe broke but it runs: it cannot be reached any more
                old.kill()
            log.warning("the engine process (pid %s) stopped (exit code %s); %d requests "
                        "fail with 503, starting it again", old.pid, old.exitcode,
                        len(self._jobs))
            jobs, self._jobs = list(self._jobs.values()), {}
            loads, self._loads = list(self._loads.values()), {}
            self.restarts += 1
            self._spawn()
            for eid, engine in list(self._engines.items()):  # loaded again, same ids
                path, kwargs = engine.spec
                self._send(("load", eid, path, kwargs))
        for waiter in loads:
            waiter.error = engine_unavailable()
            waiter.done.set()
        for job in jobs:
            self._finish(job, engine_unavailable())

    # A request ends as the in-process batcher ends one (error, events, the caller's callback).
    _finish = staticmethod(Batcher._finish)


def _exception(error: Sequence[str]) -> BaseException:
    """An error of the engine process, as the gateway handles it."""
    name, text = error
    if name == "PromptTooLong":
        return PromptTooLong(text)
    return RuntimeError(f"{name}: {text}")
