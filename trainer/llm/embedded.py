"""The model gateway in a thread of this process: the embedded default's, for jobs whose agents
call the model (`manage.py train`). The gateway's modules are imported when a job needs it: the
LLM stack (transformers) takes seconds to import, which other jobs need not wait for."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings


@contextmanager
def embedded_gateway(*, engine_process: bool | None = None) -> Iterator[str]:
    """The model gateway (trainer/llm) on LLM_GATEWAY_HOST:LLM_GATEWAY_PORT in a thread of
    this process while the block runs; yields its base URL. `engine_process` (default
    LLM_EMBEDDED_ENGINE_PROCESS): its models and decode loop in a process of their own."""
    from trainer.llm.server import ServerThread, build_gateway  # load time, not a cycle

    if engine_process is None:
        engine_process = settings.LLM_EMBEDDED_ENGINE_PROCESS
    gateway = build_gateway(engine_process=engine_process)
    try:
        server = ServerThread(gateway.app(), host=settings.LLM_GATEWAY_HOST,
                              port=settings.LLM_GATEWAY_PORT).start()
    except RuntimeError:
        gateway.close()  # its engine process, if it has one, is not left running
        raise RuntimeError(
            f"the model gateway could not listen on {settings.LLM_GATEWAY_HOST}:"
            f"{settings.LLM_GATEWAY_PORT} (in use?); set LLM_GATEWAY_PORT") from None
    interval = sys.getswitchinterval()
    if settings.LLM_EMBEDDED_SWITCH_INTERVAL_MS:  # this process's threads hand over sooner
        sys.setswitchinterval(settings.LLM_EMBEDDED_SWITCH_INTERVAL_MS / 1000)
    try:
        yield f"http://{settings.LLM_GATEWAY_HOST}:{server.port}/v1"
    finally:
        server.stop()
        sys.setswitchinterval(interval)
