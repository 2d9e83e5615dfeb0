"""The watchdog sweep: time out, mark unresponsive, expire queue waits, then retry or fail.

Runs on a schedule (celery-beat), independent of traffic. Each batch is one short transaction
over a partial index; rows another process holds are skipped and picked up by the next sweep,
so sweeps may run concurrently with each other and with heartbeats.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from store import rules, wakeups
from store.models import Attempt, Rollout, Worker
from store.rules import first_report_seconds
from store.services._bulk import bulk_set
from store.services._common import (
    ROLLOUT_FOLLOW_FIELDS,
    attempt_deadline,
    follow_latest_attempt,
    set_attempt_status,
    worker_sync_for_attempts,
)
from store.services.groups import rollouts_finished
from store.statemachine import (
    ATTEMPT_LIVE,
    QUEUED,
    ROLLOUT_TERMINAL,
    AttemptStatus,
    RolloutConfig,
    RolloutStatus,
)

QUEUE_EXPIRED = "queue wait expired"


@dataclass
class SweepResult:
    timed_out: list[str] = field(default_factory=list)  # "ro-.../at-..." of each attempt
    unresponsive: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)  # rollout ids sent back to the queue
    failed: list[str] = field(default_factory=list)  # rollout ids failed by the sweep
    queue_expired: list[str] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return len(self.timed_out) + len(self.unresponsive) + len(self.queue_expired)

    def as_dict(self) -> dict[str, list[str]]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def sweep(
    *, now: datetime | None = None, batch_size: int | None = None, max_batches: int = 20,
    project_id: int | None = None,
) -> SweepResult:
    """One pass of the watchdog (over one project with `project_id`); at most `max_batches`
    batches of each kind."""
    now = now or timezone.now()
    batch_size = batch_size or settings.STORE_SWEEP_BATCH_SIZE
    result = SweepResult()
    for _ in range(max_batches):
        if _sweep_attempts(now, batch_size, result, project_id) < batch_size:
            break
    for _ in range(max_batches):
        if _sweep_silent_claims(now, batch_size, result, project_id) < batch_size:
            break
    for _ in range(max_batches):
        if _expire_queue_waits(now, batch_size, result, project_id) < batch_size:
            break
    return result


# A process sweeps a project on its API calls at most this often (AGL's own tests expect a
# verdict within 0.25 s of its deadline; the scheduled sweep runs every few seconds).
CALL_SWEEP_INTERVAL = 0.1
_last_call_sweep: dict[int, float] = {}


def sweep_on_call(project_id: int) -> SweepResult | None:
    """AGL runs its watchdog before store calls; so do we, per project and throttled, so no
    caller sees an overdue attempt or queue wait as if it were alive. None when throttled or
    when nothing of the project is due: one read (no transaction) looks first, so a busy
    project's calls pay one statement per interval, not a sweep's two transactions."""
    clock = time.monotonic()
    if clock - _last_call_sweep.get(project_id, float("-inf")) < CALL_SWEEP_INTERVAL:
        return None
    _last_call_sweep[project_id] = clock
    now = timezone.now()
    if not _anything_due(project_id, now):
        return None
    return sweep(now=now, project_id=project_id, max_batches=1)


def _anything_due(project_id: int, now: datetime) -> bool:
    """Whether the project has a live attempt past its deadline or a queue wait past its
    deadline (the rows `sweep` would look at), in one statement over the partial indexes.
    Written out, not built by the ORM: building it cost more than running it."""
    stamp = connection.ops.adapt_datetimefield_value(now)
    with connection.cursor() as cursor:
        cursor.execute(_DUE_SQL, [project_id, stamp, project_id, stamp])
        return bool(cursor.fetchone()[0])


_DUE_SQL = f"""
    SELECT EXISTS (
        SELECT 1 FROM store_attempt a JOIN store_rollout r ON r.id = a.rollout_id
        WHERE r.project_id = %s AND {rules.ATTEMPT_OVERDUE.sql("a.status", "a.deadline", "%s")}
    ) OR EXISTS (
        SELECT 1 FROM store_rollout WHERE project_id = %s
          AND {rules.QUEUE_EXPIRED.sql("status", "queue_deadline", "%s")}
    )
"""


def _sweep_attempts(now: datetime, batch_size: int, result: SweepResult,
                    project_id: int | None = None) -> int:
    with transaction.atomic():
        # Served by the partial index attempt_live_deadline.
        due = Attempt.objects.filter(rules.ATTEMPT_OVERDUE.q(now))
        if project_id is not None:
            due = due.filter(rollout__project_id=project_id)
        attempts = list(
            due.select_for_update(skip_locked=True, of=("self",))
            .order_by("deadline")[:batch_size]
        )
        if not attempts:
            return 0
        _judge(attempts, now, result, _due_verdict)
    return len(attempts)


def _sweep_silent_claims(now: datetime, batch_size: int, result: SweepResult,
                         project_id: int | None = None) -> int:
    """Claims that never reported (preparing, no heartbeat) whose worker has given no sign
    of life for STORE_SILENT_WORKER_SECONDS (a runner killed right after its claim):
    unresponsive now, not at the end of their limits or of the first-report window. A live
    worker shows itself within seconds (our runners heartbeat an attempt every
    RUNNERS_HEARTBEAT_SECONDS, a runner with a free slot long-polls the dequeue, an AGL
    runner calls update_worker every 10 s), so a slow agent of a live worker is never
    judged by this."""
    window = settings.STORE_SILENT_WORKER_SECONDS
    if not window:
        return 0
    cutoff = now - timedelta(seconds=window)
    quiet = Q()
    for sign in ("last_heartbeat_time", "last_dequeue_time", "last_busy_time",
                 "last_idle_time"):
        quiet &= Q(**{f"{sign}__isnull": True}) | Q(**{f"{sign}__lt": cutoff})
    silent_worker = Worker.objects.filter(
        quiet, project_id=OuterRef("rollout__project_id"), worker_id=OuterRef("worker_id"))
    with transaction.atomic():
        # Served by the partial index attempt_live_deadline (a claim that never reported has
        # the first-report window's deadline), then worker_uniq per attempt.
        due = Attempt.objects.filter(status__in=ATTEMPT_LIVE, deadline__isnull=False).filter(
            Exists(silent_worker), status=AttemptStatus.PREPARING,
            last_heartbeat_time__isnull=True, start_time__lte=cutoff)
        if project_id is not None:
            due = due.filter(rollout__project_id=project_id)
        attempts = list(
            due.select_for_update(skip_locked=True, of=("self",))
            .order_by("start_time")[:batch_size]
        )
        if not attempts:
            return 0
        _judge(attempts, now, result, _silent_verdict)
    return len(attempts)


def _judge(attempts: list[Attempt], now: datetime, result: SweepResult,
           verdict_for: Callable[[Attempt, RolloutConfig, datetime], tuple[str, str] | None],
           ) -> None:
    """Apply `verdict_for(attempt, config, now)` (a status and its error, or None: not due)
    to locked live attempts: the attempts, their rollouts (retry or fail), their workers and
    groups."""
    rollouts = {
        r.pk: r
        for r in Rollout.objects.select_for_update()
        .filter(pk__in={a.rollout_id for a in attempts})
        .order_by("pk")
    }
    lost, changed, finished = [], {}, []
    for attempt in attempts:
        rollout = rollouts[attempt.rollout_id]
        config = RolloutConfig.parse(rollout.config)
        judged = verdict_for(attempt, config, now)
        if judged is None:
            continue
        verdict, error = judged
        set_attempt_status(attempt, verdict, now)
        attempt.metadata = rules.ERROR_MERGE.python(attempt.metadata, error)
        lost.append(attempt)
        key = f"{attempt.rollout_id}/{attempt.attempt_id}"
        timed_out = verdict == AttemptStatus.TIMEOUT
        (result.timed_out if timed_out else result.unresponsive).append(key)
        was_terminal = rollout.status in ROLLOUT_TERMINAL
        if follow_latest_attempt(rollout, attempt, now):
            changed[rollout.pk] = rollout
            if rollout.status in QUEUED:
                result.requeued.append(rollout.pk)
            elif rollout.status == RolloutStatus.FAILED and not was_terminal:
                result.failed.append(rollout.pk)
                finished.append(rollout)
    bulk_set(attempts, ["status", "end_time", "deadline", "metadata"])
    if changed:
        bulk_set(list(changed.values()), ROLLOUT_FOLLOW_FIELDS)
    for project_id in {r.project_id for r in rollouts.values()}:
        mine = [a for a in lost if rollouts[a.rollout_id].project_id == project_id]
        worker_sync_for_attempts(project_id, mine, now)
    for project_id in {changed[rid].project_id for rid in result.requeued if rid in changed}:
        wakeups.announce(wakeups.QUEUED, project_id)
    rollouts_finished(finished, now)


def _due_verdict(attempt: Attempt, config: RolloutConfig, now: datetime
                 ) -> tuple[str, str] | None:
    verdict = _verdict(attempt, config, now)
    return None if verdict is None else (verdict, verdict_error(attempt, verdict, config, now))


def _silent_verdict(attempt: Attempt, config: RolloutConfig, now: datetime
                    ) -> tuple[str, str] | None:
    if attempt.status != AttemptStatus.PREPARING or attempt.last_heartbeat_time is not None:
        # It reported since the query looked.
        return None
    age = (now - attempt.start_time).total_seconds()
    return AttemptStatus.UNRESPONSIVE, (
        f"unresponsive: claimed {age:.1f} s ago and never reported, and its worker "
        f"{attempt.worker_id!r} gave no sign of life (dequeue, heartbeat or report) for "
        f"{settings.STORE_SILENT_WORKER_SECONDS:g} s (STORE_SILENT_WORKER_SECONDS; ended by "
        "the watchdog)")


def _verdict(attempt: Attempt, config: RolloutConfig, now: datetime) -> str | None:
    """timeout or unresponsive for a live attempt whose deadline is due, by our clock only:
    every report moves the deadline from the time we received it, while the stored
    last_heartbeat_time may be a runner's clock (update_attempt keeps it as sent, as AGL does),
    hours off either way. None after setting the deadline again (the config changed)."""
    age = (now - attempt.start_time).total_seconds()
    if config.timeout_seconds and age >= config.timeout_seconds:
        return AttemptStatus.TIMEOUT
    if config.unresponsive_seconds:
        return AttemptStatus.UNRESPONSIVE  # no report within the window the deadline holds
    never_reported = attempt.last_heartbeat_time is None
    if never_reported and first_report_seconds() and age >= first_report_seconds():
        return AttemptStatus.UNRESPONSIVE  # claimed, then nothing: the claim's window
    # Not due after all (the config changed): the timeout, and the claim's window if the
    # attempt never reported (no unresponsive limit: the stored time plays no part).
    attempt.deadline = attempt_deadline(config, attempt.start_time,
                                        None if never_reported else attempt.start_time)
    return None


def verdict_error(attempt: Attempt, verdict: str, config: RolloutConfig, now: datetime) -> str:
    """The error a watchdog verdict records on its attempt (what a job's error and the
    rollout task's failure quote)."""
    if verdict == AttemptStatus.TIMEOUT:
        age = (now - attempt.start_time).total_seconds()
        return (f"timeout: the attempt ran {age:.1f} s, past its timeout_seconds="
                f"{config.timeout_seconds:g} (ended by the watchdog)")
    if not config.unresponsive_seconds:  # the claim's window (STORE_FIRST_REPORT_SECONDS)
        return (f"unresponsive: no report in the {first_report_seconds():g} s since it was "
                "claimed (STORE_FIRST_REPORT_SECONDS; ended by the watchdog)")
    # By our clock: the deadline is the last report's arrival plus the limit.
    late = (now - attempt.deadline).total_seconds() if attempt.deadline else 0.0
    silent = config.unresponsive_seconds + max(late, 0.0)
    return (f"unresponsive: no heartbeat for {silent:.1f} s, past its unresponsive_seconds="
            f"{config.unresponsive_seconds:g} (ended by the watchdog)")


def _expire_queue_waits(now: datetime, batch_size: int, result: SweepResult,
                        project_id: int | None = None) -> int:
    with transaction.atomic():
        # Served by the partial index rollout_queue_deadline.
        due = Rollout.objects.filter(rules.QUEUE_EXPIRED.q(now))
        if project_id is not None:
            due = due.filter(project_id=project_id)
        rollouts = list(
            due.select_for_update(skip_locked=True).order_by("queue_deadline")[:batch_size]
        )
        for rollout in rollouts:
            rollout.status = RolloutStatus.FAILED
            rollout.end_time = now
            rollout.metadata = {**(rollout.metadata or {}), "store.failure": QUEUE_EXPIRED}
            result.queue_expired.append(rollout.pk)
        if rollouts:
            bulk_set(rollouts, ["status", "end_time", "metadata"])
            rollouts_finished(rollouts, now)
    return len(rollouts)
