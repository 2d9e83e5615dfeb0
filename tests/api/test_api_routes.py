"""Every route of the AGL 0.3 wire protocol, over real HTTP against a gunicorn server."""

from __future__ import annotations

import httpx

from store.models import Rollout
from tests.api.conftest import Keys

SPAN = {
    "trace_id": "a" * 32, "name": "llm", "status": {"status_code": "OK", "description": None},
    "attributes": {"agentlightning.reward.0.value": 1.0}, "events": [], "links": [],
    "start_time": 1.0, "end_time": 2.0, "context": None, "parent": None,
    "resource": {"attributes": {}, "schema_url": ""}, "custom_field": "kept",
}


def _enqueue(algo: httpx.Client, n: int = 1, **extra) -> list[dict]:
    body = {"rollouts": [{"input": {"i": i}, **extra} for i in range(n)]}
    response = algo.post("/queues/rollouts/enqueue", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def _dequeue(runner: httpx.Client, worker: str = "w1", limit: int = 1) -> list[dict]:
    response = runner.post("/queues/rollouts/dequeue", json={"limit": limit, "worker_id": worker})
    assert response.status_code == 200, response.text
    return response.json()


def test_health_needs_no_key(api_server):
    assert httpx.get(api_server.url + "/v1/agl/health").json() == {"status": "ok"}


def test_enqueue_then_dequeue_returns_attempted_rollouts_in_fifo_order(algo, runner):
    queued = _enqueue(algo, 3, mode="train", metadata={"k": "v"})
    assert [r["status"] for r in queued] == ["queuing"] * 3
    assert isinstance(queued[0]["start_time"], float)
    claimed = _dequeue(runner, limit=2)
    assert [r["rollout_id"] for r in claimed] == [r["rollout_id"] for r in queued[:2]]
    first = claimed[0]
    assert first["status"] == "preparing" and first["metadata"] == {"k": "v"}
    assert first["attempt"]["sequence_id"] == 1 and first["attempt"]["worker_id"] == "w1"
    assert first["attempt"]["attempt_id"].startswith("at-")


def test_dequeue_with_null_body_and_empty_queue_returns_empty_list(runner):
    response = runner.post("/queues/rollouts/dequeue", content=b"null",
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 200 and response.json() == []


def test_dequeue_long_poll_returns_empty_after_wait(runner):
    response = runner.post("/queues/rollouts/dequeue", json={"wait_seconds": 0.3})
    assert response.status_code == 200 and response.json() == []


def test_idempotency_key_makes_a_retried_enqueue_create_nothing(algo, keys: Keys):
    body = {"rollouts": [{"input": 1}, {"input": 2}]}
    headers = {"Idempotency-Key": "job-1/step-3"}
    first = algo.post("/queues/rollouts/enqueue", json=body, headers=headers).json()
    again = algo.post("/queues/rollouts/enqueue", json=body, headers=headers).json()
    assert [r["rollout_id"] for r in first] == [r["rollout_id"] for r in again]
    assert Rollout.objects.filter(project=keys.project).count() == 2


def test_start_rollout_skips_the_queue(algo):
    response = algo.post("/rollouts", json={"input": "x", "worker_id": "w9", "config": None,
                                             "mode": None, "metadata": None, "resources_id": None})
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == "preparing" and body["attempt"]["worker_id"] == "w9"


def test_query_and_search_rollouts_paginate(algo):
    _enqueue(algo, 5)
    page = algo.get("/rollouts", params={"limit": 2, "offset": 1, "status_in": ["queuing"]}).json()
    assert (page["limit"], page["offset"], page["total"], len(page["items"])) == (2, 1, 5, 2)
    found = algo.post("/rollouts/search", json={"status_in": ["running"], "limit": -1}).json()
    assert found["total"] == 0 and found["items"] == []
    desc = algo.post("/rollouts/search", json={"sort_by": "start_time", "sort_order": "desc"})
    assert desc.json()["items"][0]["input"] == {"i": 4}


def test_get_and_update_rollout(algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    got = algo.get(f"/rollouts/{rid}").json()
    assert got["rollout_id"] == rid and "attempt" not in got
    _dequeue(runner)
    assert "attempt" in algo.get(f"/rollouts/{rid}").json()
    updated = algo.post(f"/rollouts/{rid}", json={"metadata": {"tag": 1}, "mode": "val"}).json()
    assert updated["metadata"] == {"tag": 1} and updated["mode"] == "val"
    cancelled = algo.post(f"/rollouts/{rid}", json={"status": "cancelled"}).json()
    assert cancelled["status"] == "cancelled" and cancelled["end_time"] is not None
    # The algorithm's explicit command reopens it, as AGL allows.
    again = algo.post(f"/rollouts/{rid}", json={"status": "requeuing"})
    assert again.status_code == 200 and again.json()["end_time"] is None


def test_attempt_routes(algo, runner):
    queued = _enqueue(algo, config={"max_attempts": 3, "retry_condition": ["failed"]})
    rid = queued[0]["rollout_id"]
    aid = _dequeue(runner)[0]["attempt"]["attempt_id"]
    latest = runner.get(f"/rollouts/{rid}/attempts/latest").json()
    assert latest["attempt_id"] == aid
    assert runner.get(f"/rollouts/{rid}/attempts/{aid}").json()["attempt_id"] == aid
    failed = runner.post(f"/rollouts/{rid}/attempts/{aid}", json={"status": "failed"}).json()
    assert failed["status"] == "failed" and failed["end_time"] is not None
    assert algo.get(f"/rollouts/{rid}").json()["status"] == "requeuing"
    started = algo.post(f"/rollouts/{rid}/attempts", json={"worker_id": "w2"})
    assert started.status_code == 201 and started.json()["attempt"]["sequence_id"] == 2
    page = algo.get(f"/rollouts/{rid}/attempts", params={"sort_order": "desc"}).json()
    assert [a["sequence_id"] for a in page["items"]] == [2, 1]
    search = algo.post(f"/rollouts/{rid}/attempts/search", json={"limit": 1}).json()
    assert search["total"] == 2 and len(search["items"]) == 1
    via_latest = runner.post(f"/rollouts/{rid}/attempts/latest",
                             json={"status": "succeeded", "last_heartbeat_time": 1.5e9})
    assert via_latest.json()["status"] == "succeeded"
    assert algo.get(f"/rollouts/{rid}").json()["status"] == "succeeded"


def test_get_latest_attempt_of_a_queued_rollout_is_null(algo):
    rid = _enqueue(algo)[0]["rollout_id"]
    response = algo.get(f"/rollouts/{rid}/attempts/latest")
    assert response.status_code == 200 and response.json() is None


def test_worker_routes(algo, runner):
    _enqueue(algo)
    _dequeue(runner, worker="wk-1")
    worker = runner.post("/workers/wk-1", json={"heartbeat_stats": {"cpu": 0.5}}).json()
    assert worker["status"] == "busy" and worker["heartbeat_stats"] == {"cpu": 0.5}
    assert isinstance(worker["last_heartbeat_time"], float)
    assert runner.post("/workers/wk-2").status_code == 200  # no body, as AGL sends
    assert runner.get("/workers/wk-1").json()["worker_id"] == "wk-1"
    assert runner.get("/workers/nobody").json() is None
    page = runner.get("/workers", params={"status_in": ["busy"]}).json()
    assert [w["worker_id"] for w in page["items"]] == ["wk-1"]
    search = runner.post("/workers/search", json={"worker_id_contains": "wk"}).json()
    assert search["total"] == 2


def test_resource_routes(algo):
    llm = {"resource_type": "llm", "endpoint": "http://127.0.0.1:1/v1", "model": "m",
           "sampling_parameters": {"temperature": 0.5}}
    added = algo.post("/resources", json={"main_llm": llm})
    assert added.status_code == 201
    rs_id = added.json()["resources_id"]
    assert rs_id.startswith("rs-") and added.json()["version"] == 1
    bumped = algo.post(f"/resources/{rs_id}", json={"main_llm": {**llm, "model": "m2"}}).json()
    assert bumped["version"] == 2
    assert algo.get(f"/resources/{rs_id}").json()["resources"]["main_llm"]["model"] == "m2"
    first = algo.get(f"/resources/{rs_id}", params={"version": 1}).json()
    assert first["resources"]["main_llm"]["model"] == "m"
    assert algo.get("/resources/latest").json()["resources_id"] == rs_id
    page = algo.get("/resources", params={"resources_id_contains": rs_id[3:8]}).json()
    assert page["total"] == 1 and page["items"][0]["version"] == 2
    named = algo.post("/resources/rs-mine", json={"p": {"resource_type": "prompt_template",
                                                        "template": "hi", "engine": "f-string"}})
    assert named.status_code == 200 and named.json()["version"] == 1
    assert algo.delete("/resources/rs-mine").status_code == 204
    assert algo.get("/resources/rs-mine").status_code == 404


def test_deleting_resources_an_unfinished_rollout_uses_is_refused(algo):
    rs = algo.post("/resources", json={"x": {"resource_type": "llm", "endpoint": "e",
                                             "model": "m"}}).json()["resources_id"]
    _enqueue(algo, resources_id=rs)
    assert algo.delete(f"/resources/{rs}").status_code == 409


def test_latest_resources_is_null_when_there_are_none(algo):
    response = algo.get("/resources/latest")
    assert response.status_code == 200 and response.json() is None


def test_span_routes(algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    aid = _dequeue(runner)[0]["attempt"]["attempt_id"]
    seq = runner.post("/spans/next", json={"rollout_id": rid, "attempt_id": aid}).json()
    assert seq == {"sequence_id": 1}
    span = {**SPAN, "rollout_id": rid, "attempt_id": aid, "sequence_id": 1, "span_id": "b" * 16}
    added = runner.post("/spans", json=span)
    assert added.status_code == 201
    assert added.json()["custom_field"] == "kept" and added.json()["attempt_id"] == aid
    duplicate = runner.post("/spans", json=span)
    assert duplicate.status_code == 201 and duplicate.json() is None
    assert algo.get(f"/rollouts/{rid}").json()["status"] == "running"  # a span is a heartbeat
    batch = [{**span, "span_id": f"{i:016x}", "sequence_id": i + 2} for i in range(3)]
    result = runner.post("/spans/batch", json={"spans": batch + [span]}).json()
    assert result == {"added": 3, "duplicates": 1, "cancelled_rollout_ids": []}
    page = algo.get("/spans", params={"rollout_id": rid, "attempt_id": "latest"}).json()
    assert page["total"] == 4 and [s["sequence_id"] for s in page["items"]] == [1, 2, 3, 4]
    found = algo.post("/spans/search", json={"rollout_id": rid, "span_id": "b" * 16}).json()
    assert found["total"] == 1 and found["items"][0]["attributes"] == SPAN["attributes"]


def test_wait_for_rollouts_returns_finished_ones(algo, runner):
    rids = [r["rollout_id"] for r in _enqueue(algo, 2)]
    aid = _dequeue(runner)[0]["attempt"]["attempt_id"]
    runner.post(f"/rollouts/{rids[0]}/attempts/{aid}", json={"status": "succeeded"})
    done = algo.post("/waits/rollouts", json={"rollout_ids": rids, "timeout": 0.2}).json()
    assert [r["rollout_id"] for r in done] == [rids[0]]
    assert algo.post("/waits/rollouts", json={"rollout_ids": rids, "timeout": 0}).json() == done


def test_statistics_count_this_project_only(algo, keys: Keys, api_server):
    _enqueue(algo, 2)
    stats = algo.get("/statistics").json()
    assert stats["total_rollouts"] == 2
    other = httpx.get(api_server.url + "/v1/agl/statistics",
                      headers={"Authorization": f"Bearer {keys.other}"}).json()
    assert other["total_rollouts"] == 0


def test_update_attempt_and_span_post_tell_the_runner_about_cancellation(algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    aid = _dequeue(runner)[0]["attempt"]["attempt_id"]
    beat = runner.post(f"/rollouts/{rid}/attempts/{aid}", json={"last_heartbeat_time": 1.7e9})
    assert "X-Cancelled-Rollouts" not in beat.headers
    algo.post(f"/rollouts/{rid}", json={"status": "cancelled"})
    beat = runner.post(f"/rollouts/{rid}/attempts/{aid}", json={"last_heartbeat_time": 1.7e9})
    assert beat.headers["X-Cancelled-Rollouts"] == rid
    span = {**SPAN, "rollout_id": rid, "attempt_id": aid, "sequence_id": 1, "span_id": "c" * 16}
    result = runner.post("/spans/batch", json={"spans": [span]})
    assert result.json()["cancelled_rollout_ids"] == [rid]
    assert result.headers["X-Cancelled-Rollouts"] == rid
    late = runner.post(f"/rollouts/{rid}/attempts/{aid}", json={"status": "succeeded"})
    assert late.status_code == 200
    assert algo.get(f"/rollouts/{rid}").json()["status"] == "cancelled"  # terminal stays


def test_claim_rollout_takes_a_named_queued_rollout_once(algo, runner):
    rid = _enqueue(algo, 2)[1]["rollout_id"]
    claimed = runner.post(f"/rollouts/{rid}/claim", json={"worker_id": "w"}).json()
    assert claimed["rollout_id"] == rid and claimed["attempt"]["sequence_id"] == 1
    assert claimed["resources_version"] is None
    again = runner.post(f"/rollouts/{rid}/claim", json={"worker_id": "w"})
    assert again.status_code == 200 and again.json() is None


def test_attempts_batch_ends_many_attempts_in_one_request(algo, runner):
    _enqueue(algo, 3)
    claimed = _dequeue(runner, limit=3)
    updates = [{"rollout_id": r["rollout_id"], "attempt_id": r["attempt"]["attempt_id"],
                "status": "succeeded"} for r in claimed]
    result = runner.post("/attempts/batch", json={"updates": updates})
    assert result.status_code == 200, result.text
    assert [a["status"] for a in result.json()["attempts"]] == ["succeeded"] * 3
    assert algo.get("/rollouts", params={"status_in": "succeeded"}).json()["total"] == 3
    unknown = runner.post("/attempts/batch", json={"updates": [
        {"rollout_id": "ro-0", "attempt_id": "at-0", "status": "failed"}]})
    assert unknown.status_code == 404


def test_a_span_batch_over_many_attempts_heartbeats_each_of_them(algo, runner):
    _enqueue(algo, 3)
    claimed = _dequeue(runner, limit=3)
    spans = [{**SPAN, "rollout_id": r["rollout_id"], "attempt_id": r["attempt"]["attempt_id"],
              "sequence_id": 1, "span_id": f"{i:016x}"} for i, r in enumerate(claimed)]
    assert runner.post("/spans/batch", json={"spans": spans}).json()["added"] == 3
    for rollout in claimed:
        got = algo.get(f"/rollouts/{rollout['rollout_id']}").json()
        assert got["status"] == "running" and got["attempt"]["status"] == "running"
        assert got["attempt"]["last_heartbeat_time"] is not None


def test_finish_attempt_stores_the_spans_it_carries_before_its_verdict(algo, runner):
    """Our runner sent its last spans, then the verdict: two requests per attempt end."""
    first = _enqueue(algo)[0]["rollout_id"]
    aid = _dequeue(runner)[0]["attempt"]["attempt_id"]
    path = f"/rollouts/{first}/attempts/{aid}/finish"
    spans = [{**SPAN, "rollout_id": first, "attempt_id": aid, "sequence_id": 1 + i,
              "span_id": f"{i:016x}"} for i in range(3)]
    # a span of an attempt the store does not know: 404, nothing stored, no verdict
    unknown = {**spans[0], "attempt_id": "at-nosuch"}
    refused = runner.post(path, json={"status": "succeeded", "spans": [spans[0], unknown]})
    assert refused.status_code == 404, refused.text
    assert algo.get(f"/rollouts/{first}").json()["status"] != "succeeded"
    assert algo.get("/spans", params={"rollout_id": first}).json()["total"] == 0
    # more spans than a request may carry: 413 before any is looked at
    many = [{**spans[0], "span_id": f"{i:016x}"} for i in range(5001)]
    assert runner.post(path, json={"status": "succeeded", "spans": many}).status_code == 413
    done = runner.post(path, json={"status": "succeeded", "spans": spans})
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "succeeded"
    stored = algo.get("/spans", params={"rollout_id": first}).json()
    assert sorted(s["span_id"] for s in stored["items"]) == [s["span_id"] for s in spans]
    # a repeat (the answer was lost) changes nothing: the spans are duplicates
    again = runner.post(path, json={"status": "succeeded", "spans": spans})
    assert again.status_code == 200
    assert algo.get("/spans", params={"rollout_id": first}).json()["total"] == 3


def test_finish_attempt_merges_the_error_and_is_idempotent(algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    aid = _dequeue(runner)[0]["attempt"]["attempt_id"]
    path = f"/rollouts/{rid}/attempts/{aid}"
    assert runner.post(path, json={"metadata": {"m": 1}}).status_code == 200
    done = runner.post(path + "/finish", json={"status": "failed", "error": "boom"})
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "failed"
    assert done.json()["metadata"] == {"m": 1, "error": "boom"}
    again = runner.post(path + "/finish", json={"status": "failed", "error": "boom"})
    assert again.status_code == 200 and again.json()["metadata"] == {"m": 1, "error": "boom"}
    assert runner.post(path + "/finish", json={"status": "succeeded"}).status_code == 409
    assert runner.post(path + "/finish", json={"status": "running"}).status_code == 422
