"""The engine's own process: the models, the decode loop and the continuous batcher, away from
the gateway's GIL (README "The model gateway", LLM_GATEWAY_ENGINE_PROCESS).

The gateway process starts it (`multiprocessing`, spawn) and talks to it over one pipe
(engine_client.py). Messages in, each a tuple:
- `("load", eid, path, kwargs)`: `Engine(path, **kwargs)` under the gateway's id `eid`, on a
  loading thread (calls of other engines keep decoding meanwhile); answered `("loaded", eid,
  facts)` or `("load_failed", eid, error)`;
- `("unload", eid)`: the gateway dropped it (requests running on it finish on it);
- `("submit", jid, eid, tenant, [(prompt_ids, params, index, streamed), ...])`: a request,
  decoded by the batcher (batcher.py) once its engine is loaded; answered by `("token", jid,
  position, token, logprob, top, text, finish_reason)` per generated token of a streamed
  sequence and one `("done", jid, error, [final state of each sequence], times)` (times:
  perf_counter when it arrived here, joined a batch and finished, or absent);
- `("stop",)`.
Out, messages go in lists (what a decode step produced, one write). When the gateway's end of
the pipe closes (the gateway died), this process exits.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


def main(conn: Any, config: dict[str, Any]) -> None:
    """The process's entry point (spawned: nothing of the gateway's process is inherited)."""
    if os.environ.get("DJANGO_SETTINGS_MODULE"):  # models.py and lora.py read settings
        import django

        django.setup()
    import torch

    if config.get("torch_threads"):
        torch.set_num_threads(int(config["torch_threads"]))
    if config.get("switch_interval_ms"):  # LLM_GATEWAY_SWITCH_INTERVAL_MS
        sys.setswitchinterval(config["switch_interval_ms"] / 1000)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    _Serving(conn, config).run()


def error_of(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


class _Serving:
    def __init__(self, conn: Any, config: dict[str, Any]) -> None:
        from trainer.llm.batcher import Batcher

        self.conn = conn
        self.batcher = Batcher(window=config.get("window", 0.005),
                               max_batch=config.get("max_batch", 64),
                               tenant_rows=config.get("tenant_rows", 0),
                               idle=config.get("idle", 0.0))
        self.engines: dict[int, Future] = {}
        self.loading = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llm-engine-load")
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._send_loop, name="llm-engine-send", daemon=True).start()

    def run(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the gateway is gone: nobody to answer
                os._exit(0)
            kind = message[0]
            if kind == "load":
                _, eid, path, kwargs = message
                self.engines[eid] = self.loading.submit(self._load, eid, path, kwargs)
            elif kind == "unload":
                self.engines.pop(message[1], None)
            elif kind == "submit":
                self._submit(*message[1:], received=time.perf_counter())
            elif kind == "stop":
                os._exit(0)

    def _load(self, eid: int, path: str, kwargs: dict[str, Any]) -> Any:
        from trainer.llm.engine import Engine

        try:
            engine = Engine(path, **kwargs)
        except BaseException as exc:
            log.warning("engine %s (%s) did not load: %s", eid, path, exc)
            self.out.put(("load_failed", eid, error_of(exc)))
            raise
        self.out.put(("loaded", eid, {
            "tokenizer_dir": engine.tokenizer_dir, "context": engine.context,
            "vocab_size": engine.vocab_size, "eos_ids": sorted(engine.eos_ids),
            "pad_id": engine.pad_id, "dtype_name": engine.dtype_name,
            "shared": engine.shared is not None, "path": engine.path, "device": engine.device}))
        return engine

    def _submit(self, jid: int, eid: int, tenant: object, specs: list,
                received: float = 0.0) -> None:
        loaded = self.engines.get(eid)
        if loaded is None:
            self.out.put(("done", jid, ("LookupError", "this model is no longer loaded"), None))
            return
        loaded.add_done_callback(lambda future: self._start(jid, future, tenant, specs,
                                                            received))

    def _start(self, jid: int, loaded: Future, tenant: object, specs: list,
               received: float = 0.0) -> None:
        from trainer.llm.engine import Sequence_

        if loaded.exception() is not None:
            self.out.put(("done", jid, error_of(loaded.exception()), None))
            return
        position: dict[int, int] = {}
        out = self.out

        def on_token(seq: Sequence_, token: int, logprob: float, top: list) -> None:
            out.put(("token", jid, position[id(seq)], token, logprob, top, seq.text,
                     seq.finish_reason))

        sequences = []
        for i, (prompt_ids, params, index, streamed) in enumerate(specs):
            seq = Sequence_(list(prompt_ids), params, index=index,
                            on_token=on_token if streamed else None)
            position[id(seq)] = i
            sequences.append(seq)

        def on_done(job: Any) -> None:
            final = [(s.token_ids, s.logprobs, s.top, s.text, s.finish_reason, s.logprobs_of)
                     for s in sequences]
            out.put(("done", jid, error_of(job.error) if job.error is not None else None,
                     final, (received, job.joined, job.finished)))

        try:
            self.batcher.submit(loaded.result(), sequences, tenant, on_done=on_done)
        except Exception as exc:  # e.g. a prompt too long for this model
            self.out.put(("done", jid, error_of(exc), None))

    def _send_loop(self) -> None:
        while True:
            batch = [self.out.get()]
            while True:
                try:
                    batch.append(self.out.get_nowait())
                except queue.Empty:
                    break
            try:
                self.conn.send(batch)
            except (OSError, ValueError):  # the gateway is gone
                os._exit(0)
