"""Span conventions shared by agents that record decisions and the trainer that learns from
them. Dependency-free on purpose: agents import it without pulling in the trainer's models.

A decision span (one per action the agent takes) carries the observation it acted on, the
action, the log-probability the acting policy gave it, and which agent took it (for selective
optimization in multi-agent systems). Rewards use Agent Lightning's annotation convention.
"""

from __future__ import annotations

DECISION_SPAN = "lightning.decision"
ATTR_AGENT = "lightning.agent_name"
ATTR_OBSERVATION = "lightning.observation"  # JSON: a list of floats (the policy's input)
ATTR_ACTION = "lightning.action"  # int: index of the discrete action taken
ATTR_LOGPROB = "lightning.logprob"  # float: log pi_old(action | observation)
ATTR_TURN = "lightning.turn"  # int: position of the decision in its episode

# Agent Lightning 0.3: rewards are spans named "agentlightning.annotation" with attributes
# "agentlightning.reward.N.name" / "agentlightning.reward.N.value"; older agents sent a span
# named "agentlightning.reward" with a "reward" attribute.
REWARD_ANNOTATION_SPAN = "agentlightning.annotation"
REWARD_LEGACY_SPAN = "agentlightning.reward"
REWARD_VALUE_ATTR = "agentlightning.reward.{index}.value"

# LLM calls recorded by the model gateway (trainer/llm/calls.py): one span per returned choice,
# named as AGL 0.3's triplet adapter expects, with its attribute names for the token ids.
LLM_CALL_SPAN = "openai.chat.completion"
LLM_COMPLETION_SPAN = "openai.completion"
LLM_PROMPT_IDS = "prompt_token_ids"  # list[int]
LLM_RESPONSE_IDS = "response_token_ids"  # list[int]
LLM_LOGPROBS = "lightning.llm.logprobs"  # list[float]: per response token (LLM_LOGPROBS_OF)
# How LLM_LOGPROBS were computed: "sampled:<model dtype>" = under the distribution sampled from
# (trainer/llm/sampling.py, at LLM_TEMPERATURE and LLM_TOP_P); absent = not said (upstream).
LLM_LOGPROBS_OF = "lightning.llm.logprobs_of"
LLM_TEMPERATURE = "lightning.llm.temperature"  # float: the temperature sampled at (0 = greedy)
LLM_TOP_P = "lightning.llm.top_p"  # float
LLM_VERSION = "lightning.llm.version"  # int: the checkpoint version that generated it
# Rollout metadata, True: the gateway serves each of the rollout's calls with the newest
# published version instead of the pinned one (partial rollouts: an episode in flight when a
# version is published continues on it; each call's span says which served it).
LLM_LATEST = "lightning.llm.latest"
# str: sha256 of the request body, which binds an idempotency key to it (trainer/llm/calls.py)
LLM_REQUEST_SHA256 = "lightning.llm.request_sha256"
LLM_FINISH = "gen_ai.response.finish_reasons"
# bool, on a call that follows another of its attempt: True when its prompt ids do not start
# with the previous call's prompt and response ids (the turns cannot make one trajectory).
LLM_RETOKENIZED = "lightning.llm.retokenization_mismatch"
