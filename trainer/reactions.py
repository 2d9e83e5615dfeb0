"""The trainer's reaction to its rollout groups' completions (store.models.GroupCompletion):
a step whose group finished may become ready."""

from __future__ import annotations

from django.db import transaction

from store import services as store_services
from trainer import services
from trainer.models import GROUP_OWNER, StepStatus, TrainingStep


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
