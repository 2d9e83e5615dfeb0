"""LLM resources, routed to the attempt that uses them.

A job that trains a language model publishes an `llm` resource of type `proxy_llm` (AGL 0.3's
ProxyLLM): the model gateway's endpoint, the model name and the checkpoint version. Before the
agent runs, the runner gives it a copy whose `endpoint` is the attempt's own base URL,
`{gateway}/rollout/{rollout_id}/attempt/{attempt_id}/v1` (AGL's `get_base_url`), and whose
`api_key` is good for those calls: so an agent that calls
`openai.OpenAI(base_url=llm["endpoint"], api_key=llm["api_key"])` has every call recorded as a
span of its attempt, with no code of ours in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PROXY_LLM = "proxy_llm"


def routed_base_url(endpoint: str, rollout_id: str, attempt_id: str) -> str:
    """AGL 0.3's ProxyLLM.get_base_url: the attempt's path goes before a trailing /v1."""
    prefix = endpoint.rstrip("/")
    has_v1 = prefix.endswith("/v1")
    if has_v1:
        prefix = prefix[:-3]
    prefix += f"/rollout/{rollout_id}/attempt/{attempt_id}"
    return prefix + "/v1" if has_v1 else prefix


def route_llm_resources(resources: Mapping[str, Any], *, rollout_id: str, attempt_id: str,
                        api_key: str | None) -> dict[str, Any]:
    """The resources with every proxy_llm routed to this attempt (others unchanged)."""
    routed = dict(resources)
    for name, value in resources.items():
        if isinstance(value, Mapping) and value.get("resource_type") == PROXY_LLM:
            copy = dict(value)
            copy["endpoint"] = routed_base_url(str(value["endpoint"]), rollout_id, attempt_id)
            copy["base_endpoint"] = value["endpoint"]
            if api_key and not value.get("api_key"):
                copy["api_key"] = api_key
            routed[name] = copy
    return routed
