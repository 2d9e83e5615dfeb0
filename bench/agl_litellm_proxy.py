"""AGL 0.3's LiteLLM proxy (`agentlightning.LLMProxy`), configured as AGL's trainer configures
it (agentlightning/verl/daemon.py: model_list `hosted_vllm/<model>` at the server's `/v1/`,
the default middlewares and callbacks: token ids, logprobs, OpenTelemetry spans into the
store), in front of an OpenAI-compatible server. Run with .venv-agl's Python by
bench/llm_bench.py; prints `AGL-LLMPROXY {json}` (port, rollout and attempt ids) once it
serves, then
serves until killed.

    .venv-agl/bin/python bench/agl_litellm_proxy.py --upstream http://127.0.0.1:PORT/v1 \\
        --model tiny --api-key KEY --sessions 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at start
os.environ.setdefault("LITELLM_LOG", "ERROR")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--sessions", type=int, default=64)
    args = parser.parse_args()

    import agentlightning as agl
    from agentlightning.store import InMemoryLightningStore

    store = InMemoryLightningStore()  # async-safe: the proxy runs on this event loop
    port = _free_port()
    params = {"model": "hosted_vllm/" + args.model, "api_base": args.upstream.rstrip("/") + "/"}
    if args.api_key:
        params["api_key"] = args.api_key
    proxy = agl.LLMProxy(port=port, model_list=[{"model_name": args.model,
                                                 "litellm_params": params}],
                         store=store, launch_mode="asyncio")
    await proxy.start()
    attempts = []
    for i in range(args.sessions):
        rollout = await store.start_rollout(input={"i": i}, mode="train")
        attempts.append([rollout.rollout_id, rollout.attempt.attempt_id])
    print("AGL-LLMPROXY " + json.dumps({"port": port, "attempts": attempts}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
