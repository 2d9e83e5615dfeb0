"""Spans -> training samples, in Agent Lightning's spirit.

AGL turns a rollout's spans into (prompt, response, reward) triplets. Ours are
(observation, action, reward) with the acting policy's log-probability: one per decision span
(conventions.DECISION_SPAN). Two choices, both from the job's config:

- `agents`: train only on decisions of these agents (selective optimization when several
  agents act in one episode); None trains on every agent's decisions;
- `aggregation`: "transition" makes each decision a sample; "trajectory" makes the whole
  episode one sample (its log-probability is the sum over its decisions).

The reward of a rollout is its last reward annotation (AGL's "final reward"), given to every
decision of the episode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trainer import conventions as c


@dataclass
class FinishedRollout:
    rollout_id: str
    mode: str
    status: str
    input: Any
    spans: list[dict[str, Any]] = field(default_factory=list)  # {"name", "attributes", ...}
    # The oldest resources version that produced any part of it (trainer/staleness.py)
    version: int | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"

    @property
    def group(self) -> Any:
        """Rollouts of the same task share a group (GRPO compares within it)."""
        return self.input.get("group") if isinstance(self.input, dict) else None

    @property
    def reward(self) -> float | None:
        return final_reward(self.spans)


@dataclass
class Sample:
    rollout_id: str
    group: Any
    agent: str | None
    observations: list[list[float]]
    actions: list[int]
    logprobs: list[float]
    reward: float
    version: int | None = None  # the rollout's (FinishedRollout.version)


def final_reward(spans: list[dict[str, Any]]) -> float | None:
    reward = None
    for span in sorted(spans, key=lambda s: (s.get("sequence_id") or 0)):
        attributes = span.get("attributes") or {}
        if span.get("name") == c.REWARD_ANNOTATION_SPAN:
            value = attributes.get(c.REWARD_VALUE_ATTR.format(index=0))
        elif span.get("name") == c.REWARD_LEGACY_SPAN:
            value = attributes.get("reward")
        else:
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            reward = float(value)
    return reward


def _observation(raw: Any) -> list[float]:
    value = json.loads(raw) if isinstance(raw, str) else raw
    return [float(x) for x in value]


@dataclass(frozen=True)
class TripletAdapter:
    agents: frozenset[str] | None = None
    aggregation: str = "transition"

    def __post_init__(self) -> None:
        if self.aggregation not in ("transition", "trajectory"):
            raise ValueError("aggregation must be 'transition' or 'trajectory'")

    def decisions(self, rollout: FinishedRollout) -> list[dict[str, Any]]:
        chosen = []
        for span in rollout.spans:
            attributes = span.get("attributes") or {}
            if span.get("name") != c.DECISION_SPAN:
                continue
            if self.agents is not None and attributes.get(c.ATTR_AGENT) not in self.agents:
                continue
            chosen.append(span)
        return sorted(chosen, key=lambda s: (s["attributes"].get(c.ATTR_TURN, 0),
                                             s.get("sequence_id") or 0))

    def samples(self, rollout: FinishedRollout) -> list[Sample]:
        reward = rollout.reward
        decisions = self.decisions(rollout)
        if reward is None or not decisions:
            return []
        triplets = [
            Sample(
                rollout_id=rollout.rollout_id,
                group=rollout.group,
                agent=span["attributes"].get(c.ATTR_AGENT),
                observations=[_observation(span["attributes"][c.ATTR_OBSERVATION])],
                actions=[int(span["attributes"][c.ATTR_ACTION])],
                logprobs=[float(span["attributes"][c.ATTR_LOGPROB])],
                reward=reward,
                version=rollout.version,
            )
            for span in decisions
        ]
        if self.aggregation == "transition":
            return triplets
        return [
            Sample(
                rollout_id=rollout.rollout_id,
                group=rollout.group,
                agent=triplets[0].agent,
                observations=[t.observations[0] for t in triplets],
                actions=[t.actions[0] for t in triplets],
                logprobs=[t.logprobs[0] for t in triplets],
                reward=reward,
                version=rollout.version,
            )
        ]
