"""LoRA in grpo_lm on a tiny random model: config validation, adapter-only checkpoints, the
base's sha256 guard, save/load/resume bitwise, and the gateway serving base + adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.llm.tiny import tiny_model
from trainer import checkpoints
from trainer import conventions as c
from trainer.algorithms import algorithm_load
from trainer.algorithms.adapter import FinishedRollout
from trainer.llm import lora
from trainer.llm.engine import Engine, Params, Sequence_
from trainer.llm.registry import Registry

LORA = {"r": 4, "alpha": 8, "target_modules": ["c_attn", "c_proj"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def storage(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "store")}}}


def rollouts(engine, n=6):
    """n sampled answers to one prompt, rewarded 1 for every other one (one group)."""
    prompt = engine.tokenizer("abc 12")["input_ids"]
    seqs = [Sequence_(prompt, Params(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True))
            for i in range(n)]
    engine.generate(seqs)
    out = []
    for i, seq in enumerate(seqs):
        spans = [{"name": c.LLM_CALL_SPAN, "sequence_id": 1, "attributes": {
                     c.LLM_PROMPT_IDS: prompt, c.LLM_RESPONSE_IDS: seq.token_ids,
                     c.LLM_LOGPROBS: seq.logprobs, c.LLM_LOGPROBS_OF: seq.logprobs_of,
                     c.LLM_TEMPERATURE: 1.0, c.LLM_TOP_P: 1.0}},
                 {"name": c.REWARD_ANNOTATION_SPAN, "sequence_id": 2,
                  "attributes": {c.REWARD_VALUE_ATTR.format(index=0): float(i % 2)}}]
        out.append(FinishedRollout(f"r{i}", "train", "succeeded", {"group": "g"}, spans))
    return out


def logits(engine, ids):
    """The engine's logits for `ids` (an adapter engine: its own adapter on the shared base)."""
    with torch.no_grad():
        if engine.shared is None:
            return engine.model(ids).logits
        return engine.model(ids, adapter_names=[engine.adapter] * len(ids)).logits


def tensors(directory):
    return load_file(str(directory / "adapter_model.safetensors"))


def test_lora_config_is_validated_one_line_per_bad_field(tiny):
    with pytest.raises(ValueError) as info:
        algorithm_load("grpo_lm", {"model": str(tiny), "lora": {
            "r": 0, "alpha": -1, "dropout": 1.0, "target_modules": [], "rank": 3}})
    lines = str(info.value).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "lora.rank", "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules"]
    with pytest.raises(ValueError, match="lora must be a mapping"):
        algorithm_load("grpo_lm", {"model": str(tiny), "lora": 8})
    assert algorithm_load("grpo_lm", {"model": str(tiny), "lora": {}}).lora["r"] == 8


@pytest.mark.django_db
def test_lora_step_trains_the_adapter_only_and_resumes_bitwise(tiny, storage, tmp_path):
    algorithm = algorithm_load("grpo_lm", {"model": str(tiny), "lora": LORA, "lr": 1e-2,
                                           "epochs": 2, "seed": 3})
    step0 = algorithm.save(algorithm.init_state(), name_prefix="jobs/l", step=0)
    assert "adapter_model.safetensors" in step0["files"]
    assert "model.safetensors" not in step0["files"]
    # version 0 is the base itself: LoRA's B matrices start at 0
    engine0 = Engine(checkpoints.checkpoint_local_dir(step0), device="cpu", share_base=True)
    base = Engine(tiny, device="cpu")
    ids = torch.tensor([base.tokenizer("abc 12")["input_ids"]])
    assert torch.equal(logits(engine0, ids), logits(base, ids))

    samples = algorithm.samples(rollouts(engine0))
    state0 = algorithm.load(step0)
    update = algorithm.update(step=0, state=state0, samples=samples, device="cpu")
    assert update.metrics["trained_samples"] == 6
    assert "recomputed_samples" not in update.metrics  # the engine's logprobs were exact
    assert abs(update.metrics["mean_ratio"] - 1) < 0.2  # the second epoch's, after one update
    trained = tensors(Path(update.state["dir"]))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in trained.items())
    step1 = algorithm.save(update.state, name_prefix="jobs/l", step=1)
    files = sorted(step1["files"])
    assert files == ["adapter_config.json", "adapter_model.safetensors",
                     "lightning-lora.json", "optimizer.pt"], files
    local1 = checkpoints.checkpoint_local_dir(step1)
    size = sum(p.stat().st_size for p in local1.iterdir())
    full = sum(p.stat().st_size for p in tiny.iterdir() if p.suffix == ".safetensors")
    assert size < full / 2, (size, full)
    # save/load is bitwise; the base's weights are untouched (the adapter is all that moved)
    loaded = tensors(local1)
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)
    # resume: the same step from the loaded checkpoint twice gives bitwise the same adapter
    again = [algorithm.update(step=1, state=algorithm.load(step1), samples=samples,
                              device="cpu") for _ in range(2)]
    a, b = (tensors(Path(u.state["dir"])) for u in again)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], loaded[k]) for k in a)  # and it did train

    # the gateway serves base + adapter for the published version
    llm = algorithm.published_resources(step1, job_id=9)["llm"]
    registry = Registry(share_base=True)
    served = registry.for_resource(llm, project_id=1, resources_id="res")
    assert served.version == 1
    assert served.shared is engine0.shared  # one copy of the base for both versions
    assert not torch.allclose(logits(served, ids), logits(base, ids))
    # what the trainer computes with the adapter on the base; the same merged
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny),
                                    str(local1)).eval()
    with torch.no_grad():
        assert torch.allclose(logits(served, ids), ref(ids).logits, atol=1e-5)
    merged = Engine(local1, device="cpu")
    assert merged.shared is None
    assert torch.allclose(logits(served, ids), logits(merged, ids), atol=1e-5)


@pytest.mark.django_db
def test_an_adapter_is_refused_on_another_base(tiny, storage, tmp_path):
    other = tiny_model(tmp_path / "other", seed=1)
    mine = algorithm_load("grpo_lm", {"model": str(tiny), "lora": LORA})
    step0 = mine.save(mine.init_state(), name_prefix="jobs/m", step=0)
    theirs = algorithm_load("grpo_lm", {"model": str(other), "lora": LORA})
    with pytest.raises(lora.BaseMismatch, match="trained on a base model with sha256"):
        theirs.update(step=0, state=theirs.load(step0), samples=[], device="cpu")
    # the gateway refuses it too, when the base it names is no longer the one it was made on
    local = checkpoints.checkpoint_local_dir(step0)
    meta = json.loads((local / lora.META).read_text())
    (local / lora.META).write_text(json.dumps({**meta, "base": str(other)}))
    with pytest.raises(lora.BaseMismatch):
        Engine(local, device="cpu")


@pytest.mark.slow
def test_a_lora_job_runs_end_to_end_and_the_gateway_serves_each_adapter(tmp_path, model_dir):
    """`manage.py train` embedded (SQLite, in-process workers, the gateway over HTTP): every
    checkpoint is an adapter, and step k's rollouts were served by version k (base + adapter
    k, hot-reloaded)."""
    import sqlite3
    import subprocess

    from django.conf import settings

    from tests.api.conftest import free_port
    from tests.test_trainer_commands import ROOT, embedded_env, manage

    steps = 3
    env = {**embedded_env(tmp_path), "LLM_GATEWAY_PORT": str(free_port()),
           "LLM_GATEWAY_SHARE_BASE": "1",  # the adapters on one base, through the real gateway
           "LIGHTNING_MODELS_DIR": str(settings.MODELS_DIR)}
    subprocess.run(manage("migrate", "-v0"), env=env, cwd=ROOT, check=True, timeout=300)
    done = subprocess.run(manage("train", "tests.llm.lora_job", "--steps", str(steps),
                                 "--quiet"), env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    with sqlite3.connect(tmp_path / "lightning.sqlite3") as db:
        rows = db.execute("SELECT attributes FROM store_span WHERE name = ?",
                          ("openai.chat.completion",)).fetchall()
        llm = [json.loads(r)["llm"] for (r,) in db.execute(
            "SELECT resources FROM store_resourceversion ORDER BY version")]
    attributes = [json.loads(a) for (a,) in rows]
    assert {a[c.LLM_VERSION] for a in attributes} == set(range(steps + 1))
    assert {a[c.LLM_LOGPROBS_OF] for a in attributes} == {"sampled:float32"}
    assert llm[-1]["version"] == steps
    for resource in llm:
        files = set(resource["checkpoint"]["files"])
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files


def adapter(tiny, out, seed):
    """A LoRA checkpoint on `tiny` with random (non-zero) weights."""
    from trainer.llm import models

    base, _, sha = lora.load_base(str(tiny))
    torch.manual_seed(seed)
    model = lora.new_adapter(base, lora.settings(LORA))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    lora.save_adapter(model, out, base=str(tiny), sha=models.base_sha256(tiny))
    return out


def test_adapters_of_one_base_share_it_and_decode_in_one_batch(tiny, tmp_path):
    import gc

    from trainer.llm.batcher import Batcher

    one, two, three = (Engine(adapter(tiny, tmp_path / f"a{i}", i), device="cpu",
                              share_base=True) for i in range(3))
    assert one.shared is two.shared is three.shared and one.adapter != two.adapter
    assert one.batch_key == two.batch_key
    prompt = one.tokenizer("abc 12")["input_ids"]

    def greedy(n=3):
        return [Sequence_(list(prompt), Params(max_tokens=6, temperature=0.0, ignore_eos=True))
                for _ in range(n)]

    alone = {}
    for engine in (one, two, three):
        seqs = greedy(1)
        engine.generate(seqs)
        alone[engine.adapter] = seqs[0].token_ids
    assert len({tuple(v) for v in alone.values()}) == 3  # three different policies
    batcher = Batcher(window=0.5)
    jobs = [(engine, batcher.submit(engine, greedy(), tenant=i))
            for i, engine in enumerate((one, two, three))]
    for engine, job in jobs:
        assert job.done.wait(30) and job.error is None
        assert [s.token_ids for s in job.sequences] == [alone[engine.adapter]] * 3
    assert batcher.batches == 1 and batcher.largest == 9  # one mixed-adapter batch
    # a dropped version's adapter leaves the base at the next load
    shared, gone = two.shared, two.adapter
    del two, jobs, job, engine
    batcher.run(one, greedy(1))  # the batcher's thread forgets the last batch's engines
    gc.collect()
    four = Engine(adapter(tiny, tmp_path / "a4", 4), device="cpu", share_base=True)
    assert gone not in shared.adapters() and four.adapter in shared.adapters()


def test_loading_adapters_does_not_disturb_calls_in_flight(tiny, tmp_path):
    """New versions load onto the shared base while another thread decodes on it: every call
    finishes, with the tokens its adapter gives alone."""
    import threading

    one = Engine(adapter(tiny, tmp_path / "a0", 0), device="cpu", share_base=True)
    prompt = one.tokenizer("abc 12")["input_ids"]

    def greedy():
        seqs = [Sequence_(list(prompt), Params(max_tokens=6, temperature=0.0, ignore_eos=True))]
        one.generate(seqs)
        return seqs[0].token_ids

    expected, results, errors = greedy(), [], []
    stop = threading.Event()

    def caller():
        while not stop.is_set():
            try:
                results.append(greedy())
            except Exception as exc:  # noqa: BLE001 - the test reports any
                errors.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        loaded = [Engine(adapter(tiny, tmp_path / f"n{i}", 10 + i), device="cpu",
                         share_base=True) for i in range(4)]
    finally:
        stop.set()
        thread.join(30)
    assert not errors and results and all(r == expected for r in results)
    assert all(e.shared is one.shared for e in loaded)
