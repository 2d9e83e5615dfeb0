"""The calculator agent: plain OpenAI-client code with one tool, passed as `tools=`.

It asks the question (after two worked examples); when the model calls the `calculator`, the
agent runs it, sends the result back as a `tool` message and asks again for the final answer
(at most `MAX_TURNS` calls). Every call goes through the rollout's `llm` resource, the model
gateway, which records the tokens; the reward is whether the final answer is right.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import openai

from examples.calculator.task import TOOL, calculator, messages, reward

MAX_TURNS = 3
# One connection pool for every rollout of this process (each rollout has its own base URL).
_http = httpx.Client(timeout=120.0)


def calculator_agent(task: dict[str, Any], llm: Mapping[str, Any]) -> float:
    """`task`: {"task": {"a", "b"}, "seed", "greedy"} (grpo_lm's plan)."""
    pair = task["task"]
    client = openai.OpenAI(base_url=llm["endpoint"], api_key=llm.get("api_key") or "-",
                           http_client=_http, max_retries=2)
    sampling = dict(llm.get("sampling_parameters") or {})
    if task.get("greedy"):  # validation: the model's best answer
        sampling["temperature"] = 0.0
    chat = messages(pair)
    for _ in range(MAX_TURNS):
        completion = client.chat.completions.create(
            model=llm["model"], messages=chat, tools=[TOOL], seed=task.get("seed"), **sampling)
        message = completion.choices[0].message
        if not message.tool_calls:
            return reward(pair, message.content)
        chat.append({"role": "assistant", "content": message.content or "",
                     "tool_calls": [call.model_dump() for call in message.tool_calls]})
        for call in message.tool_calls:
            result = (calculator(call.function.arguments) if call.function.name == "calculator"
                      else f"error: no tool named {call.function.name}")
            chat.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0  # still calling tools after MAX_TURNS: no answer
