"""Rollout groups: the store keeps a batch's total and finished counts in the transactions that
enqueue and finish its rollouts, on every writer's path, and writes one completion event per
completion, taken once by compare-and-swap (deleted: consumed events leave no rows)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from store import hooks, services, watchdog
from store.models import GroupCompletion, RolloutGroup
from store.services import RolloutSpec
from tests.conftest import backdate


def _group(project, key="g", n=3, **spec):
    group, created = services.group_create(project=project, key=key, owner="test")
    assert created
    rollouts = services.rollout_enqueue_many(
        project=project, specs=[RolloutSpec(input=i, **spec) for i in range(n)], group=group)
    return group, rollouts


def _counts(group):
    group.refresh_from_db()
    return group.total, group.finished, GroupCompletion.objects.filter(group=group).count()


def test_every_terminal_path_counts_and_completion_is_written_once(project):
    group, (a, b, c) = _group(project, config={"timeout_seconds": 1, "max_attempts": 1})
    services.rollout_enqueue(project=project, spec=RolloutSpec(input="outside"))
    assert _counts(group) == (3, 0, 0)
    # a runner's report (attempt_update_many: hand-written SQL on Postgres)
    rollout, attempt = services.rollout_claim(project=project, rollout_id=a.pk)
    services.attempt_finish(project=project, rollout_id=a.pk, attempt_id=attempt.attempt_id,
                            status="succeeded")
    assert _counts(group) == (3, 1, 0)
    # the watchdog's verdict
    rollout, attempt = services.rollout_claim(project=project, rollout_id=b.pk)
    backdate(attempt, 2)
    assert watchdog.sweep().timed_out == [f"{b.pk}/{attempt.attempt_id}"]
    assert _counts(group) == (3, 2, 0)
    # the algorithm's explicit command
    services.rollout_update(project=project, rollout_id=c.pk, status="cancelled")
    assert _counts(group) == (3, 3, 1)
    assert group.completed_at is not None
    # a verdict changed by hand on a terminal rollout is not counted twice
    services.rollout_update(project=project, rollout_id=c.pk, status="failed")
    assert _counts(group) == (3, 3, 1)


def test_a_reopened_member_makes_the_group_wait_and_complete_again(project):
    group, rollouts = _group(project, n=2)
    for rollout in rollouts:
        services.rollout_update(project=project, rollout_id=rollout.pk, status="succeeded")
    assert _counts(group) == (2, 2, 1)
    services.rollout_update(project=project, rollout_id=rollouts[0].pk, status="queuing")
    assert _counts(group) == (2, 1, 1) and group.completed_at is None
    services.attempt_start(project=project, rollout_id=rollouts[1].pk)  # reopens it too
    assert _counts(group) == (2, 0, 1)
    for rollout in rollouts:
        services.rollout_update(project=project, rollout_id=rollout.pk, status="failed")
    assert _counts(group) == (2, 2, 2)


def test_queue_expiry_counts(project):
    group, _ = _group(project, n=2, queue_timeout_seconds=0.001)
    time.sleep(0.01)
    assert len(watchdog.sweep().queue_expired) == 2
    assert _counts(group) == (2, 2, 1)


def test_a_completion_is_taken_once_and_only_by_its_owner(project):
    group, rollouts = _group(project, n=1)
    services.rollout_update(project=project, rollout_id=rollouts[0].pk, status="succeeded")
    assert services.group_completions_take(owner="someone-else") == []
    taken = services.group_completions_take(owner="test")
    assert [e.group_id for e in taken] == [group.pk]
    assert services.group_completions_take(owner="test") == []


def test_taken_completions_leave_no_rows_and_a_failed_reaction_leaves_them_taken_by_none(
        project):
    """Consumed events are deleted (nothing reads them afterwards): the table holds only the
    pending ones. A reaction that fails rolls its take back: the event waits for the next."""
    group, rollouts = _group(project, n=1)
    services.rollout_update(project=project, rollout_id=rollouts[0].pk, status="succeeded")
    with pytest.raises(RuntimeError), transaction.atomic():
        assert len(services.group_completions_take(owner="test")) == 1
        raise RuntimeError("the reaction failed")
    assert GroupCompletion.objects.filter(group=group).count() == 1
    with transaction.atomic():
        assert [e.group_id for e in services.group_completions_take(owner="test")] == [group.pk]
    assert not GroupCompletion.objects.exists()
    assert RolloutGroup.objects.get(pk=group.pk).completed_at is not None  # the group keeps it


def test_the_owner_is_nudged_after_commit(project, django_capture_on_commit_callbacks):
    nudges = []
    hooks.on_groups_completed("test", lambda: nudges.append(1))
    try:
        group, rollouts = _group(project, n=2)
        with django_capture_on_commit_callbacks(execute=True):
            services.rollout_update(project=project, rollout_id=rollouts[0].pk,
                                    status="succeeded")
        assert nudges == []
        with django_capture_on_commit_callbacks(execute=True):
            services.rollout_update(project=project, rollout_id=rollouts[1].pk,
                                    status="succeeded")
        assert nudges == [1]
    finally:
        hooks._completed_callbacks.pop("test", None)


def test_a_replayed_enqueue_adds_no_members(project):
    group, _ = services.group_create(project=project, key="g", owner="test")
    specs = [RolloutSpec(input=i, idempotency_key=f"k{i}") for i in range(2)]
    services.rollout_enqueue_many(project=project, specs=specs, group=group)
    services.rollout_enqueue_many(project=project, specs=specs, group=group)
    assert _counts(group) == (2, 0, 0)
    assert services.group_create(project=project, key="g", owner="test") == (group, False)


def test_a_group_of_another_project_is_refused(project, other_project):
    group, _ = services.group_create(project=other_project, key="g", owner="test")
    from store.errors import InvalidInput

    with pytest.raises(InvalidInput):
        services.rollout_enqueue_many(project=project, specs=[RolloutSpec()], group=group)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_finishes_count_every_member_and_complete_once(project):
    """Runners finishing members of one group at once, in batches that overlap two groups:
    no count is lost, no deadlock, one completion per group."""
    first, a = _group(project, key="a", n=24)
    second, b = _group(project, key="b", n=24)
    claimed = [services.rollout_claim(project=project, rollout_id=r.pk) for r in a + b]
    batches = [claimed[i::6] for i in range(6)]  # each batch holds members of both groups
    errors = []

    def finish(batch):
        try:
            updates = [services.AttemptUpdate(r.pk, at.attempt_id, "succeeded")
                       for r, at in batch]
            services.attempt_update_many(project=project, updates=updates)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=finish, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert _counts(first) == (24, 24, 1) and _counts(second) == (24, 24, 1)
    assert RolloutGroup.objects.count() == 2
