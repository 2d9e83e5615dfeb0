"""Running the gateway: under uvicorn in its own process (`manage.py llm_serve`) or in a
thread of this process (the embedded default: `trainer.llm.embedded.embedded_gateway`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.conf import settings

from trainer.llm.batcher import Batcher
from trainer.llm.engine_client import EngineProcess
from trainer.llm.gateway import Gateway
from trainer.llm.registry import Registry

log = logging.getLogger(__name__)


def build_gateway(*, models: list[str] | None = None, upstream_url: str | None = None,
                  upstream_key: str | None = None, engine_process: bool = False) -> Gateway:
    """A gateway from settings (LLM_GATEWAY_*), with `models` ("name=path") served as well.
    `engine_process`: the models and the decode loop in a process of their own
    (engine_client.py; `llm_serve` passes LLM_GATEWAY_ENGINE_PROCESS), else in this one."""
    from trainer.llm.upstream import Upstream

    quiet_transformers()
    if settings.LLM_GATEWAY_TORCH_THREADS:
        import torch

        torch.set_num_threads(settings.LLM_GATEWAY_TORCH_THREADS)
    upstream_url = upstream_url if upstream_url is not None else settings.LLM_GATEWAY_UPSTREAM_URL
    upstream = None
    if upstream_url:
        upstream = Upstream(upstream_url, api_key=upstream_key if upstream_key is not None
                            else settings.LLM_GATEWAY_UPSTREAM_KEY)
    batching = {"window": settings.LLM_GATEWAY_BATCH_WINDOW_MS / 1000,
                "max_batch": settings.LLM_GATEWAY_MAX_BATCH,
                "tenant_rows": settings.LLM_GATEWAY_PROJECT_BATCH_ROWS,
                "idle": settings.LLM_GATEWAY_PROJECT_IDLE_MS / 1000}
    batcher: Batcher | EngineProcess
    if engine_process and not upstream:
        batcher = EngineProcess(**batching,
                                torch_threads=settings.LLM_GATEWAY_TORCH_THREADS,
                                switch_interval_ms=settings.LLM_GATEWAY_SWITCH_INTERVAL_MS)
        make_engine = batcher.engine
    else:
        batcher, make_engine = Batcher(**batching), None
    gateway = Gateway(
        registry=Registry(max_versions=settings.LLM_GATEWAY_MAX_VERSIONS,
                          max_spaces=settings.LLM_GATEWAY_MAX_MODELS_PER_PROJECT,
                          share_base=settings.LLM_GATEWAY_SHARE_BASE, make_engine=make_engine),
        batcher=batcher,
        upstream=upstream, poll_seconds=settings.LLM_GATEWAY_POLL_SECONDS,
        max_body_bytes=settings.LLM_GATEWAY_MAX_BODY_BYTES,
        body_timeout=settings.LLM_GATEWAY_BODY_TIMEOUT_SECONDS,
        max_tokens=settings.LLM_GATEWAY_MAX_TOKENS,
        max_sequences_per_project=settings.LLM_GATEWAY_MAX_SEQUENCES_PER_PROJECT,
        threads=settings.LLM_GATEWAY_THREADS,
        runtime_lora=settings.LLM_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING,
        upstream_keep=settings.LLM_GATEWAY_MAX_VERSIONS,
        record_writers=settings.LLM_GATEWAY_RECORD_WRITERS,
        record_turn_calls=settings.LLM_GATEWAY_RECORD_TURN_CALLS,
    )
    try:
        for spec in [*settings.LLM_GATEWAY_MODELS, *(models or [])]:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"a served model is 'name=path', not {spec!r}")
            gateway.registry.add_directory(name, path)
    except BaseException:
        if isinstance(batcher, EngineProcess):  # not left running for a gateway that is not
            batcher.close()
        raise
    return gateway


def quiet_transformers() -> None:
    """No progress bars or notices from transformers in our output."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


class ServerThread:
    """uvicorn serving `app` on (host, port) in a daemon thread; `port` 0 picks a free one."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="llm-gateway", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the model gateway did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        state = getattr(self.server.config.app, "state", None)
        gateway = getattr(state, "gateway", None)
        if gateway is not None:  # the app is a Gateway's: close its database connections
            gateway.close()
