"""Rollout rewards as Agent Lightning 0.3 records them: the last reward span of the rollout's
latest attempt (AGL's "final reward"). Spans named "agentlightning.annotation" carry
"agentlightning.reward.0.value"; older agents sent "agentlightning.reward" with "reward"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import F

from store.models import Span

REWARD_ANNOTATION_SPAN = "agentlightning.annotation"
REWARD_LEGACY_SPAN = "agentlightning.reward"
REWARD_VALUE_ATTR = "agentlightning.reward.0.value"


def span_reward(name: str, attributes: dict[str, Any]) -> float | None:
    """The reward a span carries, or None (not a reward span, or no number in it)."""
    if name == REWARD_ANNOTATION_SPAN:
        value = attributes.get(REWARD_VALUE_ATTR)
    elif name == REWARD_LEGACY_SPAN:
        value = attributes.get("reward")
    else:
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def rollout_rewards(*, rollout_ids: Sequence[str]) -> dict[str, float]:
    """Final reward per rollout, for those that have one (one query over their reward spans)."""
    rows = (Span.objects.filter(rollout_id__in=list(rollout_ids),
                                attempt_id=F("rollout__latest_attempt_id"),
                                name__in=(REWARD_ANNOTATION_SPAN, REWARD_LEGACY_SPAN))
            .order_by("sequence_id").values_list("rollout_id", "name", "attributes"))
    rewards: dict[str, float] = {}
    for rollout_id, name, attributes in rows.iterator():
        reward = span_reward(name, attributes or {})
        if reward is not None:
            rewards[rollout_id] = reward
    return rewards


def mean_reward(*, rollout_ids: Sequence[str]) -> tuple[float | None, int]:
    """Mean final reward of the listed rollouts that have one, and how many have one."""
    rewards = list(rollout_rewards(rollout_ids=rollout_ids).values())
    return (sum(rewards) / len(rewards) if rewards else None), len(rewards)
