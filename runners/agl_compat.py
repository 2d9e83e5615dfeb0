"""Agent Lightning 0.3 agents on our runners, unchanged.

An AGL agent (an `@agl.rollout` function, which AGL turns into a `LitAgent`, or a `LitAgent`
subclass) named by dotted path runs on a Celery rollout worker or `manage.py runner` as AGL's own
runner runs it: it gets AGL's typed resources (`agl.LLM`, `agl.ProxyLLM`, whose per-attempt base
URL AGL's `get_base_url` builds, `agl.PromptTemplate`) and its `AttemptedRollout`; training mode
calls `training_rollout`, the others `validation_rollout`; `agl.emit_reward`, `emit_message`,
`emit_object`, `emit_exception` and `agl.operation` spans go to the attempt as our tracing
collects every span; a returned number is the reward, returned spans are stored.

`agentlightning` is an optional dependency (`pip install -e '.[agl]'`) that costs seconds to
import, so it is imported on the first AGL agent only: recognising one needs no import.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections.abc import Mapping
from functools import cache
from typing import Any

from runners import tracing
from runners.agent import RolloutInfo

_AGL_PACKAGE = "agentlightning"
_tracer_lock = threading.Lock()


def is_agl_agent(agent: Any) -> bool:
    """An instance of AGL's LitAgent (what `@agl.rollout` makes, or a subclass)."""
    return any(cls.__module__.split(".")[0] == _AGL_PACKAGE and cls.__name__ == "LitAgent"
               for cls in type(agent).__mro__)


@cache
def _agl() -> Any:
    return importlib.import_module(_AGL_PACKAGE)


def call_agl_agent(agent: Any, *, task: Any, resources: Mapping[str, Any],
                   rollout: RolloutInfo) -> float | None:
    """Run an AGL agent once as AGL's runner does; returns its reward (None: it gave none)."""
    _ensure_active_tracer()
    named = agl_resources(resources)
    attempted = agl_rollout(task, rollout)
    train = rollout.mode == "train"
    if agent.is_async():
        method = agent.training_rollout_async if train else agent.validation_rollout_async
        result = asyncio.run(method(task, resources=named, rollout=attempted))
    else:
        method = agent.training_rollout if train else agent.validation_rollout
        result = method(task, resources=named, rollout=attempted)
    return _reward(result, rollout)


def agl_resources(resources: Mapping[str, Any]) -> dict[str, Any]:
    """`{name: resource dict}` as AGL's NamedResources; a resource of a type AGL does not
    know (one of ours) stays a dict."""
    adapter = _resource_adapter()
    typed: dict[str, Any] = {}
    for name, resource in resources.items():
        try:
            typed[name] = adapter.validate_python(_unrouted(resource))
        except ValueError:  # pydantic's ValidationError: not a resource type AGL knows
            typed[name] = resource
    return typed


def _unrouted(resource: Any) -> Any:
    """A proxy_llm as published: the executor routed its endpoint to the attempt
    (runners/llm.py), and AGL's ProxyLLM routes it again in `get_base_url`, so AGL gets the
    gateway's own endpoint back (the attempt's api_key stays)."""
    if isinstance(resource, Mapping) and "base_endpoint" in resource:
        unrouted = {k: v for k, v in resource.items() if k != "base_endpoint"}
        unrouted["endpoint"] = resource["base_endpoint"]
        return unrouted
    return resource


@cache
def _resource_adapter() -> Any:
    pydantic = importlib.import_module("pydantic")  # AGL's own dependency
    return pydantic.TypeAdapter(_agl().types.resources.ResourceUnion)


def agl_rollout(task: Any, rollout: RolloutInfo) -> Any:
    """The claimed attempt as AGL's AttemptedRollout."""
    types = _agl().types
    now = time.time()
    attempt = types.Attempt(rollout_id=rollout.rollout_id, attempt_id=rollout.attempt_id,
                            sequence_id=rollout.sequence_id, start_time=now, status="running")
    return types.AttemptedRollout(
        rollout_id=rollout.rollout_id, input=task, start_time=now, mode=rollout.mode,
        resources_id=rollout.resources_id, status="running",
        config=types.RolloutConfig.model_validate(dict(rollout.config or {})),
        metadata=dict(rollout.metadata or {}), attempt=attempt,
    )


def _reward(result: Any, rollout: RolloutInfo) -> float | None:
    """AGL's reading of a rollout's return value: a number is the final reward; a list of
    spans (OpenTelemetry or AGL's) is stored with the attempt; None leaves the spans as
    they were emitted."""
    if result is None:
        return None
    if isinstance(result, bool | int | float):
        return float(result)
    if isinstance(result, list):
        for span in result:
            if isinstance(span, tracing.ReadableSpan):
                tracing.collect_returned(span)
            elif hasattr(span, "model_dump"):
                tracing.add_returned_dict({**span.model_dump(), "sequence_id": None,
                                           "rollout_id": rollout.rollout_id,
                                           "attempt_id": rollout.attempt_id})
            else:
                raise TypeError(f"an AGL agent returned a list holding {type(span).__name__}")
        return None
    raise TypeError(f"an AGL agent returns a number, spans or None, not {type(result).__name__}")


def _ensure_active_tracer() -> None:
    """AGL's emitters write through the process's active AGL tracer; ours sends their spans
    to our tracer provider, where the attempt's scope collects them."""
    tracer_base = importlib.import_module(f"{_AGL_PACKAGE}.tracer.base")
    with _tracer_lock:
        if tracer_base.get_active_tracer() is None:
            tracer_base.set_active_tracer(_runner_tracer_class()())


@cache
def _runner_tracer_class() -> type:
    otel = importlib.import_module(f"{_AGL_PACKAGE}.tracer.otel")

    class RunnerTracer(otel.OtelTracer):
        """AGL's OpenTelemetry tracer on our provider (no exporter of its own: our runner
        ships the attempt's spans)."""

        def _get_tracer_provider(self) -> Any:
            return tracing.tracer_provider()

    return RunnerTracer
