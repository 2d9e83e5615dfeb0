"""What the gateway records, whatever the client does (issue 22, point 0): a streamed call's
spans are stored before its final chunk and whether or not the client stays to read it; an
idempotency key is bound to its request body; an upstream's streamed answer is forwarded."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from trainer.llm.server import ServerThread, build_gateway

from .test_gateway import MESSAGES, llm_spans, started_attempt

pytestmark = pytest.mark.slow


def url(base, rid, aid):
    return f"{base}/rollout/{rid}/attempt/{aid}/v1/chat/completions"


def events(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def test_a_streamed_call_is_recorded_before_its_final_chunk(gateway_server, keyed):
    _, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "stream": True, "n": 2,
            "seed": 4}
    finished = 0
    with httpx.stream("POST", url(base, rid, aid), json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        for event in events(response):
            for choice in event["choices"]:
                if choice.get("finish_reason"):
                    assert len(llm_spans(rid)) == 2  # stored before the client hears the end
                    finished += 1
            if finished == 2:
                break  # and the client leaves at finish_reason, as it may
    assert finished == 2


def test_a_client_that_leaves_mid_stream_does_not_lose_the_call(gateway_server, keyed):
    _, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "stream": True,
            "ignore_eos": True, "seed": 2}
    with httpx.stream("POST", url(base, rid, aid), json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        next(events(response))  # the first chunk, then gone
    deadline = time.monotonic() + 60
    while not llm_spans(rid) and time.monotonic() < deadline:
        time.sleep(0.2)
    spans = llm_spans(rid)
    assert len(spans) == 1
    assert len(spans[0].attributes["response_token_ids"]) == 12


def test_an_idempotency_key_is_bound_to_its_body(gateway_server, keyed):
    _, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "k-1"}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "seed": 9}
    first = httpx.post(url(base, rid, aid), json=body, headers=headers, timeout=60)
    again = httpx.post(url(base, rid, aid), json=body, headers=headers, timeout=60)
    assert first.status_code == again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    other = httpx.post(url(base, rid, aid), json={**body, "max_tokens": 4}, headers=headers,
                       timeout=60)
    assert other.status_code == 422, other.text
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert len(llm_spans(rid)) == 1


def test_an_upstreams_streamed_answer_is_forwarded_and_recorded(gateway_server, keyed):
    _, engine_base = gateway_server
    project, key, *_ = keyed
    front = build_gateway(upstream_url=f"{engine_base}/v1", upstream_key=key)
    server = ServerThread(front.app()).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        rid, aid = started_attempt(project)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "stream": True,
                "seed": 3}
        with httpx.stream("POST", url(base, rid, aid), json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as response:
            chunks = list(events(response))
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        spans = llm_spans(rid)
        assert len(spans) == 1
        assert spans[0].attributes["gen_ai.completion.0.content"] == text
    finally:
        server.stop()
