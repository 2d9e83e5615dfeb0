"""The JSON columns' text of the one-statement span paths (store/services/spans.py
`json_column_text`): orjson's where Postgres reads it as the same value as `json.dumps`'
(what Django's JSONField sends), `json.dumps`' own text where orjson would differ."""

from __future__ import annotations

import json
import math

import pytest
from django.db import connection

from store.services.spans import json_column_text

pytestmark = pytest.mark.django_db

VALUES = [
    {"gen_ai.prompt": "héllo ✓ 世界", "n": 3, "f": 0.1, "big": 1e20, "small": 1e-7,
     "neg": -0.0, "x": 123456789.123456789, "t": True, "list": [1, 2.5, "a", {"b": []}]},
    {"nested": {"deep": {"deeper": [{"k": "v\n\t\"q\""}]}}, "empty": {}},
    {"max": 2**63 - 1, "min": -(2**63)},
    {"ctrl": "a\u0001b"},
]
# orjson would write another value (null for NaN), or refuses it: json.dumps' text.
AS_BEFORE = [
    {"nan": math.nan}, {"inf": [math.inf]}, {"none": None}, {"huge": 2**70}, {1: "int key"},
    {"text": "nullable"},
]


@pytest.mark.parametrize("value", VALUES)
def test_postgres_reads_the_same_value(value):
    text = json_column_text(value)
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::jsonb = %s::jsonb, %s::jsonb::text",
                       [text, json.dumps(value), text])
        same, stored = cursor.fetchone()
    assert same, (text, json.dumps(value))
    assert json.loads(stored) == json.loads(json.dumps(value))


@pytest.mark.parametrize("value", AS_BEFORE)
def test_what_orjson_would_change_is_json_dumps_text(value):
    assert json_column_text(value) == json.dumps(value)


def test_none_is_sql_null():
    assert json_column_text(None) is None
