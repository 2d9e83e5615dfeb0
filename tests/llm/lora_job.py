"""A job spec for tests: the LLM example, small, trained with LoRA (`manage.py train
tests.llm.lora_job --steps N`)."""

from __future__ import annotations

from typing import Any

from examples.llm_cipher import job_spec as example_spec
from examples.llm_cipher.task import make_dataset


def job_spec(*, seed: int = 0, steps: int = 3) -> dict[str, Any]:
    spec = example_spec(seed=seed, steps=steps)
    spec["name"] = "llm-cipher-lora"
    spec["config"].update({
        "lora": {"r": 8, "alpha": 16, "target_modules": ["c_attn", "c_proj", "c_fc"]},
        "lr": 1e-2, "epochs": 2, "group_size": 4, "tasks_per_step": 4,
    })
    spec["val_dataset"] = make_dataset(8, seed=seed + 1, held_out=True)
    return spec
