"""The cipher agent: acts with the checkpoint its rollout names, records every decision and its
log-probability as a span, and emits the episode's reward (see examples/cipher/__init__.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from examples.cipher.task import answer, build_policy, observe
from runners.tracing import emit_reward, tracer
from trainer import conventions as c
from trainer.checkpoints import checkpoint_load, find_checkpoint

AGENT_NAME = "decoder"
# Rollouts run many to a process: one thread each keeps them from fighting over the cores.
torch.set_num_threads(1)
_policies: dict[str, torch.nn.Module] = {}  # oldest first
KEEP_POLICIES = 4


def _policy(checkpoint: Mapping[str, Any]) -> torch.nn.Module:
    """The policy of a checkpoint, built once per process per content hash."""
    policy = _policies.get(checkpoint["sha256"])
    if policy is None:
        policy = build_policy()
        policy.load_state_dict(checkpoint_load(dict(checkpoint))["model"])
        policy.eval()
        # a synchronous job's rollouts move to the next version together; an asynchronous
        # job's run against a few versions at once (max_staleness + 1): keep that many
        while len(_policies) >= KEEP_POLICIES:
            _policies.pop(next(iter(_policies)))
        _policies[checkpoint["sha256"]] = policy
    return policy


def cipher_agent(task: dict[str, Any], resources: Mapping[str, Any]) -> None:
    checkpoint = find_checkpoint(dict(resources))
    if checkpoint is None:
        raise ValueError("the cipher agent needs a checkpoint resource")
    policy = _policy(checkpoint)
    generator = torch.Generator().manual_seed(int(task["seed"]))
    message = task["task"]["message"]
    correct = 0
    for position, symbol in enumerate(message):
        features = observe(symbol, position)
        with torch.no_grad():
            logp = torch.log_softmax(policy(torch.tensor([features])), dim=-1)[0]
        if task.get("greedy"):
            action = int(torch.argmax(logp))
        else:
            action = int(torch.multinomial(logp.exp(), 1, generator=generator))
        with tracer().start_as_current_span(c.DECISION_SPAN, attributes={
            c.ATTR_AGENT: AGENT_NAME,
            c.ATTR_OBSERVATION: features,
            c.ATTR_ACTION: action,
            c.ATTR_LOGPROB: float(logp[action]),
            c.ATTR_TURN: position,
        }):
            pass
        correct += int(action == answer(symbol))
    # The reward as an AGL annotation span (returning it instead would do the same).
    emit_reward(correct / len(message))
