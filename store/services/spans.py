"""Span ingest: batched inserts, duplicates ignored, every span an attempt heartbeat."""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from django.db import DataError, connection, transaction
from django.db.models import CharField, FloatField, JSONField
from django.db.models.base import ModelState
from django.utils import timezone
from psycopg import errors as pg_errors

from store import rules
from store.errors import InvalidInput, NotFound, StoreError
from store.jsontext import SpanJSONEncoder, span_json_text
from store.models import Attempt, Project, Rollout, Span
from store.services._bulk import Write, insert_new
from store.services._common import attempt_deadline, set_attempt_status
from store.services._copy import COPY_THRESHOLD
from store.services._rows import (
    EPOCH_SQL,
    KEY_LIVE_SQL,
    LiveKey,
    attempts_and_rollouts_locked,
    epoch_now,
    fetch_one_prepared,
    require_key_live,
    server_epoch,
)
from store.statemachine import AttemptStatus, RolloutConfig, RolloutStatus
from store.text import find_bad_text

_KNOWN = {
    "rollout_id", "attempt_id", "sequence_id", "trace_id", "span_id", "parent_id", "name",
    "status", "attributes", "events", "links", "start_time", "end_time", "context", "parent",
    "resource",
}


def span_add(*, project: Project, span: dict[str, Any]) -> Span | None:
    """Add one span; None when (rollout, attempt, span_id) was already stored."""
    return spans_add(project=project, spans=[span])[0]


def spans_add(
    *, project: Project, spans: Sequence[dict[str, Any]], now: datetime | None = None
) -> list[Span | None]:
    """Add spans in one batched insert; returns the new rows, None where a span was a
    duplicate. Each attempt that received a span gets a heartbeat."""
    return spans_ingest(project=project, spans=spans, now=now).rows


@dataclass
class SpansIngested:
    rows: list[Span | None]  # per span: the new row, or None for a duplicate
    cancelled: set[str]  # ids of the spans' rollouts that are cancelled (tell the runner)


def spans_ingest(
    *, project: Project, spans: Sequence[dict[str, Any]], now: datetime | None = None
) -> SpansIngested:
    """`spans_add`, for the API: a span whose `sequence_id` is None gets its attempt's next
    id (reserved in the same transaction), and the answer says which rollouts are cancelled.

    On Postgres a small batch is two statements and a commit: lock the attempts and their
    rollouts, then one statement that writes the attempts (heartbeat), the rollouts (sequence
    ids, preparing -> running) and inserts the spans. A stored span is skipped, not an error:
    identity is (attempt, span_id), so repeating a post is harmless."""
    for index, span in enumerate(spans):
        _validate(span, index)
    with _naming_bad_text(spans):
        return _ingest(project, spans, now or timezone.now())[0]


@dataclass
class SpansExported:
    cancelled: set[str]  # ids of the spans' rollouts that are cancelled (tell the runner)
    unknown: int  # spans naming an attempt the project does not have: not stored


def spans_export(
    *, project: Project, spans: Sequence[dict[str, Any]], now: datetime | None = None,
    live_key: LiveKey | None = None,
) -> SpansExported:
    """`spans_ingest` for an OTLP export (store/api/otlp.py, the view and the ASGI front's
    lean path): a span naming an attempt the project does not have is set aside and counted
    (the others are stored), and no rows come back.

    On Postgres outside any transaction, spans of one attempt are one statement run in
    autocommit, committing asynchronously (`_export_common`); the full path (`_ingest`)
    answers the rest, and the few cases that statement leaves to it, the same way.

    With `live_key` (a lean request's key), KeyNotLive and nothing stored unless that key
    is live: the one statement checks it; the full path reads it first."""
    for index, span in enumerate(spans):
        _validate(span, index)
    if not spans:
        return SpansExported(set(), 0)
    now = now or timezone.now()
    with _naming_bad_text(spans):
        if _common_case_possible(spans):
            row = _export_common(project, spans, now, live_key)
            if row is not None:
                return SpansExported(_cancelled(row, spans[0]), 0)
        require_key_live(live_key)
        ingested, unknown = _ingest(project, spans, now, unknown_ok=True)
        return SpansExported(ingested.cancelled, unknown)


def span_add_lean(*, project: Project, span: dict[str, Any], live_key: LiveKey,
                  now: datetime | None = None) -> SpansIngested | None:
    """`spans_ingest` of one span for the ASGI front's lean `POST /v1/agl/spans`
    (store/api/fastjson.py): the export's one statement (`_export_common`, in autocommit,
    committing asynchronously like every span-only write), which also checks `live_key`.
    The row is the one the full path would answer with (the span's `sequence_id` as the
    statement gave it; None for a duplicate). None, having written nothing, where the
    statement leaves the work to the full path (or the key is dead): Django answers."""
    _validate(span, 0)
    if not _common_case_possible([span]):
        return None
    with _naming_bad_text([span]):
        row = _export_common(project, [span], now or timezone.now(), live_key)
    if row is None:
        return None
    if span.get("sequence_id") is None:
        span["sequence_id"] = row[3]
    stored = None
    if row[1]:
        stored = SimpleNamespace(rollout_id=span["rollout_id"], sequence_id=span["sequence_id"],
                                 attempt=SimpleNamespace(attempt_id=span["attempt_id"]),
                                 **_span_values(span))
    return SpansIngested([stored], _cancelled(row, span))


def _cancelled(row: tuple, span: dict[str, Any]) -> set[str]:
    return {span["rollout_id"]} if row[0] == RolloutStatus.CANCELLED else set()


@contextmanager
def _naming_bad_text(spans: Sequence[dict[str, Any]]) -> Iterator[None]:
    try:
        yield
    except StoreError:
        raise
    except (DataError, pg_errors.DataError, UnicodeEncodeError, ValueError) as exc:
        # Text the database refused (a NUL, a lone surrogate): name the span and field.
        # The transaction was rolled back, so nothing of the batch is stored.
        bad = find_bad_text(list(spans))
        if bad is None:
            raise
        (index, *path), problem = bad
        field = ".".join([f"spans[{index}]", *map(str, path)])
        raise InvalidInput(field, problem, loc=(f"spans[{index}]", *path)) from exc


@contextmanager
def span_transaction() -> Iterator[None]:
    """A transaction for work that only adds spans (and reads): it commits asynchronously
    (`_commit_asynchronously`) when it is the outermost one. The setting travels with the
    transaction's first locking read when there is one (`_claim_async_commit`), else it is
    sent before the commit: either way the commit is asynchronous."""
    if connection.in_atomic_block:
        # Nested in a span transaction: no savepoint (two round trips); an error ends the
        # whole transaction, the outer one's to roll back. In another caller's: a savepoint.
        with transaction.atomic(savepoint=not getattr(_span_transaction, "open", False)):
            yield
        return
    with transaction.atomic():
        _span_transaction.open = True
        _span_transaction.async_pending = connection.vendor == "postgresql"
        try:
            yield
            if _span_transaction.async_pending:
                _commit_asynchronously()
        finally:
            _span_transaction.open = _span_transaction.async_pending = False


_span_transaction = threading.local()


def _claim_async_commit() -> bool:
    """True (once per span transaction) when the caller's next statement is to make the
    outermost span transaction commit asynchronously (`set_config('synchronous_commit',
    'off', true)`, the function form of `SET LOCAL`); the caller must then send it."""
    if getattr(_span_transaction, "async_pending", False):
        _span_transaction.async_pending = False
        return True
    return False


def _ingest(project: Project, spans: Sequence[dict[str, Any]], now: datetime,
            unknown_ok: bool = False) -> tuple[SpansIngested, int]:
    """The full path; with `unknown_ok`, spans naming an attempt the project does not have
    are left out (and counted) instead of refused."""
    with span_transaction():
        attempts, unknown = _attempts_for(project, spans, unknown_ok)
        if unknown:
            spans = [s for s in spans if (s["rollout_id"], s["attempt_id"]) in attempts]
        if not spans:
            return SpansIngested([], set()), len(unknown)
        counted = _assign_sequence_ids(spans, attempts)
        rows = [_row(span, attempts[(span["rollout_id"], span["attempt_id"])]) for span in spans]
        due = _heartbeats_due(list(attempts.values()), now)
        revived = [a for a in due if rules.REVIVES.python(a.status)]
        for attempt in due:
            # An ended attempt records the heartbeat too, and keeps its status (as in AGL).
            attempt.last_heartbeat_time = now
        lost = [a for a in revived if a.status == AttemptStatus.UNRESPONSIVE]
        for attempt in revived:
            # Records the watchdog's verdict on a revived attempt (store.watchdog_verdict).
            set_attempt_status(attempt, AttemptStatus.RUNNING, now)
            attempt.deadline = _deadline(attempt, now)
        running = _rollouts_running([a for a in revived if a.rollout.latest_attempt_id == a.pk])
        fields = ["status", "last_heartbeat_time", "deadline"]
        by_pk = functools.partial(sorted, key=lambda row: row.pk)
        writes = [Write.set(by_pk(a for a in due if a not in lost), fields),
                  Write.set(lost, [*fields, "metadata"]),
                  Write.set(by_pk(r for r in counted if r not in running),
                            ["next_span_sequence_id"]),
                  Write.set(by_pk(running), ["next_span_sequence_id", "status",
                                             "queue_deadline"])]
        inserted = {id(row) for row in insert_new(rows, ["attempt", "span_id"], also=writes)}
    cancelled = {a.rollout_id for a in attempts.values()
                 if a.rollout.status == RolloutStatus.CANCELLED}
    rows = [row if id(row) in inserted else None for row in rows]
    return SpansIngested(rows, cancelled), len(unknown)


def _commit_asynchronously() -> None:
    """A span-only transaction commits without waiting for its WAL to reach the disk
    (Postgres `synchronous_commit = off`, this transaction only). Safe for what we promise:
    WAL is one sequence, and a synchronous commit returns only once the WAL up to its own
    record is flushed, which includes every earlier commit. An attempt's completion
    (`attempt_update`, a synchronous commit) is acknowledged after its spans' commits, so once
    the runner hears "succeeded", its spans are as durable as the verdict. What a crash can
    lose is only the last ~0.6 s (3 x wal_writer_delay) of spans of attempts not finished yet,
    which the crash interrupts anyway. Never applied inside a caller's transaction: it would
    make the caller's whole commit asynchronous. (tests/test_span_durability.py crashes a
    Postgres right after a completion is acknowledged.)"""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit = off")


def _validate(span: Any, index: int) -> None:
    if not isinstance(span, dict):
        raise InvalidInput(f"spans[{index}]", "must be an object")
    for name in ("rollout_id", "attempt_id", "trace_id", "span_id", "name"):
        if not isinstance(span.get(name), str) or not span[name]:
            raise InvalidInput(f"spans[{index}].{name}", "must be a non-empty string")
    seq = span.get("sequence_id")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int)):
        raise InvalidInput(f"spans[{index}].sequence_id", "must be an integer or null")
    for name in ("attributes", "resource"):
        if span.get(name) is not None and not isinstance(span[name], dict):
            raise InvalidInput(f"spans[{index}].{name}", "must be an object")
    for name in ("start_time", "end_time"):
        value = span.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value)):
            raise InvalidInput(f"spans[{index}].{name}", "must be a finite number or null")


def _attempts_for(project: Project, spans: Sequence[dict], unknown_ok: bool = False
                  ) -> tuple[dict[tuple[str, str], Attempt], list[tuple[str, str]]]:
    """The spans' attempts with their rollouts (one instance per rollout), locked in attempt
    pk order, then their rollouts (rules.LOCK_ORDER): the rollout holds the span sequence
    counter. Also the keys naming no attempt of the project, in order: refused (NotFound,
    the first of them) unless `unknown_ok`."""
    keys = {(s["rollout_id"], s["attempt_id"]) for s in spans}
    rollout_ids = sorted({rid for rid, _ in keys})
    attempt_ids = sorted({aid for _, aid in keys})
    if connection.vendor == "postgresql":
        claimed = _claim_async_commit()
        rows = attempts_and_rollouts_locked(project.pk, rollout_ids, attempt_ids,
                                            async_commit=claimed)
        if claimed and not rows:  # the setting rode on no row: still to be sent
            _span_transaction.async_pending = True
    else:  # the embedded SQLite default: its transactions are serialized (BEGIN IMMEDIATE)
        rows = list(
            Attempt.objects.select_related("rollout")
            .filter(rollout_id__in=rollout_ids, attempt_id__in=attempt_ids)
            .order_by("pk")
        )
        shared: dict[str, Rollout] = {}
        for attempt in rows:
            attempt.rollout = shared.setdefault(attempt.rollout_id, attempt.rollout)
    # Postgres filtered the project before locking; checked again for SQLite's rows.
    found = {(a.rollout_id, a.attempt_id): a for a in rows if a.rollout.project_id == project.pk}
    unknown = [key for key in sorted(keys) if key not in found]
    if unknown and not unknown_ok:
        key = unknown[0]
        if not any(rid == key[0] for rid, _ in found):
            _check_rollout(project, key[0])
        raise NotFound("attempt", f"{key[0]}/{key[1]}")
    return {key: found[key] for key in keys if key in found}, unknown


def _check_rollout(project: Project, rollout_id: str) -> None:
    """AGL's wording: `Rollout <id> not found` before `Attempt <id> not found ...`."""
    if not Rollout.objects.filter(project=project, pk=rollout_id).exists():
        raise NotFound("rollout", rollout_id)


def _span_values(span: dict[str, Any]) -> dict[str, Any]:
    """A span's stored fields, less its ids (rollout, attempt, sequence, row)."""
    return {
        "trace_id": span["trace_id"],
        "span_id": span["span_id"],
        "parent_id": span.get("parent_id"),
        "name": span["name"],
        "status": span.get("status") or {"status_code": "UNSET", "description": None},
        "attributes": span.get("attributes") or {},
        "events": span.get("events") or [],
        "links": span.get("links") or [],
        "start_time": span.get("start_time"),
        "end_time": span.get("end_time"),
        "context": span.get("context"),
        "parent": span.get("parent"),
        "resource": span.get("resource") or {"attributes": {}, "schema_url": ""},
        "extra": {k: v for k, v in span.items() if k not in _KNOWN},
    }


def _row(span: dict[str, Any], attempt: Attempt) -> Span:
    values = {
        "id": None,
        "rollout_id": attempt.rollout_id,
        "attempt_id": attempt.pk,
        "sequence_id": span["sequence_id"],
        **_span_values(span),
    }
    # Filling the instance's dict directly skips Django's per-field descriptors in
    # Model.__init__, which cost more than the rest of building the row.
    row = Span.__new__(Span)
    row._state = ModelState()
    row.__dict__.update(values)
    return row


def _assign_sequence_ids(
    spans: Sequence[dict[str, Any]], attempts: dict[tuple[str, str], Attempt]
) -> list[Rollout]:
    """AGL's per-rollout counter (rules.SPAN_COUNTER, from rules.SPAN_BASE), shared by the
    rollout's attempts (the rollout rows are locked): an explicit `sequence_id` raises it
    past that id, then spans without one get the next ids. Returns the rollouts whose
    counter moved."""
    rollouts = {a.rollout_id: a.rollout for a in attempts.values()}
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_rollout.setdefault(span["rollout_id"], []).append(span)
    moved: dict[str, Rollout] = {}
    postgres = connection.vendor == "postgresql"
    epoch = epoch_now() if postgres else None  # read in this transaction, not a kept copy
    for rollout_id, mine in by_rollout.items():
        rollout = rollouts[rollout_id]
        explicit = [s["sequence_id"] for s in mine if s.get("sequence_id") is not None]
        missing = [s for s in mine if s.get("sequence_id") is None]
        base = rollout.next_span_sequence_id  # SQLite: never an asynchronous commit
        if postgres:
            base = rules.SPAN_BASE.python(base, rollout.span_ids_reserved, rollout.span_epoch,
                                          epoch)
        counter = rules.SPAN_COUNTER.python(base,
                                            max(explicit) + 1 if explicit else None,
                                            len(missing))
        if counter == rollout.next_span_sequence_id:
            continue
        for seq, span in enumerate(missing, start=counter - len(missing)):
            span["sequence_id"] = seq
        rollout.next_span_sequence_id = counter
        moved[rollout.pk] = rollout
    return list(moved.values())


def _heartbeats_due(attempts: list[Attempt], now: datetime) -> list[Attempt]:
    """The attempts whose heartbeat is due (rules.HEARTBEAT_DUE): preparing/unresponsive ->
    running; an attempt that ended (succeeded, failed, timeout) records the time but keeps
    its status."""
    return [a for a in attempts
            if rules.HEARTBEAT_DUE.python(a.status, a.last_heartbeat_time, now)]


def _rollouts_running(latest: list[Attempt]) -> list[Rollout]:
    """The rollouts of latest attempts that had a heartbeat, moved preparing/requeuing ->
    running (the caller writes them). Their rows are locked (Postgres; SQLite's transactions
    are serialized), so a terminal rollout never moves."""
    moved = []
    for attempt in latest:
        rollout = attempt.rollout
        if rollout not in moved and rules.HEARTBEAT_MOVES_ROLLOUT.python(
                rollout.status, rollout.latest_attempt_id, attempt.pk):
            rollout.status = RolloutStatus.RUNNING
            rollout.queue_deadline = None
            moved.append(rollout)
    return moved


def _common_case_possible(spans: Sequence[dict[str, Any]]) -> bool:
    """Worth trying `_export_common`: Postgres in autocommit, a small batch, one attempt."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return False
    if len(spans) >= COPY_THRESHOLD or not connection.get_autocommit():
        return False
    first = spans[0]
    key = (first["rollout_id"], first["attempt_id"])
    return all((s["rollout_id"], s["attempt_id"]) == key for s in spans)


def _export_common(project: Project, spans: Sequence[dict[str, Any]], now: datetime,
                   live_key: LiveKey | None = None) -> tuple | None:
    """An OTLP export of one attempt's spans in one statement run in autocommit (also
    `span_add_lean`'s): the statement's row (the rollout's status, spans inserted, heartbeats
    written, the first sequence id given to spans without one); None, having written
    nothing, when the full path must answer: the attempt is unknown (or another project's),
    or unresponsive (its revival records the watchdog's verdict), or its rollout's config
    sets a limit beyond the bounds (rules.MAX_LIMIT_SECONDS: the full path refuses it).

    The statement does what `_ingest` does, in the same lock order: it locks the attempt
    (FOR NO KEY UPDATE, read as it is once locked), writes its heartbeat when due (preparing
    or running -> running with a new deadline, rules.DEADLINE; an ended attempt
    keeps its status and deadline), then the UPDATE that moves the rollout's sequence
    counter locks the rollout and moves it preparing/requeuing -> running when its latest
    attempt was revived, the spans are inserted (stored ones skipped), and the commit is
    asynchronous (`_commit_asynchronously`'s argument: a span-only transaction). Sequence
    ids are assigned as `_assign_sequence_ids` does, from the counter as the UPDATE finds
    it. The attempt's lock waits, as the full path's does, for a writer of that attempt.
    Nothing is written unless the statement does it all; with `live_key`, nothing unless
    that key is live either (None then)."""
    first = spans[0]
    explicit = [s["sequence_id"] for s in spans if s.get("sequence_id") is not None]
    missing = len(spans) - len(explicit)
    params: list[Any] = [
        now, first["rollout_id"], first["attempt_id"], project.pk, *(live_key or ()),  # a
        AttemptStatus.RUNNING, now,  # u
        max(explicit) + 1 if explicit else None, missing, missing,  # r
    ]
    plan = _span_plan()
    ordinal = 0
    for index, span in enumerate(spans):
        seq = span.get("sequence_id")
        params += [index, seq, None if seq is not None else ordinal]
        if seq is None:
            ordinal += 1
        values = _span_values(span)
        for name, prepare in plan:
            params.append(prepare(values[name]))
    return fetch_one_prepared(_common_sql(len(spans), live_key is not None), params)


_IDS = ("id", "rollout_id", "attempt_id", "sequence_id")


@functools.cache
def _span_plan() -> tuple[tuple[str, Any], ...]:
    """The span's other columns, each with what makes its parameter: JSON as text in the
    field's own encoding (what Django sends), the rest as the field prepares it."""
    def json_text(field: JSONField):
        if field.encoder is SpanJSONEncoder:
            return span_json_text
        return lambda value: None if value is None else json.dumps(value, cls=field.encoder)

    def prepared(field):
        # What the field's own preparation gives back unchanged (a string for text, a float
        # for a float, None), passed as it is: a span's values nearly always are.
        kept = (str if isinstance(field, CharField) else
                float if isinstance(field, FloatField) else None)

        def prepare(value):
            if value is None or type(value) is kept:
                return value
            return field.get_db_prep_save(value, connection)

        return prepare

    return tuple((f.attname, json_text(f) if isinstance(f, JSONField) else prepared(f))
                 for f in Span._meta.concrete_fields if f.attname not in _IDS)


@functools.lru_cache(maxsize=2 * COPY_THRESHOLD)
def _common_sql(count: int, key_checked: bool = False) -> str:
    fields = [f for f in Span._meta.concrete_fields if f.attname not in _IDS]
    # Text, not varchar(n): a cast would cut an over-long value, where the insert refuses it.
    casts = ["text" if isinstance(f, CharField) else f.db_type(connection) for f in fields]
    placeholder = "(" + ", ".join(["%s::int4"] * 3 + [f"%s::{c}" for c in casts]) + ")"
    names = [f"c{i}" for i in range(len(fields))]
    columns = ", ".join(f'"{f.column}"' for f in fields)
    span = Span._meta
    timeout = rules.config_seconds_sql("r.config", "timeout_seconds")
    unresponsive = rules.config_seconds_sql("r.config", "unresponsive_seconds")
    due = rules.HEARTBEAT_DUE.sql("a.status", "a.last_heartbeat_time", "n.now")
    deadline = rules.DEADLINE.sql("a.start_time", "n.now", timeout, unresponsive,
                                  "NULL::float8")
    moves = ("a.due AND a.revivable AND "
             f"{rules.HEARTBEAT_MOVES_ROLLOUT.sql('r.status', 'r.latest_attempt_id', 'a.id')}")
    bound = rules.MAX_LIMIT_SECONDS
    # Where the counter moves from: after a crash (a new span epoch, read by the statement)
    # past what `spans/next` may have handed out asynchronously; a span write never moves
    # the reserve.
    base = rules.SPAN_BASE.sql("r.next_span_sequence_id", "r.span_ids_reserved",
                               "r.span_epoch", EPOCH_SQL)
    return (
        # The attempt, locked; its heartbeat `due` and `revivable` (revived when due) as
        # `_ingest` decides them (rules; an unresponsive attempt is the full path's), and its
        # new deadline for a revival.
        f"WITH a AS (SELECT a.id, a.rollout_id, {due} AS due, "
        f"{rules.REVIVES.sql('a.status')} AS revivable, {deadline} AS deadline "
        "FROM store_attempt a JOIN store_rollout r ON r.id = a.rollout_id, "
        "(SELECT %s::timestamptz AS now) n "
        "WHERE a.rollout_id = %s AND a.attempt_id = %s AND r.project_id + 0 = %s "
        f"AND a.status <> {rules.literal(AttemptStatus.UNRESPONSIVE)} "
        f"AND COALESCE({timeout}, 0) <= {bound!r} AND COALESCE({unresponsive}, 0) <= {bound!r} "
        f"{f'AND {KEY_LIVE_SQL} ' if key_checked else ''}"
        "FOR NO KEY UPDATE OF a), "
        # Its heartbeat, when due.
        "u AS (UPDATE store_attempt t SET "
        "status = CASE WHEN a.revivable THEN %s ELSE t.status END, "
        "last_heartbeat_time = %s, "
        "deadline = CASE WHEN a.revivable THEN a.deadline ELSE t.deadline END "
        "FROM a WHERE t.id = a.id AND a.due RETURNING t.id), "
        # The rollout: its counter, and preparing/requeuing -> running.
        "r AS (UPDATE store_rollout r SET next_span_sequence_id = "
        f"{rules.SPAN_COUNTER.sql(base, '%s::int4', '%s::int4')}, "
        f"status = CASE WHEN {moves} THEN {rules.literal(RolloutStatus.RUNNING)} "
        "ELSE r.status END, "
        f"queue_deadline = CASE WHEN {moves} THEN NULL ELSE r.queue_deadline END "
        "FROM a WHERE r.id = a.rollout_id RETURNING r.id, r.status, "
        "r.next_span_sequence_id - %s::int4 AS first), "
        f'm AS (INSERT INTO "{span.db_table}" ("rollout_id", "attempt_id", "sequence_id", '
        f"{columns}) SELECT r.id, a.id, COALESCE(v.seq, r.first + v.ord), "
        f"{', '.join(f'v.{n}' for n in names)} FROM a, r, "
        f"(VALUES {', '.join([placeholder] * count)}) AS v(i, seq, ord, {', '.join(names)}) "
        "ORDER BY v.i ON CONFLICT (attempt_id, span_id) DO NOTHING RETURNING 1) "
        "SELECT r.status, (SELECT count(*) FROM m), (SELECT count(*) FROM u), r.first, "
        "set_config('synchronous_commit', 'off', true) FROM r"
    )


def _deadline(attempt: Attempt, now: datetime) -> datetime | None:
    return attempt_deadline(RolloutConfig.parse(attempt.rollout.config), attempt.start_time, now)


def span_next_sequence_id(
    *, project: Project, rollout_id: str, attempt_id: str, count: int = 1,
    live_key: LiveKey | None = None, durable_ok: bool = True,
) -> int | None:
    """Reserve `count` span sequence ids of a rollout (its counter is shared by all its
    attempts, so any attempt id of a known rollout will do, as in AGL); returns the first.

    One statement, without a transaction of its own (in autocommit it is its own; in a
    caller's, part of it): it locks the rollout's row, so concurrent reservations of one
    rollout get disjoint ids. On Postgres in autocommit it commits asynchronously while the
    ids stay below the rollout's `span_ids_reserved` in the span epoch that last moved
    its counter, else synchronously (rules.SPAN_BASE, SPAN_IDS_DURABLE: an id handed out is
    never handed out again, after a crash too; README "Span sequence ids and crashes").
    With `durable_ok` False (the ASGI front's event loop, which must not wait for a WAL
    flush), a reservation that would commit synchronously is not made: None, nothing
    written. With `live_key` (a lean request's key), the statement also checks that key:
    KeyNotLive and nothing reserved unless it is live."""
    if count < 1:
        raise InvalidInput("count", "must be >= 1")
    postgres = connection.vendor == "postgresql"
    alone = not connection.in_atomic_block and connection.get_autocommit()
    sql, params = span_next_sequence_statement(
        project=project, rollout_id=rollout_id, count=count, live_key=live_key,
        durable_ok=durable_ok or not alone, alone=alone)
    if postgres:
        row = fetch_one_prepared(sql, params)  # prepared once per connection
        if row is not None and row[1]:
            # No span epoch (a crash emptied it): this one was durable; start one, so the
            # next may be asynchronous.
            server_epoch(renew=True)
    else:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
    if row is None:
        if not durable_ok and postgres:
            return None  # unknown, a dead key, or one to commit synchronously: the full path
        require_key_live(live_key)
        raise NotFound("rollout", rollout_id)
    return row[0]


def span_next_sequence_statement(
    *, project: Project, rollout_id: str, count: int = 1, live_key: LiveKey | None = None,
    durable_ok: bool = True, alone: bool = True,
) -> tuple[str, list]:
    """`span_next_sequence_id`'s one statement and its parameters, for a caller that runs
    it on a connection of its own (the ASGI front's awaited connections: autocommit): its
    one row is the first id reserved; no row, nothing reserved (an unknown rollout, another
    project's, a dead key, or with `durable_ok` False one that would commit
    synchronously). `alone`: the statement is its own transaction (autocommit) and sets
    its commit's mode; inside a caller's transaction it leaves the caller's. It reads the
    span epoch itself, on the connection that runs it."""
    if connection.vendor != "postgresql":
        return (_next_sequence_sql_sqlite(live_key is not None),
                [count, rollout_id, project.pk, *(live_key or ()), count])
    return (_next_sequence_sql(live_key is not None, durable_ok, alone),
            [count, rollout_id, project.pk, *(live_key or ())])


@functools.cache
def _next_sequence_sql(key_checked: bool, durable_ok: bool, alone: bool) -> str:
    """Postgres: one UPDATE of the rollout's row, its counter moved from rules.SPAN_BASE;
    a durable move (rules.SPAN_IDS_DURABLE) also moves the reserve SPAN_ID_BLOCK past the new
    counter. It reads the span epoch itself (no copy a client kept could outlive a crash:
    behind a pooler a client's connection does) and returns whether it found none, after
    the first id. Alone, it sets its commit's mode (SET LOCAL's function form), told by the
    row as written: only a durable move leaves the reserve exactly SPAN_ID_BLOCK past
    the counter (any other move raises the counter and leaves the reserve, which was at most
    that far past it), so RETURNING, which sees the new row only, tells them apart."""
    table = Rollout._meta.db_table
    key = f" AND {KEY_LIVE_SQL}" if key_checked else ""
    block = rules.SPAN_ID_BLOCK
    counter, reserved = "r.next_span_sequence_id", "r.span_ids_reserved"
    base = rules.SPAN_BASE.sql(counter, reserved, "r.span_epoch", "c.e")
    durable = rules.SPAN_IDS_DURABLE.sql(base, "c.n", reserved, "r.span_epoch", "c.e")
    return (
        f'UPDATE "{table}" r SET next_span_sequence_id = {base} + c.n, '
        f"span_ids_reserved = CASE WHEN {durable} THEN {base} + c.n + {block} "
        f"ELSE {reserved} END, span_epoch = c.e "
        f"FROM (SELECT {EPOCH_SQL} AS e, %s::int4 AS n) c "
        f'WHERE r."id" = %s AND r."project_id" = %s{key}'
        f"{'' if durable_ok else f' AND NOT {durable}'} "
        f"RETURNING {counter} - c.n, c.e IS NULL"
        + (f", set_config('synchronous_commit', CASE WHEN {reserved} - {counter} = {block} "
           "THEN 'on' ELSE 'off' END, true)" if alone else "")
    )


@functools.cache
def _next_sequence_sql_sqlite(key_checked: bool) -> str:
    """SQLite: its commits are never asynchronous, so the counter itself."""
    table = Rollout._meta.db_table
    key = f" AND {KEY_LIVE_SQL}" if key_checked else ""
    return (f'UPDATE "{table}" SET "next_span_sequence_id" = "next_span_sequence_id" + %s '
            f'WHERE "id" = %s AND "project_id" = %s{key} RETURNING "next_span_sequence_id" - %s')
