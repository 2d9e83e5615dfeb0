"""Attempt updates: a runner's status reports and heartbeats, one or many per transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from store import hooks, rules, wakeups
from store.errors import IllegalTransition, InvalidInput, NotFound
from store.models import Attempt, Project, Rollout
from store.services import _ledger, _verdict
from store.services._bulk import Write, write_together
from store.services._common import (
    ROLLOUT_FOLLOW_FIELDS,
    attempt_deadline,
    follow_latest_attempt,
    set_attempt_status,
    worker_writes_for_attempts,
)
from store.services._rows import LiveKey, attempts_locked, require_key_live
from store.services.groups import rollouts_finished
from store.services.spans import spans_ingest
from store.statemachine import (
    ATTEMPT_FINAL,
    ATTEMPT_LIVE,
    QUEUED,
    ROLLOUT_TERMINAL,
    AttemptStatus,
    RolloutConfig,
    check_attempt_transition,
)

_UNSET: Any = object()


@dataclass
class AttemptUpdate:
    """AGL's UpdateAttemptRequest for one attempt ("latest" names the latest one)."""

    rollout_id: str
    attempt_id: str
    status: str | None = None
    worker_id: Any = _UNSET
    last_heartbeat_time: datetime | None = None
    metadata: Any = _UNSET
    error: str | None = None  # attempt_finish: merged into the metadata under the lock
    # attempt_finish: what the runner measured, for the ledger row of its verdict
    usage: _ledger.Usage | None = None


def attempt_update(
    *,
    project: Project,
    rollout_id: str,
    attempt_id: str,
    status: str | None = None,
    worker_id: Any = _UNSET,
    last_heartbeat_time: datetime | None = None,
    metadata: Any = _UNSET,
    live_key: LiveKey | None = None,
) -> Attempt:
    """One runner report. `live_key`: a lean request's key (pk, role), checked live by the
    locking statement (nothing found, NotFound, when it is not). A bare final verdict is one
    statement on Postgres (store/services/_verdict.py) where it can be."""
    if (worker_id is _UNSET and metadata is _UNSET and last_heartbeat_time is None
            and _verdict.possible(attempt_id, status)):
        attempt = _verdict.finish(project, rollout_id, attempt_id, status, timezone.now(),
                                  live_key=live_key)
        if attempt is not None:
            return attempt
    update = AttemptUpdate(rollout_id, attempt_id, status, worker_id, last_heartbeat_time, metadata)
    return attempt_update_many(project=project, updates=[update], live_key=live_key)[0]


def attempt_finish(
    *, project: Project, rollout_id: str, attempt_id: str, status: str, error: str | None = None,
    usage: _ledger.Usage | None = None, spans: Sequence[dict[str, Any]] = (),
) -> Attempt:
    """A runner's final verdict (succeeded or failed), with its error merged into the
    attempt's metadata under the row lock, so that nothing another writer stored (the
    watchdog's verdict) is lost, and the attempt's ledger row (`usage`: what the runner
    measured) written in the same transaction. Idempotent: finishing again with the same
    status changes nothing; another final status raises IllegalTransition.

    `spans`: the runner's last spans (`spans_ingest`'s), stored before the verdict: in the
    verdict's transaction where the verdict takes one (the embedded SQLite default: one
    write transaction, one turn of the file's writers, instead of two), else committed
    first (Postgres in autocommit: the spans' asynchronous commit, then the verdict's one
    statement). Either way a verdict is never stored without the spans sent with it, and a
    verdict refused (IllegalTransition) leaves them stored, as when they came apart."""
    if status not in ATTEMPT_FINAL:
        raise InvalidInput("status", f"must be one of {sorted(ATTEMPT_FINAL)}")
    if _verdict.possible(attempt_id, status):
        if spans:
            spans_ingest(project=project, spans=spans)
            spans = ()
        attempt = _verdict.finish(project, rollout_id, attempt_id, status, timezone.now(),
                                  error=error, usage=usage)
        if attempt is not None:
            return attempt
    update = AttemptUpdate(rollout_id, attempt_id, status, error=error, usage=usage)
    if not spans:
        return attempt_update_many(project=project, updates=[update])[0]
    refused = None
    with transaction.atomic():
        spans_ingest(project=project, spans=spans)
        try:  # the verdict's transaction is a savepoint in this one: refused, it keeps the spans
            attempt = attempt_update_many(project=project, updates=[update])[0]
        except IllegalTransition as exc:
            refused = exc
    if refused is not None:
        raise refused
    return attempt


def attempt_update_many(*, project: Project, updates: Sequence[AttemptUpdate],
                        live_key: LiveKey | None = None) -> list[Attempt]:
    """Apply runner reports in one transaction. Locks attempts, then their rollouts, then
    workers, then groups (rules.LOCK_ORDER). A rollout follows its latest attempt unless
    terminal."""
    for update in updates:
        if update.status is not None and update.status not in AttemptStatus.values:
            raise InvalidInput("status", f"must be one of {AttemptStatus.values}")
        if update.metadata is not _UNSET and update.metadata is not None and not isinstance(
            update.metadata, dict
        ):
            raise InvalidInput("metadata", "must be an object")
    now = timezone.now()
    rollout_ids = {u.rollout_id for u in updates}
    with transaction.atomic():
        all_attempts, rollouts = _lock(project, rollout_ids, live_key)
        attempts = _pick(project, updates, all_attempts, rollouts)
        finished: list[Rollout] = []
        changed_rollouts: dict[str, Rollout] = {}
        verdicts: list[tuple[Attempt, _ledger.Usage | None]] = []
        for update, attempt in zip(updates, attempts, strict=True):
            rollout = rollouts[attempt.rollout_id]
            was_terminal = rollout.status in ROLLOUT_TERMINAL
            had_verdict = attempt.status in ATTEMPT_FINAL
            _apply(update, attempt, rollout, now)
            if not had_verdict and attempt.status in ATTEMPT_FINAL:
                verdicts.append((attempt, update.usage))
            if follow_latest_attempt(rollout, attempt, now):
                changed_rollouts[rollout.pk] = rollout
                if not was_terminal and rollout.status in ROLLOUT_TERMINAL:
                    finished.append(rollout)
        notices = hooks.finished_notices(finished)
        if any(r.status in QUEUED for r in changed_rollouts.values()):
            notices.insert(0, (wakeups.QUEUED, project.pk))  # a failed attempt was requeued
        rules.locks_in_order("attempt", "rollout", "worker", "group")  # the writes below
        # One round trip on Postgres for the attempts, their rollouts and their workers, and
        # the wake-ups (delivered at commit, as `wakeups.announce` would send them).
        last = wakeups.announce_statement(notices)
        write_together([
            Write.set(attempts, ["status", "end_time", "worker_id", "last_heartbeat_time",
                                 "metadata", "deadline"]),
            Write.set(list(changed_rollouts.values()), ROLLOUT_FOLLOW_FIELDS),
            *worker_writes_for_attempts(project.pk, attempts, now),
            # the ledger: one row per runner's verdict, in its transaction
            _ledger.LedgerWrite(project, verdicts, now),
        ], last=last)
        if last is None:
            for channel, project_id in notices:
                wakeups.announce(channel, project_id)
        rollouts_finished(finished, now, announced=True)
    return attempts


def _lock(project: Project, rollout_ids: set[str], live_key: LiveKey | None = None
          ) -> tuple[list[Attempt], dict[str, Rollout]]:
    """Lock every attempt of the rollouts and the rollouts themselves, in one statement.
    Rows lock in attempt pk order, each rollout right after its first attempt: the order
    attempts -> rollouts that every writer keeps (see store/watchdog.py)."""
    if connection.vendor == "postgresql":
        rows = attempts_locked(project.pk, sorted(rollout_ids), None, lock_rollouts=True,
                               live_key=live_key)
    else:  # the embedded SQLite default: its transactions are serialized (BEGIN IMMEDIATE)
        require_key_live(live_key)
        rows = list(
            Attempt.objects.select_related("rollout").filter(rollout_id__in=rollout_ids)
            .order_by("pk")
        )
    rollouts: dict[str, Rollout] = {}
    for attempt in rows:
        # One instance per rollout, shared by its attempts. Postgres filtered the project
        # before locking (_rows.attempts_locked); SQLite's rows are checked here.
        attempt.rollout = rollouts.setdefault(attempt.rollout_id, attempt.rollout)
    mine = {pk: r for pk, r in rollouts.items() if r.project_id == project.pk}
    return rows, mine


def _pick(project: Project, updates: Sequence[AttemptUpdate], attempts: list[Attempt],
          rollouts: dict[str, Rollout]) -> list[Attempt]:
    found: dict[tuple[str, str], Attempt] = {}
    for attempt in attempts:
        rollout = rollouts.get(attempt.rollout_id)
        if rollout is None:  # another project's rollout: not found, never a leak
            continue
        found[(attempt.rollout_id, attempt.attempt_id)] = attempt
        if rollout.latest_attempt_id == attempt.pk:
            found[(attempt.rollout_id, "latest")] = attempt
    picked = []
    for update in updates:
        key = (update.rollout_id, update.attempt_id)
        if key not in found:
            raise _not_found(project, rollouts, key)
        picked.append(found[key])
    return picked


def _not_found(project: Project, rollouts: dict[str, Rollout], key: tuple[str, str]
               ) -> NotFound:
    """In AGL's words: the rollout, else its attempts, else the attempt is missing."""
    rollout_id, attempt_id = key
    if rollout_id in rollouts:
        return NotFound("attempt", f"{rollout_id}/{attempt_id}")
    if not Rollout.objects.filter(project=project, pk=rollout_id).exists():
        return NotFound("rollout", rollout_id)
    return NotFound("attempt", f"{rollout_id}/{attempt_id}",
                    f"No attempts found for rollout {rollout_id}")


def _older_verdict_changed(attempt: Attempt, rollout: Rollout, status: str) -> bool:
    """AGL accepts another final status for a finished attempt; we keep the verdict of a
    rollout's latest attempt (what the rollout follows) and let an older attempt's change, as
    AGL does (its rollout follows the latest attempt, so nothing else moves)."""
    return (attempt.status in ATTEMPT_FINAL and status in ATTEMPT_FINAL
            and rollout.latest_attempt_id != attempt.pk)


def _apply(update: AttemptUpdate, attempt: Attempt, rollout: Rollout, now: datetime) -> None:
    moved = False
    if update.status is not None:
        try:
            moved = check_attempt_transition(attempt.status, update.status)
        except ValueError:
            if not _older_verdict_changed(attempt, rollout, update.status):
                raise IllegalTransition(
                    "attempt", attempt.attempt_id, attempt.status, update.status
                ) from None
            moved = True
    if update.worker_id is not _UNSET:
        attempt.worker_id = update.worker_id
    if update.metadata is not _UNSET:
        attempt.metadata = update.metadata or {}
    if moved:  # after the metadata, so that a replaced metadata keeps the watchdog's verdict
        set_attempt_status(attempt, update.status, now)
        if update.error is not None:
            attempt.metadata = rules.ERROR_MERGE.python(attempt.metadata, update.error)
    if update.last_heartbeat_time is not None:
        attempt.last_heartbeat_time = update.last_heartbeat_time
    if attempt.status in ATTEMPT_LIVE and (moved or update.last_heartbeat_time is not None):
        # A report is a sign of life, dated by our clock: a runner's own clock (its
        # last_heartbeat_time, stored as sent) never moves the watchdog's deadline.
        config = RolloutConfig.parse(rollout.config)
        attempt.deadline = attempt_deadline(config, attempt.start_time, now)
