"""Agent Lightning 0.3.0's own triplet adapter reads the spans our model gateway records:
token ids and rewards come out as AGL's training code expects them."""

from __future__ import annotations

import json

import openai
import pytest

from runners.tracing import AGL_ANNOTATION
from store import services
from store.services import RolloutSpec
from tests.api.test_api_agl_compat import agl_python, run_agl  # noqa: F401 - fixture
from trainer import conventions as c
from trainer.llm.server import ServerThread, build_gateway

pytestmark = pytest.mark.slow


def test_agl_tracer_trace_to_triplet_reads_gateway_spans(api_server, keys, agl_python):  # noqa: F811
    from django.conf import settings

    from examples.llm_cipher.model import base_checkpoint

    gateway = build_gateway(models=[f"tiny={base_checkpoint(settings.MODELS_DIR)}"])
    server = ServerThread(gateway.app()).start()
    try:
        project = keys.project
        services.rollout_enqueue_many(project=project, specs=[RolloutSpec(input={})])
        rollout, attempt = services.rollout_dequeue(project=project, worker_id="w")
        llm = openai.OpenAI(api_key=keys.runner, max_retries=0, base_url=(
            f"http://127.0.0.1:{server.port}/rollout/{rollout.pk}/attempt/"
            f"{attempt.attempt_id}/v1"))
        replies = [llm.chat.completions.create(model="tiny", max_tokens=3, seed=i, messages=[
            {"role": "user", "content": f"abc {i}"}]) for i in range(2)]
        services.spans_add(project=project, spans=[{
            "rollout_id": rollout.pk, "attempt_id": attempt.attempt_id, "trace_id": "f" * 32,
            "span_id": "e" * 16, "name": AGL_ANNOTATION, "start_time": 9e9, "end_time": 9e9,
            "attributes": {"agentlightning.reward.0.name": "primary",
                           c.REWARD_VALUE_ATTR.format(index=0): 0.75}}])
    finally:
        server.stop()
    url = api_server.url.replace("http://", f"http://algo:{keys.algorithm}@")
    out = json.loads(run_agl(agl_python, "llm_triplets.py", url, rollout.pk).splitlines()[-1])
    engine = gateway.registry.by_name("tiny")
    triplets = out["triplets"]
    assert len(triplets) == 2
    assert [engine.decode(t["response"]) for t in triplets] == [
        r.choices[0].message.content for r in replies]
    assert all(t["prompt"] for t in triplets)
    assert [t["response_id"] for t in triplets] == [r.id for r in replies]
    assert triplets[-1]["reward"] == 0.75
