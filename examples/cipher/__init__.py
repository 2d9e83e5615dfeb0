"""The example that learns: decode a secret cipher.

Each task is a message of `LENGTH` (4) symbols out of `VOCAB` (10). The agent decodes one
symbol per turn, seeing the symbol and its position; the right answer is `SECRET[symbol]`, a
substitution it is never told. The reward is the fraction of symbols decoded correctly, given
once at the end of the episode (so GRPO must work out which decisions earned it). An untrained
policy guesses (expected reward 1/VOCAB = 0.1); a trained one decodes every message (1.0).

`./lightning train examples.cipher` trains it with GRPO from scratch (torch, CPU).
"""

from __future__ import annotations

from typing import Any

from examples.cipher.task import LENGTH, VOCAB, make_dataset

# Mean validation reward (greedy decoding) that counts as "clearly learned".
THRESHOLD = 0.9


def job_spec(*, seed: int = 0, steps: int = 20) -> dict[str, Any]:
    """What `manage.py train examples.cipher` runs (its options override these)."""
    return {
        "name": "cipher",
        "agent": "examples.cipher.agent.cipher_agent",
        "algorithm": "grpo",
        "config": {
            "seed": seed,
            "steps": steps,
            "policy": "examples.cipher.task.build_policy",
            "policy_kwargs": {"vocab": VOCAB, "length": LENGTH, "hidden": 32},
            "lr": 0.05,
            "group_size": 8,
            "tasks_per_step": 8,
            "epochs": 4,
            "val_every": 5,
            "threshold": THRESHOLD,
        },
        "train_dataset": make_dataset(200, seed=seed),
        "val_dataset": make_dataset(32, seed=seed + 1),
    }
