"""grpo_lm on two DDP ranks (trainer/distributed.py): for the same samples, seed and global
batch the update equals one process's, for every weight and for a LoRA adapter (a tiny
random LM, no store needed); the ranks' shards have different numbers of micro-batches."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.llm.tiny import tiny_model
from trainer import distributed
from trainer.algorithms.grpo_lm import GRPOLM
from trainer.algorithms.token_adapter import TokenSample

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def token_samples(count: int = 7, shared: int = 0) -> list[TokenSample]:
    """`count` samples in groups of 4 with different rewards, prompts and responses of
    different lengths (after `shared` ids every prompt starts with: grpo_lm runs such a
    prefix once per micro-batch); their old logprobs are not exact (recomputed before the
    update)."""
    generator = torch.Generator().manual_seed(3)
    head = torch.randint(0, 20, (shared,), generator=generator).tolist()
    samples = []
    for i in range(count):
        prompt, response = shared + 3 + i % 3, 2 + i % 4
        ids = head + torch.randint(0, 20, (prompt + response - shared,),
                                   generator=generator).tolist()
        samples.append(TokenSample(
            rollout_id=f"r{i}", group=f"g{i // 4}", input_ids=ids,
            mask=[0] * prompt + [1] * response, old_logprobs=[0.0] * (prompt + response),
            reward=float((i * 7) % 3), temperature=1.0))
    return samples


def weights(directory: str) -> dict[str, torch.Tensor]:
    path = Path(directory)
    file = path / "adapter_model.safetensors"
    return load_file(file if file.exists() else path / "model.safetensors")


@pytest.mark.parametrize(("lora", "shared", "extra"), [
    (None, 0, {}), ({"r": 4, "alpha": 8}, 0, {}), (None, 20, {}),
    # every sample's tokens in the loss's mean and the entropy bonus, a solved group among them
    (None, 0, {"loss_tokens": "all", "entropy_coef": 0.05}),
], ids=["full", "lora", "full-shared-prefix", "full-entropy-all-tokens"])
def test_grpo_lm_world_size_2_update_equals_world_size_1(tiny, lora, shared, extra):
    # grpo_lm's default lr. Adam divides each gradient by its running size, so on weights
    # whose gradient is ~0 in exact arithmetic (GPT-2's key bias) summation-order noise
    # becomes an lr-sized step: at lr 1e-2 even one process with another micro_batch differs
    # by 1.3e-5 (printed below at this lr as the floor).
    config = {"model": str(tiny), "lr": 1e-3, "epochs": 2, "micro_batch": 3, "seed": 0,
              **({"lora": lora} if lora else {}), **extra}
    algorithm = GRPOLM(config)
    state = algorithm.init_state()
    # 7 trained samples: shards of 3 and 4, 1 and 2 micro-batches
    samples = token_samples(shared=shared)
    if extra:  # a group whose rewards are all equal: in the batch for the entropy only
        samples += [dataclasses.replace(s, rollout_id=f"s{i}", group="solved", reward=1.0)
                    for i, s in enumerate(samples[:4])]
    one = algorithm.update(step=0, state=state, samples=samples, device="cpu")
    two, device = distributed.update(algorithm, step=0, state=state, samples=samples,
                                     world_size=2)
    floor = GRPOLM({**config, "micro_batch": 7}).update(step=0, state=state, samples=samples,
                                                        device="cpu")
    try:
        a, b = weights(one.state["dir"]), weights(two.state["dir"])
        before = weights(state["dir"])
        assert set(a) == set(b)
        difference = max(float((a[k] - b[k]).abs().max()) for k in a)
        c = weights(floor.state["dir"])
        noise = max(float((a[k] - c[k]).abs().max()) for k in a)
        moved = max(float((a[k] - before[k]).abs().max()) for k in a if k in before)
        print(f"\nworld_size 2 vs 1, grpo_lm tiny GPT-2 ({'LoRA r=4' if lora else 'full'}"
              f"{f', shared prefix {shared}' if shared else ''}), "
              f"{one.metrics['trained_samples']} samples x 2 epochs: max abs weight "
              f"difference {difference:.3g}; one process, micro_batch 7 vs 3: {noise:.3g} "
              f"(the update moved weights by up to {moved:.3g})")
        assert device == "cpu x2"
        assert difference < 1e-5
        assert moved > 1e-3  # it did train
        assert two.metrics["trained_samples"] == one.metrics["trained_samples"] == 7
        assert two.metrics["recomputed_samples"] == one.metrics["recomputed_samples"] == len(
            samples if extra else samples[:7])
        assert two.metrics["loss"] == pytest.approx(one.metrics["loss"], abs=1e-5)
        assert two.metrics["mean_ratio"] == pytest.approx(one.metrics["mean_ratio"], abs=1e-5)
        # target_kl's figure: every rank decides on the global batch's
        assert two.metrics["approx_kl"] == pytest.approx(one.metrics["approx_kl"], rel=1e-3)
        assert two.metrics["epochs_done"] == one.metrics["epochs_done"] == 2
        if extra:
            assert two.metrics["entropy"] == pytest.approx(one.metrics["entropy"], rel=1e-5)
            assert two.metrics["grad_norm"] == pytest.approx(one.metrics["grad_norm"], rel=1e-4)
    finally:
        for update in (one, two, floor):
            shutil.rmtree(update.state["dir"], ignore_errors=True)
        if state.get("owned"):
            shutil.rmtree(state["dir"], ignore_errors=True)
