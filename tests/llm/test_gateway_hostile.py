"""The gateway against a hostile tenant (issue 22, point 0): every bad input is a 4xx in
OpenAI's error shape, found before the shared decode; the key is checked before the body is
read; one bad request in a batch fails no neighbour."""

from __future__ import annotations

import threading

import httpx
import pytest

from trainer.llm.batcher import Batcher
from trainer.llm.engine import Engine, Params, Sequence_

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "abc 7"}]


def post(base, key, body=None, *, raw=None, path="/v1/chat/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(base + path, content=raw, headers=headers, timeout=60)
    return httpx.post(base + path, json=body, headers=headers, timeout=60)


def chat(**extra):
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra}


def assert_error(reply, status, param=None):
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(("body", "param"), [
    (chat(seed=2**64), "seed"),
    (chat(max_tokens=10**6), "max_tokens"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": 7}]}]),
     "messages[0].content[0]"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0]"),
    (chat(messages=[{"role": "user", "content": "a\x00b"}]), "messages[0].content"),
    ({"model": "tiny", "prompt": [1, 2, 10**9], "max_tokens": 2}, "prompt"),
    ({"model": "tiny", "prompt": [-1], "max_tokens": 2}, "prompt"),
])
def test_values_the_engine_or_the_store_would_reject_are_400(gateway_server, keyed, body, param):
    _, base = gateway_server
    _, key, *_ = keyed
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    assert_error(post(base, key, body, path=path), 400, param)


def test_a_lone_surrogate_and_deep_nesting_are_400_and_checked_after_the_key(
        gateway_server, keyed):
    _, base = gateway_server
    _, key, *_ = keyed
    lone = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}'
    assert_error(post(base, key, raw=lone), 400, "messages[0].content")
    deep = b"[" * 100_000 + b"]" * 100_000
    assert_error(post(base, None, raw=deep), 401)
    assert_error(post(base, key, raw=deep), 400)


def test_large_seeds_and_tiny_temperatures_are_served(gateway_server, keyed):
    _, base = gateway_server
    _, key, *_ = keyed
    for extra in ({"seed": 2**63}, {"seed": -(2**63)}, {"seed": 9_300_000_000_000},
                  {"temperature": 1e-39}, {"temperature": 1e-7, "seed": 1}):
        reply = post(base, key, chat(**extra))
        assert reply.status_code == 200, (extra, reply.text)


def test_bodies_are_capped_and_prompts_refused_by_size_before_tokenizing(gateway_server, keyed):
    gateway, base = gateway_server
    _, key, *_ = keyed
    huge = chat(messages=[{"role": "user", "content": "a" * 200_000}])
    assert_error(post(base, key, huge), 400, "messages")
    assert post(base, key, huge).json()["error"]["code"] == "context_length_exceeded"
    gateway.max_body_bytes = 4096
    assert_error(post(base, None, huge), 401)  # no key: refused before the body is read
    assert_error(post(base, key, huge), 413)
    assert post(base, key, chat()).status_code == 200


def test_a_nul_in_the_paths_rollout_id_is_404(gateway_server, keyed):
    _, base = gateway_server
    _, key, *_ = keyed
    reply = post(base, key, chat(), path="/rollout/ro-%00x/attempt/at-1/v1/chat/completions")
    assert_error(reply, 404)


def test_bad_and_good_requests_released_together_fail_only_the_bad(gateway_server, keyed):
    _, base = gateway_server
    _, a_key, _, b_key = keyed
    bad = [chat(seed=2**64), {"model": "tiny", "prompt": [10**9], "max_tokens": 2}]
    results: dict[str, list[int]] = {"a": [], "b": []}
    start = threading.Barrier(6)

    def send(who, key, body):
        start.wait()
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        results[who].append(post(base, key, body, path=path).status_code)

    threads = [threading.Thread(target=send, args=("a", a_key, body)) for body in bad]
    threads += [threading.Thread(target=send, args=("b", b_key, chat(seed=i)))
                for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results["a"]) == [400, 400]
    assert results["b"] == [200] * 4


def test_a_batch_that_fails_decodes_each_request_alone(model_dir):
    """Below the gateway's checks: a request the engine fails on, batched with a good one,
    fails alone."""
    engine = Engine(model_dir, name="tiny")  # in this process, whatever the gateway's layout
    good_ids = engine.tokenizer("abc 7")["input_ids"]
    batcher = Batcher(window=0.5)
    bad = batcher.submit(engine, [Sequence_([10**9], Params(max_tokens=2))])
    good = batcher.submit(engine, [Sequence_(list(good_ids), Params(max_tokens=2, seed=1))])
    for job in (bad, good):
        assert job.done.wait(60)
    assert bad.error is not None
    assert good.error is None and good.sequences[0].done
    assert batcher.batches == 1


def test_a_checkpoint_that_does_not_load_is_422_and_stops_no_other_preload(
        gateway_server, keyed, model_dir, settings, tmp_path, caplog):
    from store import services
    from trainer.checkpoints import checkpoint_save_dir
    from trainer.llm.registry import Space
    from trainer.models import TrainingJob

    from .test_gateway import client, started_attempt

    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "ckpt")}}}
    gateway, base = gateway_server
    project, key, *_ = keyed
    job = TrainingJob.objects.create(project=project, agent="a", algorithm="grpo_lm")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{not json")
    broken = checkpoint_save_dir(directory=junk, name_prefix=f"jobs/{job.pk}", step=1)
    good = checkpoint_save_dir(directory=model_dir, name_prefix=f"jobs/{job.pk}", step=0)

    def llm(model, checkpoint):
        return {"llm": {"resource_type": "proxy_llm", "endpoint": f"{base}/v1", "model": model,
                        "version": 0, "checkpoint": checkpoint}}

    bad_res = services.resources_add(project=project, resources=llm("bad", broken)) \
        .resource_set.resources_id
    good_res = services.resources_add(project=project, resources=llm("good", good)) \
        .resource_set.resources_id
    rid, aid = started_attempt(project, bad_res)
    with pytest.raises(Exception) as caught:
        client(base, key, rid, aid).chat.completions.create(
            model="bad", messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 422
    assert caught.value.body["code"] == "checkpoint_unavailable"

    # Both followed; the bad one first: the good one still loads, the bad one is said once.
    gateway._watched.clear()
    gateway.watch(project.pk, bad_res, "bad")
    gateway.watch(project.pk, good_res, "good")
    assert gateway.poll_once() == 1
    assert gateway.registry.loaded_versions(Space(project.pk, good_res, "good")) == [0]
    assert gateway.poll_once() == 0
    assert sum("does not load" in r.getMessage() for r in caplog.records) == 1
