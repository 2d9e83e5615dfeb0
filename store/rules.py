"""The store's state rules, each written once: one named `Rule` holds its Python function and
its SQL fragment side by side, and every path that applies the rule is built from it (the
services and the watchdog call `.python`; the claim, the one-statement verdict, the one-statement
span export and the watchdog's reads put `.sql` into their text; the ORM paths take `.q` where a
rule has one). tests/test_rules.py runs each fragment on Postgres (and SQLite where the path
exists) against its Python function over edge inputs and requires equal answers.

A fragment is a function of SQL expressions (column references or placeholders), given in the
order of the Python function's arguments. Statuses, bounds and intervals are written into the
text from the enums and constants here (ours, fixed), so a statement's text never changes and
is parsed once.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import F, FloatField, Q
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce
from django.db.models.lookups import LessThanOrEqual

from store.statuses import (
    ATTEMPT_FINAL,
    ATTEMPT_LIVE,
    ATTEMPT_LOST,
    QUEUED,
    ROLLOUT_TERMINAL,
    AttemptStatus,
    RolloutStatus,
    WorkerStatus,
)


@dataclass(frozen=True)
class Rule:
    name: str
    python: Callable[..., Any]
    sql: Callable[..., str]
    q: Callable[..., Q] | None = None  # the ORM's form, where a path filters with it


def literal(values: str | Sequence[str]) -> str:
    """Status names (fixed, ours) as an SQL literal or list."""
    if isinstance(values, str):
        return f"'{values}'"
    return ", ".join(f"'{value}'" for value in sorted(values))


# --- Bounds of a limit in seconds -------------------------------------------------------------

# The longest limit (seconds) a rollout may set: about a century. Beyond it a deadline may not
# fit a datetime (Python's, or psycopg's reading of Postgres's). RolloutConfig.parse and the REST
# serializers refuse a limit above it (the field named); the deadline rule ignores one.
MAX_LIMIT_SECONDS = 3.2e9


def _limit_counts(seconds: float | None) -> bool:
    return seconds is not None and 0 < seconds <= MAX_LIMIT_SECONDS


def _limit_counts_sql(seconds: str) -> str:
    """NULL (no limit) counts as no, as in a WHERE or CASE WHEN."""
    return f"({seconds} > 0 AND {seconds} <= {MAX_LIMIT_SECONDS!r})"


LIMIT = Rule("limit", _limit_counts, _limit_counts_sql)


def first_report_seconds() -> float:
    """How long a claimed attempt may go without any report (heartbeat, status or span)
    before the watchdog calls it unresponsive, whatever its config: a dequeue answer lost on
    the way or a runner killed right after its claim never strand a rollout. 0: no bound.
    STORE_FIRST_REPORT_SECONDS: 0, or within the bounds of a limit (ImproperlyConfigured)."""
    seconds = settings.STORE_FIRST_REPORT_SECONDS
    if seconds and not _limit_counts(seconds):
        raise ImproperlyConfigured(
            f"STORE_FIRST_REPORT_SECONDS={seconds!r} must be 0 or in (0, {MAX_LIMIT_SECONDS:.0f}]")
    return seconds


# --- The deadline -------------------------------------------------------------------------------

# The first instant past the last one a deadline may take: Python's datetime ends just before
# it (psycopg cannot read a later timestamptz back), so a later one is no deadline, in both
# languages.
PAST_LAST_INSTANT_SQL = "'10000-01-01Z'"


def after(base: datetime, seconds: float | None) -> datetime | None:
    """`base` plus a limit within the bounds; None (never) for any other limit, or past the
    last instant."""
    if not _limit_counts(seconds):
        return None
    try:
        return base + timedelta(seconds=seconds)
    except OverflowError:
        return None


def _deadline(start: datetime, heartbeat: datetime | None, timeout: float | None,
              unresponsive: float | None, first_report: float | None) -> datetime | None:
    """When the watchdog must next look at a live attempt (None: never): the earliest of the
    timeout from its start, the unresponsive limit from its last report (`heartbeat`, by our
    clock; its start before any), and, while it never reported, the first-report window
    from its start. A limit outside the bounds, or an instant past the last, counts for none."""
    candidates = [after(start, timeout), after(heartbeat or start, unresponsive)]
    if heartbeat is None:
        candidates.append(after(start, first_report))
    candidates = [c for c in candidates if c is not None]
    return min(candidates) if candidates else None


def _deadline_sql(start: str, heartbeat: str, timeout: str, unresponsive: str,
                  first_report: str) -> str:
    # Each candidate (its base, its limit) is a row, so each argument is written once and the
    # statements that embed the rule stay short (psycopg caches the parsing of statements up
    # to 4 KB only). MIN skips the NULLs of limits out of bounds and of instants past the last.
    return (f"(SELECT min(v) FROM (VALUES ({start}, {timeout}), "
            f"(COALESCE({heartbeat}, {start}), {unresponsive}), "
            f"(CASE WHEN {heartbeat} IS NULL THEN {start} END, {first_report})) x(b, s), "
            f"LATERAL (SELECT CASE WHEN {_limit_counts_sql('s')} "
            f"THEN b + make_interval(secs => s) END AS v) y WHERE v < {PAST_LAST_INSTANT_SQL})")


DEADLINE = Rule("deadline", _deadline, _deadline_sql)


def config_seconds_sql(config: str, name: str) -> str:
    """A limit of a rollout's config (jsonb) as the deadline's fragment takes it."""
    return f"({config}->>'{name}')::float8"


# --- The queue ------------------------------------------------------------------------------------

def _claimable(status: str, queue_deadline: datetime | None, now: datetime) -> bool:
    """A rollout a claim may take: queued, its wait not expired."""
    return status in QUEUED and (queue_deadline is None or queue_deadline > now)


def _claimable_sql(status: str, queue_deadline: str, now: str) -> str:
    return (f"({status} IN ({literal(QUEUED)}) "
            f"AND ({queue_deadline} IS NULL OR {queue_deadline} > {now}))")


def _claimable_q(now: datetime) -> Q:
    return Q(status__in=QUEUED) & (Q(queue_deadline__isnull=True) | Q(queue_deadline__gt=now))


CLAIMABLE = Rule("claimable", _claimable, _claimable_sql, _claimable_q)


def _queue_expired(status: str, queue_deadline: datetime | None, now: datetime) -> bool:
    """A queued rollout whose wait ran out: the watchdog fails it."""
    return status in QUEUED and queue_deadline is not None and queue_deadline <= now


def _queue_expired_sql(status: str, queue_deadline: str, now: str) -> str:
    return (f"({status} IN ({literal(QUEUED)}) AND {queue_deadline} IS NOT NULL "
            f"AND {queue_deadline} <= {now})")


def _queue_expired_q(now: datetime) -> Q:
    return Q(status__in=QUEUED, queue_deadline__isnull=False, queue_deadline__lte=now)


QUEUE_EXPIRED = Rule("queue_expired", _queue_expired, _queue_expired_sql, _queue_expired_q)


def _attempt_overdue(status: str, deadline: datetime | None, now: datetime) -> bool:
    """A live attempt past its deadline: the watchdog judges it."""
    return status in ATTEMPT_LIVE and deadline is not None and deadline <= now


def _attempt_overdue_sql(status: str, deadline: str, now: str) -> str:
    return (f"({status} IN ({literal(ATTEMPT_LIVE)}) AND {deadline} IS NOT NULL "
            f"AND {deadline} <= {now})")


def _attempt_overdue_q(now: datetime) -> Q:
    return Q(status__in=ATTEMPT_LIVE, deadline__lte=now)


ATTEMPT_OVERDUE = Rule("attempt_overdue", _attempt_overdue, _attempt_overdue_sql,
                       _attempt_overdue_q)


# --- The fair share (README "Scheduling") -----------------------------------------------------

# Past this many half-lives a usage counts as nothing (2**-1000, ~1e-301: Postgres's
# `^` raises on an underflow to 0, Python's does not).
_MAX_HALF_LIVES = 1000.0


def usage_half_life() -> float:
    """SCHEDULER_USAGE_HALF_LIFE_SECONDS: > 0 (ImproperlyConfigured)."""
    seconds = settings.SCHEDULER_USAGE_HALF_LIFE_SECONDS
    if not isinstance(seconds, int | float) or not 0 < seconds <= MAX_LIMIT_SECONDS:
        raise ImproperlyConfigured(
            f"SCHEDULER_USAGE_HALF_LIFE_SECONDS={seconds!r} must be in "
            f"(0, {MAX_LIMIT_SECONDS:.0f}]")
    return float(seconds)


def _decayed(usage: float, usage_at: datetime | None, now: datetime, half_life: float) -> float:
    """A party's usage (claims) recorded at `usage_at`, as it counts at `now`: halved every
    `half_life` seconds (Kueue's and Slurm's decay). A `usage_at` ahead of `now` (another
    process's clock) counts as now."""
    if usage_at is None:
        return usage
    lives = min(max((now - usage_at).total_seconds(), 0.0) / half_life, _MAX_HALF_LIVES)
    return usage * 2.0 ** -lives


def _decayed_sql(usage: str, usage_at: str, now: str, half_life: str) -> str:
    # GREATEST skips the NULL of a usage never recorded: 0 half-lives.
    return (f"({usage} * 0.5::float8 ^ LEAST(GREATEST(extract(epoch FROM {now} - {usage_at})"
            f"::float8, 0) / {half_life}, {_MAX_HALF_LIVES!r}))")


DECAYED = Rule("decayed", _decayed, _decayed_sql)


def _under_cap(live: int, cap: int | None) -> bool:
    """A project may have another rollout claimed: it has no cap on concurrent rollouts, or
    fewer than its cap claimed and not finished (`live`: preparing or running)."""
    return cap is None or live < cap


def _under_cap_sql(live: str, cap: str) -> str:
    return f"({cap} IS NULL OR {live} < {cap})"


UNDER_CAP = Rule("under_cap", _under_cap, _under_cap_sql)


def _share_order(priority: int, project_usage: float, project_weight: float,
                 party_usage: float, party_weight: float, enqueue_time: datetime) -> tuple:
    """The claim's order over queued rollouts (smallest first): priority (higher first), then
    the project with the least usage per unit of weight, then the party (within the project)
    likewise, then the oldest. Usages are decayed to the claim's instant (DECAYED); a project's
    usage is the sum of its parties'. Two levels, as Slurm's Fair Tree: a project's share does
    not grow with the number of its jobs."""
    return (-priority, project_usage / project_weight, party_usage / party_weight, enqueue_time)


def _share_order_sql(priority: str, project_usage: str, project_weight: str, party_usage: str,
                     party_weight: str, enqueue_time: str) -> str:
    """An ORDER BY list."""
    return (f"{priority} DESC, {project_usage} / {project_weight}, "
            f"{party_usage} / {party_weight}, {enqueue_time}")


SHARE_ORDER = Rule("share_order", _share_order, _share_order_sql)


def _fits(timeout: float | None, max_timeout: float | None) -> bool:
    """A rollout with this config timeout a Celery ticket may run: the ticket has no bound
    (`max_timeout` None), or the rollout has a timeout within it (the ticket's task's time
    limits came from the timeout of the rollout it was sent for)."""
    return max_timeout is None or (timeout is not None and timeout <= max_timeout)


def _fits_sql(config: str, max_timeout: str) -> str:
    """`config` is the rollout's config (jsonb)."""
    return f"({max_timeout} IS NULL OR ({config}->>'timeout_seconds')::float8 <= {max_timeout})"


def _fits_q(max_timeout: float | None) -> Q:
    """On the rollout's `config` (the claim's SQLite path)."""
    if max_timeout is None:
        return Q()
    timeout = Cast(KeyTextTransform("timeout_seconds", "config"), FloatField())
    # A JSON null is no timeout (SQLite's text of it, 'null', would cast to 0).
    return Q(LessThanOrEqual(timeout, max_timeout)) & ~Q(config__timeout_seconds=None)


FITS = Rule("fits", _fits, _fits_sql, _fits_q)


# --- The retry rule and rollout-follows-attempt ---------------------------------------------

def _retried(status: str, sequence_id: int, retry_condition: Sequence[str] | None,
             max_attempts: int | None) -> bool:
    """A latest attempt ending `status` sends its rollout back to the queue: its config
    retries that status and attempts are left (`max_attempts`, 1 when unset)."""
    return status in (retry_condition or ()) and sequence_id < (max_attempts or 1)


def _retried_sql(status: str, sequence_id: str, config: str) -> str:
    """`config` is the rollout's config (jsonb): its retry_condition and max_attempts."""
    return (f"(COALESCE({config}->'retry_condition', '[]'::jsonb) "
            f"@> jsonb_build_array({status}::text) "
            f"AND {sequence_id} < COALESCE(({config}->>'max_attempts')::int, 1))")


RETRY = Rule("retry", _retried, _retried_sql)


def _rollout_status_for_attempt(status: str, sequence_id: int,
                                retry_condition: Sequence[str] | None,
                                max_attempts: int | None) -> str:
    """What a rollout becomes when its latest attempt reaches `status`."""
    if status in (AttemptStatus.PREPARING, AttemptStatus.RUNNING, AttemptStatus.SUCCEEDED):
        return status
    if _retried(status, sequence_id, retry_condition, max_attempts):
        return RolloutStatus.REQUEUING
    return RolloutStatus.FAILED


_KEPT = (AttemptStatus.PREPARING, AttemptStatus.RUNNING, AttemptStatus.SUCCEEDED)


def _rollout_status_for_attempt_sql(status: str, sequence_id: str, config: str) -> str:
    return (f"(CASE WHEN {status} IN ({literal(_KEPT)}) THEN {status}::varchar "
            f"WHEN {_retried_sql(status, sequence_id, config)} "
            f"THEN {literal(RolloutStatus.REQUEUING)} "
            f"ELSE {literal(RolloutStatus.FAILED)} END)")


ROLLOUT_FOR_ATTEMPT = Rule("rollout_for_attempt", _rollout_status_for_attempt,
                           _rollout_status_for_attempt_sql)


def _follows(rollout_status: str, latest_attempt: int | None, attempt: int) -> bool:
    """A rollout follows this attempt: it is the rollout's latest and the rollout is not
    terminal (terminal rollouts stay terminal against runners and the watchdog)."""
    return latest_attempt == attempt and rollout_status not in ROLLOUT_TERMINAL


def _follows_sql(rollout_status: str, latest_attempt: str, attempt: str) -> str:
    """NULL (no latest attempt) counts as no, as in a WHERE or CASE WHEN."""
    return (f"({latest_attempt} = {attempt} "
            f"AND {rollout_status} NOT IN ({literal(ROLLOUT_TERMINAL)}))")


FOLLOWS = Rule("follows", _follows, _follows_sql)


# --- Heartbeats -------------------------------------------------------------------------------

# A heartbeat rewrites its attempt at most this often; the watchdog's view of a busy attempt
# is at most this stale, and a stream of spans costs one attempt write a second, not one each.
HEARTBEAT_MIN_INTERVAL = timedelta(seconds=1)
# Statuses a heartbeat moves to running (the watchdog's unresponsive verdict is revisable).
REVIVABLE = (AttemptStatus.PREPARING, AttemptStatus.RUNNING, AttemptStatus.UNRESPONSIVE)
_REVIVED_AT_ONCE = (AttemptStatus.PREPARING, AttemptStatus.UNRESPONSIVE)


def _heartbeat_due(status: str, last: datetime | None, now: datetime) -> bool:
    """AGL: a span is its attempt's heartbeat. It is written when the attempt moves with it
    (preparing/unresponsive -> running), else at most once per HEARTBEAT_MIN_INTERVAL. A stored
    time ahead of ours is a runner's clock (update_attempt keeps it as sent): due."""
    if status in _REVIVED_AT_ONCE or last is None:
        return True
    return last > now or now - last >= HEARTBEAT_MIN_INTERVAL


def _heartbeat_due_sql(status: str, last: str, now: str) -> str:
    interval = HEARTBEAT_MIN_INTERVAL.total_seconds()
    return (f"({status} IN ({literal(_REVIVED_AT_ONCE)}) OR {last} IS NULL "
            f"OR {last} <= {now} - make_interval(secs => {interval!r}) OR {last} > {now})")


HEARTBEAT_DUE = Rule("heartbeat_due", _heartbeat_due, _heartbeat_due_sql)


def _revives(status: str) -> bool:
    """A due heartbeat makes the attempt running (an ended one records the time only)."""
    return status in REVIVABLE


def _revives_sql(status: str) -> str:
    return f"({status} IN ({literal(REVIVABLE)}))"


REVIVES = Rule("revives", _revives, _revives_sql)

_MOVED_BY_HEARTBEAT = (RolloutStatus.PREPARING, RolloutStatus.REQUEUING)


def _heartbeat_moves_rollout(rollout_status: str, latest_attempt: int | None,
                             attempt: int) -> bool:
    """A revived latest attempt moves its rollout preparing/requeuing -> running."""
    return latest_attempt == attempt and rollout_status in _MOVED_BY_HEARTBEAT


def _heartbeat_moves_rollout_sql(rollout_status: str, latest_attempt: str, attempt: str) -> str:
    return (f"({latest_attempt} = {attempt} "
            f"AND {rollout_status} IN ({literal(_MOVED_BY_HEARTBEAT)}))")


HEARTBEAT_MOVES_ROLLOUT = Rule("heartbeat_moves_rollout", _heartbeat_moves_rollout,
                               _heartbeat_moves_rollout_sql)


# --- Span sequence ids ---------------------------------------------------------------------------

def _span_counter(counter: int, next_explicit: int | None, missing: int) -> int:
    """AGL's per-rollout span counter after a batch: raised past the batch's highest explicit
    `sequence_id` (`next_explicit`, that id + 1; None: none), then one id for each of the
    `missing` spans without one (they get the ids just below the new counter, in order)."""
    return max(counter, next_explicit if next_explicit is not None else counter) + missing


def _span_counter_sql(counter: str, next_explicit: str, missing: str) -> str:
    return f"(GREATEST({counter}, {next_explicit}) + {missing})"


SPAN_COUNTER = Rule("span_counter", _span_counter, _span_counter_sql)


# Ids `spans/next` may hand out past its last synchronous commit, per rollout: a reservation
# that reaches past `span_ids_reserved` commits synchronously and moves it this far beyond.
SPAN_ID_BLOCK = 1024


def _same_epoch(epoch: Any, current: Any) -> bool:
    return epoch is not None and epoch == current


def _span_base(counter: int, reserved: int, epoch: Any, current: Any) -> int:
    """Where a rollout's counter moves from on Postgres (before SPAN_COUNTER): the counter
    itself, unless it last moved in another span epoch (`epoch`; `current`: the one now,
    None where unknown): a crash since may have lost reservations that were handed out, all
    below `reserved` (raised only by a synchronous commit), so it starts at `reserved` at
    least (README "Span sequence ids and crashes"). A rollout without an epoch (None) handed
    out nothing asynchronously (SPAN_IDS_DURABLE): the counter itself. SQLite's commits are
    never asynchronous: its paths take the counter itself."""
    return counter if epoch is None or epoch == current else max(counter, reserved)


def _span_base_sql(counter: str, reserved: str, epoch: str, current: str) -> str:
    return (f"(CASE WHEN {epoch} IS NULL OR {epoch} = {current} THEN {counter} "
            f"ELSE GREATEST({counter}, {reserved}) END)")


SPAN_BASE = Rule("span_base", _span_base, _span_base_sql)


def _span_ids_durable(base: int, count: int, reserved: int, epoch: Any, current: Any) -> bool:
    """Whether a reservation of `count` ids from `base` (SPAN_BASE) must commit synchronously:
    it reaches past `reserved`, or the counter last moved in another span epoch. Then it
    also moves `reserved` to SPAN_ID_BLOCK past the new counter; else it may commit
    asynchronously (a crash that loses it leaves the counter below `reserved`, which the next
    reservation in a new epoch skips to)."""
    return not _same_epoch(epoch, current) or base + count > reserved


def _span_ids_durable_sql(base: str, count: str, reserved: str, epoch: str, current: str
                          ) -> str:
    return f"(({epoch} = {current}) IS NOT TRUE OR {base} + {count} > {reserved})"


SPAN_IDS_DURABLE = Rule("span_ids_durable", _span_ids_durable, _span_ids_durable_sql)


# --- The error merge ------------------------------------------------------------------------------

def _with_error(metadata: Any, error: str) -> dict:
    """`{**metadata, "error": error}`; metadata that is not an object counts as empty."""
    return {**(metadata if isinstance(metadata, dict) else {}), "error": error}


def _with_error_sql(metadata: str, error: str) -> str:
    return (f"(CASE WHEN jsonb_typeof({metadata}) = 'object' THEN {metadata} "
            f"ELSE '{{}}'::jsonb END || jsonb_build_object('error', {error}::text))")


ERROR_MERGE = Rule("error_merge", _with_error, _with_error_sql)


# --- Attempt ids ----------------------------------------------------------------------------------

def new_attempt_id() -> str:
    """AGL's format: "at-" and 8 hex digits. The one generator: the claim's statement takes
    ids made here (`ATTEMPT_ID.sql`) rather than making its own."""
    return "at-" + secrets.token_hex(4)


def _attempt_id_pick(ids: Sequence[str], index: int) -> str | None:
    """The `index`-th (from 1) of ids made beforehand, as the claim's statement picks them."""
    return ids[index - 1] if 1 <= index <= len(ids) else None


def _attempt_id_pick_sql(ids: str, index: str) -> str:
    return f"({ids}::text[])[{index}]"


ATTEMPT_ID = Rule("attempt_id", _attempt_id_pick, _attempt_id_pick_sql)


# --- Worker bookkeeping ---------------------------------------------------------------------------

def _worker_for_attempt(status: str) -> str:
    """AGL's worker bookkeeping, after its attempt's status: finished -> idle, lost by the
    watchdog -> unknown, otherwise busy."""
    if status in ATTEMPT_FINAL:
        return WorkerStatus.IDLE
    if status in ATTEMPT_LOST:
        return WorkerStatus.UNKNOWN
    return WorkerStatus.BUSY


def _worker_for_attempt_sql(status: str) -> str:
    return (f"(CASE WHEN {status} IN ({literal(ATTEMPT_FINAL)}) "
            f"THEN {literal(WorkerStatus.IDLE)} WHEN {status} IN ({literal(ATTEMPT_LOST)}) "
            f"THEN {literal(WorkerStatus.UNKNOWN)} ELSE {literal(WorkerStatus.BUSY)} END)")


WORKER_FOR_ATTEMPT = Rule("worker_for_attempt", _worker_for_attempt, _worker_for_attempt_sql)


def _worker_after_claim(claimed: bool) -> str:
    """A dequeue leaves its worker busy (with the last rollout claimed) or idle."""
    return WorkerStatus.BUSY if claimed else WorkerStatus.IDLE


def _worker_after_claim_sql(claimed: str) -> str:
    return (f"(CASE WHEN {claimed} THEN {literal(WorkerStatus.BUSY)} "
            f"ELSE {literal(WorkerStatus.IDLE)} END)")


WORKER_AFTER_CLAIM = Rule("worker_after_claim", _worker_after_claim, _worker_after_claim_sql)


# --- Group completion -----------------------------------------------------------------------------

def _group_count(finished: int, total: int, completed_at: datetime | None, delta: int,
                 now: datetime) -> tuple[int, datetime | None, bool]:
    """A group's count once `delta` members became terminal (-1: one reopened): its new
    `finished` (never below 0), its `completed_at` (kept, or now, while full; else None), and
    whether this change completed it (a completion event)."""
    new = max(finished + delta, 0)
    full = new >= total
    return new, (completed_at or now) if full else None, total > 0 and finished < total <= new


def _group_finished_sql(finished: str, delta: str) -> str:
    return f"GREATEST({finished} + {delta}, 0)"


def _group_completed_at_sql(finished: str, total: str, completed_at: str, delta: str,
                            now: str) -> str:
    return (f"CASE WHEN {_group_finished_sql(finished, delta)} >= {total} "
            f"THEN COALESCE({completed_at}, {now}) END")


def _group_completed_now_sql(before: str, total: str, finished: str) -> str:
    """Over a changed group's row: `before`, its count before the change; `finished`, after."""
    return f"({total} > 0 AND {before} < {total} AND {finished} >= {total})"


def _group_count_sql(finished: str, total: str, completed_at: str, delta: str,
                     now: str) -> str:
    """The three answers as three columns."""
    new = _group_finished_sql(finished, delta)
    return (f"{new}, {_group_completed_at_sql(finished, total, completed_at, delta, now)}, "
            f"{_group_completed_now_sql(finished, total, new)}")


GROUP_COUNT = Rule("group_count", _group_count, _group_count_sql)
group_finished_sql = _group_finished_sql
group_completed_at_sql = _group_completed_at_sql
group_completed_now_sql = _group_completed_now_sql


# --- Quotas --------------------------------------------------------------------------------------

# A project's GPU-seconds cap (Project.gpu_seconds_per_day) counts its ledger rows of the last
# 24 h, a rolling window: a row written at t counts while t > now - QUOTA_WINDOW, so it ages out
# at t + QUOTA_WINDOW (README "Quotas"). The sum is served by the index usage_project_time.
QUOTA_WINDOW = timedelta(hours=24)


def _gpu_quota_reached(used: float | None, cap: float | None) -> bool:
    """The project used its allowance: the window's GPU-seconds at or past its cap (a cap of
    0 holds every step); no cap (None) is never reached."""
    return cap is not None and (used or 0.0) >= cap


def _gpu_quota_reached_sql(used: str, cap: str) -> str:
    return f"({cap} IS NOT NULL AND COALESCE({used}, 0) >= {cap})"


def _gpu_quota_reached_q(used: str, cap: str) -> Q:
    """Over rows annotated with the window's sum (`used`) beside the cap's column."""
    return Q(**{f"{cap}__isnull": False, f"{cap}__lte": Coalesce(F(used), 0.0)})


GPU_QUOTA = Rule("gpu_quota", _gpu_quota_reached, _gpu_quota_reached_sql, _gpu_quota_reached_q)


# --- The lock order -------------------------------------------------------------------------------

# Every writer locks rows in this order of tables (within a table, in id order): projects (the
# claim of a capped project's rollouts, first), attempts, then rollouts, then workers, then
# groups, then parties (the claim's usage). The verdict (both paths), the watchdog, the span
# ingest, attempt_start and the claim keep it; a writer that takes two in the other order
# deadlocks against them (attempt_start reopening a group member did: 17 deadlocks in 30
# rounds).
LOCK_ORDER = ("project", "attempt", "rollout", "worker", "group", "party")


def locks_in_order(*tables: str) -> None:
    """Assert, where a statement or a path is built, that it locks `tables` in the one order."""
    ranks = [LOCK_ORDER.index(t) for t in tables]
    if ranks != sorted(ranks):
        raise AssertionError(f"locks {tables} out of the order {LOCK_ORDER}")


ALL = (LIMIT, DEADLINE, CLAIMABLE, QUEUE_EXPIRED, ATTEMPT_OVERDUE, RETRY, ROLLOUT_FOR_ATTEMPT,
       FOLLOWS, HEARTBEAT_DUE, REVIVES, HEARTBEAT_MOVES_ROLLOUT, ERROR_MERGE, ATTEMPT_ID,
       WORKER_FOR_ATTEMPT, WORKER_AFTER_CLAIM, GROUP_COUNT, SPAN_COUNTER, SPAN_BASE,
       SPAN_IDS_DURABLE, GPU_QUOTA, DECAYED,
       UNDER_CAP, SHARE_ORDER, FITS)
