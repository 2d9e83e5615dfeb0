"""The trainer's reactions to its rollout groups' completions (store.models.GroupCompletion):
a step whose group finished may become ready; and, in an asynchronous job consuming groups,
to its train rollouts finishing: the next step may have enough complete groups."""

from __future__ import annotations

import logging

from django.db import transaction

from store import services as store_services
from store.models import Rollout
from store.statemachine import ROLLOUT_TERMINAL
from trainer import services
from trainer.models import GROUP_OWNER, StepStatus, TrainingStep

log = logging.getLogger(__name__)


def groups_completed() -> int:
    """Take the trainer's pending group completions (compare-and-swap: each is taken once,
    by whichever process comes first) and check the rolling steps whose group they name, in
    one transaction: a reaction that fails leaves its events for the next taker. Run after
    the commit that completed a group (the store's nudge, in that process) and by the
    periodic control sweep (a nudge lost with its process). Returns the events taken."""
    with transaction.atomic():
        events = store_services.group_completions_take(owner=GROUP_OWNER)
        if not events:
            return 0
        steps = TrainingStep.objects.filter(
            group_id__in=[e.group_id for e in events], status=StepStatus.ROLLING
        ).order_by("pk").values_list("pk", flat=True)
        for step_id in list(steps):
            services.step_check_ready(step_id=step_id)
    return len(events)


def rollouts_finished(rollouts: list[Rollout]) -> None:
    """Rollouts of an asynchronous job that consumes groups finished (the store's
    rollouts-finished hook, after their commit): when one completed its group (GRPO's
    rollouts of one task) or its step's validation, the job's next step may have what it
    trains on now, without waiting for its own group (trainer/pool.py). No query for other
    jobs' rollouts (metadata `trainer.pool`); never raises (the control sweep checks rolling
    steps anyway)."""
    jobs = set()
    for rollout in rollouts:
        metadata = rollout.metadata if isinstance(rollout.metadata, dict) else {}
        if (metadata.get("trainer.pool") and rollout.group_id is not None
                and _completes(rollout)):
            jobs.add(metadata["trainer.job"])
    for job_id in sorted(jobs):
        try:
            step = (TrainingStep.objects.filter(job_id=job_id, status=StepStatus.ROLLING)
                    .select_related("job").order_by("n").first())
            if step is not None:
                services.step_check_ready(step_id=step.pk)
        except Exception:  # a hook must not raise; the sweep comes back to it
            log.exception("checking job %s's next step after rollouts finished", job_id)


def _completes(rollout: Rollout) -> bool:
    """The rollout's group (its task's rollouts in its round; validation: all of its round's)
    has no open member left."""
    members = Rollout.objects.filter(group_id=rollout.group_id, mode=rollout.mode)
    if (rollout.mode or "train") == "train":
        task = rollout.input.get("group") if isinstance(rollout.input, dict) else None
        if task is None:
            return True
        members = members.filter(input__group=task)
    return not members.exclude(status__in=ROLLOUT_TERMINAL).exists()
