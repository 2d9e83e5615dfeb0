"""Gateway spans -> token-level training samples.

Each LLM call the gateway recorded (trainer/conventions.py: LLM_CALL_SPAN and
LLM_COMPLETION_SPAN, with prompt and response token ids and per-token log-probabilities) is a
transition. With `aggregation: "trajectory"`, the calls of one episode become one sample when
each call's prompt extends the previous call's prompt and response (a multi-turn chat): the
tokens are the last call's prompt and response, and the mask marks every token the model
generated; episodes whose turns do not chain that way stay transitions. Every sample carries
the rollout's final reward (AGL's convention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer import conventions as c
from trainer.algorithms.adapter import FinishedRollout

LLM_SPANS = (c.LLM_CALL_SPAN, c.LLM_COMPLETION_SPAN)


@dataclass
class TokenSample:
    rollout_id: str
    group: Any
    input_ids: list[int]  # prompt and response tokens
    mask: list[int]  # 1 where the model generated the token (trained on), else 0
    old_logprobs: list[float]  # per input token; 0.0 where mask is 0
    reward: float
    # the oldest checkpoint version that generated any of its tokens (the staleness bound is
    # checked on it), and per input token the version that generated it (None: not generated
    # by the model, or not said); a partial rollout's calls may carry several
    version: int | None = None
    # The distribution the tokens were sampled from (trainer/llm/sampling.py) and how the
    # recorded logprobs were computed (conventions.LLM_LOGPROBS_OF; "" = not said).
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs_of: str = ""
    versions: list[int | None] | None = None

    @property
    def generated(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class TokenAdapter:
    aggregation: str = "transition"

    def __post_init__(self) -> None:
        if self.aggregation not in ("transition", "trajectory"):
            raise ValueError("aggregation must be 'transition' or 'trajectory'")

    def calls(self, rollout: FinishedRollout) -> list[dict[str, Any]]:
        chosen = []
        for index, span in enumerate(rollout.spans):
            attributes = span.get("attributes") or {}
            if span.get("name") in LLM_SPANS and attributes.get(c.LLM_RESPONSE_IDS):
                chosen.append((span.get("sequence_id") or 0, index, attributes))
        return [attributes for _, _, attributes in sorted(chosen, key=lambda t: t[:2])]

    def samples(self, rollout: FinishedRollout) -> list[TokenSample]:
        reward = rollout.reward
        calls = self.calls(rollout)
        if reward is None or not calls:
            return []
        transitions = [self._transition(rollout, a, reward) for a in calls]
        if self.aggregation == "transition" or len(transitions) == 1:
            return transitions
        return self._chained(transitions) or transitions

    def _transition(self, rollout: FinishedRollout, attributes: dict[str, Any],
                    reward: float) -> TokenSample:
        prompt = [int(t) for t in attributes[c.LLM_PROMPT_IDS]]
        response = [int(t) for t in attributes[c.LLM_RESPONSE_IDS]]
        logprobs = [float(x) for x in attributes.get(c.LLM_LOGPROBS) or []]
        if len(logprobs) != len(response):
            raise ValueError(f"rollout {rollout.rollout_id}: an LLM call span has "
                             f"{len(response)} response tokens but {len(logprobs)} logprobs")
        version = attributes.get(c.LLM_VERSION)
        return TokenSample(
            rollout_id=rollout.rollout_id, group=rollout.group, input_ids=prompt + response,
            mask=[0] * len(prompt) + [1] * len(response),
            old_logprobs=[0.0] * len(prompt) + logprobs, reward=reward,
            version=version, versions=[None] * len(prompt) + [version] * len(response),
            temperature=float(_first(attributes, c.LLM_TEMPERATURE, "gen_ai.request.temperature",
                                     default=1.0)),
            top_p=float(_first(attributes, c.LLM_TOP_P, "gen_ai.request.top_p", default=1.0)),
            logprobs_of=str(attributes.get(c.LLM_LOGPROBS_OF) or ""),
        )

    @staticmethod
    def _chained(turns: list[TokenSample]) -> list[TokenSample]:
        """One sample for the episode, or [] when a turn does not extend the previous one."""
        ids, mask, logprobs = list(turns[0].input_ids), list(turns[0].mask), \
            list(turns[0].old_logprobs)
        versions = list(turns[0].versions or [None] * len(ids))
        for turn in turns[1:]:
            if turn.input_ids[:len(ids)] != ids:
                return []
            extra = len(turn.input_ids) - len(ids)
            ids += turn.input_ids[len(ids):]
            mask += turn.mask[-extra:] if extra else []
            logprobs += turn.old_logprobs[-extra:] if extra else []
            versions += (turn.versions or [None] * len(turn.input_ids))[-extra:] if extra else []
        first = turns[0]
        known = [t.version for t in turns if t.version is not None]
        return [TokenSample(first.rollout_id, first.group, ids, mask, logprobs, first.reward,
                            min(known) if known else None, first.temperature, first.top_p,
                            first.logprobs_of if all(t.logprobs_of == first.logprobs_of and
                                                     t.temperature == first.temperature and
                                                     t.top_p == first.top_p for t in turns)
                            else "", versions)]


def _first(attributes: dict[str, Any], *names: str, default: Any) -> Any:
    for name in names:
        if attributes.get(name) is not None:
            return attributes[name]
    return default
