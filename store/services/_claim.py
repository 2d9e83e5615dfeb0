"""Claiming queued rollouts: each claim creates the rollout's next attempt in the same
transaction. On Postgres it is one statement (select with SKIP LOCKED, or a bounded wait
for the row of a named claim; insert the attempts; update the rollouts); elsewhere (the
embedded SQLite default, whose writers are serialized by BEGIN IMMEDIATE) the same steps
run through the ORM."""

from __future__ import annotations

import functools
from datetime import datetime

from django.db import connection

from store import rules
from store.models import Attempt, Project, Rollout
from store.services._bulk import bulk_set
from store.services._common import attempt_deadline, worker_mark_dequeued
from store.services._rows import KEY_LIVE_SQL_NAMED, LiveKey, require_key_live, row_instance
from store.statemachine import AttemptStatus, RolloutConfig, RolloutStatus

# How long a named claim waits for its rollout's row lock (see _claim_sql).
NAMED_CLAIM_LOCK_WAIT_MS = 5000


def claim_queued(
    project: Project, worker_id: str | None, limit: int, now: datetime,
    rollout_id: str | None = None, idle_if_none: bool = True, live_key: LiveKey | None = None,
) -> list[tuple[Rollout, Attempt]]:
    """Claim up to `limit` queued rollouts (or the named one), highest priority then oldest
    first, and record the dequeue on the worker (busy with the last rollout claimed; idle
    when none was, unless `idle_if_none` is False). Must run inside a transaction, except
    an unnamed claim on Postgres: one statement, atomic by itself.

    With `live_key` (a lean request's key), nothing is claimed or recorded unless that
    key is live; KeyNotLive then. On Postgres the claim statement checks it (a claim that
    finds nothing asks again, to tell an empty queue from a dead key); elsewhere a read
    before the claim does."""
    if connection.vendor == "postgresql":
        claimed = _claim_sql(project, worker_id, limit, now, rollout_id, idle_if_none,
                             live_key)
        if not claimed:
            require_key_live(live_key)
    else:
        require_key_live(live_key)
        claimed = _claim_orm(project, worker_id, limit, now, rollout_id)
    claimed.sort(key=lambda pair: (-pair[0].priority, pair[0].enqueue_time))
    if connection.vendor != "postgresql" and worker_id and (claimed or idle_if_none):
        worker_mark_dequeued(project.pk, worker_id, [a for _, a in claimed], now)
    return claimed


def _queued(project: Project, now: datetime, rollout_id: str | None):
    qs = Rollout.objects.filter(rules.CLAIMABLE.q(now), project=project)
    return qs.filter(pk=rollout_id) if rollout_id else qs


def new_attempt(rollout: Rollout, worker_id: str | None, now: datetime) -> Attempt:
    config = RolloutConfig.parse(rollout.config)
    return Attempt(
        rollout=rollout,
        attempt_id=rules.new_attempt_id(),
        sequence_id=rollout.attempt_count + 1,
        status=AttemptStatus.PREPARING,
        worker_id=worker_id,
        start_time=now,
        deadline=attempt_deadline(config, now, None),
    )


def attach(rollouts: list[Rollout], attempts: list[Attempt]) -> None:
    """Make each attempt its rollout's latest; the rollout becomes preparing."""
    Attempt.objects.bulk_create(attempts)
    for rollout, attempt in zip(rollouts, attempts, strict=True):
        rollout.status = RolloutStatus.PREPARING
        rollout.latest_attempt = attempt
        rollout.attempt_count = attempt.sequence_id
        rollout.queue_deadline = None
    bulk_set(rollouts, ["status", "latest_attempt", "attempt_count", "queue_deadline"])


def _claim_orm(project, worker_id, limit, now, rollout_id) -> list[tuple[Rollout, Attempt]]:
    rollouts = list(
        _queued(project, now, rollout_id)
        .select_for_update(skip_locked=True)
        .order_by("-priority", "enqueue_time")[:limit]
    )
    attempts = [new_attempt(rollout, worker_id, now) for rollout in rollouts]
    if rollouts:
        attach(rollouts, attempts)
    return list(zip(rollouts, attempts, strict=True))


# rules.DEADLINE of an attempt claimed now, which never reported.
_DEADLINE_SQL = rules.DEADLINE.sql(
    "%(now)s", "NULL::timestamptz", rules.config_seconds_sql("p.config", "timeout_seconds"),
    rules.config_seconds_sql("p.config", "unresponsive_seconds"), "%(first_report)s::float8")


# worker_mark_dequeued in SQL, as the last clause of the claim: the worker is busy with the
# last rollout claimed (lowest priority, then newest), or idle when none was claimed
# (rules.WORKER_AFTER_CLAIM).
_WORKER_SQL = f"""
    , last AS (
        SELECT ins.rollout_id, ins.attempt_id FROM ins JOIN picked p ON p.id = ins.rollout_id
        ORDER BY p.priority, p.enqueue_time DESC LIMIT 1
    ), worker AS (
        INSERT INTO store_worker (project_id, worker_id, status, heartbeat_stats,
            last_heartbeat_time, last_dequeue_time, last_busy_time, last_idle_time,
            current_rollout_id, current_attempt_id)
        SELECT %(project)s, %(worker)s,
            {rules.WORKER_AFTER_CLAIM.sql("last.rollout_id IS NOT NULL")}, NULL, NULL,
            %(now)s, CASE WHEN last.rollout_id IS NULL THEN NULL ELSE %(now)s END,
            CASE WHEN last.rollout_id IS NULL THEN %(now)s END,
            last.rollout_id, last.attempt_id
        FROM (SELECT 1) one LEFT JOIN last ON true
        WHERE last.rollout_id IS NOT NULL OR %(idle_if_none)s
        ON CONFLICT (project_id, worker_id) DO UPDATE SET status = EXCLUDED.status,
            last_dequeue_time = EXCLUDED.last_dequeue_time,
            last_busy_time = COALESCE(EXCLUDED.last_busy_time, store_worker.last_busy_time),
            last_idle_time = COALESCE(EXCLUDED.last_idle_time, store_worker.last_idle_time),
            current_rollout_id = EXCLUDED.current_rollout_id,
            current_attempt_id = EXCLUDED.current_attempt_id
    )
"""


def _claim_sql(project, worker_id, limit, now, rollout_id, idle_if_none, live_key=None
               ) -> list[tuple[Rollout, Attempt]]:
    sql, defaults = _claim_statement(bool(rollout_id), bool(worker_id), live_key is not None)
    params = {**defaults, "project": project.pk, "now": now, "worker": worker_id,
              "first_report": rules.first_report_seconds(),
              "ids": [rules.new_attempt_id() for _ in range(limit)],
              "limit": limit, "rid": rollout_id, "idle_if_none": idle_if_none,
              "key": live_key and live_key[0], "key_role": live_key and live_key[1]}
    with connection.cursor() as cursor:
        if rollout_id:
            # A named claim waits for a row another writer holds briefly (an algorithm's
            # update, a duplicate message's claim) instead of skipping it: a skipped rollout
            # lost its message. Bounded, so a stuck writer costs an error (the task retries),
            # not a hung worker.
            cursor.execute(f"SET LOCAL lock_timeout = '{NAMED_CLAIM_LOCK_WAIT_MS}ms'")
        cursor.execute(sql, params)
        rows = cursor.fetchall()
        if rollout_id:
            cursor.execute("SET LOCAL lock_timeout TO DEFAULT")
    width = len(Rollout._meta.concrete_fields)
    claimed = []
    for row in rows:
        rollout = row_instance(Rollout, list(row[:width]))
        attempt_pk, attempt_id, sequence_id, deadline = row[width:]
        attempt = Attempt(
            pk=attempt_pk, rollout=rollout, attempt_id=attempt_id, sequence_id=sequence_id,
            status=AttemptStatus.PREPARING, worker_id=worker_id, start_time=now,
            deadline=deadline,
        )
        attempt._state.adding = False
        attempt._state.db = rollout._state.db
        rollout.latest_attempt = attempt
        claimed.append((rollout, attempt))
    return claimed


@functools.cache
def _claim_statement(only_named: bool, with_worker: bool, key_checked: bool = False
                     ) -> tuple[str, dict]:
    """The claim statement (its text never changes, so psycopg parses it once) and the
    parameters of the attempt columns that take their model default. With `key_checked`,
    it claims and records nothing unless the key `%(key)s` is live (`KEY_LIVE_SQL_NAMED`)."""
    given = {
        "rollout_id": "p.id",
        "attempt_id": rules.ATTEMPT_ID.sql("%(ids)s", "p.n"),
        "sequence_id": "p.attempt_count + 1",
        "status": rules.literal(AttemptStatus.PREPARING),
        "worker_id": "%(worker)s::varchar",
        "start_time": "%(now)s",
        "deadline": _DEADLINE_SQL,
    }
    defaults = {}
    columns, values = [], []
    for field in Attempt._meta.concrete_fields:
        if field.primary_key:
            continue
        columns.append(f'"{field.column}"')
        if field.column in given:
            values.append(given[field.column])
        else:  # every other column takes its model default, so new fields need no edit here
            defaults[f"d_{field.column}"] = field.get_db_prep_save(field.get_default(),
                                                                   connection)
            values.append(f"%(d_{field.column})s::{field.db_type(connection)}")
    rollout_columns = ", ".join(f'upd."{f.column}"' for f in Rollout._meta.concrete_fields)
    only = "AND id = %(rid)s" if only_named else ""
    live = f"AND {KEY_LIVE_SQL_NAMED}" if key_checked else ""
    worker = _WORKER_SQL.replace("OR %(idle_if_none)s", f"OR %(idle_if_none)s) {live}")
    worker = worker.replace("WHERE last.rollout_id", "WHERE (last.rollout_id")
    sql = f"""
        WITH picked AS (
            SELECT id, attempt_count, config, priority, enqueue_time FROM store_rollout
            WHERE project_id = %(project)s
              AND {rules.CLAIMABLE.sql("status", "queue_deadline", "%(now)s")} {only} {live}
            ORDER BY priority DESC, enqueue_time LIMIT %(limit)s
            FOR UPDATE {"" if only_named else "SKIP LOCKED"}
        ), ins AS (
            INSERT INTO store_attempt ({", ".join(columns)})
            SELECT {", ".join(values)}
            FROM (SELECT picked.*, row_number() OVER () AS n FROM picked) p
            RETURNING id, rollout_id, attempt_id, sequence_id, deadline
        ), upd AS (
            UPDATE store_rollout r SET status = {rules.literal(RolloutStatus.PREPARING)},
                latest_attempt_id = ins.id,
                attempt_count = ins.sequence_id, queue_deadline = NULL
            FROM ins WHERE r.id = ins.rollout_id
            RETURNING r.*
        ) {worker if with_worker else ""}
        SELECT {rollout_columns}, ins.id, ins.attempt_id, ins.sequence_id, ins.deadline
        FROM upd JOIN ins ON ins.rollout_id = upd.id
    """
    return sql, defaults
