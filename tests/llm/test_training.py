"""Token-level training pieces: the span adapter, grpo_lm's update, directory checkpoints,
and the runner's routing of LLM resources."""

from __future__ import annotations

import pytest
import torch

from runners.llm import route_llm_resources, routed_base_url
from trainer import checkpoints
from trainer import conventions as c
from trainer.algorithms import algorithm_load
from trainer.algorithms.adapter import FinishedRollout
from trainer.algorithms.token_adapter import TokenAdapter
from trainer.llm.engine import Engine
from trainer.llm.tokenizer import render_chat


def call_span(prompt, response, seq, logprobs=None, version=0):
    return {"name": c.LLM_CALL_SPAN, "sequence_id": seq, "attributes": {
        c.LLM_PROMPT_IDS: prompt, c.LLM_RESPONSE_IDS: response,
        c.LLM_LOGPROBS: logprobs if logprobs is not None else [-0.5] * len(response),
        c.LLM_VERSION: version}}


def reward_span(value, seq):
    return {"name": c.REWARD_ANNOTATION_SPAN, "sequence_id": seq,
            "attributes": {c.REWARD_VALUE_ATTR.format(index=0): value}}


def rollout(spans, rid="r1"):
    return FinishedRollout(rollout_id=rid, mode="train", status="succeeded",
                           input={"group": "g"}, spans=spans)


def test_adapter_makes_a_sample_per_call_with_the_final_reward():
    r = rollout([call_span([1, 2], [3], 1), call_span([1, 2, 3, 4], [5, 6], 2),
                 reward_span(0.5, 3)])
    samples = TokenAdapter().samples(r)
    assert [s.input_ids for s in samples] == [[1, 2, 3], [1, 2, 3, 4, 5, 6]]
    assert [s.mask for s in samples] == [[0, 0, 1], [0, 0, 0, 0, 1, 1]]
    assert {s.reward for s in samples} == {0.5}


def test_trajectory_chains_turns_that_extend_each_other():
    spans = [call_span([1, 2], [3], 1, [-0.1]), call_span([1, 2, 3, 9], [5], 2, [-0.2]),
             reward_span(1.0, 3)]
    (sample,) = TokenAdapter("trajectory").samples(rollout(spans))
    assert sample.input_ids == [1, 2, 3, 9, 5]
    assert sample.mask == [0, 0, 1, 0, 1]
    assert sample.old_logprobs == [0, 0, -0.1, 0, -0.2]
    # turns that do not chain stay transitions
    spans[1] = call_span([7, 7], [5], 2)
    assert len(TokenAdapter("trajectory").samples(rollout(spans))) == 2


def test_no_reward_no_sample_and_bad_logprobs_are_loud():
    assert TokenAdapter().samples(rollout([call_span([1], [2], 1)])) == []
    with pytest.raises(ValueError, match="logprobs"):
        TokenAdapter().samples(rollout([call_span([1], [2, 3], 1, [-1.0]), reward_span(1, 2)]))


@pytest.mark.django_db
def test_grpo_lm_update_makes_the_rewarded_answer_likelier(model_dir, settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    algorithm = algorithm_load("grpo_lm", {"model": str(model_dir), "lr": 3e-3, "epochs": 4})
    engine = Engine(model_dir)
    tok = engine.tokenizer
    prompt = render_chat(tok, [{"role": "user", "content": "abc 3"}])
    letters = {x: tok.convert_tokens_to_ids(x) for x in "ABCDE"}

    def p_of(eng, letter):
        with torch.no_grad():
            logits = eng.model(torch.tensor([prompt])).logits[0, -1]
        return float(torch.softmax(logits, -1)[letters[letter]])

    spans_for = {}
    for i, letter in enumerate("ABCDEABCDE"):
        with torch.no_grad():
            lp = torch.log_softmax(engine.model(torch.tensor([prompt])).logits[0, -1], -1)
        spans_for[f"r{i}"] = [call_span(prompt, [letters[letter]], 1,
                                        [float(lp[letters[letter]])]),
                              reward_span(1.0 if letter == "C" else 0.0, 2)]
    rollouts = [FinishedRollout(rid, "train", "succeeded", {"group": "g"}, spans)
                for rid, spans in spans_for.items()]
    samples = algorithm.samples(rollouts)
    state = algorithm.load(algorithm.save(algorithm.init_state(), name_prefix="jobs/t", step=0))
    update = algorithm.update(step=0, state=state, samples=samples, device="cpu")
    assert update.metrics["trained_samples"] == 10
    resource = algorithm.save(update.state, name_prefix="jobs/t", step=1)
    assert resource["format"] == checkpoints.DIR_FORMAT
    assert "model.safetensors" in resource["files"] and "optimizer.pt" in resource["files"]
    after = Engine(checkpoints.checkpoint_local_dir(resource))
    assert p_of(after, "C") > p_of(engine, "C") + 0.05
    published = algorithm.published_resources(resource, job_id=7)["llm"]
    assert published["model"] == "job-7" and published["version"] == 1
    assert published["checkpoint"]["sha256"] == resource["sha256"]
    # retention removes the directories no kept version names
    gone = checkpoints.checkpoints_prune(name_prefix="jobs/t", keep_names={resource["name"]})
    assert len(gone) == 1 and resource["name"] not in gone
    assert checkpoints.checkpoint_local_dir(resource).exists()


def test_proxy_llm_resources_are_routed_to_the_attempt():
    assert routed_base_url("http://h:1/v1", "ro-1", "at-2") == \
        "http://h:1/rollout/ro-1/attempt/at-2/v1"
    assert routed_base_url("http://h:1/", "ro-1", "at-2") == "http://h:1/rollout/ro-1/attempt/at-2"
    resources = {"llm": {"resource_type": "proxy_llm", "endpoint": "http://h:1/v1", "model": "m"},
                 "other": {"resource_type": "llm", "endpoint": "http://x/v1"}}
    routed = route_llm_resources(resources, rollout_id="r", attempt_id="a", api_key="k")
    assert routed["llm"]["endpoint"] == "http://h:1/rollout/r/attempt/a/v1"
    assert routed["llm"]["api_key"] == "k"
    assert routed["other"] == resources["other"]
    assert resources["llm"]["endpoint"] == "http://h:1/v1"  # the original is untouched
