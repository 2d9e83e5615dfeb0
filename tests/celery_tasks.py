"""Test-only Celery tasks; workers load them with `-I tests.celery_tasks`."""

from __future__ import annotations

from celery import shared_task

from core.queues import Queue


@shared_task(name="tests.record_node", lightning_queue=Queue.TRAINING.value, bind=True)
def record_node(self, *, path: str) -> None:
    """Append the node name of the worker that ran it."""
    with open(path, "a") as out:
        out.write(f"{self.request.hostname}\n")
