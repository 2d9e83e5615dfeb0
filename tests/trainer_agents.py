"""Agents of the asynchronous trainer tests (found by dotted path)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from examples.cipher.agent import cipher_agent
from runners.tracing import tracer
from trainer import conventions as c
from trainer.checkpoints import find_checkpoint


def lagging_gateway_agent(task: dict[str, Any], resources: Mapping[str, Any]) -> None:
    """The cipher agent behind a model gateway one checkpoint behind the rollout's pin (a hot
    reload not done yet): each episode records an LLM call span saying the previous checkpoint
    served it (`lightning.llm.version`), which makes its sample one version older than its
    pinned resources version."""
    pinned = int(find_checkpoint(dict(resources))["step"])
    with tracer().start_as_current_span(c.LLM_CALL_SPAN, attributes={
            c.LLM_VERSION: max(pinned - 1, 0)}):
        pass
    cipher_agent(task, resources)
