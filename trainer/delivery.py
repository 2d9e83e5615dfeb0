"""Sending Celery messages for the trainer. A message is only a wake-up call: every receiver
re-reads its rows and claims with a compare-and-swap, so sending twice is harmless. Callers
send after the transaction that justifies the message commits."""

from __future__ import annotations

from lightning_site.celery import app
from lightning_site.queues import Queue

TRAIN_STEP_TASK = "trainer.train_step"
# The runners app's rollout task and dispatch name (runners.services.RUN_ROLLOUT_TASK, CELERY).
# Named here as strings because trainer and runners never import each other; the task's
# contract (keyword ids, claim by compare-and-swap) is what both sides rely on.
ROLLOUT_TASK = "runners.run_rollout"
CELERY_DISPATCH = "celery"


def send_train_step(step_id: int) -> None:
    app.send_task(TRAIN_STEP_TASK, kwargs={"step_id": step_id}, queue=Queue.TRAINING.value)


def send_rollouts(project_id: int, rollout_ids: list[str]) -> None:
    """One rollout task per rollout, over one broker connection."""
    if not rollout_ids:
        return
    with app.producer_or_acquire() as producer:
        for rollout_id in rollout_ids:
            app.send_task(ROLLOUT_TASK, kwargs={"project_id": project_id, "rollout_id": rollout_id},
                          queue=Queue.ROLLOUTS.value, producer=producer)
