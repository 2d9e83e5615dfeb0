"""A runner's final verdict in one statement (Postgres, autocommit): the common case of
`attempt_update_many` and `attempt_finish`, in one round trip instead of four (BEGIN, the
locking read, the write, COMMIT), with no model instances built on the way in. The verdict is
"succeeded", or "failed" where the rollout's config does not retry it (it fails with it).

The statement does what the full path does for that case, in the same lock order (attempts,
then rollouts, then workers, then groups: rules.LOCK_ORDER), each rule from store/rules.py:

- it locks the attempt (FOR NO KEY UPDATE, read as it is once locked) when it is preparing or
  running (and the lean request's key is live);
- it moves the rollout to the verdict, if the attempt is still its latest and the rollout is
  not terminal (the UPDATE's conditions are checked again on the row it locked);
- then the attempt (the verdict, ended now; its deadline as it was, its metadata too, with
  `error` merged in when the runner gave one);
- then its worker, when it names one (idle since now, no current rollout);
- then the rollout's group, if any (one more finished member; reaching its total writes
  the completion event), and the finished wake-up, sent at commit;
- and the attempt's ledger row (store/services/_ledger.py: the runner's usage, the gateway's
  tokens counted from the attempt's spans, the cost).

The commit is synchronous (a verdict is durable once acknowledged). Nothing is written unless
the statement does it all: any other case (a failure the config retries, a move the rules
refuse or make a no-op, a late verdict on an attempt the watchdog gave up on, an attempt that
is no longer the latest, a terminal rollout, "latest" for the attempt id, fields beside the
status, a process with rollouts-finished callbacks) returns None and the full path answers it,
the same way. tests/test_verdict_services.py holds both paths to the same rows.
"""

from __future__ import annotations

import functools
from datetime import datetime

from django.conf import settings
from django.db import connection

from store import hooks, rules, wakeups
from store.models import Attempt, Project, Rollout, Worker
from store.services._ledger import Usage, cost_sql, fixed_cost, gateway_tokens_sql
from store.services._rows import KEY_LIVE_SQL, LiveKey, _columns, fetch_one_prepared, row_instance
from store.statemachine import (
    ATTEMPT_FINAL,
    ATTEMPT_LIVE,
    ROLLOUT_TERMINAL,
    AttemptStatus,
)


def possible(attempt_id: str, status: str | None) -> bool:
    """Worth trying `finish`: a final verdict, Postgres in autocommit, a named attempt, no
    callbacks to call with the finished rollout's row."""
    return (status in ATTEMPT_FINAL and connection.vendor == "postgresql"
            and not connection.in_atomic_block and connection.get_autocommit()
            and attempt_id != "latest" and not hooks.has_finished_callbacks())


def finish(project: Project, rollout_id: str, attempt_id: str, status: str, now: datetime,
           error: str | None = None, live_key: LiveKey | None = None,
           usage: Usage | None = None) -> Attempt | None:
    """The attempt as the statement left it (`status`, a final one), or None, having written
    nothing: the full path must answer."""
    sql, params = statement(project, rollout_id, attempt_id, status, now, error=error,
                            live_key=live_key, usage=usage)
    row = fetch_one_prepared(sql, params)
    if row is None:
        return None
    follow_up(row, rollout_id)
    return attempt_of(row)


def statement(project: Project, rollout_id: str, attempt_id: str, status: str, now: datetime,
              error: str | None = None, live_key: LiveKey | None = None,
              usage: Usage | None = None) -> tuple[str, list]:
    """`finish`'s one statement and its parameters, for a caller that runs it on a
    connection of its own (the ASGI front's awaited connections: autocommit, a synchronous
    commit); then, with its row (none: nothing written), `follow_up` where
    `needs_follow_up` says so (it reads the database), and `attempt_of`."""
    usage = usage or Usage()
    params = [
        rollout_id, attempt_id, project.pk, *(live_key or ()),  # a
        status, now,  # r
        status, now, *([] if error is None else [error]),  # u
        *_worker_params(project.pk, now),  # w
        now,  # g
        now,  # c
        project.pk, usage.cpu_seconds, usage.gpu_seconds, usage.gpu_type,  # l
        fixed_cost(usage), settings.COST_PER_1K_TOKENS, now,
        wakeups.FINISHED, str(project.pk),
    ]
    return _sql(live_key is not None, status == AttemptStatus.FAILED, error is not None), params


def _width() -> int:
    return len(Attempt._meta.concrete_fields)


def needs_follow_up(row: tuple) -> bool:
    """Whether the committed verdict's row asks for `follow_up`: a group it completed, or a
    hurry-only callback that wants its rollout."""
    owners, group_id = row[_width()], row[_width() + 1]
    return bool(owners) or hooks.has_hurry_callbacks(grouped=group_id is not None)


def follow_up(row: tuple, rollout_id: str) -> None:
    """After the commit: the groups-completed callbacks of the groups it completed (as
    on_commit would call them), and the hurry-only callbacks that want the rollout, read
    now that it is terminal (those of grouped rollouts only skip one without a group)."""
    owners, group_id = row[_width()], row[_width() + 1]
    if owners:
        hooks.notify_groups_completed(sorted(set(owners)))
    if hooks.has_hurry_callbacks(grouped=group_id is not None):
        rollout = Rollout.objects.filter(pk=rollout_id, status__in=ROLLOUT_TERMINAL).first()
        if rollout is not None:
            hooks.call_hurry_callbacks([rollout])


def attempt_of(row: tuple) -> Attempt:
    return row_instance(Attempt, list(row[:_width()]))


# The worker upsert's values (`worker_writes_for_attempts` for a finished attempt: idle since
# now, no current rollout); the other columns as a new row has them.
_WORKER_GIVEN = {"project": "%s::bigint", "worker_id": "u.worker_id",
                 "status": rules.WORKER_FOR_ATTEMPT.sql("u.status"),
                 "last_idle_time": "%s::timestamptz"}


@functools.cache
def _worker_insert() -> tuple[str, str, tuple[str, ...]]:
    """The worker upsert's columns, values, and the names of its parameters in their order
    (the model's field order)."""
    columns, values, params = [], [], []
    for field in Worker._meta.concrete_fields:
        if field.primary_key:
            continue
        if field.name not in _WORKER_GIVEN:
            assert field.null and field.get_default() is None, field.name
        elif "%s" in _WORKER_GIVEN[field.name]:
            params.append(field.name)
        columns.append(f'"{field.column}"')
        values.append(_WORKER_GIVEN.get(field.name, "NULL"))
    return ", ".join(columns), ", ".join(values), tuple(params)


def _worker_params(project_id: int, now: datetime) -> list:
    value = {"project": project_id, "last_idle_time": now}
    return [value[name] for name in _worker_insert()[2]]


@functools.cache
def _sql(key_checked: bool, failed: bool, with_error: bool) -> str:
    worker_columns, worker_values, _ = _worker_insert()
    verdict = rules.literal(AttemptStatus.FAILED if failed else AttemptStatus.SUCCEEDED)
    # The rollout follows the attempt (rules.FOLLOWS) to the verdict itself; where it would
    # go elsewhere (a failure its config retries: rules.ROLLOUT_FOR_ATTEMPT), the full path.
    follows = (f"{rules.FOLLOWS.sql('r.status', 'r.latest_attempt_id', 'a.id')} AND "
               f"{rules.ROLLOUT_FOR_ATTEMPT.sql(verdict, 'a.sequence_id', 'r.config')} "
               f"= {verdict}")
    rules.locks_in_order("attempt", "rollout", "worker", "group")  # a, r (u), w, g below
    finished = rules.group_finished_sql("g.finished", "1")
    merge = rules.ERROR_MERGE.sql("t.metadata", "%s")
    completed_at = rules.group_completed_at_sql("g.finished", "g.total", "g.completed_at", "1",
                                                "%s::timestamptz")
    return (
        # The attempt, locked, if it may move to a final status.
        "WITH a AS (SELECT a.id, a.rollout_id, a.sequence_id FROM store_attempt a "
        "JOIN store_rollout r ON r.id = a.rollout_id "
        "WHERE a.rollout_id = %s AND a.attempt_id = %s AND r.project_id + 0 = %s "
        f"AND a.status IN ({rules.literal(ATTEMPT_LIVE)}) "
        f"{f'AND {KEY_LIVE_SQL} ' if key_checked else ''}"
        "FOR NO KEY UPDATE OF a), "
        # The rollout follows its latest attempt, unless terminal.
        "r AS (UPDATE store_rollout r SET status = %s, end_time = %s::timestamptz FROM a "
        f"WHERE r.id = a.rollout_id AND {follows} "
        "RETURNING r.id, r.group_id), "
        "u AS (UPDATE store_attempt t SET status = %s, end_time = %s::timestamptz"
        f"{f', metadata = {merge}' if with_error else ''} "
        f"FROM a, r WHERE t.id = a.id RETURNING {_columns(Attempt, 't')}), "
        f"w AS (INSERT INTO store_worker ({worker_columns}) SELECT {worker_values} FROM u "
        "WHERE u.worker_id <> '' ON CONFLICT (project_id, worker_id) DO UPDATE SET "
        "status = EXCLUDED.status, last_idle_time = EXCLUDED.last_idle_time, "
        "current_rollout_id = NULL, current_attempt_id = NULL RETURNING 1), "
        # The group, after the worker (the one lock order): the scalar subquery runs w first.
        f"g AS (UPDATE store_rolloutgroup g SET finished = {finished}, "
        f"completed_at = {completed_at} "
        "FROM r WHERE g.id = r.group_id AND (SELECT count(*) FROM w) >= 0 "
        "RETURNING g.id, g.owner, g.finished, g.total, g.finished - 1 AS before), "
        "c AS (INSERT INTO store_groupcompletion (group_id, owner, created_at) "
        "SELECT id, owner, %s::timestamptz FROM g "
        f"WHERE {rules.group_completed_now_sql('before', 'total', 'finished')} RETURNING owner), "
        # The ledger row (executed though nothing reads it: every data-modifying WITH runs).
        "l AS (INSERT INTO store_usageentry (project_id, kind, rollout_id, attempt_id, "
        "group_id, cpu_seconds, gpu_seconds, gpu_type, tokens, cost, created_at) "
        "SELECT %s, 'attempt', u.rollout_id, u.attempt_id, r.group_id, %s::float8, %s::float8, "
        f"%s::varchar, t.n, {cost_sql('t.n')}, %s::timestamptz FROM u, r, "
        f"LATERAL (SELECT {gateway_tokens_sql('u.id')} AS n) t) "
        f"SELECT {_columns(Attempt, 'u')}, (SELECT array_agg(owner) FROM c), "
        "(SELECT group_id FROM r), pg_notify(%s, %s) FROM u"
    )
