"""Our OpenAPI schema (/api/schema/) and docs page, and schemathesis (every check, every phase,
a few examples per operation; tests/api/schemathesis.toml) against the live server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from store import services

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def test_schema_lists_every_agl_route(api_server):
    schema = httpx.get(api_server.url + "/api/schema/?format=json").json()
    paths = set(schema["paths"])
    for route in ("/v1/agl/queues/rollouts/enqueue", "/v1/agl/queues/rollouts/dequeue",
                  "/v1/agl/rollouts/{rollout_id}/attempts/{attempt_id}", "/v1/agl/spans/next",
                  "/v1/agl/waits/rollouts", "/v1/traces", "/v1/metrics", "/v1/logs"):
        assert route in paths
    assert {"ApiKeyBearer", "ApiKeyBasic"} <= set(schema["components"]["securitySchemes"])


def _operations(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            yield path, method, operation


def test_schema_tells_the_truth(api_server):
    """Each operation declares its error answers, its `null` answers, either auth scheme
    (not both together) and exact parameters."""
    schema = httpx.get(api_server.url + "/api/schema/?format=json").json()
    ops = {op["operationId"]: (path, method, op) for path, method, op in _operations(schema)}
    for op_id, (_path, _method, op) in ops.items():
        statuses = set(op["responses"])
        assert {"400", "408", "411", "413", "414"} <= statuses, op_id
        if op_id == "health":
            assert "security" not in op or op["security"] in ([], [{}])
            continue
        assert op["security"] == [{"ApiKeyBearer": []}, {"ApiKeyBasic": []}], op_id
        assert {"401", "503"} <= statuses, op_id
        assert op["responses"]["503"]["headers"]["Retry-After"]["required"] is True
        if "requestBody" in op:
            assert {"400", "415", "422"} <= statuses, op_id
        for param in op.get("parameters", []):
            if param["in"] == "path":
                assert param["schema"]["minLength"] == 1, (op_id, param)
    for op_id in ("enqueue_rollouts", "start_rollout", "update_rollout", "delete_resources",
                  "add_resources", "create_project"):
        assert "403" in ops[op_id][2]["responses"], op_id
    assert "403" not in ops["dequeue_rollouts"][2]["responses"]
    for op_id in ("get_rollout_by_id", "get_attempt", "update_attempt", "delete_resources"):
        assert "404" in ops[op_id][2]["responses"], op_id
    for op_id in ("update_rollout", "update_attempt", "finish_attempt", "delete_resources"):
        assert "409" in ops[op_id][2]["responses"], op_id
    for op_id in ("wait_for_rollouts", "dequeue_rollouts"):
        assert ops[op_id][2]["responses"]["429"]["headers"]["Retry-After"]["required"]
    assert "411" in ops["otlp_traces"][2]["responses"]
    for op_id in ("get_worker", "claim_rollout", "add_span", "get_attempt",
                  "get_latest_resources"):
        ok = next(r for s, r in ops[op_id][2]["responses"].items() if s.startswith("2"))
        assert ok["content"]["application/json"]["schema"]["nullable"] is True, op_id
    query = {p["name"]: p["schema"] for p in ops["query_rollouts"][2]["parameters"]}
    assert "rollout_id" in query["sort_by"]["enum"] and "bogus" not in query["sort_by"]["enum"]
    assert query["offset"]["minimum"] == 0
    assert [c.get("enum") for c in query["limit"]["anyOf"]] == [[-1], None]
    update = schema["components"]["schemas"]["UpdateAttemptInRequest"]["properties"]
    assert "nullable" not in update["status"]  # an explicit null is AGL's 400
    errors = schema["components"]["schemas"]
    assert errors["ValidationError"]["properties"]["detail"]["type"] == "array"


def test_answers_that_fuzzing_rarely_reaches_are_declared(api_server, algo, runner):
    """State-dependent answers, produced on purpose: each status must be among its
    operation's declared responses."""
    schema = httpx.get(api_server.url + "/api/schema/?format=json").json()
    declared = {op["operationId"]: set(op["responses"]) for _p, _m, op in _operations(schema)}
    rollout = algo.post("/rollouts", json={"input": 1}).json()
    rid, aid = rollout["rollout_id"], rollout["attempt"]["attempt_id"]
    seen = {
        "update_rollout": [algo.post(f"/rollouts/{rid}", json={"status": "cancelled"}),
                           algo.post(f"/rollouts/{rid}", json={"input": 2})],
        "finish_attempt": [runner.post(f"/rollouts/{rid}/attempts/{aid}/finish",
                                       json={"status": "succeeded"}),
                           runner.post(f"/rollouts/{rid}/attempts/{aid}/finish",
                                       json={"status": "failed"})],
        "enqueue_rollouts": [runner.post("/queues/rollouts/enqueue",
                                         json={"rollouts": [{"input": 1}]})],
        "get_worker": [runner.get("/workers/never-seen")],
        "get_rollout_by_id": [runner.get("/rollouts/ro-000000000000")],
        "add_span": [runner.post("/spans", json={
            "rollout_id": rid, "attempt_id": "at-none", "trace_id": "t", "span_id": "s",
            "name": "n"})],
    }
    statuses = {op: [r.status_code for r in answers] for op, answers in seen.items()}
    assert statuses["update_rollout"][1] == 409 and statuses["finish_attempt"][1] == 409
    assert statuses["enqueue_rollouts"] == [403] and statuses["get_worker"] == [200]
    for op, codes in statuses.items():
        for code in codes:
            assert str(code) in declared[op], (op, code, sorted(declared[op]))


def test_docs_page_serves_its_assets_locally(api_server):
    page = httpx.get(api_server.url + "/api/docs/")
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "/static/drf_spectacular_sidecar/" in page.text
    asset = httpx.get(api_server.url +
                      "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert asset.status_code == 200 and len(asset.content) > 10_000


def test_schemathesis_finds_the_server_true_to_its_schema(api_server, keys, tmp_path):
    """schemathesis 4, as a user would run it: every check (status codes, response schemas,
    content types, headers, positive and negative data, auth, ...) and every phase,
    stateful included, against the live gunicorn on Postgres. Its figures are printed."""
    # A site_admin key may call every operation (creating projects included).
    key = services.api_key_create(project=keys.project, role="site_admin")[1]
    env = {**os.environ, "PYTHONPATH": str(HERE), "SCHEMATHESIS_HOOKS": "schemathesis_hooks"}
    cmd = [
        str(Path(sys.executable).parent / "schemathesis"),
        "--config-file", str(HERE / "schemathesis.toml"),
        "run", api_server.url + "/api/schema/",
        "-H", f"Authorization: Bearer {key}",
        "--seed", os.environ.get("SCHEMATHESIS_SEED", "4"), "--workers", "1", "--no-shrink",
    ]
    # cwd: schemathesis keeps a cache of crashes there, which would replay into later runs.
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    summary = run.stdout[run.stdout.rfind("SUMMARY"):]
    print(summary)
    failures = run.stdout[run.stdout.find("=== FAILURES"):run.stdout.rfind("=== WARNINGS")]
    assert run.returncode == 0, failures[:20000] or run.stdout[-20000:]
    assert " passed" in summary and "failures" not in summary.lower().split("test cases")[-1]
