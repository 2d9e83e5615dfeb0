"""A training step's statuses and the moves between them (like store/statemachine.py), and the
one compare-and-swap every step write goes through.

    rolling --group finished / deadline--> ready --claim--> training --finish--> done
    training --a try failed--> ready (train again) | rolling (its rollouts run again)
    training --its worker died--> training (taken over by another try)
    rolling | ready | training --> failed (tries used up) | cancelled (the job was)
    failed | cancelled --the job resumes--> ready | rolling

One lock order: the job's row, then the step's (`step_finish` holds the job while it plans
the next step; so does every move here), so two writers never wait on each other crosswise.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from store.errors import IllegalTransition
from trainer.models import StepStatus, TrainingJob, TrainingStep

S = StepStatus
STEP_TRANSITIONS: dict[str, frozenset[str]] = {
    S.ROLLING: frozenset({S.ROLLING, S.READY, S.FAILED, S.CANCELLED}),
    S.READY: frozenset({S.TRAINING, S.FAILED, S.CANCELLED}),
    S.TRAINING: frozenset({S.TRAINING, S.DONE, S.READY, S.ROLLING, S.FAILED, S.CANCELLED}),
    S.DONE: frozenset(),
    S.FAILED: frozenset({S.READY, S.ROLLING}),
    S.CANCELLED: frozenset({S.READY, S.ROLLING}),
}


def check_step_transition(current: str, requested: str, step_id: int | None = None) -> None:
    """Raises IllegalTransition unless a step may go from `current` to `requested`."""
    if requested not in STEP_TRANSITIONS.get(current, ()):
        raise IllegalTransition("step", step_id, current, requested)


def step_move(step_id: int, *, expect: list[str] | tuple[str, ...], to: str | None,
              where: Q | None = None, now: datetime | None = None, **fields: Any) -> bool:
    """Compare-and-swap: the step goes to `to` (None: keeps its status) with `fields` set and
    `updated_at` stamped, if it is in one of the `expect` statuses and matches `where`.
    Every `expect -> to` must be a legal move (else IllegalTransition, before any write).
    Locks the job's row, then the step's. True when the step moved."""
    if to is not None:
        for current in expect:
            check_step_transition(current, to, step_id)
        fields["status"] = to
    now = now or timezone.now()
    with transaction.atomic():
        job_id = TrainingStep.objects.filter(pk=step_id).values_list("job_id", flat=True).first()
        if job_id is None:  # its job was deleted
            return False
        TrainingJob.objects.select_for_update().filter(pk=job_id).values_list("pk").first()
        steps = TrainingStep.objects.filter(pk=step_id, status__in=list(expect))
        if where is not None:
            steps = steps.filter(where)
        return bool(steps.update(updated_at=now, **fields))
