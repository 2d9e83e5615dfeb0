"""Sending Celery messages for the trainer. A message is only a wake-up call: every receiver
re-reads its rows and claims with a compare-and-swap, so sending twice is harmless. Callers
send after the transaction that justifies the message commits, through the one publisher
(core.publish); what the broker did not take is marked on its rows as unsent, so the
next reconcile sends it again at once."""

from __future__ import annotations

from core.publish import Message, publish
from core.queues import Queue
from store import services as store_services
from trainer.models import STEP_OPEN, TrainingStep
from trainer.statemachine import step_move

TRAIN_STEP_TASK = "trainer.train_step"
# The runners app's rollout task and dispatch name (runners.services.RUN_ROLLOUT_TASK, CELERY).
# Named here as strings because trainer and runners never import each other; the task's
# contract (keyword ids, claim by compare-and-swap) is what both sides rely on.
ROLLOUT_TASK = "runners.run_rollout"
CELERY_DISPATCH = "celery"


def send_train_step(step_id: int) -> None:
    """One message per node: a multi-node step's gang needs that many training workers, each
    taking one (trainer/gang.py); the extra ones find the step started and do nothing."""
    config = TrainingStep.objects.filter(pk=step_id).values_list("job__config", flat=True).first()
    nodes = int((config or {}).get("nodes", 1))
    message = Message(TRAIN_STEP_TASK, {"step_id": step_id}, Queue.TRAINING.value)
    if publish([message] * max(1, nodes)):
        # Never sent: the trainer sweep sends a step with no `sent_at` at once.
        step_move(step_id, expect=STEP_OPEN, to=None, sent_at=None)


def send_rollouts(project_id: int, rollout_ids: list[str]) -> None:
    """One rollout task per rollout, over one broker connection."""
    unsent = publish([
        Message(ROLLOUT_TASK, {"project_id": project_id, "rollout_id": rollout_id},
                Queue.ROLLOUTS.value)
        for rollout_id in rollout_ids
    ])
    if unsent:
        store_services.rollout_dispatch_unpublished(
            rollout_ids=[m.kwargs["rollout_id"] for m in unsent]
        )
