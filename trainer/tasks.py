"""Celery tasks of the trainer: thin (ids in, one service call), each on its queue."""

from __future__ import annotations

import os

from celery import shared_task
from django.db import InterfaceError, OperationalError

from core.queues import Queue
from trainer import delivery, gang


# A database briefly unreachable before the claim retries the message with backoff, instead
# of waiting for the trainer sweep's re-send; running it again is safe (the claim is a
# compare-and-swap; after it, step_train retries in place).
@shared_task(
    name=delivery.TRAIN_STEP_TASK,
    lightning_queue=Queue.TRAINING.value,
    bind=True,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=True,
    retry_backoff_max=30,
    max_retries=8,
)
def train_step(self, *, step_id: int) -> str:
    """Idempotent: a redelivered or re-sent step that is done, or held by a live worker, does
    nothing (see services.step_train); a multi-node step's message makes this worker a member
    of its gang (trainer/gang.py)."""
    worker = f"celery:{self.request.hostname or 'local'}:{os.getpid()}"
    return gang.step_train(step_id=step_id, worker=worker)
