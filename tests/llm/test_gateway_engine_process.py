"""The engine in its own process (issue 22, point 1; LLM_GATEWAY_ENGINE_PROCESS): calls stream
back from it with their logprobs and are recorded, an engine process killed mid-call is
restarted and only that call fails (503, nothing recorded), and hot reload keeps serving 16
concurrent callers."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from store import services
from trainer import conventions as c
from trainer.checkpoints import checkpoint_save_dir
from trainer.llm.engine_client import EngineProcess
from trainer.llm.registry import Space
from trainer.llm.server import ServerThread, build_gateway
from trainer.models import TrainingJob

from .test_gateway import MESSAGES, client, llm_spans, started_attempt

pytestmark = pytest.mark.slow


@pytest.fixture
def process_gateway(model_dir: Path, transactional_db: None) -> Iterator[tuple]:
    gateway = build_gateway(models=[f"tiny={model_dir}"], engine_process=True)
    server = ServerThread(gateway.app()).start()
    try:
        yield gateway, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def wait_until(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_calls_decode_in_another_process_and_are_recorded(process_gateway, keyed):
    gateway, base = process_gateway
    project, key, *_ = keyed
    assert isinstance(gateway.batcher, EngineProcess)
    assert gateway.batcher.pid not in (None, os.getpid())
    rid, aid = started_attempt(project)
    reply = client(base, key, rid, aid).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, seed=3, n=2, logprobs=True,
        top_logprobs=2)
    assert len(reply.choices) == 2
    spans = sorted(llm_spans(rid), key=lambda s: s.attributes["lightning.llm.choice_index"])
    engine = gateway.registry.by_name("tiny")
    for span, choice in zip(spans, reply.choices, strict=True):
        a = span.attributes
        assert engine.decode(a[c.LLM_RESPONSE_IDS]) == choice.message.content
        assert len(a[c.LLM_LOGPROBS]) == len(a[c.LLM_RESPONSE_IDS]) == len(
            choice.logprobs.content)
        assert [e.logprob for e in choice.logprobs.content] == a[c.LLM_LOGPROBS]
        assert a[c.LLM_LOGPROBS_OF] == "sampled:float32"
    # streamed: token by token from the engine process (a chunk each, with its id), the
    # tokens and the text the ones recorded
    stream = client(base, key, rid, aid).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, stream=True, seed=1,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    streamed = [i for ch in chunks for i in (ch.model_extra or {}).get("token_ids") or []]
    recorded = llm_spans(rid)[-1].attributes[c.LLM_RESPONSE_IDS]
    assert len([ch for ch in chunks if (ch.model_extra or {}).get("token_ids")]) == 6
    assert streamed == recorded
    assert engine.decode(recorded) == "".join(ch.delta.content or "" for ch in chunks)
    # idempotent retry: one span, the same answer
    again = [client(base, key, rid, aid).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, seed=5,
        extra_headers={"Idempotency-Key": "k1"}).id for _ in range(2)]
    assert again[0] == again[1] and len(llm_spans(rid)) == 4


def test_an_engine_process_killed_mid_call_is_restarted_and_that_call_fails_503(
        process_gateway, keyed):
    gateway, base = process_gateway
    project, key, *_ = keyed
    engines = gateway.batcher
    rid, aid = started_attempt(project)
    client(base, key, rid, aid).chat.completions.create(model="tiny", messages=MESSAGES,
                                                        max_tokens=2)
    assert len(llm_spans(rid)) == 1
    first = engines.pid
    os.kill(first, signal.SIGSTOP)  # frozen: the call below is surely in flight when killed
    answer = {}

    def call() -> None:
        answer["r"] = httpx.post(
            f"{base}/rollout/{rid}/attempt/{aid}/v1/chat/completions", timeout=60,
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "messages": MESSAGES, "max_tokens": 8})

    thread = threading.Thread(target=call)
    thread.start()
    wait_until(lambda: engines.pending() == 1)
    os.kill(first, signal.SIGKILL)
    thread.join(60)
    r = answer["r"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert r.headers["retry-after"] == "1"
    assert len(llm_spans(rid)) == 1  # nothing of the failed call recorded
    assert engines.restarts == 1 and engines.pid != first
    # later calls succeed on the new engine process (the model loaded there again)
    for _ in range(3):
        client(base, key, rid, aid).chat.completions.create(model="tiny", messages=MESSAGES,
                                                            max_tokens=2)
    assert len(llm_spans(rid)) == 4
    assert engines.pending() == 0


def test_hot_reload_under_16_concurrent_callers(process_gateway, keyed, model_dir, settings,
                                                tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "ckpt")}}}
    gateway, base = process_gateway
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
    client(base, key, rid, aid).chat.completions.create(model="job-x", messages=MESSAGES,
                                                        max_tokens=2)
    assert gateway.registry.loaded_versions(space) == [0]
    errors, answers, stop = [], [], threading.Event()

    def caller(i: int) -> None:
        try:
            while not stop.is_set() or len(answers) < 16 * 3:
                out = client(base, key, rid, aid).chat.completions.create(
                    model="job-x", messages=MESSAGES, max_tokens=3, stream=(i % 2 == 1))
                answers.append(list(out) if i % 2 == 1 else out)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for version in (1, 2, 3):  # the trainer publishes new versions while calls run
        services.resources_update(project=project, resources_id=resources_id,
                                  resources=llm(version))
        gateway.poll_once()
        assert version in gateway.registry.loaded_versions(space)
    stop.set()
    for t in threads:
        t.join(120)
    assert errors == []
    assert gateway.registry.loaded_versions(space) == [2, 3]  # at most 2 kept
    assert gateway.batcher.restarts == 0
    assert len(llm_spans(rid)) == 1 + len(answers)
    # dropped versions are unloaded in the engine process too; the newest serves the pin
    client(base, key, rid, aid).chat.completions.create(model="job-x", messages=MESSAGES,
                                                        max_tokens=2)
    assert llm_spans(rid)[-1].attributes[c.LLM_VERSION] == 3
    with pytest.raises(openai.NotFoundError):
        client(base, key).chat.completions.create(model="missing", messages=MESSAGES)


def test_calls_right_after_a_restart_wait_for_the_new_engine_process(process_gateway, keyed):
    """Killed between calls: nothing fails, and a call sent while the new process is still
    starting (importing torch, loading the model) waits for it there and is answered."""
    gateway, base = process_gateway
    project, key, *_ = keyed
    engines = gateway.batcher
    rid, aid = started_attempt(project)
    os.kill(engines.pid, signal.SIGKILL)
    wait_until(lambda: engines.restarts == 1)
    stream = client(base, key, rid, aid).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == \
        gateway.registry.by_name("tiny").decode(llm_spans(rid)[0].attributes[c.LLM_RESPONSE_IDS])
    assert len(llm_spans(rid)) == 1 and engines.restarts == 1
