"""Claiming queued rollouts: each claim creates the rollout's next attempt in the same
transaction. On Postgres it is one statement (select with SKIP LOCKED, or a bounded wait
for the row of a named claim; insert the attempts; update the rollouts; charge the parties'
usage); elsewhere (the embedded SQLite default, whose writers are serialized by BEGIN
IMMEDIATE) the same steps run one statement each (`_claim_orm`).

Which rollout an unnamed claim takes is the store's choice (README "Scheduling"): highest
priority first, then the project and, inside it, the party (job) with the least decayed usage
per unit of weight (rules.SHARE_ORDER), then the oldest; projects at their cap of concurrent
rollouts are skipped (rules.UNDER_CAP). A `Scope` says among what: one project (a runner's
dequeue), or every project's rollouts delivered by one dispatch (a Celery message, which is
a ticket for the next rollout due on its queue, not for the rollout it was sent for). The
statement reaches the rollouts through their parties (few rows): per party, the first
`limit + CANDIDATE_SLACK` of its queued rollouts in index order (rollout_party_claim_order),
so concurrent claimers that skip each other's locked rows still find one."""

from __future__ import annotations

import functools
import re
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.db.models import Count

from store import rules
from store.models import Attempt, Party, Project, Rollout
from store.services._bulk import bulk_set
from store.services._common import attempt_deadline, worker_mark_dequeued
from store.services._rows import KEY_LIVE_SQL_NAMED, LiveKey, require_key_live, row_instance
from store.statemachine import AttemptStatus, RolloutConfig, RolloutStatus
from store.statuses import QUEUED, ROLLOUT_ACTIVE

# How long a named claim waits for its rollout's row lock (see _claim_sql).
NAMED_CLAIM_LOCK_WAIT_MS = 5000
# Candidates per party beyond the claim's limit: as many concurrent claimers may skip each
# other's locked rows in one party before one of them finds none.
CANDIDATE_SLACK = 16


@dataclass(frozen=True)
class Scope:
    """Among what an unnamed claim chooses: `project`'s rollouts (a runner's dequeue), or,
    with `project` None, every project's rollouts delivered by `dispatch` whose timeout is at
    most `max_timeout` (a Celery ticket: its task's time limits came from the timeout of the
    rollout it was sent for; None: any)."""

    project: Project | None
    dispatch: str | None = None
    max_timeout: float | None = None


def claim_queued(
    project: Project | Scope, worker_id: str | None, limit: int, now: datetime,
    rollout_id: str | None = None, idle_if_none: bool = True, live_key: LiveKey | None = None,
) -> list[tuple[Rollout, Attempt]]:
    """Claim up to `limit` queued rollouts of the scope in the store's order (module doc), or
    the named one (of `project`, unless its project is at its cap), and record the dequeue on
    the worker (busy with the last rollout claimed; idle when none was, unless `idle_if_none`
    is False). Must run inside a transaction, except an unnamed claim on Postgres: one
    statement, atomic by itself.

    With `live_key` (a lean request's key), nothing is claimed or recorded unless that
    key is live; KeyNotLive then. On Postgres the claim statement checks it (a claim that
    finds nothing asks again, to tell an empty queue from a dead key); elsewhere a read
    before the claim does."""
    scope = as_scope(project)
    if connection.vendor == "postgresql":
        if not rollout_id and _cap_unread(scope):
            # A lean request's project (its pk alone): one statement that claims only while
            # the project has no cap (read by the statement itself) instead of a read of the
            # cap first. Where it claims nothing (an empty queue, or a cap), the exact path
            # below reads the cap and claims again; it recorded nothing on the worker.
            claimed = _claim_sql(scope, worker_id, limit, now, None, False, live_key,
                                 uncapped_only=True)
            if claimed:
                claimed.sort(key=lambda pair: (-pair[0].priority, pair[0].enqueue_time))
                return claimed
        capped = _capped_to_lock(scope)
        with transaction.atomic() if capped and not connection.in_atomic_block else nullcontext():
            if capped:
                _lock_projects(capped)
                limit = _room(scope, limit)
            claimed = _claim_sql(scope, worker_id, limit, now, rollout_id, idle_if_none,
                                 live_key)
        if not claimed:
            require_key_live(live_key)
    else:
        require_key_live(live_key)
        claimed = _claim_orm(scope, worker_id, _room(scope, limit), now, rollout_id)
    claimed.sort(key=lambda pair: (-pair[0].priority, pair[0].enqueue_time))
    if connection.vendor != "postgresql" and worker_id and (claimed or idle_if_none):
        project_id = claimed[0][0].project_id if claimed else scope.project.pk
        worker_mark_dequeued(project_id, worker_id, [a for _, a in claimed], now)
    return claimed


# How long a process trusts its last look at whether any project has a cap (a cap set since
# is exact within this many seconds; until then only claims that do not overlap respect it).
CAPS_RECHECK_SECONDS = 5.0
_caps_seen: tuple[float, list[int]] = (-CAPS_RECHECK_SECONDS, [])


def _cap_unread(scope: Scope) -> bool:
    """A project-scoped claim whose project's cap was not loaded (a lean request's project,
    by its pk alone: reading the cap would be a statement of its own)."""
    return (scope.project is not None and scope.dispatch is None
            and "max_concurrent_rollouts" in scope.project.get_deferred_fields())


def _capped_to_lock(scope: Scope) -> list[int]:
    """The capped projects a claim in this scope must lock first. The claim statement counts
    a project's live rollouts in its own snapshot, so two claims at once could both see room
    for one: claims that may take a capped project's rollout take turns on its row, and the
    claim's snapshot (the next statement's) then sees the turns before it."""
    global _caps_seen
    if scope.project is not None:
        return [scope.project.pk] if scope.project.max_concurrent_rollouts is not None else []
    seen_at, ids = _caps_seen
    if time.monotonic() - seen_at >= CAPS_RECHECK_SECONDS:
        ids = list(Project.objects.filter(max_concurrent_rollouts__isnull=False)
                   .order_by("pk").values_list("pk", flat=True))
        _caps_seen = (time.monotonic(), ids)
    return ids


def _room(scope: Scope, limit: int) -> int:
    """A batch dequeue of a capped project takes at most what its cap leaves (the statement
    only asks whether the project may have one more; a ticket claims one)."""
    if scope.project is None or scope.project.max_concurrent_rollouts is None or limit == 1:
        return limit
    cap = Project.objects.filter(pk=scope.project.pk).values_list(
        "max_concurrent_rollouts", flat=True).first()
    if cap is None:
        return limit
    return max(1, min(limit, cap - _live_counts([scope.project.pk]).get(scope.project.pk, 0)))


def _lock_projects(ids: list[int]) -> None:
    # Served by the primary key; in id order (rules.LOCK_ORDER: projects first).
    list(Project.objects.filter(pk__in=ids).order_by("pk").select_for_update()
         .values_list("pk", flat=True))


def as_scope(project: Project | Scope) -> Scope:
    return project if isinstance(project, Scope) else Scope(project)


def _live_counts(project_ids) -> dict[int, int]:
    rows = (Rollout.objects.filter(project_id__in=project_ids, status__in=ROLLOUT_ACTIVE)
            .values("project_id").annotate(n=Count("pk")))
    return {row["project_id"]: row["n"] for row in rows}


def _under_cap(projects: list[Project]) -> set[int]:
    capped = [p.pk for p in projects if p.max_concurrent_rollouts is not None]
    live = _live_counts(capped) if capped else {}
    return {p.pk for p in projects
            if rules.UNDER_CAP.python(live.get(p.pk, 0), p.max_concurrent_rollouts)}


def _parties(scope: Scope, now: datetime) -> list[tuple[Party, float, float]]:
    """The scope's parties of projects under their cap, each with its decayed usage and its
    project's (the sum over the project's parties)."""
    parties = Party.objects.select_related("project")
    if scope.project is not None:
        parties = parties.filter(project=scope.project)
    parties = list(parties)
    allowed = _under_cap(list({p.project_id: p.project for p in parties}.values()))
    half_life = rules.usage_half_life()
    used = {p.pk: rules.DECAYED.python(p.usage, p.usage_at, now, half_life) for p in parties}
    per_project: dict[int, float] = defaultdict(float)
    for party in parties:
        per_project[party.project_id] += used[party.pk]
    return [(p, used[p.pk], per_project[p.project_id]) for p in parties
            if p.project_id in allowed]


def _candidates(scope: Scope, parties: list[tuple[Party, float, float]], now: datetime,
                limit: int) -> list[Rollout]:
    """The fair order's first rollouts (the statement's `c` and `picked`, in Python): per
    party, its first `limit` claimable rollouts in index order, ranked across parties. No
    slack and no second read to lock them: the embedded default's write transactions are
    serialized (BEGIN IMMEDIATE), so what this reads is what the claim takes."""
    sql, fits = _candidates_sql(scope.dispatch is not None, scope.max_timeout is not None)
    at = Rollout._meta.get_field("queue_deadline").get_db_prep_value(now, connection)
    ranked = []
    for party, usage, project_usage in parties:
        params = [party.pk, at, *([scope.dispatch] if scope.dispatch is not None else []),
                  *(fits[0] + (scope.max_timeout,) + fits[1]
                    if scope.max_timeout is not None else ()), limit]
        for rollout in Rollout.objects.raw(sql, params):
            key = rules.SHARE_ORDER.python(rollout.priority, project_usage,
                                           party.project.share_weight, usage, party.weight,
                                           rollout.enqueue_time)
            ranked.append((key, rollout))
    ranked.sort(key=lambda pair: pair[0])
    return [rollout for _, rollout in ranked[:limit]]


@functools.cache
def _candidates_sql(dispatch: bool, bounded: bool) -> tuple[str, tuple[tuple, tuple]]:
    """A party's first claimable rollouts (rules.CLAIMABLE; delivered by a dispatch, and
    within a ticket's bound, rules.FITS, where the claim says), and the parameters of the
    bound's fragment before and after the bound: written once, not built by the ORM for
    every claim (its compiling cost more than the statement, in the write transaction)."""
    where = ['"party_id" = %s', rules.CLAIMABLE.sql('"status"', '"queue_deadline"', "%s")]
    if dispatch:
        where.append('"dispatch" = %s')
    fits: tuple[tuple, tuple] = ((), ())
    if bounded:
        # rules.FITS's ORM form as this database's SQL, and its parameters around the bound.
        query = Rollout.objects.filter(rules.FITS.q(_BOUND)).query
        fragment, params = query.where.as_sql(query.get_compiler(connection.alias), connection)
        (at,) = [i for i, param in enumerate(params) if param is _BOUND]
        where.append(fragment)
        fits = (tuple(params[:at]), tuple(params[at + 1:]))
    return (f'SELECT * FROM "{Rollout._meta.db_table}" WHERE {" AND ".join(where)} '
            'ORDER BY "priority" DESC, "enqueue_time" LIMIT %s'), fits


_BOUND = 4321.5  # the bound while its fragment is compiled (found by identity)


def _charge(rollouts: list[Rollout], parties: list[tuple[Party, float, float]],
            now: datetime) -> None:
    """Each claim adds 1 to its party's decayed usage (the statement's `use`), from the
    usage `_parties` read in this (serialized) transaction."""
    counts: dict[int, int] = defaultdict(int)
    for rollout in rollouts:
        if rollout.party_id is not None:
            counts[rollout.party_id] += 1
    for party, usage, _ in sorted(parties, key=lambda row: row[0].pk):
        if party.pk in counts:
            Party.objects.filter(pk=party.pk).update(usage=usage + counts[party.pk],
                                                     usage_at=now)


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


def _claim_orm(scope: Project | Scope, worker_id, limit, now, rollout_id
               ) -> list[tuple[Rollout, Attempt]]:
    scope = as_scope(scope)
    if rollout_id:
        project = scope.project
        rollouts = list(Rollout.objects.filter(rules.CLAIMABLE.q(now), project=project,
                                               pk=rollout_id))
        if rollouts and not _under_cap([project]):
            rollouts = []
        # A rollout without a party charges nothing; one with a party charges its party.
        parties = _parties(scope, now) if rollouts and rollouts[0].party_id else []
    else:
        parties = _parties(scope, now)
        rollouts = _candidates(scope, parties, now, limit)
    attempts = [new_attempt(rollout, worker_id, now) for rollout in rollouts]
    if rollouts:
        attach(rollouts, attempts)
        _charge(rollouts, parties, now)
    return list(zip(rollouts, attempts, strict=True))


# rules.DEADLINE of an attempt claimed now, which never reported.
_DEADLINE_SQL = rules.DEADLINE.sql(
    "%(now)s", "NULL::timestamptz", rules.config_seconds_sql("p.config", "timeout_seconds"),
    rules.config_seconds_sql("p.config", "unresponsive_seconds"), "%(first_report)s::float8")


# worker_mark_dequeued in SQL, as the last clause of the claim: the worker is busy with the
# last rollout claimed (`l`: lowest priority, then newest), or idle when none was claimed
# (rules.WORKER_AFTER_CLAIM). Short aliases keep the claim under psycopg's 4 KB parse cache.
_WORKER_SQL = f"""
    , l AS (
        SELECT ins.rollout_id, ins.attempt_id, p.project_id
        FROM ins JOIN picked p ON p.id = ins.rollout_id
        ORDER BY p.priority, p.enqueue_time DESC LIMIT 1
    ), worker AS (
        INSERT INTO store_worker AS w (project_id, worker_id, status, heartbeat_stats,
            last_heartbeat_time, last_dequeue_time, last_busy_time, last_idle_time,
            current_rollout_id, current_attempt_id)
        SELECT COALESCE(l.project_id, %(project)s::bigint), %(worker)s,
            {rules.WORKER_AFTER_CLAIM.sql("l.rollout_id IS NOT NULL")}, NULL, NULL,
            %(now)s, CASE WHEN l.rollout_id IS NULL THEN NULL ELSE %(now)s END,
            CASE WHEN l.rollout_id IS NULL THEN %(now)s END,
            l.rollout_id, l.attempt_id
        FROM (SELECT 1) one LEFT JOIN l ON true
        WHERE l.rollout_id IS NOT NULL OR %(idle_if_none)s
        ON CONFLICT (project_id, worker_id) DO UPDATE SET status = EXCLUDED.status,
            last_dequeue_time = EXCLUDED.last_dequeue_time,
            last_busy_time = COALESCE(EXCLUDED.last_busy_time, w.last_busy_time),
            last_idle_time = COALESCE(EXCLUDED.last_idle_time, w.last_idle_time),
            current_rollout_id = EXCLUDED.current_rollout_id,
            current_attempt_id = EXCLUDED.current_attempt_id
    )
"""


def _claim_sql(scope: Project | Scope, worker_id, limit, now, rollout_id, idle_if_none,
               live_key=None, uncapped_only: bool = False) -> list[tuple[Rollout, Attempt]]:
    scope = as_scope(scope)
    sql, defaults = _claim_statement(bool(rollout_id), bool(worker_id), live_key is not None,
                                     scope.project is None, uncapped_only,
                                     0 if rollout_id else limit)
    params = {**defaults, "project": scope.project and scope.project.pk, "now": now,
              "worker": worker_id, "first_report": rules.first_report_seconds(),
              "ids": [rules.new_attempt_id() for _ in range(limit)],
              "rid": rollout_id, "idle_if_none": idle_if_none,
              "key": live_key and live_key[0], "key_role": live_key and live_key[1],
              "hl": rules.usage_half_life(),
              "dispatch": scope.dispatch, "fit": scope.max_timeout}
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


# The number of a project's rollouts claimed and not finished (served by the index
# rollout_project_status), and whether the project `j` may have one more (rules.UNDER_CAP).
_LIVE_SQL = (f"(SELECT count(*) FROM store_rollout x WHERE x.project_id = j.id "
             f"AND x.status IN ({rules.literal(ROLLOUT_ACTIVE)}))")
_UNDER_CAP_SQL = rules.UNDER_CAP.sql(_LIVE_SQL, "j.max_concurrent_rollouts")
_COLUMNS = "id, attempt_count, config, priority, enqueue_time, project_id, party_id"

# The fair choice (module doc): `pa`, the scope's parties of projects under their cap, with
# their decayed usage; `sh` adds each project's usage; `c` ranks the first claimable rollouts
# of each party in the store's order; `picked` locks the first `limit` of them still queued
# (a row another claim took since this statement's snapshot is skipped or, once committed,
# rechecked by Postgres against the status: the queue deadline only changes with it).
# `picked` reads its few rows by primary key (`r.id = ANY(...)`, the join's own condition
# again): joined to `c` alone, the planner's estimates made it scan every queued rollout and
# hash them, a cost that grew with the queue (tests/test_claim_plan.py).
_FAIR_SQL = f"""
    pa AS (
        SELECT pa.id, pa.project_id, pa.weight w, j.share_weight jw,
            {rules.DECAYED.sql("pa.usage", "pa.usage_at", "%(now)s", "%(hl)s")} u
        FROM store_party pa JOIN store_project j ON j.id = pa.project_id
        WHERE {{scope}} AND {_UNDER_CAP_SQL}
    ), sh AS (SELECT *, sum(u) OVER (PARTITION BY project_id) pu FROM pa
    ), c AS (
        SELECT r.id, row_number() OVER (ORDER BY {rules.SHARE_ORDER.sql(
            "r.priority", "s.pu", "s.jw", "s.u", "s.w", "r.enqueue_time")}) k
        FROM sh s, LATERAL (SELECT id, priority, enqueue_time FROM store_rollout
            WHERE party_id = s.id AND {rules.CLAIMABLE.sql("status", "queue_deadline", "%(now)s")}
            {{only}} ORDER BY priority DESC, enqueue_time LIMIT {{candidates}}) r
    ), picked AS (
        SELECT r.* FROM store_rollout r JOIN c ON c.id = r.id
        WHERE r.id = ANY(ARRAY(SELECT id FROM c)) AND r.status IN ({rules.literal(QUEUED)})
          {{live}}
        ORDER BY c.k LIMIT {{limit}} FOR UPDATE OF r SKIP LOCKED
    )"""

# A named claim: the rollout, unless its project is at its cap.
_NAMED_SQL = f"""
    picked AS (
        SELECT {_COLUMNS} FROM store_rollout WHERE project_id = %(project)s
          AND {rules.CLAIMABLE.sql("status", "queue_deadline", "%(now)s")} AND id = %(rid)s
          AND (SELECT {_UNDER_CAP_SQL} FROM store_project j WHERE j.id = %(project)s) {{live}}
        FOR UPDATE
    )"""

# Each claim adds 1 to its party's decayed usage (rules.DECAYED), last (rules.LOCK_ORDER).
_CHARGE_SQL = f"""
    , use AS (
        UPDATE store_party pa SET usage_at = %(now)s,
            usage = {rules.DECAYED.sql("pa.usage", "pa.usage_at", "%(now)s", "%(hl)s")} + n.n
        FROM (SELECT party_id, count(*) n FROM picked GROUP BY party_id) n
        WHERE pa.id = n.party_id
    )"""
rules.locks_in_order("project", "rollout", "worker", "party")


# Texts of the claim statement kept (one per flags and limit; runners claim 1 at a time).
CLAIM_STATEMENTS_CACHED = 256


@functools.lru_cache(maxsize=CLAIM_STATEMENTS_CACHED)
def _claim_statement(only_named: bool, with_worker: bool, key_checked: bool = False,
                     ticket: bool = False, uncapped_only: bool = False, limit: int = 1
                     ) -> tuple[str, dict]:
    """The claim statement (one text per flags and `limit`, so psycopg parses it once) and the
    parameters of the attempt columns that take their model default. With `key_checked`,
    it claims and records nothing unless the key `%(key)s` is live (`KEY_LIVE_SQL_NAMED`).
    With `ticket`, an unnamed claim chooses among every project's rollouts delivered by
    `%(dispatch)s` whose timeout fits `%(fit)s` (Scope). With `uncapped_only`, a project's
    unnamed claim takes nothing when the project has a cap."""
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
            db_type = field.db_type(connection).replace("timestamp with time zone", "timestamptz")
            values.append(f"%(d_{field.column})s::{db_type}")
    rollout_columns = ", ".join(f"upd.{f.column}" for f in Rollout._meta.concrete_fields)
    live = f"AND {KEY_LIVE_SQL_NAMED}" if key_checked else ""
    worker = _WORKER_SQL.replace("OR %(idle_if_none)s", f"OR %(idle_if_none)s) {live}")
    worker = worker.replace("WHERE l.rollout_id", "WHERE (l.rollout_id")
    # An unnamed claim's limits are written into its text, not parameters: with `LIMIT $n`
    # Postgres' generic plan guesses a tenth of the queue per party and costs more than a
    # plan for the values, so it planned the statement again on every run (about 1 ms of
    # Postgres per claim, more than running it); with numbers it keeps its generic plan.
    limits = {"candidates": int(limit) + CANDIDATE_SLACK, "limit": int(limit)}
    if only_named:
        picked = _NAMED_SQL.format(live=live)
    elif ticket:
        only = (f"AND dispatch = %(dispatch)s AND "
                f"{rules.FITS.sql('config', '%(fit)s::float8')}")
        picked = _FAIR_SQL.format(scope="true", only=only, live=live, **limits)
    else:
        scope = "pa.project_id = %(project)s"
        if uncapped_only:
            scope += " AND j.max_concurrent_rollouts IS NULL"
        picked = _FAIR_SQL.format(scope=scope, only="", live=live, **limits)
    sql = f"""
        WITH {picked}, ins AS (
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
        ) {worker if with_worker else ""} {_CHARGE_SQL}
        SELECT {rollout_columns}, ins.id, ins.attempt_id, ins.sequence_id, ins.deadline
        FROM upd JOIN ins ON ins.rollout_id = upd.id
    """
    return _compact(sql), defaults


def _compact(sql: str) -> str:
    """The text without the spaces SQL does not need (runs of them, and those beside
    parentheses, commas and the operators = + * /; no literal of ours holds one there), so
    the claim stays under psycopg's 4 KB parse cache (tests/test_rules.py)."""
    sql = re.sub(r"\s+", " ", sql)
    return re.sub(r" ?([(),]) ?| ([=+*/]) ", r"\1\2", sql).strip()
