"""A runner's dequeue on the lean path knows its project by its pk alone (store/api/auth.py
`cached_key_lean`): the claim is then one statement that claims only while the project has
no cap, instead of a read of the cap and the claim; a capped project's claim still reads the
cap and keeps to it (store/services/_claim.py `claim_queued`)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from store.models import Project, Rollout
from store.services._claim import claim_queued
from tests.conftest import enqueue

pytestmark = pytest.mark.django_db(transaction=True)


def _by_pk(project: Project) -> Project:
    return Project.from_db("default", ["id"], [project.pk])


def test_an_uncapped_projects_lean_claim_is_one_statement(project):
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim is Postgres'")
    enqueue(project, 3)
    with CaptureQueriesContext(connection) as queries:
        claimed = claim_queued(_by_pk(project), "w1", 2, timezone.now())
    assert len(claimed) == 2
    assert len(queries) == 1, [q["sql"][:80] for q in queries]
    assert Rollout.objects.filter(status="preparing").count() == 2


def test_a_capped_projects_lean_claim_keeps_to_the_cap(project):
    Project.objects.filter(pk=project.pk).update(max_concurrent_rollouts=1)
    enqueue(project, 3)
    assert len(claim_queued(_by_pk(project), "w1", 3, timezone.now())) == 1
    assert claim_queued(_by_pk(project), "w1", 3, timezone.now()) == []
    assert Rollout.objects.filter(status="preparing").count() == 1


def test_an_empty_queue_still_records_the_worker_idle(project):
    assert claim_queued(_by_pk(project), "w-idle", 1, timezone.now()) == []
    assert project.workers.get(worker_id="w-idle").status == "idle"
