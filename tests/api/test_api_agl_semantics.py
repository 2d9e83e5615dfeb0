"""AGL 0.3's store semantics over HTTP (issue 9, points 1-8): status codes and messages as
AGL's server gives them, against a real gunicorn server."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from store import watchdog
from store.models import Attempt
from tests.api.test_api_routes import SPAN, _dequeue, _enqueue


def _span(rid: str, aid: str, span_id: str, sequence_id: int | None = None) -> dict:
    return {**SPAN, "rollout_id": rid, "attempt_id": aid, "span_id": span_id,
            "sequence_id": sequence_id}


def test_span_sequence_ids_are_one_counter_per_rollout(algo, runner):
    rid = _enqueue(algo, config={"max_attempts": 2, "retry_condition": ["failed"]})[0]["rollout_id"]
    first = _dequeue(runner)[0]["attempt"]["attempt_id"]
    assert runner.post("/spans", json=_span(rid, first, "1" * 16)).json()["sequence_id"] == 1
    runner.post(f"/rollouts/{rid}/attempts/{first}", json={"status": "failed"})
    second = _dequeue(runner)[0]["attempt"]["attempt_id"]
    got = [runner.post("/spans", json=_span(rid, second, f"{n:016x}")).json()["sequence_id"]
           for n in range(2, 5)]
    assert got == [2, 3, 4]  # AGL's [1, 2, 3, 4] over both attempts, not [1, 1, 2, 3]
    runner.post("/spans", json=_span(rid, second, "f" * 16, sequence_id=100))
    nxt = runner.post("/spans/next", json={"rollout_id": rid, "attempt_id": "at-anything"})
    assert nxt.status_code == 200 and nxt.json() == {"sequence_id": 101}
    unknown = runner.post("/spans/next", json={"rollout_id": "ro-nope", "attempt_id": "a"})
    assert unknown.status_code == 404 and unknown.json()["detail"] == "Rollout ro-nope not found"


def test_unknown_resources_id_is_stored_as_given(algo):
    queued = _enqueue(algo, resources_id="rs-not-yet")[0]
    assert queued["resources_id"] == "rs-not-yet" and queued["resources_version"] is None
    started = algo.post("/rollouts", json={"input": 1, "resources_id": "rs-other"})
    assert started.status_code == 201 and started.json()["resources_id"] == "rs-other"
    moved = algo.post(f"/rollouts/{queued['rollout_id']}", json={"resources_id": "rs-third"})
    assert moved.status_code == 200 and moved.json()["resources_id"] == "rs-third"


@pytest.mark.parametrize("path_kind,field", [
    ("rollout", "status"), ("rollout", "config"),
    ("attempt", "status"), ("attempt", "worker_id"), ("attempt", "last_heartbeat_time"),
    ("attempt", "metadata"), ("worker", "heartbeat_stats"),
])
def test_explicit_null_is_400_with_agls_message(algo, runner, path_kind, field):
    rollout = _enqueue(algo)[0]
    attempt = _dequeue(runner)[0]["attempt"]
    path = {"rollout": f"/rollouts/{rollout['rollout_id']}",
            "attempt": f"/rollouts/{rollout['rollout_id']}/attempts/{attempt['attempt_id']}",
            "worker": "/workers/w1"}[path_kind]
    response = algo.post(path, json={field: None})
    assert response.status_code == 400
    assert response.json()["detail"] == f"{field} is invalid; it cannot be a null value."


def test_omitted_fields_stay_and_empty_worker_id_clears(algo, runner):
    rollout = _enqueue(algo)[0]
    attempt = _dequeue(runner, worker="w7")[0]["attempt"]
    path = f"/rollouts/{rollout['rollout_id']}/attempts/{attempt['attempt_id']}"
    kept = runner.post(path, json={"metadata": {"k": 1}}).json()
    assert kept["worker_id"] == "w7" and kept["status"] == "preparing"
    cleared = runner.post(path, json={"worker_id": ""})
    assert cleared.status_code == 200 and cleared.json()["worker_id"] == ""
    assert cleared.json()["metadata"] == {"k": 1}


def test_sorting_and_paging_answer_as_agl(algo):
    ids = [r["rollout_id"] for r in _enqueue(algo, 3)]
    algo.post(f"/rollouts/{ids[1]}", json={"mode": "val"})
    page = algo.post("/rollouts/search", json={"sort_by": "mode"}).json()
    assert page["items"][-1]["rollout_id"] == ids[1]  # None sorts first ascending
    page = algo.get("/rollouts", params={"sort_by": "mode", "sort_order": "desc"}).json()
    assert page["items"][0]["rollout_id"] == ids[1]
    assert algo.get("/rollouts", params={"sort_by": "metadata"}).status_code == 200
    bad = algo.post("/rollouts/search", json={"sort_by": "nonsense"})
    assert bad.status_code == 400 and bad.json()["detail"] == (
        "Invalid sort_by: nonsense, allowed fields are: rollout_id, input, start_time, "
        "end_time, mode, resources_id, status, config, metadata")
    offset = algo.get("/workers", params={"offset": -1})
    assert offset.status_code == 400
    assert offset.json()["detail"] == "Offset must be greater than or equal to 0"
    limit = algo.post("/spans/search", json={"rollout_id": ids[0], "limit": 0})
    assert limit.status_code == 400
    assert limit.json()["detail"] == "Limit must be greater than 0 or -1 for no limit"
    # FastAPI validates the Literal fields itself: 422, as AGL's server answers.
    assert algo.get("/rollouts", params={"sort_order": "up"}).status_code == 422
    assert algo.get(f"/rollouts/{ids[0]}/attempts",
                    params={"sort_by": "worker_id"}).status_code == 200


def test_not_found_wording_and_empty_searches(algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    missing = runner.post("/spans", json=_span("ro-missing", "at-1", "1" * 16))
    assert missing.status_code == 404 and missing.json()["detail"] == "Rollout ro-missing not found"
    attempt = runner.post(f"/rollouts/{rid}/attempts/at-zzz", json={"status": "running"})
    assert attempt.status_code == 404
    assert attempt.json()["detail"] == f"No attempts found for rollout {rid}"  # none yet
    runner.post("/queues/rollouts/dequeue", json={"worker_id": "w1"})
    attempt = runner.post(f"/rollouts/{rid}/attempts/at-zzz", json={"status": "running"})
    assert attempt.status_code == 404
    assert attempt.json()["detail"] == f"Attempt at-zzz not found for rollout {rid}"
    for path in ("/spans/search", "/rollouts/ro-missing/attempts/search"):
        page = algo.post(path, json={"rollout_id": "ro-missing"})
        assert page.status_code == 200 and page.json()["items"] == [], path
    stats = algo.get("/statistics").json()
    assert stats["name"] and stats["uptime"] >= 0 and stats["total_rollouts"] == 1
    empty = runner.post("/queues/rollouts/dequeue", json={"limit": 0})
    assert empty.status_code == 200 and empty.json() == []


def test_algorithm_commands_reopen_terminal_rollouts_but_late_reports_do_not(algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    aid = _dequeue(runner)[0]["attempt"]["attempt_id"]
    runner.post(f"/rollouts/{rid}/attempts/{aid}", json={"status": "failed"})
    assert algo.get(f"/rollouts/{rid}").json()["status"] == "failed"
    assert algo.post(f"/rollouts/{rid}", json={"status": "requeuing"}).json()["status"] == "requeuing"
    retry = _dequeue(runner)[0]
    assert retry["rollout_id"] == rid and retry["attempt"]["sequence_id"] == 2
    algo.post(f"/rollouts/{rid}", json={"status": "cancelled"})
    late = runner.post(f"/rollouts/{rid}/attempts/latest", json={"status": "succeeded"})
    assert late.status_code == 200 and late.json()["status"] == "succeeded"
    assert algo.get(f"/rollouts/{rid}").json()["status"] == "cancelled"
    by_hand = algo.post(f"/rollouts/{rid}/attempts", json={"worker_id": "w2"})
    assert by_hand.status_code == 201 and by_hand.json()["status"] == "preparing"
    assert by_hand.json()["attempt"]["sequence_id"] == 3


def test_an_overdue_attempt_is_seen_timed_out_by_the_next_call(algo, runner):
    rid = _enqueue(algo, config={"timeout_seconds": 30})[0]["rollout_id"]
    _dequeue(runner)
    past = timezone.now() - timedelta(seconds=31)
    Attempt.objects.filter(rollout_id=rid).update(start_time=past, deadline=past)
    # No scheduled sweep runs in this test: the API call itself applies the deadline (a
    # process sweeps a project at most every CALL_SWEEP_INTERVAL; AGL's bound is 0.25 s).
    time.sleep(watchdog.CALL_SWEEP_INTERVAL + 0.05)
    got = algo.get(f"/rollouts/{rid}").json()
    assert got["status"] == "failed" and got["attempt"]["status"] == "timeout"


def test_a_span_on_a_timed_out_attempt_records_its_heartbeat(algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    aid = _dequeue(runner)[0]["attempt"]["attempt_id"]
    Attempt.objects.filter(rollout_id=rid).update(status="timeout")
    assert runner.post("/spans", json=_span(rid, aid, "1" * 16)).status_code == 201
    attempt = algo.get(f"/rollouts/{rid}/attempts/{aid}").json()
    assert attempt["status"] == "timeout" and attempt["last_heartbeat_time"] is not None
