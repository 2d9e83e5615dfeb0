"""Celery tasks of the trainer: thin (ids in, one service call), each on its queue."""

from __future__ import annotations

import os

from celery import shared_task

from lightning_site.queues import Queue
from trainer import delivery, services


@shared_task(name=delivery.TRAIN_STEP_TASK, lightning_queue=Queue.TRAINING.value, bind=True)
def train_step(self, *, step_id: int) -> str:
    """Idempotent: a redelivered or re-sent step that is done, or held by a live worker, does
    nothing (see services.step_train)."""
    worker = f"celery:{self.request.hostname or 'local'}:{os.getpid()}"
    return services.step_train(step_id=step_id, worker=worker)
