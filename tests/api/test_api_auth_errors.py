"""Authentication, roles, project isolation and bad input, over real HTTP."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from django.utils import timezone

from store import services
from store.models import ApiKey, Project
from tests.api.conftest import Keys, http


def _enqueue(client: httpx.Client, n: int = 1) -> list[dict]:
    response = client.post("/queues/rollouts/enqueue",
                           json={"rollouts": [{"input": i} for i in range(n)]})
    assert response.status_code == 201, response.text
    return response.json()


def test_missing_key_is_401(api_server):
    response = httpx.get(api_server.url + "/v1/agl/rollouts")
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("header", [
    "Bearer agl_wrong-key-000000000000000",
    "Bearer short",
    "Basic " + base64.b64encode(b"runner:agl_not-a-real-key-at-all").decode(),
    "Basic !!!not-base64",
    "Token abc",
    "Bearer",
])
def test_wrong_or_malformed_key_is_401(api_server, keys: Keys, header: str):
    response = httpx.get(api_server.url + "/v1/agl/rollouts", headers={"Authorization": header})
    assert response.status_code == 401
    assert "Traceback" not in response.text


def test_basic_auth_with_the_key_as_password_works(api_server, keys: Keys):
    url = api_server.url.replace("http://", f"http://runner:{keys.runner}@") + "/v1/agl/statistics"
    response = httpx.get(url)
    assert response.status_code == 200 and response.json()["total_rollouts"] == 0


def test_revoked_key_is_401(api_server, keys: Keys):
    ApiKey.objects.filter(project=keys.project, role="runner").update(revoked_at=timezone.now())
    with http(api_server, keys.runner) as client:
        assert client.get("/statistics").status_code == 401


def test_a_revoked_key_is_refused_at_once_by_every_process(api_server, keys: Keys):
    """Each process cached a checked key for 5 s, so a revoked key kept working that long
    (issue 11, finding 6). Every worker and thread has just used the key when it is revoked."""
    with http(api_server, keys.runner) as client:
        for _ in range(40):  # 2 workers x 8 threads: every process has seen the key
            assert client.get("/statistics").status_code == 200
        ApiKey.objects.filter(project=keys.project, role="runner").update(
            revoked_at=timezone.now())
        answers = [client.get("/statistics").status_code for _ in range(40)]
    assert set(answers) == {401}, answers


def test_another_projects_ids_are_not_found(api_server, keys: Keys, algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    aid = runner.post("/queues/rollouts/dequeue", json={"worker_id": "w"}).json()[0]["attempt"][
        "attempt_id"]
    rs = algo.post("/resources", json={"r": {"resource_type": "llm", "endpoint": "e",
                                             "model": "m"}}).json()["resources_id"]
    with http(api_server, keys.other) as other:
        assert other.get(f"/rollouts/{rid}").status_code == 404
        assert other.post(f"/rollouts/{rid}", json={"status": "cancelled"}).status_code == 404
        # Searches answer an empty page for a rollout they do not know, as AGL's do.
        assert other.get(f"/rollouts/{rid}/attempts").json()["items"] == []
        assert other.post(f"/rollouts/{rid}/attempts/{aid}",
                          json={"status": "failed"}).status_code == 404
        assert other.get(f"/resources/{rs}").status_code == 404
        # Ids are per project: the same id there is the other project's own history.
        assert other.post(f"/resources/{rs}", json={}).json()["version"] == 1
        assert other.get("/spans", params={"rollout_id": rid}).json()["items"] == []
        assert other.post("/spans/next", json={"rollout_id": rid,
                                               "attempt_id": aid}).status_code == 404
        assert other.get("/rollouts").json()["total"] == 0
        assert other.post("/queues/rollouts/dequeue", json={}).json() == []
        assert other.get("/workers/w").json() is None
        body = other.post("/waits/rollouts", json={"rollout_ids": [rid], "timeout": 0}).json()
        assert body == []
    assert algo.get(f"/rollouts/{rid}").json()["status"] == "preparing"
    mine = algo.get(f"/resources/{rs}").json()
    assert (mine["version"], list(mine["resources"])) == (1, ["r"])


@pytest.mark.parametrize("method,path,body", [
    ("post", "/queues/rollouts/enqueue", {"rollouts": [{"input": 1}]}),
    ("post", "/rollouts", {"input": 1}),
    ("post", "/rollouts/ro-x", {"status": "cancelled"}),
    ("post", "/rollouts/ro-x/attempts", None),
    ("post", "/resources", {}),
    ("post", "/resources/rs-x", {}),
    ("delete", "/resources/rs-x", None),
])
def test_runner_keys_cannot_do_algorithm_work(runner, method: str, path: str, body):
    response = runner.request(method.upper(), path, json=body)
    assert response.status_code == 403, response.text


def test_only_site_admin_keys_create_projects(api_server, keys: Keys):
    """A project's admin key could create any number of projects and learn which names
    exist (issue 11, finding 6): creating projects takes the site_admin role."""
    url = api_server.url + "/v1/projects"
    for key in (keys.runner, keys.algorithm, keys.admin):
        response = httpx.post(url, json={"name": "new"}, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 403
        response = httpx.post(url, json={"name": "api-other"},
                              headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 403  # no answer says whether the name exists
    assert not Project.objects.filter(name="new").exists()
    site = services.api_key_create(project=keys.project, role="site_admin")[1]
    response = httpx.post(url, json={"name": "new"}, headers={"Authorization": f"Bearer {site}"})
    assert response.status_code == 201
    new_keys = response.json()["keys"]
    assert set(new_keys) == {"runner", "algorithm", "admin"}
    assert Project.objects.filter(name="new").exists()
    with http(api_server, new_keys["runner"]) as client:
        assert client.get("/rollouts").json()["total"] == 0
    again = httpx.post(url, json={"name": "new"}, headers={"Authorization": f"Bearer {site}"})
    assert again.status_code == 422


@pytest.mark.parametrize("path,body,field", [
    ("/queues/rollouts/enqueue", {"rollouts": [{"input": 1, "mode": "bogus"}]},
     ["body", "rollouts", 0, "mode"]),
    ("/queues/rollouts/enqueue", {"rollouts": [{"input": 1, "config": {"max_attempts": 0}}]},
     ["body", "rollouts", 0, "config", "max_attempts"]),
    ("/queues/rollouts/enqueue", {"rollouts": "nope"}, ["body", "rollouts"]),
    ("/queues/rollouts/enqueue", {}, ["body", "rollouts"]),
    ("/queues/rollouts/dequeue", {"limit": "x"}, ["body", "limit"]),
    ("/rollouts/search", {"sort_order": "sideways"}, ["body", "sort_order"]),
    ("/rollouts/search", {"filter_logic": "xor"}, ["body", "filter_logic"]),
    ("/waits/rollouts", {"rollout_ids": "ro-1"}, ["body", "rollout_ids"]),
    ("/spans/search", {}, ["body", "rollout_id"]),
    ("/resources", {"x": "not an object"}, ["body", "resources", "x"]),
])
def test_bad_input_is_422_naming_the_field(algo, path: str, body, field: list):
    response = algo.post(path, json=body)
    assert response.status_code == 422, response.text
    locations = [item["loc"] for item in response.json()["detail"]]
    assert field in locations, locations


def test_bad_query_parameters_are_422(algo):
    response = algo.get("/rollouts", params={"limit": "many"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["query", "limit"]
    assert algo.get("/rollouts", params={"status_in": "weird"}).status_code == 422
    assert algo.get("/spans").status_code == 422  # rollout_id is required


@pytest.mark.parametrize("path,field", [
    ("/rollouts?limit=", ["query", "limit"]),  # blank is a value, as in AGL 0.3, not "absent"
    ("/rollouts/ro-1/attempts?sort_order=", ["query", "sort_order"]),
    ("/workers?limit=99999999999999999999", ["query", "limit"]),  # was the database's 400
    ("/resources/rs-1?version=abc", ["query", "version"]),
])
def test_query_parameter_errors_name_the_query_and_the_parameter(algo, path: str, field: list):
    response = algo.get(path)
    assert response.status_code == 422, response.text
    assert [item["loc"] for item in response.json()["detail"]] == [field]


def test_a_span_sequence_id_whose_successor_overflows_is_422_not_400(algo):
    span = {"rollout_id": "ro-1", "attempt_id": "at-1", "sequence_id": 2**31 - 1,
            "trace_id": "t", "span_id": "s", "name": "n"}
    response = algo.post("/spans", json=span)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "sequence_id"]


def test_path_parameter_errors_say_path(algo):
    response = algo.post("/workers/" + "w" * 201, json={})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["path", "worker_id"]
    response = algo.post("/resources/" + "r" * 41, json={"main": {"resource_type": "x"}})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["path", "resources_id"]


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2", b"\xff\xfe", b'{"rollouts": [}'])
def test_malformed_json_is_400_without_a_traceback(algo, raw: bytes):
    response = algo.post("/queues/rollouts/enqueue", content=raw,
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "Traceback" not in response.text and "detail" in response.json()


def test_json_with_a_nul_character_is_refused_not_500(algo):
    response = algo.post("/queues/rollouts/enqueue",
                         json={"rollouts": [{"input": {"text": "a\u0000b"}}]})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "rollouts", 0, "input", "text"]


def test_unknown_ids_are_404(algo):
    assert algo.get("/rollouts/ro-000000000000").status_code == 404
    assert algo.post("/rollouts/ro-000000000000/attempts/at-1",
                     json={"status": "failed"}).status_code == 404
    assert algo.get("/resources/rs-000000000000").status_code == 404
    assert algo.post("/spans/next", json={"rollout_id": "ro-0", "attempt_id": "at-0"}
                     ).status_code == 404


def test_a_body_over_the_limit_is_413(algo):
    huge = json.dumps({"rollouts": [{"input": "x" * (9 * 1024 * 1024)}]})
    response = algo.post("/queues/rollouts/enqueue", content=huge,
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 413


def test_too_many_spans_or_a_huge_attribute_is_refused(algo, runner):
    rid = _enqueue(algo)[0]["rollout_id"]
    aid = runner.post("/queues/rollouts/dequeue", json={}).json()[0]["attempt"]["attempt_id"]
    base = {"rollout_id": rid, "attempt_id": aid, "sequence_id": 1, "trace_id": "a" * 32,
            "name": "s"}
    many = [{**base, "span_id": f"{i:016x}"} for i in range(5001)]
    assert runner.post("/spans/batch", json={"spans": many}).status_code == 413
    big = {**base, "span_id": "1" * 16, "attributes": {"prompt": "x" * (300 * 1024)}}
    response = runner.post("/spans", json=big)
    assert response.status_code == 400
    assert "prompt" in response.json()["detail"]["attributes"]


def test_wrong_content_type_is_415(algo):
    response = algo.post("/rollouts/search", content=b"limit=1",
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 415


def test_a_database_that_is_down_answers_503_with_retry_after(django_db_setup):
    """Finding 6: Postgres restarting answered HTTP 500s (enqueue, span batch, dequeue)
    instead of a retryable answer. Nothing listens on the database port here."""
    from runners.client import ApiError, StoreClient
    from tests.api.conftest import start_server

    server = start_server(workers=1, threads=2,
                          env={"DATABASE_URL": "postgres://postgres@127.0.0.1:18601/down"})
    try:
        with http(server, "agl_some-key-0000000000000000000") as client:
            for path, body in [("/queues/rollouts/enqueue", {"rollouts": [{"input": 1}]}),
                               ("/queues/rollouts/dequeue", {"limit": 1}),
                               ("/spans/batch", {"spans": []})]:
                response = client.post(path, json=body)
                assert response.status_code == 503, (path, response.text)
                assert response.headers["Retry-After"] == "1"
        with StoreClient(server.url, "agl_some-key-0000000000000000000", retries=1,
                         backoff=0.01) as store_client, pytest.raises(ApiError) as raised:
            store_client.get_rollout("ro-x")
        assert raised.value.status == 503
    finally:
        server.stop()
