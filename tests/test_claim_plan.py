"""The claim statement reads the rollouts it locks by primary key, however long the queue:
joined to its few ranked candidates alone, the planner scanned every queued rollout and hashed
them (store/services/_claim.py `_FAIR_SQL`), a cost per claim that grew with the queue. And
Postgres keeps one plan for it (its generic plan) instead of planning it again on every run,
which cost more than running it (its limits are numbers in its text, not parameters)."""

from __future__ import annotations

import json

import pytest
from django.db import connection, transaction
from django.utils import timezone

from store import rules
from store.models import Project
from store.services import _claim
from tests.conftest import enqueue

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _rows_read(node: dict, alias: str) -> int:
    """Rows the plan's nodes on store_rollout `alias` produced (before their filters too)."""
    own = 0
    if node.get("Relation Name") == "store_rollout" and node.get("Alias") == alias:
        own = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
    return own + sum(_rows_read(child, alias) for child in node.get("Plans", []))


@pytest.mark.parametrize("uncapped_only", [False, True])
def test_a_claim_reads_its_candidates_by_key_not_the_queue(project, uncapped_only):
    enqueue(project, 1200)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE store_rollout")
    sql, defaults = _claim._claim_statement(False, True, False, False, uncapped_only, 1)
    params = {**defaults, "project": project.pk, "now": timezone.now(), "worker": "w1",
              "first_report": rules.first_report_seconds(), "ids": [rules.new_attempt_id()],
              "rid": None, "idle_if_none": True, "key": None, "key_role": None,
              "hl": rules.usage_half_life(), "dispatch": None, "fit": None}
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
        transaction.set_rollback(True)
    plan = json.loads(plan) if isinstance(plan, str) else plan
    read = _rows_read(plan[0]["Plan"], "r")
    # `picked` (alias r) reads the ranked candidates (limit + slack) and the UPDATE its one
    # row (alias r too); a scan of the queue reads all 1,200.
    assert 0 < read <= 2 * (1 + _claim.CANDIDATE_SLACK) + 1, read


def test_a_runners_claims_keep_one_plan(project):
    """With `LIMIT $n` Postgres' generic plan guessed a tenth of the queue per party, so it
    made a custom plan on every run (none generic in 1,000 runs with 6,000 queued)."""
    enqueue(project, 6000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE store_rollout")
    lean = Project.from_db("default", ["id"], [project.pk])  # as a lean dequeue knows it
    for i in range(15):
        assert _claim.claim_queued(lean, f"w{i}", 1, timezone.now())
    with connection.cursor() as cursor:
        cursor.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                       "WHERE statement LIKE 'WITH pa%'")
        plans = cursor.fetchall()
    # Prepared from its fifth run (core/env.py); its first five plans are custom ones.
    assert plans and sum(generic for generic, _ in plans) >= 1, plans
