"""The PPO ratio is exactly on-policy before the first update: the engine records each token's
log-probability under the distribution it sampled from (temperature, top_p, greedy), and
grpo_lm computes the same from the same weights (a tiny random model, no store needed)."""

from __future__ import annotations

import pytest
import torch

from tests.llm.tiny import tiny_model
from trainer import conventions as c
from trainer.algorithms import grpo_lm
from trainer.algorithms.adapter import FinishedRollout
from trainer.algorithms.token_adapter import TokenAdapter
from trainer.llm import sampling
from trainer.llm.engine import Engine, Params, Sequence_

SETTINGS = [(0.0, 1.0), (0.7, 1.0), (0.7, 0.9), (1.3, 0.5)]  # (temperature, top_p)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def generated(engine):
    """One sequence per setting, decoded in one batch (prompts of different lengths)."""
    tok = engine.tokenizer
    seqs = [Sequence_(tok("abc 12" + "d" * i)["input_ids"],
                      Params(max_tokens=8, temperature=t, top_p=p, seed=5, ignore_eos=True))
            for i, (t, p) in enumerate(SETTINGS)]
    engine.generate(seqs)
    return seqs


def samples_of(seqs):
    """What the gateway records (calls.py) and the adapter makes of it."""
    out = []
    for i, seq in enumerate(seqs):
        span = {"name": c.LLM_CALL_SPAN, "sequence_id": 1, "attributes": {
            c.LLM_PROMPT_IDS: seq.prompt_ids, c.LLM_RESPONSE_IDS: seq.token_ids,
            c.LLM_LOGPROBS: seq.logprobs, c.LLM_LOGPROBS_OF: seq.logprobs_of,
            c.LLM_TEMPERATURE: seq.params.temperature, c.LLM_TOP_P: seq.params.top_p}}
        reward = {"name": c.REWARD_ANNOTATION_SPAN, "sequence_id": 2,
                  "attributes": {c.REWARD_VALUE_ATTR.format(index=0): float(i % 2)}}
        out += TokenAdapter().samples(FinishedRollout(f"r{i}", "train", "succeeded",
                                                      {"group": "g"}, [span, reward]))
    return out


def ratios(model, samples):
    batch = grpo_lm._tensors(samples, {s.rollout_id: 1.0 for s in samples}, "cpu")
    recomputed = grpo_lm._fill_old(model, batch)
    with torch.no_grad():
        new = grpo_lm._token_logprobs(model, batch)
    return torch.exp(new - batch["old"]), batch["mask"].bool(), recomputed


def test_recorded_logprobs_give_ratio_one_for_greedy_and_tempered_samples(tiny):
    engine = Engine(tiny, device="cpu")
    seqs = generated(engine)
    assert {s.logprobs_of for s in seqs} == {"sampled:float32"}
    assert all(len(s.token_ids) == 8 for s in seqs)
    greedy = seqs[0]
    assert greedy.logprobs == [0.0] * 8  # the argmax under a point mass
    samples = samples_of(seqs)
    assert [(s.temperature, s.top_p) for s in samples] == SETTINGS
    # the trainer's own float32 model (not the engine's), as grpo_lm.update loads it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ratio, mask, recomputed = ratios(model, samples)
    assert recomputed == 0  # the recorded logprobs were used as they are
    for row, (temperature, top_p) in enumerate(SETTINGS):
        dev = (ratio[row][mask[row]] - 1).abs().max().item()
        assert dev < 1e-4, (temperature, top_p, dev)
    # What the engine did before: the T=0.7 sample's logprobs at temperature 1 (off-policy).
    plain = torch.log_softmax(engine.model(torch.tensor([seqs[1].prompt_ids + seqs[1].token_ids]))
                              .logits[0].float(), -1)
    at_t1 = plain[len(seqs[1].prompt_ids) - 1:-1].gather(
        1, torch.tensor(seqs[1].token_ids).unsqueeze(1)).squeeze(1)
    assert (at_t1 - torch.tensor(seqs[1].logprobs)).abs().max() > 1e-3


def test_logprobs_not_recorded_exactly_are_recomputed(tiny):
    engine = Engine(tiny, device="cpu")
    samples = samples_of(generated(engine))
    for s in samples:  # as an upstream server records them: not said how
        s.logprobs_of = ""
        s.old_logprobs = [x - 0.3 if m else 0.0 for x, m in zip(s.old_logprobs, s.mask,
                                                                  strict=True)]
    ratio, mask, recomputed = ratios(engine.model, samples)
    assert recomputed == len(SETTINGS)
    assert (ratio[mask] - 1).abs().max().item() < 1e-4


def test_sampling_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    greedy = sampling.logprobs(logits, 0.0)
    assert greedy[0] == 0 and torch.isinf(greedy[1:]).all()
    tempered = sampling.logprobs(logits, 0.5)
    assert torch.allclose(tempered, torch.log_softmax(logits / 0.5, -1))
    nucleus = sampling.logprobs(logits, 1.0, top_p=0.7)  # p = .61 .22 .14 .03: keeps two
    assert torch.isinf(nucleus[2:]).all()
    assert torch.allclose(nucleus[:2].exp().sum(), torch.tensor(1.0))
    generator = torch.Generator().manual_seed(0)
    assert {sampling.choose(nucleus, 1.0, generator) for _ in range(50)} == {0, 1}


@pytest.mark.parametrize("settings", [SETTINGS * 4, [(0.7, 1.0), (1.3, 1.0)] * 8])
def test_the_batch_distribution_is_each_rows_bit_for_bit(settings):
    """The engine computes every row's distribution in one pass (sampling.logprobs_rows):
    equal to `logprobs` row by row, so the recorded logprobs are those grpo_lm recomputes."""
    logits = torch.randn(len(settings), 50, generator=torch.Generator().manual_seed(3)) * 4
    rows = sampling.logprobs_rows(logits, [t for t, _ in settings], [p for _, p in settings])
    for i, (t, p) in enumerate(settings):
        assert torch.equal(rows[i], sampling.logprobs(logits[i], t, p))


def test_async_tokens_of_an_older_version_get_a_truncated_importance_weight(tiny):
    engine = Engine(tiny, device="cpu")
    samples = samples_of(generated(engine))[1:]  # the sampled ones (greedy tokens: logp 0)
    older = samples[0]  # as if an older version had acted: it liked its tokens e^1 x less
    older.old_logprobs = [x - 1.0 if m else 0.0 for x, m in zip(older.old_logprobs,
                                                                 older.mask, strict=True)]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    batch = grpo_lm._tensors(samples, {s.rollout_id: 1.0 for s in samples}, "cpu")
    stats = grpo_lm.off_policy_correct(model, [batch], cap=2.0)
    mask = batch["mask"].bool()
    assert (batch["weights"][0][mask[0]] == 2.0).all()  # e^1 = 2.7, truncated at 2
    assert (batch["weights"][1:][mask[1:]] - 1).abs().max().item() < 1e-4  # on-policy
    assert stats["is_weight_truncated_fraction"] == pytest.approx(
        float(mask[0].sum() / mask.sum()))
    assert stats["is_weight_max"] == pytest.approx(2.718, abs=1e-2)
    with torch.no_grad():  # the ratio is now against the proximal policy: 1 before updating
        new = grpo_lm._token_logprobs(model, batch)
    assert (torch.exp(new - batch["old"])[mask] - 1).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_shared_prefix_computed_once_gives_the_same_logprobs_and_gradients(tmp_path, arch):
    """grpo_lm runs the ids every row of a micro-batch starts with once (the system prompt,
    tools and examples an agent sends with each call) and the rest on its repeated cache: the
    same log-probabilities and gradients as each row in full, right padding included."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if arch == "gpt2":
        model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "m"))
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=64))
    model.eval()
    prefix = [(i * 7) % 20 + 1 for i in range(20)]
    rows = [prefix + [3, 4, 5], prefix + [6] * 9, prefix + [2]]
    samples = [grpo_lm.TokenSample(rollout_id=f"r{i}", group=0, input_ids=row,
                                   mask=[0] * len(prefix) + [1] * (len(row) - len(prefix)),
                                   old_logprobs=[0.0] * len(row), reward=float(i))
               for i, row in enumerate(rows)]
    batch = grpo_lm._tensors(samples, {f"r{i}": float(i) - 1 for i in range(3)}, "cpu")
    assert batch["shared"] == len(prefix)
    shared = grpo_lm._token_logprobs(model, batch)
    (shared * batch["mask"]).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = grpo_lm._token_logprobs(model, {**batch, "shared": 0})
    (full * batch["mask"]).sum().backward()
    mask = batch["mask"].bool()
    assert torch.allclose(shared[mask], full[mask], atol=1e-5)
    for got, want in zip(grads, [p.grad for p in model.parameters()], strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def test_the_engine_runs_a_prompt_prefix_shared_by_the_batch_once(tiny, monkeypatch):
    """Prompts that start alike (an agent's system prompt and examples) decode as if each were
    alone: the shared prefix's cache computed once and repeated, the rows' own ids after it
    (left padding in between, masked), the same tokens and log-probabilities."""
    from trainer.llm import decoding

    engine = Engine(tiny, device="cpu")
    prefix = "abc 123 def 456 ghi 789 jab 012 cde 345 "

    def run():
        tok = engine.tokenizer
        seqs = [Sequence_(tok(prefix + "1" * (i + 1))["input_ids"],
                          Params(max_tokens=6, temperature=t, top_p=p, seed=5, ignore_eos=True))
                for i, (t, p) in enumerate(SETTINGS)]
        engine.generate(seqs)
        return seqs

    shared = run()
    assert decoding.shared_prefix([decoding.Row(s) for s in shared]) == len(prefix)
    monkeypatch.setattr(decoding, "SHARED_MIN", 10**6)
    alone = run()
    for a, b in zip(shared, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_later_prompt_starts_from_an_earlier_prompts_prefix(tiny, monkeypatch):
    """Prefix caching: a prompt that begins with ids an earlier prompt had (an agent's system
    prompt and examples, sent again with each call) starts from their stored keys and values,
    and decodes the same tokens and log-probabilities as computed in full."""
    from trainer.llm import decoding

    engine = Engine(tiny, device="cpu")
    prefix = "abc 123 def 456 ghi 789 jab 012 cde 345 "

    def alone(text):
        seq = Sequence_(engine.tokenizer(text)["input_ids"],
                        Params(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True))
        engine.generate([seq])
        return seq

    alone(prefix + "1")  # computed in full, remembered
    assert decoding._PREFIXES[engine.model].ids == tuple(engine.tokenizer(prefix + "1")
                                                         ["input_ids"])
    calls = []
    original = decoding.Prefix.cache
    monkeypatch.setattr(decoding.Prefix, "cache",
                        lambda self, *a: calls.append(a) or original(self, *a))
    cached = alone(prefix + "22")
    assert calls == [(len(prefix), 1)]
    monkeypatch.setattr(decoding, "SHARED_MIN", 10**6)
    full = alone(prefix + "22")
    assert cached.token_ids == full.token_ids
    assert cached.logprobs == pytest.approx(full.logprobs, abs=1e-4)


def test_a_synchronous_update_does_not_depend_on_the_engines_rounding(tiny):
    """The engine's recorded logprobs differ from the trainer's by float rounding that depends
    on which requests shared its batch (timing); a synchronous step recomputes them with its
    starting weights, so the same samples give the same checkpoint bit for bit."""
    from safetensors.torch import load_file

    from trainer.algorithms import algorithm_load

    engine = Engine(tiny, device="cpu")
    seqs = generated(engine)
    weights, gaps = [], []
    for nudge in (0.0, 1e-6):
        samples = samples_of(seqs)
        for s in samples:  # as another batch's rounding would have recorded them
            s.old_logprobs = [x + nudge if m else x for x, m in zip(s.old_logprobs, s.mask,
                                                                   strict=True)]
        algorithm = algorithm_load("grpo_lm", {"model": str(tiny), "seed": 3, "epochs": 2,
                                               "lr": 1e-2})
        update = algorithm.update(step=0, state={"dir": str(tiny)}, samples=samples,
                                  device="cpu")
        weights.append(load_file(f"{update.state['dir']}/model.safetensors"))
        gaps.append(update.metrics["recorded_logprob_max_diff"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert gaps[0] < 1e-5 and gaps[1] == pytest.approx(gaps[0] + 1e-6, abs=1e-5)


def test_the_entropy_is_that_of_the_distribution_each_token_was_sampled_from(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    samples = samples_of(generated(Engine(tiny, device="cpu")))
    batch = grpo_lm._tensors(samples, {}, "cpu")
    with torch.no_grad():
        taken, entropy = grpo_lm._token_logprobs(model, batch, entropy=True)
        logits = model(input_ids=batch["ids"], attention_mask=batch["attention"]).logits
    assert torch.equal(taken, grpo_lm._token_logprobs(model, batch))
    for row, (t, p) in enumerate(batch["sampling"]):
        logp = sampling.logprobs(logits[row, -2], t, p)  # the last position's distribution
        kept = logp.isfinite()
        expected = float(-(logp[kept].exp() * logp[kept]).sum())
        assert float(entropy[row, -1]) == pytest.approx(expected, abs=1e-5)
        assert (expected == 0.0) == (t == 0.0)  # greedy: one token, no spread
    assert torch.isfinite(entropy).all() and (entropy[:, 0] == 0).all()


def _update(tiny, samples, **config):
    from safetensors.torch import load_file

    from trainer.algorithms import algorithm_load

    algorithm = algorithm_load("grpo_lm", {"model": str(tiny), "seed": 3, "lr": 1e-2,
                                           **config})
    update = algorithm.update(step=0, state={"dir": str(tiny)}, samples=samples, device="cpu")
    return update, load_file(f"{update.state['dir']}/model.safetensors")


def _mean_entropy(tiny, weights, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    batch = grpo_lm._tensors(samples, {}, "cpu")
    with torch.no_grad():
        _, entropy = grpo_lm._token_logprobs(model, batch, entropy=True)
    return float((entropy * batch["mask"]).sum() / batch["mask"].sum())


def test_the_entropy_bonus_reaches_the_groups_whose_rewards_are_all_equal(tiny):
    """A group without a spread of rewards has no advantage: without the bonus a step leaves
    the weights as they were; with it, the sampled distributions widen."""
    samples = samples_of(generated(Engine(tiny, device="cpu")))[1:]  # the tempered ones
    for s in samples:
        s.reward = 0.0  # every one wrong: a collapsed policy's group
    plain, weights = _update(tiny, samples)
    assert plain.metrics["trained_samples"] == 0 and "entropy" not in plain.metrics
    from safetensors.torch import load_file

    before = load_file(f"{tiny}/model.safetensors")
    assert all(torch.equal(weights[k], before[k]) for k in before)
    bonus, widened = _update(tiny, samples, entropy_coef=0.5, epochs=4)
    assert bonus.metrics["trained_samples"] == 0  # no sample carried an advantage
    assert bonus.metrics["entropy"] > 0
    assert _mean_entropy(tiny, widened, samples) > _mean_entropy(tiny, None, samples) + 1e-3


def test_clip_high_lets_a_rewarded_token_rise_further_than_the_symmetric_clip(tiny):
    """DAPO's clip-higher: the ratio's upper bound is 1 + clip_high; its lower stays 1 - clip."""
    samples = samples_of(generated(Engine(tiny, device="cpu")))[1:]
    rewarded = next(s for s in samples if s.reward == 1.0)

    def likelihood(weights):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
        model.load_state_dict(weights, strict=False)
        batch = grpo_lm._tensors([rewarded], {}, "cpu")
        with torch.no_grad():
            logp = grpo_lm._token_logprobs(model, batch)
        return float((logp * batch["mask"]).sum())

    symmetric, low = _update(tiny, samples, epochs=8, clip=0.1)
    higher, high = _update(tiny, samples, epochs=8, clip=0.1, clip_high=0.5)
    assert likelihood(high) > likelihood(low)
    assert symmetric.metrics["clip_fraction"] > 0  # the symmetric bound did bind


def test_loss_tokens_all_counts_the_solved_groups_in_the_mean(tiny):
    """`loss_tokens: all`: the policy loss is the mean over every sample's generated tokens, so
    a group whose rewards are all equal adds nothing to the sum but counts in the mean, and a
    step with few groups left to learn gets a gradient that much smaller (against Adam's
    memory of the earlier, larger ones); `signal`, the default, leaves those groups out."""
    import dataclasses

    engine = Engine(tiny, device="cpu")
    tok = engine.tokenizer
    seqs = [Sequence_(tok(f"abc {i}")["input_ids"], Params(max_tokens=8, temperature=1.0,
                                                           seed=i, ignore_eos=True))
            for i in range(4)]
    engine.generate(seqs)
    signal = samples_of(seqs)  # one group, rewards 0, 1, 0, 1
    solved = [dataclasses.replace(s, rollout_id=f"z{i}", group=f"z{i // 4}", reward=1.0)
              for i, s in enumerate(signal * 6)]  # six groups that all got it right
    norms = {}
    for loss_tokens in ("signal", "all"):
        for name, samples in (("alone", signal), ("diluted", signal + solved)):
            update, _ = _update(tiny, samples, epochs=1, max_grad_norm=1e9,
                                loss_tokens=loss_tokens)
            assert update.metrics["trained_samples"] == 4
            norms[loss_tokens, name] = update.metrics["grad_norm"]
    assert norms["signal", "diluted"] == pytest.approx(norms["signal", "alone"], rel=1e-5)
    assert norms["all", "alone"] == pytest.approx(norms["signal", "alone"], rel=1e-5)
    assert norms["all", "diluted"] == pytest.approx(norms["all", "alone"] * 4 / 28, rel=1e-5)


def test_target_kl_stops_a_steps_epochs_once_the_policy_has_moved_that_far(tiny):
    """PPO's early stopping: an epoch whose KL estimate from the step's starting weights has
    passed `target_kl` takes no optimizer step, nor does any after it; the first always does.
    Stopped after one epoch, the weights are exactly those of a one-epoch step."""
    samples = samples_of(generated(Engine(tiny, device="cpu")))[1:]
    free, moved = _update(tiny, samples, epochs=6)
    assert free.metrics["epochs_done"] == 6 and free.metrics["approx_kl"] > 0
    one, once = _update(tiny, samples, epochs=1)
    stopped, early = _update(tiny, samples, epochs=6, target_kl=1e-12)
    assert stopped.metrics["epochs_done"] == 1 and stopped.metrics["approx_kl"] > 1e-12
    assert all(torch.equal(early[k], once[k]) for k in once)
    assert stopped.metrics["loss"] == one.metrics["loss"]
    loose, same = _update(tiny, samples, epochs=6, target_kl=1e9)
    assert loose.metrics["epochs_done"] == 6
    assert all(torch.equal(same[k], moved[k]) for k in moved)
    # between the two: stops where the estimate first passes it
    middle = free.metrics["approx_kl"] / 2
    part, _ = _update(tiny, samples, epochs=6, target_kl=middle)
    assert 1 <= part.metrics["epochs_done"] < 6 and part.metrics["approx_kl"] > middle
