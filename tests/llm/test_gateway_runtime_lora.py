"""vLLM's runtime LoRA endpoints on our gateway, and upstream mode driving them (issue 24,
point 5): gateway B serves a tiny base with LLM_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING on, as a
vLLM would; gateway A forwards to B, loads each published LoRA version into B and routes each
call to the version its rollout pinned, under concurrent callers (the official openai client)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from store import services
from store.models import Span
from trainer import conventions as c
from trainer.checkpoints import checkpoint_local_dir, checkpoint_save_dir
from trainer.llm.engine import Engine, Params, Sequence_
from trainer.llm.server import ServerThread, build_gateway
from trainer.llm.upstream_lora import lora_name
from trainer.models import TrainingJob

from .test_gateway import client, started_attempt
from .test_lora import adapter
from .tiny import tiny_model

pytestmark = pytest.mark.slow
PROMPT = "abc 12"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny-base"))


@pytest.fixture
def storage(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "ckpt")}}}


@pytest.fixture
def projects(transactional_db):
    """Two projects, each with an algorithm key and a runner key."""
    out = []
    for name in ("lora-a", "lora-b"):
        project = services.project_create(name=name)
        _, algorithm = services.api_key_create(project=project, role="algorithm")
        _, runner = services.api_key_create(project=project, role="runner")
        out.append((project, algorithm, runner))
    return out


def serve(gateway):
    server = ServerThread(gateway.app()).start()
    return server, f"http://127.0.0.1:{server.port}"


@pytest.fixture
def engine_b(tiny, storage, settings):
    """Gateway B: the tiny base, runtime LoRA updating on (the "vLLM")."""
    settings.LLM_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING = True
    gateway = build_gateway(models=[f"tiny={tiny}"])
    server, base = serve(gateway)
    try:
        yield gateway, base
    finally:
        server.stop()


def job_adapter(project, tiny, tmp_path, seed, step):
    """A LoRA checkpoint of one of `project`'s jobs (random non-zero adapter weights)."""
    job = TrainingJob.objects.create(project=project, agent="examples.llm_cipher.agent",
                                     algorithm="grpo_lm")
    directory = adapter(tiny, tmp_path / f"adapter-{seed}", seed)
    return checkpoint_save_dir(directory=directory, name_prefix=f"jobs/{job.pk}", step=step)


def expected_text(checkpoint) -> str:
    """Greedy decoding of PROMPT by the adapter merged into its base (a reference engine)."""
    engine = Engine(checkpoint_local_dir(checkpoint), device="cpu")
    seq = Sequence_(engine.tokenizer(PROMPT)["input_ids"],
                    Params(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.generate([seq])
    return seq.text


def complete(openai_client, model):
    return openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                            temperature=0, extra_body={"ignore_eos": True})


def llm_spans(rollout_id):
    return list(Span.objects.filter(rollout_id=rollout_id, name=c.LLM_COMPLETION_SPAN))


def post(base, path, key, body):
    return httpx.post(f"{base}/v1/{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def test_load_and_unload_endpoints_answer_as_vllm(engine_b, projects, tiny, tmp_path):
    gateway, base = engine_b
    gateway.registry.max_spaces = 2  # LLM_GATEWAY_MAX_MODELS_PER_PROJECT
    (p, p_alg, p_run), (q, q_alg, _) = projects
    ckpt = job_adapter(p, tiny, tmp_path, seed=1, step=1)
    path = str(checkpoint_local_dir(ckpt))

    answer = post(base, "load_lora_adapter", p_alg, {"lora_name": "mine", "lora_path": path,
                                                      "lora_int_id": 7})
    assert answer.status_code == 200, answer.text
    assert answer.text == "Success: LoRA adapter 'mine' added successfully."
    # P calls it by name and gets the adapter's decoding over the base; Q cannot see it.
    reply = complete(client(base, p_run), "mine")
    assert reply.choices[0].text == expected_text(ckpt) != complete(client(base, p_run),
                                                                     "tiny").choices[0].text
    assert sorted(m.id for m in client(base, p_run).models.list()) == ["mine", "tiny"]
    assert [m.id for m in client(base, q_alg).models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        complete(client(base, q_alg), "mine")

    def refused(key, body, status, kind, words, path_="load_lora_adapter"):
        answer = post(base, path_, key, body)
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == (kind, status) and words in error["message"]

    refused(p_alg, {"lora_name": "mine", "lora_path": path}, 400, "InvalidUserInput",
            "The lora adapter 'mine' has already been loaded.")
    refused(p_alg, {"lora_name": "x"}, 400, "InvalidUserInput",
            "Both 'lora_name' and 'lora_path' must be provided.")
    missing = path.replace("/step-1-", "/step-9-")
    refused(p_alg, {"lora_name": "x", "lora_path": missing}, 404, "NotFoundError",
            "No adapter found")
    # another project's checkpoint, or any other directory: as if it did not exist
    refused(q_alg, {"lora_name": "x", "lora_path": path}, 404, "NotFoundError",
            "No adapter found")
    refused(p_alg, {"lora_name": "x", "lora_path": str(tiny)}, 404, "NotFoundError",
            "No adapter found")
    # an adapter trained on a base this gateway has not loaded
    other = tiny_model(tmp_path / "other-base", seed=5)
    foreign = job_adapter(p, other, tmp_path / "o", seed=2, step=1)
    refused(p_alg, {"lora_name": "x", "lora_path": str(checkpoint_local_dir(foreign))}, 400,
            "BadRequestError", "which this gateway has not loaded")
    # keys: a runner key may call but not load; no key or a bad one: 401
    refused(p_run, {"lora_name": "x", "lora_path": path}, 403, "PermissionError",
            "algorithm or admin key")
    refused("nope", {"lora_name": "x", "lora_path": path}, 401, "AuthenticationError", "key")
    # at most LLM_GATEWAY_MAX_MODELS_PER_PROJECT (2 here) adapters per project
    assert post(base, "load_lora_adapter", p_alg,
                {"lora_name": "mine-2", "lora_path": path}).status_code == 200
    refused(p_alg, {"lora_name": "mine-3", "lora_path": path}, 400, "BadRequestError",
            "at most 2")
    assert gateway.registry.runtime_names(q.pk) == []

    # unload: another project's name is not found; a call holding the engine still decodes
    refused(q_alg, {"lora_name": "mine"}, 404, "NotFoundError",
            "The lora adapter 'mine' cannot be found.", "unload_lora_adapter")
    # a call in flight (queued behind the base's decode lock, held here) when its adapter is
    # unloaded finishes on it
    held = gateway.registry.by_name("mine", project_id=p.pk)
    submitted, submit, in_flight = threading.Event(), gateway.batcher.submit, []

    def observed(*args, **kwargs):
        job = submit(*args, **kwargs)
        submitted.set()
        return job

    gateway.batcher.submit = observed
    with held.lock:
        caller = threading.Thread(target=lambda: in_flight.append(
            complete(client(base, p_run), "mine").choices[0].text))
        caller.start()
        assert submitted.wait(30)
        answer = post(base, "unload_lora_adapter", p_alg, {"lora_name": "mine"})
    caller.join(30)
    assert answer.status_code == 200
    assert answer.text == "Success: LoRA adapter 'mine' removed successfully."
    assert in_flight == [expected_text(ckpt)]
    with pytest.raises(openai.NotFoundError):
        complete(client(base, p_run), "mine")
    refused(p_alg, {"lora_name": "mine"}, 404, "NotFoundError", "cannot be found",
            "unload_lora_adapter")


def test_endpoints_do_not_exist_unless_enabled(gateway_server, keyed):
    _, base = gateway_server
    _, key, *_ = keyed
    for path in ("load_lora_adapter", "unload_lora_adapter"):
        assert post(base, path, key, {"lora_name": "x", "lora_path": "/x"}).status_code == 404


def test_upstream_mode_loads_each_version_into_the_upstream_under_concurrent_calls(
        engine_b, projects, tiny, tmp_path, settings):
    gateway_b, base_b = engine_b
    (p, p_alg, p_run), _ = projects
    front = build_gateway(upstream_url=f"{base_b}/v1", upstream_key=p_alg)
    server_a, base_a = serve(front)
    ckpts = {v: job_adapter(p, tiny, tmp_path, seed=10 + v, step=v) for v in (1, 2, 3)}
    expected = {v: expected_text(ckpt) for v, ckpt in ckpts.items()}
    assert len(set(expected.values())) == 3  # three different policies

    def llm(v):
        return {"llm": {"resource_type": "proxy_llm", "endpoint": f"{base_a}/v1",
                        "model": "policy", "version": v, "checkpoint": ckpts[v]}}

    resources_id = services.resources_add(project=p, resources=llm(1)).resource_set.resources_id
    current: dict = {}
    results, errors, pinned = [], [], {}
    stop = threading.Event()

    def caller():
        while not stop.is_set():
            rid, aid, version = current["rollout"]
            try:
                text = complete(client(base_a, p_run, rid, aid), "policy").choices[0].text
                results.append((version, text))
            except Exception as exc:  # noqa: BLE001 - the test reports any
                errors.append(repr(exc))

    try:
        for version in (1, 2, 3):
            if version > 1:  # published: loaded into B by A's poller, before any call
                services.resources_update(project=p, resources_id=resources_id,
                                          resources=llm(version))
                front.poll_once()  # (or already by its thread)
                assert version in front.upstream_loras.loaded(p.pk, resources_id)
            rid, aid = started_attempt(p, resources_id)  # pins the newest version
            pinned[rid] = version
            current["rollout"] = (rid, aid, version)
            if version == 1:
                threads = [threading.Thread(target=caller) for _ in range(3)]
                for t in threads:
                    t.start()
            deadline = time.monotonic() + 120
            while sum(v == version for v, _ in results) < 6 and not errors:
                assert time.monotonic() < deadline, "no calls served"
                time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        server_a.stop()
    assert errors == []
    assert {v for v, _ in results} == {1, 2, 3}
    assert all(text == expected[v] for v, text in results)  # each by the adapter it pinned
    for rid, version in pinned.items():  # and each span says which version served it
        spans = llm_spans(rid)
        assert len(spans) == sum(v == version for v, _ in results)
        assert {s.attributes[c.LLM_VERSION] for s in spans} == {version}
    # two versions stay loaded in B (LLM_GATEWAY_MAX_VERSIONS); v1 was unloaded from it
    names = {v: lora_name(p.pk, resources_id, v, ckpts[v]["sha256"]) for v in (1, 2, 3)}
    assert gateway_b.registry.runtime_names(p.pk) == sorted([names[2], names[3]])
    assert front.upstream_loras.loads == 3 and front.upstream_loras.unloads == 1
    listed = {m.id for m in client(base_b, p_alg).models.list()}
    assert names[1] not in listed and names[3] in listed


def test_a_load_the_upstream_refuses_is_a_502_and_is_retried_with_backoff(
        gateway_server, keyed, tiny, tmp_path, storage, settings):
    _, base_b = gateway_server  # runtime LoRA updating off there: /v1/load_lora_adapter is 404
    project, key, *_ = keyed
    front = build_gateway(upstream_url=f"{base_b}/v1", upstream_key=key)
    front.upstream_loras.first_backoff = 30.0  # the second call comes within it
    server_a, base_a = serve(front)
    try:
        ckpt = job_adapter(project, tiny, tmp_path, seed=3, step=1)
        resources_id = services.resources_add(project=project, resources={"llm": {
            "resource_type": "proxy_llm", "endpoint": f"{base_a}/v1", "model": "policy",
            "version": 1, "checkpoint": ckpt}}).resource_set.resources_id
        rid, aid = started_attempt(project, resources_id)
        for words in ("HTTP 404", "retrying in"):
            with pytest.raises(openai.APIStatusError) as caught:
                complete(client(base_a, key, rid, aid), "policy")
            assert caught.value.status_code == 502
            assert caught.value.body["code"] == "upstream_lora_load_failed"
            assert words in caught.value.body["message"]
        adapters = front.upstream_loras._spaces[(project.pk, resources_id)]
        assert adapters[1].failures == 1  # the second call did not ask the upstream again
        assert llm_spans(rid) == []
    finally:
        server_a.stop()
