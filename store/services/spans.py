"""Span ingest: batched inserts, duplicates ignored, every span an attempt heartbeat."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DataError, connection, transaction
from django.db.models import F
from django.db.models.base import ModelState
from django.utils import timezone
from psycopg import errors as pg_errors

from store.errors import InvalidInput, NotFound, StoreError
from store.models import Attempt, Project, Rollout, Span
from store.services._bulk import Write, insert_new
from store.services._common import attempt_deadline, set_attempt_status
from store.services._rows import attempts_locked
from store.statemachine import AttemptStatus, RolloutConfig, RolloutStatus
from store.text import find_bad_text

# A heartbeat rewrites its attempt at most this often; the watchdog's view of a busy attempt
# is at most this stale, and a stream of spans costs one attempt write a second, not one each.
HEARTBEAT_MIN_INTERVAL = timedelta(seconds=1)
_REVIVABLE = (AttemptStatus.PREPARING, AttemptStatus.RUNNING, AttemptStatus.UNRESPONSIVE)
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

    On Postgres a small batch is two statements and a commit: lock the attempts (with their
    rollouts' state), then one statement that writes the attempts (sequence ids, heartbeat)
    and inserts the spans. A stored span is skipped, not an error: identity is (attempt,
    span_id), so repeating a post is harmless."""
    for index, span in enumerate(spans):
        _validate(span, index)
    try:
        return _ingest(project, spans, now or timezone.now())
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
    (`_commit_asynchronously`) when it is the outermost one. The OTLP export runs its check
    of the spans' attempts and their insert in one."""
    if connection.in_atomic_block:
        # Nested in a span transaction: no savepoint (two round trips); an error ends the
        # whole transaction, the outer one's to roll back. In another caller's: a savepoint.
        with transaction.atomic(savepoint=not getattr(_span_transaction, "open", False)):
            yield
        return
    with transaction.atomic():
        _commit_asynchronously()
        _span_transaction.open = True
        try:
            yield
        finally:
            _span_transaction.open = False


_span_transaction = threading.local()


def _ingest(project: Project, spans: Sequence[dict[str, Any]], now: datetime) -> SpansIngested:
    with span_transaction():
        attempts = _attempts_for(project, spans)
        counted = _assign_sequence_ids(spans, attempts)
        rows = [_row(span, attempts[(span["rollout_id"], span["attempt_id"])]) for span in spans]
        due = _heartbeats_due(list(attempts.values()), now)
        revived = [a for a in due if a.status in _REVIVABLE]
        for attempt in due:
            # An ended attempt records the heartbeat too, and keeps its status (as in AGL).
            attempt.last_heartbeat_time = now
        lost = [a for a in revived if a.status == AttemptStatus.UNRESPONSIVE]
        for attempt in revived:
            # Records the watchdog's verdict on a revived attempt (store.watchdog_verdict).
            set_attempt_status(attempt, AttemptStatus.RUNNING, now)
            attempt.deadline = _deadline(attempt, now)
        fields = ["status", "last_heartbeat_time", "deadline"]
        writes = [Write.set(sorted((a for a in due if a not in lost), key=lambda a: a.pk),
                            fields),
                  Write.set(lost, [*fields, "metadata"]),
                  Write.set(sorted(counted, key=lambda r: r.pk), ["next_span_sequence_id"])]
        inserted = {id(row) for row in insert_new(rows, ["attempt", "span_id"], also=writes)}
        _rollouts_running([a for a in revived if a.rollout.latest_attempt_id == a.pk])
    cancelled = {a.rollout_id for a in attempts.values()
                 if a.rollout.status == RolloutStatus.CANCELLED}
    return SpansIngested([row if id(row) in inserted else None for row in rows], cancelled)


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


def _attempts_for(project: Project, spans: Sequence[dict]) -> dict[tuple[str, str], Attempt]:
    """The spans' attempts with their rollouts (one instance per rollout), locked in attempt
    pk order, each rollout right after its first attempt (the one lock order): the rollout
    holds the span sequence counter."""
    keys = {(s["rollout_id"], s["attempt_id"]) for s in spans}
    rollout_ids = sorted({rid for rid, _ in keys})
    attempt_ids = sorted({aid for _, aid in keys})
    if connection.vendor == "postgresql":
        rows = attempts_locked(project.pk, rollout_ids, attempt_ids, lock_rollouts=True)
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
    for key in sorted(keys):
        if key not in found:
            if not any(rid == key[0] for rid, _ in found):
                _check_rollout(project, key[0])
            raise NotFound("attempt", f"{key[0]}/{key[1]}")
    return {key: found[key] for key in keys}


def _check_rollout(project: Project, rollout_id: str) -> None:
    """AGL's wording: `Rollout <id> not found` before `Attempt <id> not found ...`."""
    if not Rollout.objects.filter(project=project, pk=rollout_id).exists():
        raise NotFound("rollout", rollout_id)


def _row(span: dict[str, Any], attempt: Attempt) -> Span:
    values = {
        "id": None,
        "rollout_id": attempt.rollout_id,
        "attempt_id": attempt.pk,
        "sequence_id": span["sequence_id"],
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
    # Filling the instance's dict directly skips Django's per-field descriptors in
    # Model.__init__, which cost more than the rest of building the row.
    row = Span.__new__(Span)
    row._state = ModelState()
    row.__dict__.update(values)
    return row


def _assign_sequence_ids(
    spans: Sequence[dict[str, Any]], attempts: dict[tuple[str, str], Attempt]
) -> list[Rollout]:
    """AGL's per-rollout counter, shared by the rollout's attempts (the rollout rows are
    locked): an explicit `sequence_id` raises it past that id, then spans without one get the
    next ids. Returns the rollouts whose counter moved."""
    rollouts = {a.rollout_id: a.rollout for a in attempts.values()}
    moved: dict[str, Rollout] = {}
    for span in spans:
        seq = span.get("sequence_id")
        rollout = rollouts[span["rollout_id"]]
        if seq is not None and seq >= rollout.next_span_sequence_id:
            rollout.next_span_sequence_id = seq + 1
            moved[rollout.pk] = rollout
    for span in spans:
        if span.get("sequence_id") is None:
            rollout = rollouts[span["rollout_id"]]
            span["sequence_id"] = rollout.next_span_sequence_id
            rollout.next_span_sequence_id += 1
            moved[rollout.pk] = rollout
    return list(moved.values())


def _heartbeats_due(attempts: list[Attempt], now: datetime) -> list[Attempt]:
    """AGL: a span is its attempt's heartbeat. preparing/unresponsive -> running; an attempt
    that ended (succeeded, failed, timeout) records the time but keeps its status. An
    attempt is rewritten at most once per HEARTBEAT_MIN_INTERVAL unless it is revived."""
    due = []
    for attempt in attempts:
        last = attempt.last_heartbeat_time
        revive = attempt.status in _REVIVABLE and attempt.status != AttemptStatus.RUNNING
        if not revive and last and now - last < HEARTBEAT_MIN_INTERVAL:
            continue
        due.append(attempt)
    return due


def _rollouts_running(latest: list[Attempt]) -> None:
    """The rollout of a latest attempt that had a heartbeat: preparing/requeuing -> running.
    Compare-and-swap (the rollout is not locked), so a terminal rollout never moves."""
    if latest:
        Rollout.objects.filter(
            pk__in=[a.rollout_id for a in latest],
            latest_attempt__in=[a.pk for a in latest],
            status__in=(RolloutStatus.PREPARING, RolloutStatus.REQUEUING),
        ).update(status=RolloutStatus.RUNNING, queue_deadline=None)


def _deadline(attempt: Attempt, now: datetime) -> datetime | None:
    return attempt_deadline(RolloutConfig.parse(attempt.rollout.config), attempt.start_time, now)


def span_next_sequence_id(
    *, project: Project, rollout_id: str, attempt_id: str, count: int = 1
) -> int:
    """Reserve `count` span sequence ids of a rollout (its counter is shared by all its
    attempts, so any attempt id of a known rollout will do, as in AGL); returns the first."""
    if count < 1:
        raise InvalidInput("count", "must be >= 1")
    with transaction.atomic():
        row = Rollout.objects.filter(project=project, pk=rollout_id)
        if not row.update(next_span_sequence_id=F("next_span_sequence_id") + count):
            raise NotFound("rollout", rollout_id)
        # The row stays locked by our update until commit, so this read is ours alone.
        after = row.values_list("next_span_sequence_id", flat=True)
        return after.get() - count
