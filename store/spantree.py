"""An attempt's spans as a tree, for people: parents before children, siblings by start time,
each with its depth, duration, and the reward or message it carries (AGL's conventions)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from store.models import Span
from store.rewards import span_reward

MESSAGE_SPAN = "agentlightning.message"
MESSAGE_BODY_ATTR = "agentlightning.message.body"


@dataclass(frozen=True)
class TreeRow:
    span: Span
    depth: int
    start: datetime | None
    seconds: float | None
    reward: float | None
    message: str | None


def _row(span: Span, depth: int) -> TreeRow:
    start = (datetime.fromtimestamp(span.start_time, tz=UTC)
             if span.start_time is not None else None)
    seconds = (span.end_time - span.start_time
               if span.start_time is not None and span.end_time is not None else None)
    attributes = span.attributes or {}
    message = attributes.get(MESSAGE_BODY_ATTR) if span.name == MESSAGE_SPAN else None
    return TreeRow(span, depth, start, seconds, span_reward(span.name, attributes),
                   None if message is None else str(message))


def span_tree(spans: list[Span]) -> list[TreeRow]:
    """Depth-first order. A span whose parent is not among `spans` is a root, so a partial
    trace still shows every span once."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        parent = span.parent_id if span.parent_id in ids and span.parent_id != span.span_id \
            else None
        children.setdefault(parent, []).append(span)
    for siblings in children.values():
        siblings.sort(key=lambda s: (s.start_time is None, s.start_time or 0.0, s.sequence_id))
    rows: list[TreeRow] = []
    seen: set[str] = set()
    stack = [(span, 0) for span in reversed(children.get(None, []))]
    while stack:
        span, depth = stack.pop()
        if span.span_id in seen:
            continue
        seen.add(span.span_id)
        rows.append(_row(span, depth))
        stack.extend((child, depth + 1) for child in reversed(children.get(span.span_id, [])))
    # Spans caught in a parent cycle are unreachable from a root: list them flat at the end.
    rows.extend(_row(s, 0) for s in spans if s.span_id not in seen)
    return rows
