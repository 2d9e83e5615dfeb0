"""Unmodified AGL 0.3 agents (tests/agl/agents.py) on our runners: a Celery rollout worker and
the remote runner, both running in .venv-agl (the real agentlightning==0.3.0) with our project
on the path (tests/agl/with_project.py), as after `pip install -e '.[agl]'`."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from runners import services as runner_services
from store import services as store_services
from store.models import Rollout, Span
from store.services import RolloutSpec
from tests.api.conftest import ROOT, Keys, Server, database_url_for_tests
from tests.api.test_api_agl_compat import AGL_ENV, agl_env, agl_python  # noqa: F401 - fixture
from tests.celery_fixtures import wait_until

pytestmark = pytest.mark.slow
WITH_PROJECT = str(ROOT / "tests" / "agl" / "with_project.py")
RESOURCES = {
    "llm": {"resource_type": "llm", "endpoint": "http://127.0.0.1:9/v1", "model": "compat-llm"},
    "proxy": {"resource_type": "proxy_llm", "endpoint": "http://gateway:8000", "model": "m"},
    "prompt": {"resource_type": "prompt_template", "template": "say {x}", "engine": "f-string"},
}


def _spans(algo: httpx.Client, rid: str) -> dict[str, list[dict]]:
    by_name: dict[str, list[dict]] = {}
    for span in algo.get("/spans", params={"rollout_id": rid}).json()["items"]:
        by_name.setdefault(span["name"], []).append(span)
    return by_name


def _reward(spans: dict[str, list[dict]]) -> float:
    (annotation,) = spans["agentlightning.annotation"]
    return annotation["attributes"]["agentlightning.reward.0.value"]


def _run_remote(python, server: Server, key: str, agent: str, count: int) -> str:
    env = {**agl_env(), "DATABASE_URL": database_url_for_tests(),
           "DJANGO_SECRET_KEY": "test-suite-only"}
    done = subprocess.run(
        [str(python), WITH_PROJECT, "manage.py", "runner", "--server", server.url, "--key", key,
         "--agent", agent, "--max-rollouts", str(count), "--wait-seconds", "1",
         "--heartbeat-seconds", "0.5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return done.stdout


def test_agl_rollout_function_runs_on_the_remote_runner(api_server, keys: Keys, algo,
                                                        agl_python):  # noqa: F811
    assert algo.post("/resources", json=RESOURCES).status_code == 201
    body = {"rollouts": [{"input": {"value": v}, "mode": "train"} for v in (3, 7)]}
    rollouts = algo.post("/queues/rollouts/enqueue", json=body).json()
    _run_remote(agl_python, api_server, keys.runner, "tests.agl.agents:llm_agent", 2)
    for rollout, value in zip(rollouts, (3, 7), strict=True):
        rid = rollout["rollout_id"]
        assert algo.get(f"/rollouts/{rid}").json()["status"] == "succeeded"
        spans = _spans(algo, rid)
        assert _reward(spans) == pytest.approx(value / 10)
        (obj,) = spans["agentlightning.object"]
        assert '"compat-llm"' in str(obj["attributes"]) and "127.0.0.1:9/v1" in str(
            obj["attributes"])
        (operation,) = spans["agentlightning.operation"]  # AGL's fixed operation span name
        assert "compat.think" in str(operation["attributes"])


def test_agl_litagent_gets_typed_resources_and_its_proxy_url(api_server, keys: Keys, algo,
                                                             agl_python):  # noqa: F811
    algo.post("/resources", json=RESOURCES)
    rid = algo.post("/queues/rollouts/enqueue", json={
        "rollouts": [{"input": {"value": 5}, "mode": "val"}]}).json()[0]["rollout_id"]
    _run_remote(agl_python, api_server, keys.runner, "tests.agl.agents:ProxyAgent", 1)
    got = algo.get(f"/rollouts/{rid}").json()
    assert got["status"] == "succeeded", got
    spans = _spans(algo, rid)
    assert _reward(spans) == 5.0
    (message,) = spans["agentlightning.message"]
    body = message["attributes"]["agentlightning.message.body"]
    aid = got["attempt"]["attempt_id"]
    assert body == f"val http://gateway:8000/rollout/{rid}/attempt/{aid} say 5"


def _enqueue_for_celery(project, spec: RolloutSpec, agent: str) -> Rollout:
    """`rollouts_enqueue_for_celery` without its import check of the agent: this test process
    has no agentlightning (an enqueuer with the `agl` extra passes that check)."""
    rollout = store_services.rollout_enqueue(project=project, spec=spec)
    marked = store_services.rollout_dispatch_set(
        project=project, rollout_ids=[rollout.pk], dispatch=runner_services.CELERY, target=agent)
    runner_services.dispatches_send(marked)
    return rollout


@pytest.mark.django_db(transaction=True)
def test_agl_agents_run_on_a_celery_worker(project, broker_url, sending_to, celery_workers,
                                           agl_python):  # noqa: F811
    store_services.resources_add(project=project, resources=RESOURCES)
    python = [str(agl_python), WITH_PROJECT]
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1, env=AGL_ENV,
                   python=python)
    fn = _enqueue_for_celery(project, RolloutSpec(input={"value": 4}, mode="train"),
                             "tests.agl.agents:llm_agent")
    cls = _enqueue_for_celery(project, RolloutSpec(input={"value": 2}, mode="test"),
                              "tests.agl.agents:ProxyAgent")

    def finished() -> bool:
        return set(Rollout.objects.filter(project=project).values_list("status", flat=True)) \
            <= {"succeeded", "failed"}

    wait_until(finished, timeout=240, message="AGL rollouts did not finish")
    for rollout, reward in ((fn, 0.4), (cls, 2.0)):
        rollout.refresh_from_db()
        assert rollout.status == "succeeded", rollout.latest_attempt.metadata
        annotation = Span.objects.get(rollout=rollout, name="agentlightning.annotation")
        assert annotation.attributes["agentlightning.reward.0.value"] == pytest.approx(reward)
    assert Span.objects.filter(rollout=fn, name="agentlightning.object").count() == 1
    assert Span.objects.filter(rollout=cls, name="agentlightning.message").count() == 1
