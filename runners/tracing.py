"""OpenTelemetry spans of an attempt, turned into AGL span dicts and shipped in batches.

The process gets one real SDK `TracerProvider` (ours, or the one the user installed) with one
`SpanProcessor` that routes every finished span to the attempt it belongs to. An attempt is a
scope (`attempt_tracing`): spans started in its context, or in a trace it started, or (when only
one attempt runs in the process, as in a Celery prefork child) anywhere in the process, are
its spans. So libraries instrumented with OpenTelemetry produce spans without code changes.
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanContext

# AGL 0.3's span conventions.
AGL_ANNOTATION = "agentlightning.annotation"
AGL_MESSAGE = "agentlightning.message"
AGL_ROLLOUT = "agentlightning.rollout"
ROLLOUT_ID_KEY = "agentlightning.rollout_id"
ATTEMPT_ID_KEY = "agentlightning.attempt_id"
SEQUENCE_ID_KEY = "agentlightning.span_sequence_id"
TRACER_NAME = "lightning.runners"


class AttemptSpans:
    """The finished spans of one attempt, as AGL span dicts, waiting to be shipped."""

    def __init__(self, *, rollout_id: str, attempt_id: str, batch_size: int,
                 on_full: Callable[[], None] | None = None) -> None:
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.batch_size = batch_size
        self.on_full = on_full
        self.count = 0
        self._buffer: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._trace_ids: set[int] = set()

    def collect(self, span: ReadableSpan) -> None:
        with self._lock:
            self.count += 1
            # No sequence id: the store issues it from the rollout's counter, which the
            # rollout's other attempts and the model gateway's spans share (AGL's rule).
            self._buffer.append(span_to_agl(span, self.rollout_id, self.attempt_id, None))
            full = len(self._buffer) >= self.batch_size
        if full and self.on_full is not None:
            self.on_full()

    def take(self) -> list[dict[str, Any]]:
        with self._lock:
            batch, self._buffer = self._buffer, []
        return batch

    def put_back(self, batch: list[dict[str, Any]]) -> None:
        """A batch that could not be shipped goes back in front, to be tried again."""
        with self._lock:
            self._buffer[:0] = batch


class _AttemptRouter(SpanProcessor):
    """Sends each finished span to its attempt's `AttemptSpans` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scopes: list[AttemptSpans] = []
        self._started: dict[tuple[int, int], AttemptSpans] = {}

    def add(self, scope: AttemptSpans) -> None:
        with self._lock:
            self._scopes.append(scope)

    def remove(self, scope: AttemptSpans) -> None:
        with self._lock:
            self._scopes.remove(scope)
            self._started = {k: v for k, v in self._started.items() if v is not scope}

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        ctx = span.get_span_context()
        with self._lock:
            scope = _current.get()
            if scope is None or scope not in self._scopes:
                scope = next((s for s in self._scopes if ctx.trace_id in s._trace_ids), None)
            if scope is None and len(self._scopes) == 1:
                scope = self._scopes[0]
            if scope is not None:
                scope._trace_ids.add(ctx.trace_id)
                self._started[(ctx.trace_id, ctx.span_id)] = scope

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.get_span_context()
        with self._lock:
            scope = self._started.pop((ctx.trace_id, ctx.span_id), None)
        if scope is not None:
            scope.collect(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_current: contextvars.ContextVar[AttemptSpans | None] = contextvars.ContextVar(
    "lightning_attempt_spans", default=None
)
_router = _AttemptRouter()
_install_lock = threading.Lock()
_provider: TracerProvider | None = None


def tracer_provider() -> TracerProvider:
    """The process's SDK TracerProvider, with our router installed (once)."""
    global _provider
    with _install_lock:
        if _provider is None:
            current = trace.get_tracer_provider()
            if isinstance(current, TracerProvider):
                _provider = current  # the user's own provider keeps its exporters
            else:
                _provider = TracerProvider(
                    resource=Resource.create({"service.name": "lightning-runner"})
                )
                trace.set_tracer_provider(_provider)
            _provider.add_span_processor(_router)
        return _provider


def tracer() -> trace.Tracer:
    return tracer_provider().get_tracer(TRACER_NAME)


@contextmanager
def attempt_tracing(
    *, rollout_id: str, attempt_id: str, batch_size: int = 100,
    on_full: Callable[[], None] | None = None,
) -> Iterator[AttemptSpans]:
    """Collect the spans of one attempt while the block runs."""
    tracer_provider()
    scope = AttemptSpans(rollout_id=rollout_id, attempt_id=attempt_id, batch_size=batch_size,
                         on_full=on_full)
    _router.add(scope)
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)
        _router.remove(scope)


def collect_returned(span: ReadableSpan) -> None:
    """A finished span an agent returned (AGL agents may): stored with the current attempt.
    One the attempt already collected is dropped by the store (same span id)."""
    scope = _current.get()
    if scope is not None:
        scope.collect(span)


def add_returned_dict(span: dict[str, Any]) -> None:
    """An AGL span (as a dict) an agent returned, stored with the current attempt."""
    scope = _current.get()
    if scope is not None:
        with scope._lock:
            scope.count += 1
            scope._buffer.append(span)


def emit_reward(value: float | Mapping[str, float], name: str = "primary", *,
                attributes: Mapping[str, Any] | None = None) -> None:
    """A reward span (`agentlightning.annotation` with `agentlightning.reward.N.name/value`).
    A mapping emits several rewards in one span; `name` then says which one is primary.
    A reward that is not a finite number raises ValueError here, in the agent's attempt
    (which then fails saying so), rather than becoming a span no store can hold (NaN) or a
    reward the trainer cannot use."""
    rewards = [(name, value)] if not isinstance(value, Mapping) else sorted(
        value.items(), key=lambda item: item[0] != name
    )
    attrs: dict[str, Any] = dict(attributes or {})
    for index, (key, reward) in enumerate(rewards):
        attrs[f"agentlightning.reward.{index}.name"] = key
        attrs[f"agentlightning.reward.{index}.value"] = _finite(key, reward)
    with tracer().start_as_current_span(AGL_ANNOTATION, attributes=attrs):
        pass


def _finite(name: str, reward: Any) -> float:
    try:
        value = float(reward)
    except (TypeError, ValueError):
        raise ValueError(f"reward {name!r} must be a number, got {reward!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"reward {name!r} must be a finite number, got {value}")
    return value


def emit_message(message: str, *, attributes: Mapping[str, Any] | None = None) -> None:
    """A message span (`agentlightning.message` with `agentlightning.message.body`)."""
    attrs = {**(attributes or {}), "agentlightning.message.body": message}
    with tracer().start_as_current_span(AGL_MESSAGE, attributes=attrs):
        pass


def span_to_agl(span: ReadableSpan, rollout_id: str, attempt_id: str,
                sequence_id: int | None) -> dict:
    """An OpenTelemetry span as AGL's Span (the reference OpenAPI `Span` schema); a None
    `sequence_id` asks the store to issue one."""
    ctx = span.get_span_context()
    resource = span.resource
    resource_attrs = _attrs(resource.attributes if resource else {})
    resource_attrs.update({ROLLOUT_ID_KEY: rollout_id, ATTEMPT_ID_KEY: attempt_id})
    if sequence_id is not None:
        resource_attrs[SEQUENCE_ID_KEY] = sequence_id
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "sequence_id": sequence_id,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "name": span.name,
        "status": {"status_code": span.status.status_code.name,
                   "description": span.status.description},
        "attributes": _attrs(span.attributes),
        "events": [
            {"name": e.name, "attributes": _attrs(e.attributes), "timestamp": _seconds(e.timestamp)}
            for e in span.events
        ],
        "links": [
            {"context": _context(link.context), "attributes": _attrs(link.attributes)}
            for link in span.links
        ],
        "start_time": _seconds(span.start_time),
        "end_time": _seconds(span.end_time),
        "context": _context(ctx),
        "parent": _context(span.parent) if span.parent else None,
        "resource": {"attributes": resource_attrs,
                     "schema_url": (resource.schema_url if resource else "") or ""},
    }


def _context(ctx: SpanContext) -> dict[str, Any]:
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "is_remote": bool(ctx.is_remote),
        "trace_state": dict(ctx.trace_state or {}),
    }


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


def _seconds(nanos: int | None) -> float | None:
    return None if nanos is None else nanos / 1e9
