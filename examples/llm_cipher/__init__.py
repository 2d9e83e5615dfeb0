"""The LLM example: train a language model agent to recall a secret code, with grpo_lm.

Each task is a prompt like "qzt 7"; the right answer is the letter the digit stands for in a
code the model is never told (task.py), and the reward is 1 for it, else 0. The agent
(agent.py) is plain OpenAI-client code calling its rollout's `llm` resource; every call goes
through the model gateway, which records its token ids; `grpo_lm` trains the model from them
and publishes each new checkpoint, which the gateway loads for the next step's rollouts.

The model is a small GPT-2 built from a config with a character tokenizer (model.py), with a
short supervised warm start that teaches the answer's format and a wrong (decoy) code: its
validation reward before RL is 0. `./lightning train examples.llm_cipher` runs it all.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from examples.llm_cipher.model import base_checkpoint
from examples.llm_cipher.task import make_dataset

# Mean validation reward (greedy decoding, held-out prompts) that counts as "learned".
THRESHOLD = 0.8


def job_spec(*, seed: int = 0, steps: int = 30) -> dict[str, Any]:
    return {
        "name": "llm-cipher",
        "agent": "examples.llm_cipher.agent.recall_agent",
        "algorithm": "grpo_lm",
        "config": {
            "seed": seed,
            "steps": steps,
            "model": str(base_checkpoint(settings.MODELS_DIR)),
            "model_name": "llm-cipher",
            "lr": 1e-3,
            "epochs": 4,
            # Solved digits' groups count in the loss's mean, and every sample's tokens get
            # the entropy bonus: without them a few groups' updates late in a run unlearned
            # solved digits, and asynchronous runs lost the ones that share a letter
            # (README "Benchmarks", issue 20)
            "loss_tokens": "all",
            "entropy_coef": 0.01,
            # a step whose epochs have moved the policy this far (mean KL over its tokens)
            # takes no more: a late update on a few stale groups moves less (issue 20)
            "target_kl": 0.02,
            "group_size": 16,
            "tasks_per_step": 10,
            "val_every": 1,
            "sampling_parameters": {"temperature": 1.0, "max_tokens": 4},
            "threshold": THRESHOLD,
        },
        "train_dataset": make_dataset(200, seed=seed),
        "val_dataset": make_dataset(20, seed=seed + 1, held_out=True),
    }
