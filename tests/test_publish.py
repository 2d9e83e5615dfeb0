"""The one publisher: what a broker that is down did not take is owed by its rows, and the
next reconcile sends it at once (issue 13, finding 6)."""

from __future__ import annotations

import pytest

from runners import services
from store import services as store_services
from store.models import Rollout
from store.services import RolloutSpec
from tests.celery_fixtures import use_broker
from trainer import delivery
from trainer.models import TrainingStep

pytestmark = pytest.mark.django_db(transaction=True)
DOWN = "redis://127.0.0.1:18602/0"  # nothing listens there


def test_rollouts_the_broker_did_not_take_are_sent_at_the_next_reconcile(project):
    with use_broker(DOWN):
        rollouts = services.rollouts_enqueue_for_celery(
            project=project, specs=[RolloutSpec(input=i) for i in range(3)],
            agent="tests.celery_agents:ok_agent",
        )
    ids = sorted(r.pk for r in rollouts)
    assert set(Rollout.objects.values_list("dispatched_at", flat=True)) == {None}
    # Well before the re-send age (300 s by default).
    due = store_services.rollout_dispatch_due(resend_after_seconds=300, limit=10)
    assert sorted(d.rollout_id for d in due) == ids
    assert store_services.rollout_dispatch_due(resend_after_seconds=300, limit=10) == []


def test_a_train_step_the_broker_did_not_take_is_owed_by_its_row(project):
    from tests.test_trainer_services import make_job
    from trainer import services as trainer_services

    job = make_job()
    with use_broker(DOWN):
        job = trainer_services.job_start(job_id=job.pk)
        step = job.steps.get()
        assert Rollout.objects.filter(dispatched_at__isnull=True).count() == (
            step.rollout_count + step.val_rollout_count)
        TrainingStep.objects.filter(pk=step.pk).update(status="ready")
        delivery.send_train_step(step.pk)
    step.refresh_from_db()
    assert step.sent_at is None
