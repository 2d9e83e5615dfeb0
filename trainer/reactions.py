"""The trainer's reaction to the store's hook: finished rollouts may complete their step."""

from __future__ import annotations

from store.models import Rollout
from trainer import services
from trainer.models import StepStatus, TrainingStep, parse_rollout_key


def rollouts_finished(rollouts: list[Rollout]) -> None:
    """Called by the store after commit with rollouts that became terminal. Their keys map
    them to steps (no query for rollouts of no job); each rolling step is checked
    (compare-and-swap, so concurrent callers send its train task once)."""
    steps = {parsed for rollout in rollouts
             if (parsed := parse_rollout_key(rollout.idempotency_key))}
    for job_id, n in sorted(steps):
        step_id = TrainingStep.objects.filter(
            job_id=job_id, n=n, status=StepStatus.ROLLING
        ).values_list("pk", flat=True).first()
        if step_id is not None:
            services.step_check_ready(step_id=step_id)
