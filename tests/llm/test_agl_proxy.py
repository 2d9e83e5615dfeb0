"""An unmodified AGL `@rollout` agent on a Celery worker (in .venv-agl) calls our model gateway
through its `ProxyLLM` resource: the call is attributed to the rollout and attempt by AGL's
per-attempt base URL and recorded as a span of that attempt."""

from __future__ import annotations

import pytest

from store import services
from store.models import Rollout, Span
from store.services import RolloutSpec
from tests.api.test_api_agl_agents import WITH_PROJECT, _enqueue_for_celery
from tests.api.test_api_agl_compat import AGL_ENV, agl_python  # noqa: F401 - fixture
from tests.celery_fixtures import wait_until
from trainer import conventions as c

pytestmark = pytest.mark.slow


def test_agl_proxy_llm_calls_reach_the_gateway_as_the_attempts_spans(
        gateway_server, keyed, broker_url, sending_to, celery_workers, agl_python):  # noqa: F811
    _, base = gateway_server
    project, key, *_ = keyed
    services.resources_add(project=project, resources={"llm": {
        "resource_type": "proxy_llm", "endpoint": f"{base}/v1", "model": "tiny", "api_key": key}})
    celery_workers(queues=["rollouts"], broker_url=broker_url, concurrency=1, env=AGL_ENV,
                   python=[str(agl_python), WITH_PROJECT])
    rollout = _enqueue_for_celery(project, RolloutSpec(input={"prompt": "abc 7"}, mode="train"),
                                  "tests.agl.agents:gateway_agent")

    def finished() -> bool:
        return Rollout.objects.get(pk=rollout.pk).status in ("succeeded", "failed")

    wait_until(finished, timeout=240, message="the AGL rollout did not finish")
    rollout.refresh_from_db()
    assert rollout.status == "succeeded", rollout.latest_attempt.metadata
    (call,) = Span.objects.filter(rollout=rollout, name=c.LLM_CALL_SPAN)
    assert call.attempt_id == rollout.latest_attempt_id
    assert call.attributes[c.LLM_RESPONSE_IDS]
    reward = Span.objects.get(rollout=rollout, name="agentlightning.annotation")
    assert reward.attributes["agentlightning.reward.0.value"] == 1.0
