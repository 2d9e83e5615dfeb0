"""The claim statement reads the rollouts it locks by primary key, however long the queue:
joined to its few ranked candidates alone, the planner scanned every queued rollout and hashed
them (store/services/_claim.py `_FAIR_SQL`), a cost per claim that grew with the queue."""

from __future__ import annotations

import json

import pytest
from django.db import connection, transaction
from django.utils import timezone

from store import rules
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
    sql, defaults = _claim._claim_statement(False, True, False, False, uncapped_only)
    params = {**defaults, "project": project.pk, "now": timezone.now(), "worker": "w1",
              "first_report": rules.first_report_seconds(), "ids": [rules.new_attempt_id()],
              "limit": 1, "rid": None, "idle_if_none": True, "key": None, "key_role": None,
              "hl": rules.usage_half_life(), "slack": _claim.CANDIDATE_SLACK,
              "dispatch": None, "fit": None}
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
        transaction.set_rollback(True)
    plan = json.loads(plan) if isinstance(plan, str) else plan
    read = _rows_read(plan[0]["Plan"], "r")
    # `picked` (alias r) reads the ranked candidates (limit + slack) and the UPDATE its one
    # row (alias r too); a scan of the queue reads all 1,200.
    assert 0 < read <= 2 * (1 + _claim.CANDIDATE_SLACK) + 1, read
