"""The text of a span's JSON columns: one rule for every path that writes a span (the one
statement of the lean and OTLP paths, Django's insert, COPY, the embedded SQLite store).

Numbers JSON cannot hold (NaN, infinities: an agent's attribute set to a NaN metric) are
stored as null, as AGL 0.3's own client sends them (pydantic writes them as null) and as
COPY stored them; `json.dumps` writes a `NaN` token that Postgres and SQLite refuse, which
failed the write and with it the attempt. The text is orjson's (several times cheaper than
`json.dumps`, and Postgres reads it as the same value); where orjson refuses a value
(integers past 64 bits, keys that are not strings, lone surrogates), `json.dumps`' text of
it with the non-finite numbers made null.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson


def span_json_text(value: Any) -> str | None:
    """A span JSON column's parameter (None: SQL NULL)."""
    if value is None:
        return None
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(_finite(value))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


class SpanJSONEncoder(json.JSONEncoder):
    """The span model's JSON fields' encoder: Django's insert and the portable (SQLite) path
    write `span_json_text`, as the hand-written statements and COPY do."""

    def encode(self, o: Any) -> str:
        return span_json_text(o) or "null"
