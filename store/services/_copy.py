"""Bulk inserts through COPY, Postgres only (the span ingest path).

The common case (no row already stored) is one lookup that also reserves primary keys, then
COPY straight into the table. When a concurrent writer stored one of the rows in between,
the COPY fails on the unique key; it is rolled back to a savepoint and the rows go through a
staging table and `INSERT ... ON CONFLICT DO NOTHING` instead.
"""

from __future__ import annotations

import functools
import json

import orjson
from django.db import connection, transaction
from django.db.models import Model
from psycopg import errors as pg_errors

# From this many rows on, COPY beats one INSERT with many parameters.
COPY_THRESHOLD = 50


def insert_new_copy(model, rows, unique, key_columns, fields) -> list[Model]:
    """Insert the rows whose `unique` fields match no stored row (nor an earlier row of the
    batch); returns them with their new pks. Runs in a transaction of its own or the caller's."""
    with transaction.atomic():
        fresh = _fresh_with_pks(model, rows, unique, key_columns)
        if not fresh:
            return []
        try:
            with transaction.atomic():  # a savepoint: a lost race must not spoil the caller's
                _copy(model, fresh, [model._meta.pk] + list(fields), model._meta.db_table)
            return fresh
        except pg_errors.UniqueViolation:
            for row in fresh:
                row.pk = None
    return _insert_staged(model, rows, unique, key_columns, fields)


def _fresh_with_pks(model, rows, unique, key_columns) -> list[Model]:
    """One round trip: which keys are stored already, plus a pk for each row from the
    table's own sequence (a pk left unused is a harmless gap)."""
    meta = model._meta
    key_fields = [meta.get_field(name) for name in unique]
    keys = ", ".join(f'"{f.column}"' for f in key_fields)
    arrays = ", ".join(f"%s::{f.db_type(connection)}[]" for f in key_fields)
    texts = ", ".join(f'"{f.column}"::text' for f in key_fields)
    blanks = ", ".join("NULL::text" for _ in key_fields)
    table, pk = meta.db_table, meta.pk.column
    sql = (
        f'SELECT NULL::bigint, {texts} FROM "{table}" '
        f"WHERE ({keys}) IN (SELECT * FROM unnest({arrays})) "
        f"UNION ALL SELECT nextval(%s::regclass), {blanks} FROM generate_series(1, %s)"
    )
    params = [[getattr(row, c) for row in rows] for c in key_columns]
    with connection.cursor() as cursor:
        cursor.execute(sql, params + [_sequence(table, pk), len(rows)])
        answer = cursor.fetchall()
    stored = {tuple(r[1:]) for r in answer if r[0] is None}
    pks = iter(r[0] for r in answer if r[0] is not None)
    fresh = []
    for row in rows:
        key = tuple(str(getattr(row, c)) for c in key_columns)
        if key not in stored:
            stored.add(key)  # a later duplicate in the same batch is skipped too
            row.pk = next(pks)
            fresh.append(row)
    return fresh


@functools.cache
def _sequence(table: str, column: str) -> str:
    """The sequence behind an identity column (asked once per process)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_serial_sequence(%s, %s)", [table, column])
        return cursor.fetchone()[0]


def _copy(model, rows, fields, table: str) -> None:
    columns = ", ".join(f'"{f.column}"' for f in fields)
    plan = [(f.attname, _encoder(f.encoder) if f.get_internal_type() == "JSONField" else None)
            for f in fields]
    with connection.cursor() as cursor:
        with cursor.cursor.copy(f'COPY "{table}" ({columns}) FROM STDIN') as copy:
            for row in rows:
                values = row.__dict__
                copy.write_row([_copy_value(values[name], encode) for name, encode in plan])


def _insert_staged(model, rows, unique, key_columns, fields) -> list[Model]:
    """COPY into a per-connection staging table, then one INSERT ... SELECT ... ON CONFLICT
    DO NOTHING RETURNING: right even when other writers race us for the same keys."""
    meta = model._meta
    stage = f"stage_{meta.db_table}"
    columns = ", ".join(f'"{f.column}"' for f in fields)
    keys = ", ".join(f'"{meta.get_field(n).column}"' for n in unique)
    with connection.cursor() as cursor:
        # One round trip (no parameters, so both statements go as one query): the table
        # lives as long as the connection; emptying it first makes a second insert in the
        # same transaction safe.
        cursor.execute(
            f'CREATE TEMP TABLE IF NOT EXISTS "{stage}" ON COMMIT DELETE ROWS '
            f'AS SELECT {columns} FROM "{meta.db_table}" WITH NO DATA; DELETE FROM "{stage}"'
        )
        _copy(model, rows, fields, stage)
        cursor.execute(
            f'INSERT INTO "{meta.db_table}" ({columns}) SELECT DISTINCT ON ({keys}) {columns} '
            f'FROM "{stage}" ON CONFLICT ({keys}) DO NOTHING RETURNING "{meta.pk.column}", {keys}'
        )
        returned = {tuple(r[1:]): r[0] for r in cursor.fetchall()}
    return with_returned_pks(rows, key_columns, returned)


def with_returned_pks(rows, key_columns, returned: dict[tuple, int]) -> list[Model]:
    """The rows the INSERT ... RETURNING reported, given their new pks (first of equals)."""
    inserted = []
    for row in rows:
        key = tuple(getattr(row, c) for c in key_columns)
        if key in returned:
            row.pk = returned.pop(key)
            inserted.append(row)
    return inserted


@functools.cache
def _encoder(cls):
    """JSON text for a JSON field's value: orjson (several times faster than json, and it
    writes NaN as null where json writes a token Postgres refuses), falling back to the
    field's own encoder for what orjson cannot encode (integers beyond 64 bits, say)."""
    fallback = (cls or json.JSONEncoder)()

    def encode(value) -> str:
        try:
            return orjson.dumps(value, default=fallback.default,
                                option=orjson.OPT_NON_STR_KEYS).decode()
        except (orjson.JSONEncodeError, TypeError):
            return fallback.encode(value)

    return encode


def _copy_value(value, encode):
    """COPY's text for a value; `encode` is None for a column that is not JSON."""
    if value is None or encode is None:
        return value
    if not value and isinstance(value, dict | list):
        return "{}" if isinstance(value, dict) else "[]"
    return encode(value)
