"""Runner-side services: run one rollout delivered by a message; enqueue rollouts for Celery
execution (sent after commit); re-send messages the reconciliation sweep finds lost; the
worker registry; the periodic control work."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from core import control
from core.processes import process_alive
from core.publish import Message, publish
from core.queues import Queue
from runners import stopping
from runners.agent import AgentError, load_agent, missing_resources, unoffered
from runners.agl_compat import is_agl_agent
from runners.executor import ENDED, FAILED, ExecutorOptions, Outcome, execute, last_line
from runners.gateway import Claim
from runners.held_slots import HeldSlotRecorder, held_slots_forget
from runners.local_gateway import LocalGateway
from runners.models import CeleryWorker
from runners.usage import UsageMeter
from store import rules, watchdog
from store import services as store_services
from store.errors import IllegalTransition, InvalidInput
from store.models import Attempt, Project, Rollout
from store.services import Dispatch, RolloutSpec
from store.statemachine import ATTEMPT_LIVE, QUEUED, AttemptStatus

log = logging.getLogger(__name__)

CELERY = "celery"
RUN_ROLLOUT_TASK = "runners.run_rollout"
NOT_QUEUED = "not-queued"


def executor_options() -> ExecutorOptions:
    return ExecutorOptions(
        heartbeat_seconds=settings.RUNNERS_HEARTBEAT_SECONDS,
        span_batch_size=settings.RUNNERS_SPAN_BATCH_SIZE,
        stop_grace_seconds=settings.RUNNERS_STOP_GRACE_SECONDS,
    )


def worker_id_here(hostname: str | None) -> str:
    """The attempt's worker id for a Celery task: the worker's node name and this process."""
    return f"celery:{hostname or 'local'}:{os.getpid()}"


class RolloutFailed(Exception):
    """The attempt failed (recorded in the store first). Raised out of the rollout task, so
    Celery and Flower show it as FAILURE with the agent's error; it is not in the task's
    autoretry list, and the message is acknowledged, so it is not redelivered."""


def rollout_run(*, project_id: int, rollout_id: str, worker_id: str) -> str:
    """A rollout message is a ticket for a slot of its queue (README "Scheduling"): claim the
    rollout due next among every project's Celery rollouts whose timeout fits this message's
    time limits (those of the rollout it was sent for), else the rollout it names; run it.
    Nothing claimable (a duplicate message, a runner got there first, the project is at its
    cap): returns NOT_QUEUED, and a named rollout still waiting is owed a message (the next
    reconcile, or the end of one of its project's rollouts, sends it). Returns the outcome's
    status; raises RolloutFailed when the attempt failed."""
    meter = UsageMeter()  # the task's own CPU, its claim included (the ledger, README "Cost")
    config = Rollout.objects.filter(pk=rollout_id, project_id=project_id).values_list(
        "config", flat=True).first()
    if config is None:  # deleted (with its project) since the message was sent
        return NOT_QUEUED
    timeout = config.get("timeout_seconds")
    try:
        claimed = _claim_for_ticket(project_id, rollout_id, worker_id,
                                    timeout if isinstance(timeout, int | float) else None)
    except Exception:
        # Nothing was claimed (the claim is one transaction) and this message is spent (a
        # soft time limit, a database that stayed down): the next reconcile sends another.
        _owe_message(rollout_id)
        raise
    if claimed is None:
        if Rollout.objects.filter(pk=rollout_id, status__in=QUEUED).exists():
            _owe_message(rollout_id)
        return NOT_QUEUED
    gateway, claim = claimed
    if claim.rollout_id != rollout_id:
        _ticket_taken(rollout_id, timeout, claim.rollout_id, claim.config.get("timeout_seconds"))
    try:
        return _run_claimed(gateway, claim, worker_id, meter)
    finally:
        if gateway.project.max_concurrent_rollouts is not None:
            _send_one_owed(gateway.project.pk)  # a capped project's slot freed: a ticket


def _ticket_taken(rollout_id: str, timeout: Any, other_id: str, other_timeout: Any) -> None:
    """This message ran another rollout, whose own message is left for this one. This one is
    owed a message now (sent by the next reconcile), not after the re-send age, when that
    message cannot run it (rules.FITS: a shorter timeout) or when there is none: the other
    rollout's message was itself owed (never published, e.g. the broker was down; or a
    retry's, not sent yet), so the reconcile will not send it now that it runs; without this
    the missing message passed from rollout to rollout, the newest left queued for the re-send
    age (tests/test_chaos.py: 9 rollouts, 300 s after a 5 s broker outage)."""
    number = (int, float)
    fits = rules.FITS.python(timeout if isinstance(timeout, number) else None,
                             other_timeout if isinstance(other_timeout, number) else None)
    if fits:
        fits = not Rollout.objects.filter(pk=other_id).filter(
            Q(dispatched_at__isnull=True) | Q(enqueue_time__gt=F("dispatched_at"))).exists()
    if not fits and Rollout.objects.filter(pk=rollout_id, status__in=QUEUED).exists():
        _owe_message(rollout_id)


def _claim_for_ticket(project_id: int, rollout_id: str, worker_id: str,
                      max_timeout: float | None) -> tuple[LocalGateway, Claim] | None:
    claimed = LocalGateway.claim_next(dispatch=CELERY, max_timeout=max_timeout,
                                      worker_id=worker_id)
    if claimed is not None:
        return claimed
    project = Project.objects.filter(pk=project_id).first()
    if project is None:
        return None
    # The named rollout: the fair claim skips rows other claims hold for an instant; this
    # waits for them (store.services.rollout_claim).
    gateway = LocalGateway(project)
    claim = gateway.claim_rollout(rollout_id=rollout_id, worker_id=worker_id)
    if claim is None and _take_over_from_dead(project, rollout_id, worker_id):
        claim = gateway.claim_rollout(rollout_id=rollout_id, worker_id=worker_id)
    return (gateway, claim) if claim is not None else None


def _run_claimed(gateway: LocalGateway, claim: Claim, worker_id: str, meter: UsageMeter
                 ) -> str:
    project = gateway.project
    if not claim.agent:
        error = "the rollout names no agent to run"
        gateway.finish(rollout_id=claim.rollout_id, attempt_id=claim.attempt_id, status="failed",
                       error=error, usage=meter.read())
        raise RolloutFailed(f"{claim.rollout_id}/{claim.attempt_id}: {error}")
    options = dataclasses.replace(executor_options(),
                                  held=HeldSlotRecorder(project.pk, worker_id), meter=meter)
    outcome: Outcome = execute(gateway=gateway, claim=claim, agent=claim.agent,
                               worker_id=worker_id, options=options)
    if outcome.status == FAILED:
        raise RolloutFailed(f"{claim.rollout_id}/{claim.attempt_id}: {last_line(outcome.error)}")
    if outcome.status == ENDED:  # the watchdog's verdict (timeout): the task failed too
        ended = Attempt.objects.filter(rollout_id=claim.rollout_id,
                                       attempt_id=claim.attempt_id).first()
        error = (ended.metadata or {}).get("error") if ended else None
        raise RolloutFailed(f"{claim.rollout_id}/{claim.attempt_id}: "
                            f"{error or outcome.error} ({ended.status if ended else 'gone'})")
    return outcome.status


def _send_one_owed(project_id: int) -> None:
    try:
        rollouts_redispatch(resend_after_seconds=settings.RUNNERS_REDISPATCH_SECONDS, limit=1,
                            project_id=project_id)
    except Exception:  # the database or broker is down: the reconcile sends it
        log.exception("could not send an owed rollout message")


def _owe_message(rollout_id: str) -> None:
    try:
        store_services.rollout_dispatch_unpublished(rollout_ids=[rollout_id])
    except Exception:  # the database is down: the age-based re-send still finds it
        log.exception("rollout %s: could not mark its message unsent", rollout_id)


def _take_over_from_dead(project: Project, rollout_id: str, worker_id: str) -> bool:
    """A redelivered message (its worker process was killed: WorkerLostError) finds the rollout
    held by the dead process's attempt. When that process ran on this worker node and is gone,
    its attempt is marked unresponsive now, as the watchdog would after its limit, so the
    rollout retries (or fails) within seconds. True when the rollout may be claimable now."""
    rollout = Rollout.objects.filter(pk=rollout_id, project=project).select_related(
        "latest_attempt").first()
    attempt = rollout.latest_attempt if rollout else None
    if attempt is None or attempt.status not in ATTEMPT_LIVE or not attempt.worker_id:
        return False
    node, _, pid = attempt.worker_id.rpartition(":")
    here, _, my_pid = worker_id.rpartition(":")
    if node != here or not pid.isdigit() or pid == my_pid or process_alive(int(pid)):
        return False
    log.warning("rollout %s: its attempt %s belonged to %s, which is gone; taking over",
                rollout_id, attempt.attempt_id, attempt.worker_id)
    try:
        store_services.attempt_update(project=project, rollout_id=rollout_id,
                                      attempt_id=attempt.attempt_id,
                                      status=AttemptStatus.UNRESPONSIVE)
    except IllegalTransition:
        return False  # it reported in the meantime
    return True


def celery_worker_take_over(*, name: str, pid: int) -> list[str]:
    """A worker starting under its node name takes over what dead processes of that node
    still hold: their live attempts are marked unresponsive now (as the watchdog would after
    `unresponsive_seconds`), and the rollouts that go back to the queue get a message now.
    Needed where the broker does not give the dead worker's messages back at once (Redis keeps
    an unacknowledged message until its visibility timeout). A process id that is alive again
    (reused) is left to the watchdog. Returns the rollout ids taken over."""
    prefix = f"celery:{name}:"
    # Served by the partial index attempt_live_deadline (the trainer's and Celery's rollouts
    # always have a deadline); few rows.
    held = (Attempt.objects.filter(status__in=ATTEMPT_LIVE, deadline__isnull=False,
                                   worker_id__startswith=prefix)
            .select_related("rollout__project").order_by("pk"))
    taken: list[str] = []
    for attempt in held:
        holder = attempt.worker_id[len(prefix):]
        if not holder.isdigit() or int(holder) == pid or process_alive(int(holder)):
            continue
        log.warning("rollout %s: its attempt %s belonged to %s, which is gone; taking over",
                    attempt.rollout_id, attempt.attempt_id, attempt.worker_id)
        try:
            store_services.attempt_update(
                project=attempt.rollout.project, rollout_id=attempt.rollout_id,
                attempt_id=attempt.attempt_id, status=AttemptStatus.UNRESPONSIVE)
        except IllegalTransition:
            continue  # it reported in the meantime
        taken.append(attempt.rollout_id)
    requeued = Rollout.objects.filter(pk__in=taken, status__in=QUEUED, dispatch=CELERY)
    dispatches_send([
        Dispatch(rollout_id=r.pk, project_id=r.project_id, dispatch=r.dispatch,
                 target=r.dispatch_target)
        for r in requeued.order_by("pk")
    ])
    celery_worker_resend_received(name=name)
    return taken


def attempt_holder_alive(worker_id: str) -> bool:
    """Whether the Celery worker process an attempt's `worker_id` names (`celery:<node>:<pid>`,
    worker_id_here) is known to run: its node is registered on this machine and the process
    is alive here. A process of another machine cannot be seen from here: False (unknown)."""
    node, _, pid = worker_id.removeprefix("celery:").rpartition(":")
    if not worker_id.startswith("celery:") or not node or not pid.isdigit():
        return False
    on_this_machine = CeleryWorker.objects.filter(
        name=node, hostname=socket.gethostname()).exists()
    return on_this_machine and process_alive(int(pid))


def celery_worker_resend_received(*, name: str) -> int:
    """Messages a worker killed outright had received but not started (no claim committed)
    stay with the broker (Redis: until the visibility timeout), their rollouts queued with a
    message counted as sent, so only the re-send age (RUNNERS_REDISPATCH_SECONDS) found them
    (301.9 s in a chaos run). They were at the head of the queue when it died, so they are
    among the queued rollouts whose message is oldest: the oldest `concurrency x prefetch`
    are sent again when its node starts again or is marked lost (a duplicate finds its
    rollout claimed and returns). Returns how many were sent."""
    worker = CeleryWorker.objects.filter(name=name).first()
    if worker is None or Queue.ROLLOUTS.value not in worker.queues:
        return 0
    held = max(worker.concurrency, 1) * settings.CELERY_WORKER_PREFETCH_MULTIPLIER
    return rollouts_redispatch(resend_after_seconds=0, limit=held)


def agent_problem(agent: str) -> str | None:
    """Why `agent` cannot be run here (it does not import, names nothing callable), or None.
    Checked in the process that creates the work, not once per rollout on the workers."""
    try:
        load_agent(agent)
    except AgentError as exc:
        return str(exc)
    return None


def agent_resources_problem(agent: str, resources: Mapping[str, Any]) -> str | None:
    """Why `agent` cannot run on rollouts pinning `resources` (it requires a parameter that
    neither they nor the call's context give: every rollout would fail with `missing 1
    required positional argument: 'llm'`), or None. An agent that does not import is
    `agent_problem`'s to say; AGL's LitAgent is called as AGL's runner calls it."""
    try:
        loaded = load_agent(agent)
    except AgentError:
        return None
    if is_agl_agent(loaded):
        return None
    missing = missing_resources(loaded, resources)
    return unoffered(missing, resources) if missing else None


def rollouts_enqueue_for_celery(
    *, project: Project, specs: Sequence[RolloutSpec], agent: str, party: str = ""
) -> list[Rollout]:
    """Queue rollouts to be run by `agent` (a dotted path) on the Celery `rollouts` queue,
    in the fair share's party `party` of the project (README "Scheduling"). Their messages
    are sent after the transaction commits; a lost one is sent again by the reconciliation
    sweep (`rollouts_redispatch`)."""
    if not agent or len(agent) > 300 or not (":" in agent or "." in agent):
        raise InvalidInput("agent", "must be a dotted path like 'package.module:name'")
    if (problem := agent_problem(agent)) is not None:
        raise InvalidInput("agent", problem)
    specs = [_with_default_unresponsive(spec) for spec in specs]
    with transaction.atomic():
        rollouts = store_services.rollout_enqueue_many(project=project, specs=specs,
                                                       party=party)
        marked = store_services.rollout_dispatch_set(
            project=project, rollout_ids=[r.pk for r in rollouts], dispatch=CELERY, target=agent
        )
        transaction.on_commit(lambda: dispatches_send(marked), robust=True)
    return rollouts


def rollouts_redispatch(*, resend_after_seconds: float, limit: int = 500,
                        project_id: int | None = None) -> int:
    """Send again the messages of queued rollouts (of one project, with `project_id`) that may
    have lost theirs (see `store.services.rollout_dispatch_due`). Returns how many were sent."""
    with transaction.atomic():
        due = store_services.rollout_dispatch_due(
            resend_after_seconds=resend_after_seconds, limit=limit, project_id=project_id
        )
        transaction.on_commit(lambda: dispatches_send(due), robust=True)
    return len(due)


def dispatches_send(dispatches: Sequence[Dispatch]) -> None:
    """Publish one rollout task per dispatch (core.publish); those the broker did not
    take are marked unpublished, for the next reconcile."""
    ours = [d for d in dispatches if d.dispatch == CELERY]
    messages = [
        Message(RUN_ROLLOUT_TASK, {"project_id": d.project_id, "rollout_id": d.rollout_id},
                Queue.ROLLOUTS.value)
        for d in ours
    ]
    unsent = publish(messages)
    if unsent:
        store_services.rollout_dispatch_unpublished(
            rollout_ids=[m.kwargs["rollout_id"] for m in unsent]
        )


def rollout_task_options(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The rollout task's time limits (stopping.task_time_limits), from each rollout's
    timeout, for every sender of rollout tasks (core.publish.register_options)."""
    ids = [m.kwargs["rollout_id"] for m in messages]
    timeouts = dict(Rollout.objects.filter(pk__in=ids)
                    .values_list("pk", "config__timeout_seconds"))
    options = []
    for rollout_id in ids:
        timeout = timeouts.get(rollout_id)
        limits = stopping.task_time_limits(timeout if isinstance(timeout, int | float) else None)
        options.append({"soft_time_limit": limits[0], "time_limit": limits[1]} if limits else {})
    return options


def _with_default_unresponsive(spec: RolloutSpec) -> RolloutSpec:
    default = settings.RUNNERS_DEFAULT_UNRESPONSIVE_SECONDS
    config = dict(spec.config or {})
    if not default or config.get("unresponsive_seconds") is not None:
        return spec
    config["unresponsive_seconds"] = default
    return dataclasses.replace(spec, config=config)


# --- The worker registry (runners.models.CeleryWorker) -----------------------------------------


def celery_worker_register(
    *, name: str, hostname: str, pid: int, queues: Sequence[str], concurrency: int,
    hardware: dict[str, Any], now: datetime | None = None,
) -> CeleryWorker:
    """A worker starting up (or restarting under the same node name) takes its row over."""
    now = now or timezone.now()
    row = CeleryWorker(
        name=name, hostname=hostname, pid=pid, queues=sorted(queues), concurrency=concurrency,
        cpu_count=hardware.get("cpu_count", 1), cuda_devices=hardware.get("cuda_devices", []),
        versions=hardware.get("versions", {}), status=CeleryWorker.Status.ALIVE,
        started_at=now, last_heartbeat=now, stopped_at=None,
    )
    fields = ["hostname", "pid", "queues", "concurrency", "cpu_count", "cuda_devices",
              "versions", "status", "started_at", "last_heartbeat", "stopped_at"]
    CeleryWorker.objects.bulk_create([row], update_conflicts=True, unique_fields=["name"],
                                     update_fields=fields)
    return CeleryWorker.objects.get(name=name)


def celery_worker_heartbeat(*, name: str, pid: int, now: datetime | None = None) -> bool:
    """The worker is alive (a lost one comes back); False when its row is gone or another
    process took its name over."""
    updated = CeleryWorker.objects.filter(name=name, pid=pid).exclude(
        status=CeleryWorker.Status.STOPPED
    ).update(status=CeleryWorker.Status.ALIVE, last_heartbeat=now or timezone.now())
    return bool(updated)


def celery_worker_stop(*, name: str, pid: int) -> None:
    CeleryWorker.objects.filter(name=name, pid=pid).update(
        status=CeleryWorker.Status.STOPPED, stopped_at=timezone.now()
    )


def celery_workers_mark_lost(
    *, lost_after_seconds: float, now: datetime | None = None
) -> list[str]:
    """Alive workers whose last heartbeat is older than `lost_after_seconds` become lost."""
    cutoff = (now or timezone.now()) - timedelta(seconds=lost_after_seconds)
    with transaction.atomic():
        # Served by the partial index celeryworker_alive.
        names = list(
            CeleryWorker.objects.select_for_update(skip_locked=True)
            .filter(status=CeleryWorker.Status.ALIVE, last_heartbeat__lt=cutoff)
            .values_list("name", flat=True)
        )
        CeleryWorker.objects.filter(name__in=names, status=CeleryWorker.Status.ALIVE).update(
            status=CeleryWorker.Status.LOST
        )
    return names


# --- The periodic control work (beat runs it; the embedded default runs it in a thread) ------


def control_sweep() -> dict[str, int]:
    """The store's watchdog: timeouts, unresponsive attempts, queue waits."""
    result = watchdog.sweep()
    return {name: len(ids) for name, ids in result.as_dict().items()}


def control_resend_owed() -> dict[str, int]:
    """Send the messages the broker refused (rollouts marked unpublished, requeued rollouts,
    training steps never sent): reconciliation's sending part, run when a worker's broker
    connection comes back."""
    return {"rollouts_resent": rollouts_redispatch(
        resend_after_seconds=settings.RUNNERS_REDISPATCH_SECONDS), **control.run_reconcilers()}


def control_reconcile() -> dict[str, int]:
    """Re-send what lost its message (rollouts here; training steps through the reconcilers
    other apps register in core.control), and mark silent workers lost."""
    lost = celery_workers_mark_lost(lost_after_seconds=settings.WORKERS_LOST_AFTER_SECONDS)
    counts = {
        "rollouts_resent": rollouts_redispatch(
            resend_after_seconds=settings.RUNNERS_REDISPATCH_SECONDS
        ) + sum(celery_worker_resend_received(name=name) for name in lost),
        "workers_lost": len(lost),
        "held_slots_forgotten": held_slots_forget(),
    }
    counts.update(control.run_reconcilers())
    return counts
