"""The model gateway in a thread of this process: the embedded default's, for jobs whose agents
call the model (`manage.py train`). The gateway's modules are imported when a job needs it: the
LLM stack (transformers) takes seconds to import, which other jobs need not wait for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings


@contextmanager
def embedded_gateway() -> Iterator[str]:
    """The model gateway (trainer/llm) on LLM_GATEWAY_HOST:LLM_GATEWAY_PORT in a thread of
    this process while the block runs; yields its base URL."""
    from trainer.llm.server import ServerThread, build_gateway  # load time, not a cycle

    gateway = build_gateway()
    try:
        server = ServerThread(gateway.app(), host=settings.LLM_GATEWAY_HOST,
                              port=settings.LLM_GATEWAY_PORT).start()
    except RuntimeError:
        raise RuntimeError(
            f"the model gateway could not listen on {settings.LLM_GATEWAY_HOST}:"
            f"{settings.LLM_GATEWAY_PORT} (in use?); set LLM_GATEWAY_PORT") from None
    try:
        yield f"http://{settings.LLM_GATEWAY_HOST}:{server.port}/v1"
    finally:
        server.stop()
