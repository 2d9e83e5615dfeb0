"""A training step's moves: one compare-and-swap helper refuses illegal moves and stamps
`updated_at` on every move (the sweep orders open steps by it)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from store.errors import IllegalTransition
from tests.test_trainer_services import ExplodingGRPO, checkpoint_dir, make_job  # noqa: F401
from tests.trainer_helpers import capture_sends, run_rollouts
from trainer import services
from trainer.models import StepStatus, TrainingStep
from trainer.statemachine import STEP_TRANSITIONS, check_step_transition, step_move

pytestmark = pytest.mark.django_db(transaction=True)


def stamped(step: TrainingStep, action) -> TrainingStep:
    """Run `action` with the step's `updated_at` an hour in the past; the step afterwards,
    asserted to carry a fresh `updated_at`."""
    old = timezone.now() - timedelta(hours=1)
    TrainingStep.objects.filter(pk=step.pk).update(updated_at=old)
    action()
    step.refresh_from_db()
    assert step.updated_at > old + timedelta(minutes=30), "updated_at was not stamped"
    return step


def test_updated_at_moves_on_every_move_of_a_step(monkeypatch):
    sent = capture_sends(monkeypatch)
    algorithm = f"{ExplodingGRPO.__module__}.ExplodingGRPO"
    job = services.job_start(job_id=make_job(steps=1, algorithm=algorithm,
                                             max_step_attempts=2).pk)
    step = job.steps.get()
    assert stamped(step, lambda: run_rollouts(job)).status == StepStatus.READY
    assert stamped(step, lambda: services.step_claim(step_id=step.pk, worker="w:1")
                   ).status == StepStatus.TRAINING
    assert stamped(step, lambda: services.step_record_failure(
        step_id=step.pk, attempt=1, error="x")).status == StepStatus.READY
    assert stamped(step, lambda: services._resend_due(step, timezone.now(), force=True)
                   ).status == StepStatus.READY  # a re-send moves no status, but stamps
    assert stamped(step, lambda: services.step_train(step_id=step.pk, worker="w:1")
                   ).status == StepStatus.FAILED  # the last try
    assert stamped(step, lambda: services.job_resume(job_id=job.pk)
                   ).status == StepStatus.READY  # its rollouts all finished: trains again
    assert stamped(step, lambda: services.job_cancel(job_id=job.pk)
                   ).status == StepStatus.CANCELLED
    assert sent.train_steps


def test_illegal_moves_are_refused_before_any_write(monkeypatch):
    capture_sends(monkeypatch)
    job = services.job_start(job_id=make_job().pk)
    step = job.steps.get()
    with pytest.raises(IllegalTransition):
        step_move(step.pk, expect=[StepStatus.ROLLING], to=StepStatus.DONE)
    with pytest.raises(IllegalTransition):
        step_move(step.pk, expect=[StepStatus.ROLLING, StepStatus.DONE], to=StepStatus.READY)
    step.refresh_from_db()
    assert step.status == StepStatus.ROLLING
    assert step_move(step.pk, expect=[StepStatus.READY], to=StepStatus.TRAINING) is False
    for status in StepStatus.values:
        with pytest.raises(IllegalTransition):
            check_step_transition(StepStatus.DONE, status)
    assert set(STEP_TRANSITIONS) == set(StepStatus.values)
    TrainingStep.objects.filter(pk=step.pk).update(status=StepStatus.DONE)
    with pytest.raises(IllegalTransition):  # a finished step is never planned again
        services._step_plan(job, services.algorithm_load(job.algorithm, job.config), n=0,
                            resources_version=1)
