"""The recall agent: plain OpenAI client code against its rollout's `llm` resource.

The runner hands the agent an `llm` resource whose `endpoint` is already this attempt's own
base URL on the model gateway (so every call is recorded for training) and whose `api_key` is
good for it; the agent is what any OpenAI-client code looks like. It returns the reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import openai

from examples.llm_cipher.task import prompt, reward

# One connection pool for every rollout of this process (each rollout has its own base URL).
_http = httpx.Client(timeout=60.0)


def recall_agent(task: dict[str, Any], llm: Mapping[str, Any]) -> float:
    client = openai.OpenAI(base_url=llm["endpoint"], api_key=llm.get("api_key") or "-",
                           http_client=_http, max_retries=2)
    sampling = dict(llm.get("sampling_parameters") or {})
    if task.get("greedy"):  # validation: the model's best answer
        sampling["temperature"] = 0.0
    completion = client.chat.completions.create(
        model=llm["model"], messages=[{"role": "user", "content": prompt(task["task"])}],
        seed=task.get("seed"), **sampling,
    )
    return reward(task["task"], completion.choices[0].message.content or "")
