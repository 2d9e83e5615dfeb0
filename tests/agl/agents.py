"""AGL 0.3 agents, written exactly as an AGL user writes them, for the tests that run them on
our Celery workers and remote runner (importable where agentlightning is installed)."""

from __future__ import annotations

import agentlightning as agl
import openai


@agl.rollout
def llm_agent(task: dict, llm: agl.LLM) -> float:
    """An `@rollout` function: AGL hands it the `llm` resource, typed."""
    agl.emit_object({"endpoint": llm.endpoint, "model": llm.model})
    with agl.operation(name="compat.think", value=task["value"]):
        pass
    return task["value"] / 10


class ProxyAgent(agl.LitAgent):
    """A LitAgent subclass: the ProxyLLM's base URL routes to this rollout and attempt."""

    def rollout(self, task: dict, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        proxy = resources["proxy"]
        assert isinstance(proxy, agl.ProxyLLM), type(proxy)
        prompt = resources["prompt"]
        assert isinstance(prompt, agl.PromptTemplate), type(prompt)
        base_url = proxy.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        agl.emit_message(f"{rollout.mode} {base_url} {prompt.format(x=task['value'])}")
        return float(task["value"])


@agl.rollout
def gateway_agent(task: dict, llm: agl.LLM) -> float:
    """An `@rollout` agent on the OpenAI client: its `ProxyLLM` resource, made an `LLM` by AGL,
    routes its calls to this rollout and attempt on our model gateway."""
    client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=4)
    return 1.0 if reply.choices[0].message.content is not None else 0.0
