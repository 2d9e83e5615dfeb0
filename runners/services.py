"""Runner-side services: run one rollout delivered by a message; enqueue rollouts for Celery
execution (sent after commit); re-send messages the reconciliation sweep finds lost."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

from django.conf import settings
from django.db import transaction

from lightning_site.celery import app as celery_app
from lightning_site.queues import Queue
from runners.executor import ExecutorOptions, Outcome, execute
from runners.local_gateway import LocalGateway
from store import services as store_services
from store.errors import InvalidInput
from store.models import Project, Rollout
from store.services import Dispatch, RolloutSpec

log = logging.getLogger(__name__)

CELERY = "celery"
RUN_ROLLOUT_TASK = "runners.run_rollout"
NOT_QUEUED = "not-queued"


def executor_options() -> ExecutorOptions:
    return ExecutorOptions(
        heartbeat_seconds=settings.RUNNERS_HEARTBEAT_SECONDS,
        span_batch_size=settings.RUNNERS_SPAN_BATCH_SIZE,
    )


def worker_id_here(hostname: str | None) -> str:
    """The attempt's worker id for a Celery task: the worker's node name and this process."""
    return f"celery:{hostname or 'local'}:{os.getpid()}"


def rollout_run(*, project_id: int, rollout_id: str, worker_id: str) -> str:
    """Claim a named rollout and run it; a rollout no longer queued (a duplicate message, or
    a runner got there first) is left alone. Returns the outcome's status."""
    gateway = LocalGateway(project_id)
    claim = gateway.claim_rollout(rollout_id=rollout_id, worker_id=worker_id)
    if claim is None:
        return NOT_QUEUED
    if not claim.agent:
        gateway.finish(rollout_id=claim.rollout_id, attempt_id=claim.attempt_id, status="failed",
                       error="the rollout names no agent to run")
        return "failed"
    outcome: Outcome = execute(gateway=gateway, claim=claim, agent=claim.agent,
                               worker_id=worker_id, options=executor_options())
    return outcome.status


def rollouts_enqueue_for_celery(
    *, project: Project, specs: Sequence[RolloutSpec], agent: str
) -> list[Rollout]:
    """Queue rollouts to be run by `agent` (a dotted path) on the Celery `rollouts` queue.
    Their messages are sent after the transaction commits; a lost one is sent again by the
    reconciliation sweep (`rollouts_redispatch`)."""
    if not agent or len(agent) > 300 or not (":" in agent or "." in agent):
        raise InvalidInput("agent", "must be a dotted path like 'package.module:name'")
    specs = [_with_default_unresponsive(spec) for spec in specs]
    with transaction.atomic():
        rollouts = store_services.rollout_enqueue_many(project=project, specs=specs)
        marked = store_services.rollout_dispatch_set(
            project=project, rollout_ids=[r.pk for r in rollouts], dispatch=CELERY, target=agent
        )
        transaction.on_commit(lambda: dispatches_send(marked), robust=True)
    return rollouts


def rollouts_redispatch(*, resend_after_seconds: float, limit: int = 500) -> int:
    """Send again the messages of queued rollouts that may have lost theirs (see
    `store.services.rollout_dispatch_due`). Returns how many were sent."""
    with transaction.atomic():
        due = store_services.rollout_dispatch_due(
            resend_after_seconds=resend_after_seconds, limit=limit
        )
        transaction.on_commit(lambda: dispatches_send(due), robust=True)
    return len(due)


def dispatches_send(dispatches: Sequence[Dispatch]) -> None:
    """Publish one rollout task per dispatch, over one broker connection."""
    ours = [d for d in dispatches if d.dispatch == CELERY]
    if not ours:
        return
    with celery_app.producer_or_acquire() as producer:
        for d in ours:
            celery_app.send_task(
                RUN_ROLLOUT_TASK,
                kwargs={"project_id": d.project_id, "rollout_id": d.rollout_id},
                queue=Queue.ROLLOUTS.value,
                producer=producer,
            )


def _with_default_unresponsive(spec: RolloutSpec) -> RolloutSpec:
    default = settings.RUNNERS_DEFAULT_UNRESPONSIVE_SECONDS
    config = dict(spec.config or {})
    if not default or config.get("unresponsive_seconds") is not None:
        return spec
    config["unresponsive_seconds"] = default
    return dataclasses.replace(spec, config=config)
