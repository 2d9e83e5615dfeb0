"""Job specs the trainer's command tests run (found by dotted path, as users' specs are)."""

from __future__ import annotations

from typing import Any

from examples.cipher import job_spec as cipher_spec


def broken_agent(task: Any) -> float:
    raise RuntimeError("the broken agent fails every rollout")


def spanless_agent(task: Any) -> float:
    """Returns a reward but records no decision: nothing for grpo to train on."""
    return 0.5


def unrewarded_agent(task: Any) -> None:
    """Records a decision per symbol but neither returns nor emits a reward."""
    from runners.tracing import tracer
    from trainer import conventions as c

    for position, _ in enumerate(task["task"]["message"]):
        with tracer().start_as_current_span(c.DECISION_SPAN, attributes={
            c.ATTR_AGENT: "decoder", c.ATTR_OBSERVATION: [0.0], c.ATTR_ACTION: 1,
            c.ATTR_LOGPROB: -2.3, c.ATTR_TURN: position,
        }):
            pass


def broken_baseline_spec(*, seed: int = 0, steps: int = 1) -> dict[str, Any]:
    """Evaluation only (`baseline`) with an agent that fails every rollout: the job must fail."""
    spec = cipher_spec(seed=seed, steps=steps)
    spec["val_dataset"] = spec["val_dataset"][:4]
    return {**spec, "name": "broken-baseline", "agent": "tests.trainer_specs.broken_agent",
            "algorithm": "baseline"}


def exploding_policy(**kwargs: Any) -> Any:
    """A policy factory that imports but raises: checkpoint 0 cannot be written."""
    raise RuntimeError("no policy today")
