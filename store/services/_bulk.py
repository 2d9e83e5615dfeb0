"""Fast multi-row writes. Django's bulk_update builds a CASE per field and row, which costs
milliseconds of Python per batch; on Postgres we send one `UPDATE ... FROM (VALUES ...)`, and
several such writes can travel as one statement (`write_together`): one round trip."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection
from django.db.models import Model

from store.services._copy import COPY_THRESHOLD, insert_new_copy, with_returned_pks

Statement = tuple[str, list[Any]]


def bulk_set(rows: Sequence[Model], fields: Sequence[str]) -> None:
    """Write `fields` of each (already fetched) row in one statement."""
    if rows:
        write_together([Write.set(rows, fields)])


class Write:
    """One multi-row write, run by `write_together`: an UPDATE of fetched rows (`set`) or an
    INSERT ... ON CONFLICT DO UPDATE (`upsert`)."""

    def __init__(self, rows: Sequence[Model], fields: Sequence[str], unique: Sequence[str] = ()):
        self.rows, self.fields, self.unique = list(rows), list(fields), list(unique)

    @classmethod
    def set(cls, rows: Sequence[Model], fields: Sequence[str]) -> Write:
        return cls(rows, fields)

    @classmethod
    def upsert(cls, rows: Sequence[Model], unique: Sequence[str], fields: Sequence[str]) -> Write:
        return cls(rows, fields, unique)

    def run_portable(self) -> None:
        """Elsewhere (the embedded SQLite default): the upsert's statement is portable; an
        update is one statement run once per row (executemany: compiled once). Not Django's
        bulk_update: its CASE WHEN per field and row costs more Python than the write, in
        a transaction that holds the file's one write turn."""
        with connection.cursor() as cursor:
            if self.unique:
                cursor.execute(*self._upsert_sql())
            else:
                cursor.executemany(*self._update_each_sql())

    def statement(self) -> Statement:
        return self._upsert_sql() if self.unique else self._update_sql()

    def _update_sql(self) -> Statement:
        meta = type(self.rows[0])._meta
        pk = meta.pk
        columns = [meta.get_field(name) for name in self.fields]
        casts = [pk.db_type(connection)] + [f.db_type(connection) for f in columns]
        placeholder = "(" + ", ".join(f"%s::{cast}" for cast in casts) + ")"
        params: list = []
        for row in self.rows:
            params.append(pk.get_db_prep_save(row.pk, connection))
            for field in columns:
                params.append(field.get_db_prep_save(getattr(row, field.attname), connection))
        names = ["pk"] + [f"c{i}" for i in range(len(columns))]
        assignments = ", ".join(f'"{f.column}" = v.c{i}' for i, f in enumerate(columns))
        sql = (
            f'UPDATE "{meta.db_table}" AS t SET {assignments} '
            f'FROM (VALUES {", ".join([placeholder] * len(self.rows))}) '
            f'AS v({", ".join(names)}) WHERE t."{pk.column}" = v.pk'
        )
        return sql, params

    def _update_each_sql(self) -> tuple[str, list[list]]:
        meta = type(self.rows[0])._meta
        pk = meta.pk
        columns = [meta.get_field(name) for name in self.fields]
        assignments = ", ".join(f'"{f.column}" = %s' for f in columns)
        params = [[field.get_db_prep_save(getattr(row, field.attname), connection)
                   for field in columns] + [pk.get_db_prep_save(row.pk, connection)]
                  for row in self.rows]
        return f'UPDATE "{meta.db_table}" SET {assignments} WHERE "{pk.column}" = %s', params

    def _upsert_sql(self) -> Statement:
        meta = type(self.rows[0])._meta
        fields = [f for f in meta.concrete_fields if not f.primary_key]
        placeholder = "(" + ", ".join(["%s"] * len(fields)) + ")"
        params: list = []
        for row in self.rows:
            params.extend(f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields)
        keys = ", ".join(f'"{meta.get_field(name).column}"' for name in self.unique)
        updates = ", ".join(
            f'"{column}" = EXCLUDED."{column}"'
            for column in (meta.get_field(name).column for name in self.fields)
        )
        columns = ", ".join(f'"{f.column}"' for f in fields)
        sql = (
            f'INSERT INTO "{meta.db_table}" ({columns}) '
            f'VALUES {", ".join([placeholder] * len(self.rows))} '
            f"ON CONFLICT ({keys}) DO UPDATE SET {updates}"
        )
        return sql, params


def write_together(writes: Sequence[Write], last: Statement | None = None) -> list[tuple]:
    """Run writes that touch different rows, then `last` (Postgres only), returning the
    rows `last` returns. On Postgres it is one statement (the writes as data-modifying WITH
    clauses of the last), so one round trip whatever their number."""
    writes = [w for w in writes if w.rows]
    if connection.vendor != "postgresql":
        assert last is None, "a raw statement runs on Postgres only"
        for write in writes:
            write.run_portable()
        return []
    statements = [w.statement() for w in writes] + ([last] if last else [])
    if not statements:
        return []
    *first, (sql, params) = statements
    if first:
        clauses = ", ".join(f"w{i} AS ({text})" for i, (text, _) in enumerate(first))
        sql = f"WITH {clauses} {sql}"
        params = [p for _, ps in first for p in ps] + params
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if last else []


def insert_new(
    rows: Sequence[Model], unique: Sequence[str], also: Sequence[Write] = ()
) -> list[Model]:
    """Insert rows, skipping any whose `unique` fields match a stored row; returns the rows
    inserted (with their pks). The writes `also` run first (same transaction). A small batch
    on Postgres is one statement with them: Django 5.2's bulk_create sends JSON through
    UNNEST arrays, whose escaping costs ~0.3 ms a kilobyte in Python; a large one goes
    through COPY (store/services/_copy.py)."""
    if not rows:
        write_together(also)
        return []
    model = type(rows[0])
    meta = model._meta
    fields = [f for f in meta.concrete_fields if not f.primary_key]
    key_columns = [meta.get_field(name).attname for name in unique]
    if connection.vendor != "postgresql" or len(rows) >= COPY_THRESHOLD:
        write_together(also)
        if connection.vendor != "postgresql":
            return _insert_new_portable(model, rows, unique, key_columns)
        return insert_new_copy(model, rows, unique, key_columns, fields)
    placeholder = "(" + ", ".join(["%s"] * len(fields)) + ")"
    params: list = []
    for row in rows:
        params.extend(f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields)
    keys = ", ".join(f'"{meta.get_field(name).column}"' for name in unique)
    columns = ", ".join(f'"{f.column}"' for f in fields)
    sql = (
        f'INSERT INTO "{meta.db_table}" ({columns}) '
        f'VALUES {", ".join([placeholder] * len(rows))} ON CONFLICT ({keys}) DO NOTHING '
        f'RETURNING "{meta.pk.column}", {keys}'
    )
    returned = {tuple(r[1:]): r[0] for r in write_together(also, last=(sql, params))}
    return with_returned_pks(rows, key_columns, returned)


def _insert_new_portable(model, rows, unique, key_columns) -> list[Model]:
    lookups = {
        f"{name}__in": {getattr(r, col) for r in rows}
        for name, col in zip(unique, key_columns, strict=True)
    }
    existing = set(model.objects.filter(**lookups).values_list(*key_columns))
    fresh, seen = [], set()
    for row in rows:
        key = tuple(getattr(row, c) for c in key_columns)
        if key not in existing and key not in seen:
            seen.add(key)
            fresh.append(row)
    # No ignore_conflicts: the embedded default's transactions are serialized, so what was not
    # stored above cannot conflict now, and without it the rows come back with their pks, as
    # from the Postgres paths.
    model.objects.bulk_create(fresh, batch_size=500)
    return fresh
