"""A bare final verdict in one statement (store/services/_verdict.py) leaves the same rows as
the full path (`attempt_update_many`), and declines every case it does not cover, which the
full path then answers. On SQLite both calls take the full path."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from store import hooks, rules, services, watchdog
from store.models import Attempt, GroupCompletion, Rollout, RolloutGroup, Worker
from store.services import AttemptUpdate, RolloutSpec
from store.statemachine import QUEUED, ROLLOUT_TERMINAL, RolloutConfig, WorkerStatus
from tests.conftest import backdate

pytestmark = pytest.mark.django_db(transaction=True)

FROZEN = timezone.now().replace(microsecond=123456)


@pytest.fixture(autouse=True)
def frozen(monkeypatch):
    monkeypatch.setattr(timezone, "now", lambda: FROZEN)


def _common(project, rollout_id, attempt_id, status="succeeded", error=None):
    if error is not None:
        return services.attempt_finish(project=project, rollout_id=rollout_id,
                                       attempt_id=attempt_id, status=status, error=error)
    return services.attempt_update(project=project, rollout_id=rollout_id,
                                   attempt_id=attempt_id, status=status)


def _full(project, rollout_id, attempt_id, status="succeeded", error=None):
    return services.attempt_update_many(project=project, updates=[
        AttemptUpdate(rollout_id, attempt_id, status, error=error)])[0]


def _rows(rollout_id: str, attempt_id: str) -> dict:
    """What a verdict writes, without the ids that differ between two twins."""
    attempt = Attempt.objects.get(rollout_id=rollout_id, attempt_id=attempt_id)
    rollout = Rollout.objects.get(pk=rollout_id)
    rows = {
        "attempt": {f: getattr(attempt, f) for f in (
            "status", "sequence_id", "start_time", "end_time", "last_heartbeat_time",
            "metadata", "deadline")},
        "rollout": {f: getattr(rollout, f) for f in (
            "status", "end_time", "enqueue_time", "queue_deadline", "next_span_sequence_id")},
        "worker": None, "group": None,
    }
    if attempt.worker_id:
        worker = Worker.objects.get(project_id=rollout.project_id, worker_id=attempt.worker_id)
        rows["worker"] = {f: getattr(worker, f) for f in (
            "status", "last_idle_time", "last_busy_time", "last_dequeue_time",
            "current_rollout_id", "current_attempt_id", "heartbeat_stats")}
    if rollout.group_id:
        group = RolloutGroup.objects.get(pk=rollout.group_id)
        rows["group"] = (group.total, group.finished, group.completed_at,
                         GroupCompletion.objects.filter(group=group).count())
    return rows


def _twins(project, *, grouped: int = 0, worker: bool = True, running: bool = False,
           config: dict | None = None):
    """Two rollouts in the same state (each in its own group of `grouped` members, when
    given), each claimed: [(rollout id, attempt id)] * 2."""
    twins = []
    for name in ("a", "b"):
        group = None
        if grouped:
            group, _ = services.group_create(project=project, key=name, owner="test")
        rollouts = services.rollout_enqueue_many(
            project=project,
            specs=[RolloutSpec(input=i, config=config or {}) for i in range(max(grouped, 1))],
            group=group)
        rollout, attempt = services.rollout_claim(project=project, rollout_id=rollouts[0].pk,
                                                  worker_id=f"w-{name}" if worker else None)
        if running:
            services.attempt_update(project=project, rollout_id=rollout.pk,
                                    attempt_id=attempt.attempt_id, status="running")
        twins.append((rollout.pk, attempt.attempt_id))
    return twins


def _statements(captured) -> list[str]:
    return [q["sql"] for q in captured.captured_queries if q["sql"] not in ("BEGIN", "COMMIT")]


@pytest.mark.parametrize("verdict", [
    {"status": "succeeded"}, {"status": "failed"}, {"status": "failed", "error": "boom"},
    {"status": "succeeded", "error": ""},
], ids=["succeeded", "failed", "failed-with-error", "succeeded-with-error"])
@pytest.mark.parametrize("shape", [
    {}, {"running": True}, {"worker": False}, {"grouped": 1}, {"grouped": 2},
    {"config": {"max_attempts": 3, "retry_condition": ["timeout"]}},
], ids=["preparing", "running", "no-worker", "completes-its-group", "group-waits",
        "retries-other-failures"])
def test_the_one_statement_verdict_leaves_the_rows_of_the_full_path(project, shape, verdict,
                                                                     monkeypatch):
    # The statement alone: a hurry-only listener (the trainer's) reads the rollout after it.
    monkeypatch.setattr(hooks, "has_hurry_callbacks", lambda **_: False)
    (ra, aa), (rb, ab) = _twins(project, **shape)
    completed: list[str] = []
    hooks.on_groups_completed("test", lambda: completed.append("nudged"))
    try:
        with CaptureQueriesContext(connection) as captured:
            common = _common(project, ra, aa, **verdict)
        if connection.vendor == "postgresql":
            assert len(_statements(captured)) == 1, _statements(captured)
        nudged_by_common = list(completed)
        full = _full(project, rb, ab, **verdict)
    finally:
        hooks._completed_callbacks.pop("test", None)
    assert _rows(ra, aa) == _rows(rb, ab)
    assert _rows(ra, aa)["rollout"]["status"] == verdict["status"]
    assert nudged_by_common == (["nudged"] if shape.get("grouped") == 1 else [])
    assert completed == nudged_by_common * 2
    for answer in (common, full):
        assert answer.status == verdict["status"] and answer.end_time == FROZEN
        if "error" in verdict:
            assert answer.metadata == {"error": verdict["error"]}
    assert (common.metadata, common.worker_id is None) == (full.metadata, full.worker_id is None)


@pytest.mark.postgres
@pytest.mark.parametrize("grouped", [0, 1], ids=["no-group", "grouped"])
def test_a_grouped_only_hurry_callback_costs_no_read_for_a_rollout_without_a_group(
        project, grouped, monkeypatch):
    """The one-statement verdict reads the finished rollout after its commit only for a
    hurry-only callback that wants it: one registered `grouped_only` (the trainer's) gets the
    rollouts of a group, read after the statement, and costs nothing for the others."""
    seen: list = []
    monkeypatch.setattr(hooks, "_finished_callbacks", [])
    monkeypatch.setattr(hooks, "_hurry_only", set())
    monkeypatch.setattr(hooks, "_grouped_only", set())
    hooks.on_rollouts_finished(seen.extend, hurry_only=True, grouped_only=True)
    (rollout_id, attempt_id), _ = _twins(project, grouped=grouped)
    with CaptureQueriesContext(connection) as captured:
        _common(project, rollout_id, attempt_id)
    assert len(_statements(captured)) == (2 if grouped else 1), _statements(captured)
    assert [(r.pk, r.status) for r in seen] == ([(rollout_id, "succeeded")] if grouped else [])
    # One that is not grouped-only gets every finished rollout, read after the statement.
    hooks.remove_rollouts_finished(seen.extend)
    hooks.on_rollouts_finished(seen.extend, hurry_only=True)
    (other_id, other_attempt), _ = _twins(project)
    with CaptureQueriesContext(connection) as captured:
        _common(project, other_id, other_attempt)
    assert len(_statements(captured)) == 2, _statements(captured)
    assert seen[-1].pk == other_id and seen[-1].status == "succeeded"


def _declined(project, rollout_id, attempt_id, status="succeeded"):
    """The common statement writes nothing here; the full path answers."""
    with CaptureQueriesContext(connection) as captured:
        answer = _common(project, rollout_id, attempt_id, status)
    if connection.vendor == "postgresql":
        assert "pg_notify" in _statements(captured)[0]  # tried first
        assert len(_statements(captured)) > 1  # then the full path
    return answer


def test_a_late_verdict_on_an_unresponsive_attempt_keeps_the_watchdogs(project):
    (rollout_id, attempt_id), _ = _twins(project, running=True,
                                         config={"unresponsive_seconds": 5})
    backdate(Attempt.objects.get(rollout_id=rollout_id, attempt_id=attempt_id), 10)
    swept = watchdog.sweep(now=FROZEN + timedelta(seconds=1))
    assert f"{rollout_id}/{attempt_id}" in swept.unresponsive
    answer = _declined(project, rollout_id, attempt_id)
    assert answer.status == "succeeded"
    assert answer.metadata["store.watchdog_verdict"] == "unresponsive"


def test_a_failure_the_config_retries_requeues_the_rollout(project):
    (rollout_id, attempt_id), _ = _twins(
        project, config={"max_attempts": 2, "retry_condition": ["failed"]})
    answer = _declined(project, rollout_id, attempt_id, "failed")
    assert answer.status == "failed"
    rows = _rows(rollout_id, attempt_id)
    assert rows["rollout"]["status"] == "requeuing" and rows["rollout"]["end_time"] is None


def test_a_verdict_on_a_cancelled_rollout_changes_the_attempt_only(project):
    (rollout_id, attempt_id), _ = _twins(project, grouped=1)
    services.rollout_update(project=project, rollout_id=rollout_id, status="cancelled")
    answer = _declined(project, rollout_id, attempt_id)
    assert answer.status == "succeeded"
    rows = _rows(rollout_id, attempt_id)
    assert rows["rollout"]["status"] == "cancelled"
    assert rows["group"][1:] == (1, FROZEN, 1)  # counted once, by the cancel


def test_a_verdict_given_twice_is_a_no_op_and_another_one_is_refused(project):
    from store.errors import IllegalTransition

    (rollout_id, attempt_id), _ = _twins(project, grouped=1)
    _common(project, rollout_id, attempt_id)
    before = _rows(rollout_id, attempt_id)
    assert _declined(project, rollout_id, attempt_id).status == "succeeded"
    assert _rows(rollout_id, attempt_id) == before
    with pytest.raises(IllegalTransition):
        services.attempt_update(project=project, rollout_id=rollout_id, attempt_id=attempt_id,
                                status="failed")


def _by_the_rules(before: dict, rollout_id: str, attempt_id: str, status: str,
                  error: str | None) -> dict:
    """The rows a verdict must leave, worked out from the rows before it with store/rules.py
    alone (no path of the store): the parity that holds on SQLite too, where both calls take
    the full path."""
    attempt = Attempt.objects.get(rollout_id=rollout_id, attempt_id=attempt_id)
    rollout = Rollout.objects.get(pk=rollout_id)
    rows = copy.deepcopy(before)
    rows["attempt"].update(status=status, end_time=FROZEN)
    if error is not None:
        rows["attempt"]["metadata"] = rules.ERROR_MERGE.python(before["attempt"]["metadata"],
                                                              error)
    became_terminal = False
    if rules.FOLLOWS.python(before["rollout"]["status"], rollout.latest_attempt_id, attempt.pk):
        config = RolloutConfig.parse(rollout.config)
        new = rules.ROLLOUT_FOR_ATTEMPT.python(status, attempt.sequence_id,
                                               config.retry_condition, config.max_attempts)
        rows["rollout"]["status"] = new
        if new in ROLLOUT_TERMINAL:
            rows["rollout"]["end_time"] = FROZEN
            became_terminal = True
        elif new in QUEUED:
            rows["rollout"].update(enqueue_time=FROZEN, queue_deadline=rules.after(
                FROZEN, rollout.queue_timeout_seconds))
    if before["worker"] is not None:
        worker = rules.WORKER_FOR_ATTEMPT.python(status)
        rows["worker"]["status"] = worker
        if worker == WorkerStatus.IDLE:
            rows["worker"].update(last_idle_time=FROZEN, current_rollout_id=None,
                                  current_attempt_id=None)
    if before["group"] is not None and became_terminal:
        total, finished, completed_at, events = before["group"]
        finished, completed_at, completed_now = rules.GROUP_COUNT.python(
            finished, total, completed_at, 1, FROZEN)
        rows["group"] = (total, finished, completed_at, events + int(completed_now))
    return rows


@pytest.mark.parametrize("verdict", [
    {"status": "succeeded"}, {"status": "failed"}, {"status": "failed", "error": "boom"},
], ids=["succeeded", "failed", "failed-with-error"])
@pytest.mark.parametrize("shape", [
    {}, {"running": True}, {"worker": False}, {"grouped": 1}, {"grouped": 2},
    {"config": {"max_attempts": 3, "retry_condition": ["timeout"]}},
    {"config": {"max_attempts": 2, "retry_condition": ["failed"]}, "grouped": 1},
], ids=["preparing", "running", "no-worker", "completes-its-group", "group-waits",
        "retries-other-failures", "retries-this-failure"])
@pytest.mark.parametrize("path", [_common, _full], ids=["common", "full"])
def test_each_verdict_path_leaves_the_rows_the_rules_give(project, shape, verdict, path):
    """Both verdict paths against store/rules.py, on Postgres and on SQLite."""
    (rollout_id, attempt_id), _ = _twins(project, **shape)
    before = _rows(rollout_id, attempt_id)
    path(project, rollout_id, attempt_id, **verdict)
    expected = _by_the_rules(before, rollout_id, attempt_id, verdict["status"],
                             verdict.get("error"))
    assert _rows(rollout_id, attempt_id) == expected
