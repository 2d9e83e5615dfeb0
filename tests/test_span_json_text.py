"""The text of a span's JSON columns on every path (store/jsontext.py `span_json_text`):
orjson's, which Postgres reads as the same value as `json.dumps`' (what Django's JSONField
sent), `json.dumps`' own text where orjson refuses a value, and null for NaN and infinities
(json.dumps writes a token Postgres and SQLite refuse)."""

from __future__ import annotations

import json
import math

import pytest
from django.db import connection

from store.jsontext import span_json_text

pytestmark = pytest.mark.django_db

VALUES = [
    {"gen_ai.prompt": "héllo ✓ 世界", "n": 3, "f": 0.1, "big": 1e20, "small": 1e-7,
     "neg": -0.0, "x": 123456789.123456789, "t": True, "list": [1, 2.5, "a", {"b": []}]},
    {"nested": {"deep": {"deeper": [{"k": "v\n\t\"q\""}]}}, "empty": {}},
    {"max": 2**63 - 1, "min": -(2**63)},
    {"ctrl": "a\u0001b"},
    {"none": None, "text": "nullable"},
]
# orjson refuses it: json.dumps' text.
AS_BEFORE = [{"huge": 2**70}, {1: "int key"}]


@pytest.mark.parametrize("value", VALUES)
def test_postgres_reads_the_same_value(value):
    text = span_json_text(value)
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::jsonb = %s::jsonb, %s::jsonb::text",
                       [text, json.dumps(value), text])
        same, stored = cursor.fetchone()
    assert same, (text, json.dumps(value))
    assert json.loads(stored) == json.loads(json.dumps(value))


@pytest.mark.parametrize("value", AS_BEFORE)
def test_what_orjson_would_change_is_json_dumps_text(value):
    assert span_json_text(value) == json.dumps(value)


@pytest.mark.parametrize("value, stored", [
    ({"nan": math.nan, "inf": [math.inf, -math.inf], "x": 1.5}, {"nan": None, "inf": [None, None],
                                                                 "x": 1.5}),
    ({"huge": 2**70, "nan": math.nan}, {"huge": 2**70, "nan": None}),  # json.dumps' path too
])
def test_numbers_json_cannot_hold_are_null(value, stored):
    text = span_json_text(value)
    assert json.loads(text) == stored
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::jsonb::text", [text])
        assert json.loads(cursor.fetchone()[0]) == stored


def test_none_is_sql_null():
    assert span_json_text(None) is None
