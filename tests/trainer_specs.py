"""Job specs the trainer's command tests run (found by dotted path, as users' specs are)."""

from __future__ import annotations

from typing import Any

from examples.cipher import job_spec as cipher_spec


def broken_agent(task: Any) -> float:
    raise RuntimeError("the broken agent fails every rollout")


def broken_baseline_spec(*, seed: int = 0, steps: int = 1) -> dict[str, Any]:
    """Evaluation only (`baseline`) with an agent that fails every rollout: the job must fail."""
    spec = cipher_spec(seed=seed, steps=steps)
    spec["val_dataset"] = spec["val_dataset"][:4]
    return {**spec, "name": "broken-baseline", "agent": "tests.trainer_specs.broken_agent",
            "algorithm": "baseline"}


def exploding_policy(**kwargs: Any) -> Any:
    """A policy factory that imports but raises: checkpoint 0 cannot be written."""
    raise RuntimeError("no policy today")
