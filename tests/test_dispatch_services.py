"""Store services behind Celery delivery: marking rollouts dispatched, finding lost messages."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from store import services
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db


def test_only_queued_rollouts_are_marked_dispatched(project):
    first, second = enqueue(project, 2)
    claim(project)  # takes `first`
    marked = services.rollout_dispatch_set(project=project, rollout_ids=[first.pk, second.pk],
                                           dispatch="celery", target="m:agent")
    assert [d.rollout_id for d in marked] == [second.pk]
    second.refresh_from_db()
    assert (second.dispatch, second.dispatch_target, second.dispatch_count) == (
        "celery", "m:agent", 1)
    assert second.dispatched_at >= second.enqueue_time


def test_a_message_is_due_again_only_after_the_resend_delay(project):
    (rollout,) = enqueue(project, 1)
    services.rollout_dispatch_set(project=project, rollout_ids=[rollout.pk], dispatch="celery",
                                  target="m:agent")
    assert services.rollout_dispatch_due(resend_after_seconds=60, limit=10) == []
    later = timezone.now() + timedelta(seconds=61)
    due = services.rollout_dispatch_due(resend_after_seconds=60, limit=10, now=later)
    assert [(d.rollout_id, d.target) for d in due] == [(rollout.pk, "m:agent")]
    # Marked sent: a second sweep at the same moment sends nothing.
    assert services.rollout_dispatch_due(resend_after_seconds=60, limit=10, now=later) == []
    rollout.refresh_from_db()
    assert rollout.dispatch_count == 2


def test_a_requeued_rollout_is_due_at_once(project):
    (rollout,) = enqueue(project, 1, config={"max_attempts": 2, "retry_condition": ["failed"]})
    services.rollout_dispatch_set(project=project, rollout_ids=[rollout.pk], dispatch="celery",
                                  target="m:agent")
    _, attempt = claim(project)
    services.attempt_update(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, status="failed")
    rollout.refresh_from_db()
    assert rollout.status == "requeuing"
    due = services.rollout_dispatch_due(resend_after_seconds=3600, limit=10)
    assert [d.rollout_id for d in due] == [rollout.pk]


def test_rollouts_dequeued_by_runners_are_never_dispatched(project):
    enqueue(project, 3)
    later = timezone.now() + timedelta(days=1)
    assert services.rollout_dispatch_due(resend_after_seconds=1, limit=10, now=later) == []


def test_owed_messages_of_one_project_are_found_apart(project, other_project):
    """The end of a capped project's rollout sends its own next owed message, not another
    project's (runners.services.rollout_run)."""
    ids = {}
    for p in (other_project, project):
        (rollout,) = enqueue(p, 1)
        services.rollout_dispatch_set(project=p, rollout_ids=[rollout.pk], dispatch="celery",
                                      target="m:agent")
        services.rollout_dispatch_unpublished(rollout_ids=[rollout.pk])
        ids[p.pk] = rollout.pk
    due = services.rollout_dispatch_due(resend_after_seconds=300, limit=1, project_id=project.pk)
    assert [d.rollout_id for d in due] == [ids[project.pk]]
