"""The agent protocol: how a user writes an agent (README "Writing an agent").

An agent is a plain function or an object (or class) with a `rollout` method. It is called with
the rollout's input as its first argument, and by keyword with whichever of these its signature
names:

- `resources`: the `{name: resource}` mapping the rollout pinned (LLM endpoint, prompt
  template, model checkpoint...);
- `rollout`: a `RolloutInfo` (ids, mode, config, metadata, and `cancelled`, an event set when
  the rollout is cancelled);
- `rollout_id`, `attempt_id`, `mode`;
- any resource by its name (AGL style: `def agent(task, llm): ...` gets `resources["llm"]`).

It returns a reward (a number) or None, and may emit spans with OpenTelemetry or with
`runners.tracing.emit_reward` / `emit_message`. It may be `async`. Agents are found by dotted
path: "package.module:attr" or "package.module.attr"; a class is instantiated once per process
with no arguments.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class RolloutInfo:
    rollout_id: str
    attempt_id: str
    mode: str | None = None
    resources_id: str | None = None
    resources_version: int | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    sequence_id: int = 1  # the attempt's number
    # Set when the rollout is cancelled: long agents may check it and stop early.
    cancelled: threading.Event = field(default_factory=threading.Event, compare=False)


@runtime_checkable
class LitAgent(Protocol):
    """The class form: `rollout(task, **context) -> float | None`."""

    def rollout(self, task: Any, /, **context: Any) -> float | None: ...


Agent = Callable[..., Any] | LitAgent


class AgentError(Exception):
    """The agent could not be found or returned something that is not a reward."""


@cache
def load_agent(path: str) -> Agent:
    """The agent at "module:attr" or "module.attr" (classes instantiated once per process)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise AgentError(f"agent path {path!r} must look like 'package.module:name'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and (
                module_name == exc.name or module_name.startswith(exc.name + ".")):
            # The first try of a new user: the package is not on this process's path.
            hint = " (is the directory holding it on PYTHONPATH here? README 'Writing an agent')"
        raise AgentError(f"agent module {module_name!r} cannot be imported: {exc}{hint}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AgentError(f"agent {path!r}: {module_name} has no {attr!r}") from None
    if inspect.isclass(target):
        target = target()
    if not callable(target) and not isinstance(target, LitAgent):
        raise AgentError(f"agent {path!r} is neither callable nor has a rollout method")
    return target


def call_agent(
    agent: Agent, *, task: Any, resources: Mapping[str, Any], rollout: RolloutInfo
) -> float | None:
    """Run the agent once and return its reward (None when it gives none)."""
    fn = agent.rollout if isinstance(agent, LitAgent) else agent
    result = fn(task, **_keywords(fn, resources, rollout))
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return _reward(result)


# What every call offers besides the rollout's resources (by name).
CONTEXT = ("resources", "rollout", "rollout_id", "attempt_id", "mode")


def _keywords(fn: Callable[..., Any], resources: Mapping[str, Any], rollout: RolloutInfo) -> dict:
    offered: dict[str, Any] = dict(resources)
    offered.update(
        resources=resources, rollout=rollout, rollout_id=rollout.rollout_id,
        attempt_id=rollout.attempt_id, mode=rollout.mode,
    )
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return offered
    if missing := _required(params, resources):
        raise AgentError(unoffered(missing, resources))
    # The first positional parameter takes the input; the others are matched by name.
    named = [
        p.name for p in params[1:]
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    return {name: offered[name] for name in named if name in offered}


def missing_resources(agent: Agent, resources: Mapping[str, Any] | set[str]) -> list[str]:
    """The parameters `agent` requires (no default) that neither a resource named in
    `resources` nor the call's context (CONTEXT) would give it."""
    fn = agent.rollout if isinstance(agent, LitAgent) else agent
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature: not checked
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    return _required(params, resources)


def unoffered(missing: list[str], resources: Mapping[str, Any] | set[str]) -> str:
    """Why a call cannot be made: the agent requires what the rollout does not pin."""
    pinned = ", ".join(sorted(resources)) or "none"
    names = ", ".join(repr(name) for name in missing)
    return (f"the agent requires {names}, but the rollout pins no resource of that name (its "
            f"resources: {pinned}); an agent takes the input first, then by name its "
            f"resources and {', '.join(CONTEXT)}: pin the resource (rollouts_enqueue --llm "
            f"MODEL, --resource NAME=JSON) or give the parameter a default")


def _required(params: list[inspect.Parameter], resources: Mapping[str, Any] | set[str]
              ) -> list[str]:
    return [
        p.name for p in params[1:]
        if p.default is inspect.Parameter.empty and p.name not in resources
        and p.name not in CONTEXT
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _reward(result: Any) -> float | None:
    if result is None:
        return None
    if isinstance(result, bool) or not isinstance(result, int | float):
        raise AgentError(f"an agent returns a number or None, not {type(result).__name__}")
    return float(result)
