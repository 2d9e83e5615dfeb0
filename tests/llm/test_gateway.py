"""The model gateway over real HTTP: the official openai client, attribution, recording,
bad input, hot reload, upstream mode."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from django.utils import timezone

from store import services
from store.api.auth import cached_key_lean
from store.models import ApiKey, Span
from store.services import RolloutSpec
from store.tokens import attempt_token
from trainer import conventions as c
from trainer.checkpoints import checkpoint_save_dir
from trainer.llm.registry import Space
from trainer.llm.server import ServerThread, build_gateway
from trainer.models import TrainingJob

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "abc 7"}]


def started_attempt(project, resources_id=None):
    rollout = services.rollout_enqueue_many(
        project=project, specs=[RolloutSpec(input={"x": 1}, resources_id=resources_id)])[0]
    rollout, attempt = services.rollout_dequeue(project=project, worker_id="w")
    return rollout.pk, attempt.attempt_id


def client(base: str, key: str, rollout=None, attempt=None) -> openai.OpenAI:
    url = f"{base}/rollout/{rollout}/attempt/{attempt}/v1" if rollout else f"{base}/v1"
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0)


def llm_spans(rollout_id):
    return list(Span.objects.filter(rollout_id=rollout_id, name=c.LLM_CALL_SPAN)
                .order_by("sequence_id"))


def test_openai_client_chat_and_attribution_by_path(gateway_server, keyed):
    gateway, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    reply = client(base, key, rid, aid).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=1.0, seed=3, n=2,
        logprobs=True, top_logprobs=2)
    assert len(reply.choices) == 2
    assert reply.usage.completion_tokens == sum(
        len(ch.logprobs.content) for ch in reply.choices)
    spans = llm_spans(rid)
    assert len(spans) == 2
    engine = gateway.registry.by_name("tiny")
    for span, choice in zip(sorted(spans, key=lambda s: s.attributes["lightning.llm.choice_index"]),
                            reply.choices, strict=True):
        a = span.attributes
        assert engine.decode(a[c.LLM_RESPONSE_IDS]) == choice.message.content
        assert a[c.LLM_PROMPT_IDS] and a[c.LLM_VERSION] == 0
        assert len(a[c.LLM_LOGPROBS]) == len(a[c.LLM_RESPONSE_IDS])
        assert [e["logprob"] for e in json.loads(a["logprobs.content"])] == a[c.LLM_LOGPROBS]
        assert a["gen_ai.prompt.0.content"] == "abc 7"
        assert a["gen_ai.completion.0.content"] == choice.message.content
    # The same seed gives the same text.
    again = client(base, key).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, seed=3, n=2)
    assert [ch.message.content for ch in again.choices] == [
        ch.message.content for ch in reply.choices]


def test_a_cached_key_is_refused_once_revoked_and_the_phases_are_timed(gateway_server, keyed):
    """A key the gateway authenticated is kept in its process's lean cache (no database
    before the body); the call's first statement checks that it is still live: revoked, the
    next call is 401, attributed or not, and nothing more is recorded. Server-Timing names
    each phase of a call."""
    gateway, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    attributed, plain = client(base, key, rid, aid), client(base, key)
    raw = attributed.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=2)
    raw.parse()
    phases = dict(part.strip().split(";dur=") for part in raw.headers["server-timing"].split(","))
    assert {"auth", "parse", "prepare", "engine", "queue", "decode", "wake", "record", "store",
            "respond", "gateway"} <= set(phases)
    plain.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert cached_key_lean(key) is not None  # the gateway runs in this process (a thread)
    ApiKey.objects.filter(project=project).update(revoked_at=timezone.now())
    for caller in (attributed, plain):
        with pytest.raises(openai.AuthenticationError):
            caller.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert len(llm_spans(rid)) == 1


def test_streaming_completions_and_headers_attribution(gateway_server, keyed):
    gateway, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    stream = client(base, key).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, stream=True, seed=1,
        extra_headers={"x-rollout-id": rid, "x-attempt-id": aid})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    spans = llm_spans(rid)
    assert len(spans) == 1
    assert gateway.registry.by_name("tiny").decode(
        spans[0].attributes[c.LLM_RESPONSE_IDS]) == text
    done = client(base, key, rid, aid).completions.create(model="tiny", prompt="abc 1",
                                                            max_tokens=3, logprobs=1)
    assert len(done.choices[0].logprobs.token_logprobs) == done.usage.completion_tokens
    assert Span.objects.filter(rollout_id=rid, name=c.LLM_COMPLETION_SPAN).count() == 1


def test_retry_with_the_same_idempotency_key_is_recorded_once(gateway_server, keyed):
    _, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    for _ in range(2):
        client(base, key, rid, aid).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2,
            extra_headers={"Idempotency-Key": "call-1"})
    assert len(llm_spans(rid)) == 1
    client(base, key, rid, aid).chat.completions.create(model="tiny", messages=MESSAGES,
                                                        max_tokens=2)
    assert len(llm_spans(rid)) == 2


def test_attempt_token_is_good_for_its_own_attempt_only(gateway_server, keyed):
    _, base = gateway_server
    project, *_ = keyed
    rid, aid = started_attempt(project)
    token = attempt_token(project_id=project.pk, rollout_id=rid, attempt_id=aid)
    client(base, token, rid, aid).chat.completions.create(model="tiny", messages=MESSAGES,
                                                          max_tokens=2)
    rid2, aid2 = started_attempt(project)
    with pytest.raises(openai.AuthenticationError):
        client(base, token, rid2, aid2).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(base, "wrong").chat.completions.create(model="tiny", messages=MESSAGES)


def test_bad_input_answers(gateway_server, keyed):
    _, base = gateway_server
    project, key, other, other_key = keyed
    rid, aid = started_attempt(project)
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"})
    # another project's key: the rollout is not found, nothing recorded
    with pytest.raises(openai.NotFoundError):
        client(base, other_key, rid, aid).chat.completions.create(model="tiny",
                                                                  messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        client(base, key, rid, "nope").chat.completions.create(model="tiny", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        client(base, key).chat.completions.create(model="missing", messages=MESSAGES)
    long = [{"role": "user", "content": "x" * 500}]
    with pytest.raises(openai.BadRequestError, match="context is 32 tokens"):
        client(base, key, rid, aid).chat.completions.create(model="tiny", messages=long)
    for body in ("{not json", json.dumps({"model": "tiny"}),
                 json.dumps({"model": "tiny", "messages": MESSAGES, "n": 0}),
                 json.dumps({"model": "tiny", "messages": MESSAGES, "temperature": "hot"})):
        answer = http.post(f"/rollout/{rid}/attempt/{aid}/v1/chat/completions", content=body)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["message"]
    assert llm_spans(rid) == []
    services.attempt_update(project=project, rollout_id=rid, attempt_id=aid, status="succeeded")
    answer = http.post(f"/rollout/{rid}/attempt/{aid}/v1/chat/completions",
                       json={"model": "tiny", "messages": MESSAGES})
    assert answer.status_code == 409
    assert llm_spans(rid) == []
    # unattributed calls are served, not recorded
    assert http.post("/v1/chat/completions",
                     json={"model": "tiny", "messages": MESSAGES}).status_code == 200
    assert [m.id for m in client(base, key).models.list()] == ["tiny"]


def test_gateway_metrics_need_the_token_and_count_tokens(gateway_server, keyed, settings):
    _, base = gateway_server
    project, key, *_ = keyed
    client(base, key).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    settings.METRICS_TOKEN = "scrape"
    assert httpx.get(f"{base}/metrics").status_code == 401
    text = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer scrape"}).text
    assert 'lightning_gateway_completion_tokens_total{model="tiny"}' in text


def test_hot_reload_under_concurrent_requests(gateway_server, keyed, model_dir, settings,
                                              tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "ckpt")}}}
    gateway, base = gateway_server
    project, key, *_ = keyed
    job = TrainingJob.objects.create(project=project, agent="a", algorithm="grpo_lm")
    checkpoint = checkpoint_save_dir(directory=model_dir, name_prefix=f"jobs/{job.pk}", step=0)

    def llm(version):
        return {"llm": {"resource_type": "proxy_llm", "endpoint": f"{base}/v1", "model": "job-x",
                        "version": version, "checkpoint": checkpoint}}

    resources_id = services.resources_add(project=project, resources=llm(0)) \
        .resource_set.resources_id
    rid, aid = started_attempt(project, resources_id)
    space = Space(project.pk, resources_id, "job-x")
    errors, versions = [], []

    def caller():
        try:
            for _ in range(6):
                out = client(base, key, rid, aid).chat.completions.create(
                    model="job-x", messages=MESSAGES, max_tokens=2)
                versions.append(out.id)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    client(base, key, rid, aid).chat.completions.create(model="job-x", messages=MESSAGES,
                                                        max_tokens=2)
    assert gateway.registry.loaded_versions(space) == [0]
    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for version in (1, 2):  # the trainer publishes new versions while calls run
        services.resources_update(project=project, resources_id=resources_id,
                                  resources=llm(version))
        gateway.poll_once()
        assert version in gateway.registry.loaded_versions(space)
    for t in threads:
        t.join()
    assert errors == []
    assert len(versions) == 48
    assert gateway.registry.loaded_versions(space) == [1, 2]  # at most 2 kept
    assert len(llm_spans(rid)) == 49
    # The rollout pinned llm version 0, unloaded now: the newest serves it, and says so.
    client(base, key, rid, aid).chat.completions.create(model="job-x", messages=MESSAGES,
                                                        max_tokens=2)
    assert llm_spans(rid)[-1].attributes[c.LLM_VERSION] == 2


def test_upstream_mode_records_the_upstreams_token_ids(gateway_server, keyed, model_dir):
    engine_gateway, engine_base = gateway_server
    project, key, *_ = keyed
    front = build_gateway(upstream_url=f"{engine_base}/v1", upstream_key=key)
    server = ServerThread(front.app()).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        rid, aid = started_attempt(project)
        reply = client(base, key, rid, aid).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, seed=5)
        spans = llm_spans(rid)
        assert len(spans) == 1
        a = spans[0].attributes
        engine = engine_gateway.registry.by_name("tiny")
        assert engine.decode(a[c.LLM_RESPONSE_IDS]) == reply.choices[0].message.content
        assert len(a[c.LLM_LOGPROBS]) == len(a[c.LLM_RESPONSE_IDS])
        assert a[c.LLM_PROMPT_IDS]
    finally:
        server.stop()


class _AnswerLost(httpx.HTTPTransport):
    """The first request is served in full, then its answer is lost (a read timeout, as an
    agent's client sees under load); the rest go through."""

    def __init__(self) -> None:
        super().__init__()
        self.tries = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.tries += 1
        response = super().handle_request(request)
        if self.tries == 1:
            response.read()
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response


def test_the_openai_clients_retry_of_a_call_without_a_key_is_recorded_once(gateway_server,
                                                                            keyed):
    """The openai client's own retry (no idempotency key, `x-stainless-retry-count: 1`) of a
    call whose answer it lost: one call recorded, the retry answered under its response id
    (trainer/llm/retries.py)."""
    _, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    lossy = _AnswerLost()
    agent = openai.OpenAI(base_url=f"{base}/rollout/{rid}/attempt/{aid}/v1", api_key=key,
                          max_retries=1, http_client=httpx.Client(transport=lossy))
    reply = agent.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                          seed=5, temperature=1.0)
    assert lossy.tries == 2
    spans = llm_spans(rid)
    assert len(spans) == 1
    assert spans[0].attributes["gen_ai.response.id"] == reply.id
    # The same body again, not as a retry: a new call of the agent's.
    again = client(base, key, rid, aid).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, seed=5, temperature=1.0)
    assert again.id != reply.id and len(llm_spans(rid)) == 2


def test_a_retry_header_with_another_body_is_a_new_call(gateway_server, keyed):
    _, base = gateway_server
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    http = httpx.Client(base_url=f"{base}/rollout/{rid}/attempt/{aid}/v1",
                        headers={"Authorization": f"Bearer {key}"})
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    first = http.post("/chat/completions", json=body, headers={"x-stainless-retry-count": "0"})
    other = http.post("/chat/completions", json={**body, "max_tokens": 3},
                      headers={"x-stainless-retry-count": "1"})
    retry = http.post("/chat/completions", json={**body, "max_tokens": 3},
                      headers={"x-stainless-retry-count": "2"})
    assert [a.status_code for a in (first, other, retry)] == [200, 200, 200]
    assert first.json()["id"] != other.json()["id"] == retry.json()["id"]
    assert len(llm_spans(rid)) == 2
