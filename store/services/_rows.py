"""Hand-written SELECTs for the hottest reads (Postgres), turned into model instances.

Compiling a queryset with select_related and select_for_update costs the API more CPU than
the rest of a span post; these statements are built once from the models' metadata, so they
still follow the models, and psycopg caches their parsing because their text never changes.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import threading
import time
import weakref
from datetime import datetime

import orjson
import psycopg
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import JSONField, Model
from django.db.models.base import ModelState

from store.models import ApiKey, Attempt, Project, Rollout
from store.services import _libpq


@functools.cache
def _columns(model: type[Model], alias: str) -> str:
    return ", ".join(f'{alias}."{f.column}"' for f in model._meta.concrete_fields)


@functools.cache
def _json_positions(model: type[Model]) -> tuple[tuple[int, JSONField], ...]:
    return tuple((i, f) for i, f in enumerate(model._meta.concrete_fields)
                 if isinstance(f, JSONField))


def pk_only(model: type[Model], db: str, pk: object) -> Model:
    """What `model.from_db(db, ["id"], [pk])` builds (its other fields load if ever read),
    without Model.__init__'s per-field work: a tenth of the time, for a lean request's
    project."""
    instance = model.__new__(model)
    state = ModelState()
    state.db, state.adding = db, False
    instance._state = state
    instance.__dict__[model._meta.pk.attname] = pk
    return instance


def row_instance(model: type[Model], values: list) -> Model:
    """What the ORM builds from a row: JSON columns arrive as text (Django's loader)."""
    for i, field in _json_positions(model):
        if isinstance(values[i], str):
            values[i] = _loads(values[i], field)
    return model.from_db(connection.alias, None, values)


def _loads(text: str, field: JSONField):
    if field.decoder is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:  # e.g. an integer beyond 64 bits
            pass
    return json.loads(text, cls=field.decoder)


# The span epoch (README "Span sequence ids and crashes"): one row of an UNLOGGED table,
# which Postgres empties in every crash recovery (a server stopped without a checkpoint, a
# backend killed and the shared memory reset, a replica promoted), so a new epoch starts
# after anything that can lose an asynchronous commit. The statements that decide on it
# read it themselves.
SPAN_EPOCH_TABLE = "store_span_epoch"
EPOCH_SQL = f"(SELECT started FROM {SPAN_EPOCH_TABLE} WHERE id = 1)"
# What each raw connection found (a copy, which may go stale behind a pooler: see
# server_epoch).
_epochs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_epochs_lock = threading.Lock()


def epoch_now() -> datetime | None:
    """The span epoch as the database has it now (None: none, after a crash)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {EPOCH_SQL}")
        return cursor.fetchone()[0]


def server_epoch(renew: bool = False) -> datetime | None:
    """The span epoch, started here where there is none yet (after a crash), for what may
    use a copy kept per connection: a new rollout's (an epoch gone stale only makes its
    first reservation durable). The statements that decide on it read it themselves: behind
    a pooler a client's connection outlives a crash. Kept once read outside a transaction
    (inside one it may be this transaction's own start of it, which a rollback would undo);
    `renew`: read (and start) it again. None on SQLite, whose commits are never
    asynchronous."""
    if connection.vendor != "postgresql":
        return None
    connection.ensure_connection()
    raw = connection.connection
    with _epochs_lock:
        known = None if renew else _epochs.get(raw)
    if known is not None:
        return known
    for _ in range(3):  # a concurrent first start: read again
        known = epoch_now()
        if known is not None:
            break
        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {SPAN_EPOCH_TABLE} (id, started) "
                           "VALUES (1, clock_timestamp()) ON CONFLICT (id) DO NOTHING "
                           "RETURNING started")
            started = cursor.fetchone()
            if started is not None:
                known = started[0]
                break
    if known is not None and not connection.in_atomic_block:
        with _epochs_lock:
            _epochs[raw] = known
    return known


# A column that makes the statement's transaction commit asynchronously (SET LOCAL's function
# form), evaluated once per row returned.
SET_ASYNC_COMMIT = ", set_config('synchronous_commit', 'off', true)"


def _attempts_with_rollouts(where: str, lock: str, params: list) -> list[Attempt]:
    sql = (
        f"SELECT {_columns(Attempt, 'a')}, {_columns(Rollout, 'r')} FROM store_attempt a "
        f"JOIN store_rollout r ON r.id = a.rollout_id WHERE {where} ORDER BY a.id {lock}"
    )
    return _instances(sql, params)


def _instances(sql: str, params: list) -> list[Attempt]:
    """Attempts, each with its rollout (one instance per rollout), from rows of attempt
    columns then rollout columns."""
    width = len(Attempt._meta.concrete_fields)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    rollouts: dict[str, Rollout] = {}
    attempts = []
    for row in rows:
        attempt = row_instance(Attempt, list(row[:width]))
        rollout = rollouts.get(attempt.rollout_id)
        if rollout is None:
            rollout = rollouts[attempt.rollout_id] = row_instance(
                Rollout, list(row[width:width + len(Rollout._meta.concrete_fields)]))
        attempt._state.fields_cache["rollout"] = rollout  # as select_related leaves it
        attempts.append(attempt)
    return attempts


def attempts_locked(project_id: int, rollout_ids: list[str], attempt_ids: list[str] | None,
                    lock_rollouts: bool, live_key: LiveKey | None = None) -> list[Attempt]:
    """The project's attempts of these rollouts (only those named, when `attempt_ids` is
    given), each with its rollout (one instance per rollout), locked FOR NO KEY UPDATE in
    attempt pk order; with `lock_rollouts`, their rollouts next, in id order, read again once
    locked.

    The one lock order of every writer (store/rules.py, LOCK_ORDER): attempts in id order,
    then rollouts in id order, then workers, then groups. Locking a rollout between two of
    its attempts (one joined statement locks rows as it emits them) deadlocked with the
    sweep, which holds a late attempt and waits for its rollout.

    Rows of another project are filtered out before they are locked: naming another tenant's
    ids never waits behind its transactions (a timing oracle). The filter is written
    `project_id + 0` so the planner cannot pick the project's index over the primary keys (a
    new project's stale statistics look small, and it would scan the whole project).

    With `live_key` (a lean request's key), no row is found unless that key is live
    (`KEY_LIVE_SQL`), so nothing is locked or written for a revoked key."""
    where = f"{_among('a.rollout_id', rollout_ids)} AND r.project_id + 0 = %s"
    params: list = [_one_or_all(rollout_ids), project_id]
    if attempt_ids is not None:
        where += f" AND {_among('a.attempt_id', attempt_ids)}"
        params.append(_one_or_all(attempt_ids))
    if live_key is not None:
        where += f" AND {KEY_LIVE_SQL}"
        params.extend(live_key)
    if lock_rollouts:
        return _attempts_then_rollouts_locked(where, params + [project_id])
    return _attempts_with_rollouts(where, "FOR NO KEY UPDATE OF a", params)


def _attempts_then_rollouts_locked(where: str, params: list, async_commit: bool = False
                                   ) -> list[Attempt]:
    """Both locking steps of `attempts_locked(lock_rollouts=True)` in one statement (one round
    trip): the attempts locked in id order (a materialized WITH clause), then their rollouts
    in id order, as they are once locked. The rollouts' ids come from an array built from
    the locked attempts before the rollouts' scan begins (an init plan), so every attempt is
    locked before the first rollout, as with two statements."""
    sql = (
        f"WITH la AS MATERIALIZED (SELECT {_columns(Attempt, 'a')} FROM store_attempt a "
        f"JOIN store_rollout r ON r.id = a.rollout_id WHERE {where} "
        "ORDER BY a.id FOR NO KEY UPDATE OF a), "
        f"lr AS MATERIALIZED (SELECT {_columns(Rollout, 'r')} FROM store_rollout r "
        "WHERE r.id = ANY(ARRAY(SELECT DISTINCT la.rollout_id FROM la)) "
        "AND r.project_id + 0 = %s ORDER BY r.id FOR NO KEY UPDATE) "
        f"SELECT {_columns(Attempt, 'la')}, {_columns(Rollout, 'lr')}"
        f"{SET_ASYNC_COMMIT if async_commit else ''} FROM la "
        "JOIN lr ON lr.id = la.rollout_id ORDER BY la.id"
    )
    return _instances(sql, params)


def attempts_and_rollouts_locked(project_id: int, rollout_ids: list[str],
                                 attempt_ids: list[str], async_commit: bool = False
                                 ) -> list[Attempt]:
    """`attempts_locked(project_id, rollout_ids, attempt_ids, lock_rollouts=True)` (one
    statement), for the span ingest: with `async_commit`, the statement also makes this
    transaction commit asynchronously (`set_config(..., is_local)`, as `SET LOCAL` would;
    evaluated only when rows come back), which saves that round trip."""
    where = (f"{_among('a.rollout_id', rollout_ids)} AND r.project_id + 0 = %s "
             f"AND {_among('a.attempt_id', attempt_ids)}")
    return _attempts_then_rollouts_locked(
        where, [_one_or_all(rollout_ids), project_id, _one_or_all(attempt_ids), project_id],
        async_commit)


def _among(column: str, ids: list[str]) -> str:
    """`column = %s` for one id, `column = ANY(%s)` for several. Prepared, a statement over
    an array is planned anew on every run: its generic plan, costed for an array of unknown
    length, never looks as cheap as the custom plans for one id, so Postgres keeps planning
    (a report's locking read: 0.32 ms of planning for 0.07 ms of work). With a single value
    the generic plan is the custom one, and Postgres keeps it."""
    return f"{column} = %s" if len(ids) == 1 else f"{column} = ANY(%s)"


def _one_or_all(ids: list[str]) -> str | list[str]:
    return ids[0] if len(ids) == 1 else ids


def rollouts_locked(project_id: int, rollout_ids: list[str]) -> dict[str, Rollout]:
    """The project's rollouts locked FOR NO KEY UPDATE in id order, as they are once locked."""
    sql = (
        f"SELECT {_columns(Rollout, 'r')} FROM store_rollout r WHERE r.id = ANY(%s) "
        "AND r.project_id + 0 = %s ORDER BY r.id FOR NO KEY UPDATE"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [rollout_ids, project_id])
        rows = cursor.fetchall()
    return {r.pk: r for r in (row_instance(Rollout, list(row)) for row in rows)}


def api_key_live(prefix: str) -> ApiKey | None:
    """The unrevoked key with this prefix, with its project (as select_related leaves it)."""
    sql = (f"SELECT {_columns(ApiKey, 'k')}, {_columns(Project, 'p')} FROM store_apikey k "
           "JOIN store_project p ON p.id = k.project_id "
           "WHERE k.prefix = %s AND k.revoked_at IS NULL")
    with connection.cursor() as cursor:
        cursor.execute(sql, [prefix])
        row = cursor.fetchone()
    if row is None:
        return None
    width = len(ApiKey._meta.concrete_fields)
    key = row_instance(ApiKey, list(row[:width]))
    key._state.fields_cache["project"] = row_instance(Project, list(row[width:]))
    return key


class KeyNotLive(Exception):
    """A lean request's key (`live_key`) was revoked, deleted or given another role since
    this process cached it: nothing was written; the request goes through Django, which
    answers as it would (401 for a dead key)."""


# A lean request's key as its statement checks it: (pk, role). What the process cached of
# the key; the statement finds it still so (a role may be edited in the admin).
LiveKey = tuple[int, str]
# The condition a lean request's statement adds (parameters: the key's pk, then its role):
# the key exists, still has that role, and is not revoked. Checked in the statement that
# writes, so a key revoked before it runs does nothing (read committed: the revocation's
# commit is seen).
_KEY_LIVE = ("EXISTS (SELECT 1 FROM store_apikey WHERE id = {pk} AND role = {role} "
             "AND revoked_at IS NULL)")
KEY_LIVE_SQL = _KEY_LIVE.format(pk="%s", role="%s")
KEY_LIVE_SQL_NAMED = _KEY_LIVE.format(pk="%(key)s", role="%(key_role)s")


def require_key_live(live_key: LiveKey | None) -> None:
    """Raise KeyNotLive unless the key `live_key` is live (nothing to check: None). For the
    paths whose writes do not carry `KEY_LIVE_SQL`: run it before them (inside their
    transaction, where they have one)."""
    if live_key is None:
        return
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {KEY_LIVE_SQL}", list(live_key))
        if not cursor.fetchone()[0]:
            raise KeyNotLive(live_key[0])


_PLACEHOLDER = re.compile(r"%(.|$)", re.S)


@functools.lru_cache(maxsize=512)
def _native(sql: str) -> bytes:
    """`sql` with Postgres' own placeholders ($1, $2, ...) for its `%s` (`%%`: a `%`), run
    by a `psycopg.RawCursor`. Converted once per text: psycopg's Cursor converts a statement
    on every run unless it is short (4 KB, 50 parameters), and an OTLP export's statement is
    not (its conversion cost about a fifth of the export's Python)."""
    counter = itertools.count(1)

    def placeholder(match: re.Match) -> str:
        if match.group(1) == "%":
            return "%"
        if match.group(1) == "s":
            return f"${next(counter)}"
        raise ValueError(f"only %s placeholders (and %%) are allowed: {match.group(0)!r}")

    return _PLACEHOLDER.sub(placeholder, sql).encode()


def native_sql(sql: str) -> bytes:
    """`sql` (`%s` placeholders) as `fetch_one_prepared` runs it: Postgres' own `$1, $2, ...`
    (converted once per text), for a caller with a connection of its own."""
    return _native(sql)


def fetch_one_prepared(sql: str, params: list) -> tuple | None:
    """Run one statement (Postgres) with server-side binding, prepared once per connection
    (unless DATABASE_URL says `prepared_statements=false`): its first row. For the hottest
    statement, whose parsing and planning cost Postgres more than running it (an OTLP
    export: ~0.4 ms of ~0.55), and whose parameters need no quoting into the text.

    Django's own cursors bind server-side too and are prepared from their fifth run
    (core/env.py); this one is prepared at its first. Errors are Django's, as from
    its cursors, and the statement is logged where Django logs queries."""
    db = connections[DEFAULT_DB_ALIAS]  # `connection`, looked up once, not per attribute
    db.ensure_connection()
    db.validate_thread_sharing()
    raw = db.connection
    prepare = db.settings_dict.get("PREPARED_STATEMENTS", True)
    started = time.monotonic()
    if _libpq.usable(raw):  # its own transaction: one libpq call (store/services/_libpq.py)
        with db.wrap_database_errors:
            row = _libpq.run_one(raw, _native(sql), params, prepare)
    else:
        if prepare and raw.prepare_threshold is None:
            raw.prepare_threshold = 2**31 - 1  # only what asks for it (prepare=True)
        with db.wrap_database_errors, psycopg.RawCursor(raw) as cursor:
            cursor.execute(_native(sql), params, prepare=prepare)
            row = cursor.fetchone()
    if db.queries_logged:
        db.queries_log.append({"sql": sql, "time": f"{time.monotonic() - started:.3f}"})
    return row
