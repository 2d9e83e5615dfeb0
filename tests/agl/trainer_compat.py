"""Runs inside .venv-agl: an unmodified AGL 0.3 `Trainer` (n_runners=4, client-server strategy,
our server as its store) trains an AGL `@rollout` agent that emits a span and returns a reward.
Spans travel over AGL's OTLP exporter to /v1/traces. Usage:

    .venv-agl/bin/python tests/agl/trainer_compat.py http://algo:KEY@127.0.0.1:PORT N
"""

from __future__ import annotations

import sys

import agentlightning as agl
from agentlightning.store.client_server import LightningStoreClient
from opentelemetry import trace


@agl.rollout
def compat_agent(task: dict, llm: agl.LLM) -> float:
    with trace.get_tracer("compat.agent").start_as_current_span("compat.work") as span:
        span.set_attribute("compat.value", task["value"])
        span.set_attribute("compat.model", llm.model)
    return task["value"] / 100


def main(url: str, count: int) -> None:
    store = LightningStoreClient(url)
    trainer = agl.Trainer(
        n_runners=4,
        store=store,
        strategy={"type": "cs", "managed_store": False, "role": "both"},
        algorithm=agl.Baseline(n_epochs=1, train_split=0.5, polling_interval=0.2,
                               max_queue_length=8, span_verbosity="none"),
        tracer=agl.OtelTracer(),
        initial_resources={"llm": agl.LLM(endpoint="http://127.0.0.1:9/v1", model="compat")},
    )
    data = [{"value": i} for i in range(count)]
    half = count // 2
    trainer.fit(compat_agent, train_dataset=data[:half], val_dataset=data[half:])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
