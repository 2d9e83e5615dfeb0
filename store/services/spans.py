"""Span ingest: batched inserts, duplicates ignored, every span an attempt heartbeat."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from store.errors import InvalidInput, NotFound
from store.models import Attempt, Project, Rollout, Span
from store.services._bulk import COPY_THRESHOLD, insert_new
from store.services._common import attempt_deadline, attempt_filter
from store.statemachine import AttemptStatus, RolloutConfig, RolloutStatus

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
    for index, span in enumerate(spans):
        _validate(span, index)
    now = now or timezone.now()
    attempts = _attempts_for(project, spans)
    rows = [_row(span, attempts[(span["rollout_id"], span["attempt_id"])]) for span in spans]
    due = _heartbeats_due(list(attempts.values()), now)
    if due or len(rows) >= COPY_THRESHOLD or connection.vendor != "postgresql":
        with transaction.atomic():
            # A span already stored (a retry, a concurrent writer) is skipped: identity is
            # (attempt, span_id), so repeating a post is harmless.
            inserted = {id(row) for row in insert_new(rows, ["attempt", "span_id"])}
            _heartbeat(due, now)
    else:
        # Nothing to heartbeat and few rows: one INSERT statement, atomic on its own (saves
        # the BEGIN and COMMIT round trips on the common path of a stream of spans).
        inserted = {id(row) for row in insert_new(rows, ["attempt", "span_id"])}
    return [row if id(row) in inserted else None for row in rows]


def _validate(span: Any, index: int) -> None:
    if not isinstance(span, dict):
        raise InvalidInput(f"spans[{index}]", "must be an object")
    for name in ("rollout_id", "attempt_id", "trace_id", "span_id", "name"):
        if not isinstance(span.get(name), str) or not span[name]:
            raise InvalidInput(f"spans[{index}].{name}", "must be a non-empty string")
    seq = span.get("sequence_id")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise InvalidInput(f"spans[{index}].sequence_id", "must be an integer")
    for name in ("attributes", "resource"):
        if span.get(name) is not None and not isinstance(span[name], dict):
            raise InvalidInput(f"spans[{index}].{name}", "must be an object")
    for name in ("start_time", "end_time"):
        value = span.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise InvalidInput(f"spans[{index}].{name}", "must be a number or null")


def _attempts_for(project: Project, spans: Sequence[dict]) -> dict[tuple[str, str], Attempt]:
    keys = {(s["rollout_id"], s["attempt_id"]) for s in spans}
    rows = (
        Attempt.objects.select_related("rollout")
        .filter(rollout_id__in={rid for rid, _ in keys})
        .filter(attempt_id__in={aid for _, aid in keys})
    )
    # The project is checked here, not in SQL: see attempt_update_many.
    found = {(a.rollout_id, a.attempt_id): a for a in rows if a.rollout.project_id == project.pk}
    for key in sorted(keys):
        if key not in found:
            raise NotFound("attempt", f"{key[0]}/{key[1]}")
    return {key: found[key] for key in keys}


_ATTNAMES = [f.attname for f in Span._meta.concrete_fields]


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
    # Positional construction skips Django's per-keyword checks: a third of the ingest cost.
    return Span(*[values[name] for name in _ATTNAMES])


def heartbeat(attempts: list[Attempt], now: datetime) -> None:
    """AGL: a span is its attempt's heartbeat. preparing/unresponsive -> running, and the
    rollout of a latest attempt preparing/requeuing -> running. Never revives an attempt that
    ended (succeeded, failed, timeout), never moves a terminal rollout. Compare-and-swap
    updates, so a concurrent watchdog verdict or runner report is never overwritten."""
    _heartbeat(_heartbeats_due(attempts, now), now)


def _heartbeats_due(attempts: list[Attempt], now: datetime) -> list[Attempt]:
    """The attempts a heartbeat would change, in pk order (the one lock order)."""
    due = []
    for attempt in sorted(attempts, key=lambda a: a.pk):
        if attempt.status not in _REVIVABLE:
            continue
        last = attempt.last_heartbeat_time
        if attempt.status == AttemptStatus.RUNNING and last and now - last < HEARTBEAT_MIN_INTERVAL:
            continue
        due.append(attempt)
    return due


def _heartbeat(due: list[Attempt], now: datetime) -> None:
    if not due:
        return
    if connection.vendor == "postgresql":
        moved = _heartbeat_batch(due, now)
    else:
        moved = {a.pk for a in due if _heartbeat_one(a, now)}
    latest = [a for a in due if a.pk in moved and a.rollout.latest_attempt_id == a.pk]
    if latest:
        Rollout.objects.filter(
            pk__in=[a.rollout_id for a in latest],
            latest_attempt__in=[a.pk for a in latest],
            status__in=(RolloutStatus.PREPARING, RolloutStatus.REQUEUING),
        ).update(status=RolloutStatus.RUNNING, queue_deadline=None)


def _deadline(attempt: Attempt, now: datetime) -> datetime | None:
    return attempt_deadline(RolloutConfig.parse(attempt.rollout.config), attempt.start_time, now)


def _heartbeat_one(attempt: Attempt, now: datetime) -> bool:
    return bool(Attempt.objects.filter(pk=attempt.pk, status__in=_REVIVABLE).update(
        status=AttemptStatus.RUNNING, last_heartbeat_time=now, deadline=_deadline(attempt, now),
    ))


def _heartbeat_batch(due: list[Attempt], now: datetime) -> set[int]:
    """Two statements for the whole batch (a span batch may touch hundreds of attempts):
    lock the rows in pk order (the one lock order of every writer), then one compare-and-swap
    UPDATE ... FROM (VALUES ...); returns the pks it moved."""
    table = Attempt._meta.db_table
    pks = [a.pk for a in due]
    values = ", ".join(["(%s::bigint, %s::timestamptz)"] * len(due))
    params: list[Any] = [now]
    for attempt in due:
        params += [attempt.pk, _deadline(attempt, now)]
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        cursor.execute(
            f'SELECT id FROM "{table}" WHERE id = ANY(%s) ORDER BY id FOR UPDATE', [pks]
        )
        cursor.execute(
            f'UPDATE "{table}" AS t SET status = \'running\', last_heartbeat_time = %s, '
            f"deadline = v.deadline FROM (VALUES {values}) AS v(pk, deadline) "
            f"WHERE t.id = v.pk AND t.status IN ('preparing', 'running', 'unresponsive') "
            f"RETURNING t.id",
            params,
        )
        return {row[0] for row in cursor.fetchall()}


def span_next_sequence_id(
    *, project: Project, rollout_id: str, attempt_id: str, count: int = 1
) -> int:
    """Reserve `count` span sequence ids for an attempt; returns the first."""
    if count < 1:
        raise InvalidInput("count", "must be >= 1")
    with transaction.atomic():
        query = Attempt.objects.filter(attempt_filter(project, rollout_id, attempt_id))
        pk = query.values_list("pk", flat=True).first()
        if pk is None:
            raise NotFound("attempt", f"{rollout_id}/{attempt_id}")
        row = Attempt.objects.filter(pk=pk)
        row.update(next_span_sequence_id=F("next_span_sequence_id") + count)
        # The row stays locked by our update until commit, so this read is ours alone.
        after = row.values_list("next_span_sequence_id", flat=True)
        return after.get() - count


def span_sequence_ids_reserve(
    *, project: Project, counts: dict[tuple[str, str], int]
) -> dict[tuple[str, str], int]:
    """Reserve `count` span sequence ids for each (rollout id, attempt id) in one statement
    (OTLP ingest: spans that carry no sequence id); returns the first id of each."""
    if not counts:
        return {}
    if any(count < 1 for count in counts.values()):
        raise InvalidInput("count", "must be >= 1")
    if connection.vendor != "postgresql":
        return {
            key: span_next_sequence_id(project=project, rollout_id=key[0], attempt_id=key[1],
                                       count=count)
            for key, count in counts.items()
        }
    keys = sorted(counts)
    values = ", ".join(["(%s, %s, %s::integer)"] * len(keys))
    params: list[Any] = []
    for rollout_id, attempt_id in keys:
        params += [rollout_id, attempt_id, counts[(rollout_id, attempt_id)]]
    params.append(project.pk)
    attempt, rollout = Attempt._meta.db_table, Rollout._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f'UPDATE "{attempt}" AS t SET next_span_sequence_id = t.next_span_sequence_id + v.n '
            f'FROM (VALUES {values}) AS v(rid, aid, n), "{rollout}" AS r '
            f"WHERE t.rollout_id = v.rid AND t.attempt_id = v.aid AND r.id = t.rollout_id "
            f"AND r.project_id = %s RETURNING t.rollout_id, t.attempt_id, "
            f"t.next_span_sequence_id - v.n",
            params,
        )
        first = {(row[0], row[1]): row[2] for row in cursor.fetchall()}
    for key in keys:
        if key not in first:
            raise NotFound("attempt", f"{key[0]}/{key[1]}")
    return first
