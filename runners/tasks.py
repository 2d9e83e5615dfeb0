"""Celery tasks of the runners app: thin (ids in, one service call), each on its queue."""

from __future__ import annotations

from celery import shared_task
from django.db import InterfaceError, OperationalError

from core.queues import Queue
from runners import services


# A database that is briefly unreachable retries the message with backoff, instead of waiting
# for reconciliation; running it again is safe (the claim is a compare-and-swap).
@shared_task(name=services.RUN_ROLLOUT_TASK, lightning_queue=Queue.ROLLOUTS.value, bind=True,
             autoretry_for=(OperationalError, InterfaceError), retry_backoff=True,
             retry_backoff_max=60, max_retries=8)
def run_rollout(self, *, project_id: int, rollout_id: str) -> str:
    return services.rollout_run(
        project_id=project_id, rollout_id=rollout_id,
        worker_id=services.worker_id_here(self.request.hostname),
    )


@shared_task(name="runners.sweep", lightning_queue=Queue.CONTROL.value)
def sweep() -> dict[str, int]:
    return services.control_sweep()


@shared_task(name="runners.reconcile", lightning_queue=Queue.CONTROL.value)
def reconcile() -> dict[str, int]:
    return services.control_reconcile()
