"""The Agent Lightning 0.3 side of bench/agl_mix_bench.py. Runs in .venv-agl (the real
agentlightning==0.3.0), never in the project's environment. Not a test.

    .venv-agl/bin/python bench/agl_mix_side.py runners [--runners 16] [--rounds 4]
        [--agent returns-reward|emits-reward]
    .venv-agl/bin/python bench/agl_mix_side.py store PORT

`runners`: imports agentlightning once, then, on each "run URL DIR" line of its stdin, forks
`--runners` processes (a "stop" line ends them), each what AGL's
`Trainer` starts per runner in its client-server strategy: a `LitAgentRunner` with its default
settings and AGL's default tracer (`AgentOpsTracer`, agentops and instrumentation managed),
`init_worker(i, LightningStoreClient(URL))`, then `iter()` until killed. The agent is the
shape of AGL's own store benchmark (tests/benchmark/benchmark_store.py in AGL's repository),
made deterministic and without sleeps: `--rounds` rounds of a span holding two nested spans
with ~1 KB of attributes, a reward every other round, a final span and a final reward, all
through AGL's own tracer and emitters; with `--agent returns-reward` (the default) the final
reward is the rollout function's return value, as in AGL's examples (the runner then stores it
with `spans/next` + `spans`), with `emits-reward` it is emitted as a span, as AGL's benchmark
does. Prints "ready N" once every runner set up its tracer (the bench measures from then on).
Each runner times its own HTTP requests (aiohttp for the store client, requests for the OTLP
exporter: time to the response's headers) and, on SIGTERM, writes them to DIR as JSON lines
of [unix time at the end, "METHOD /route", seconds].

`store`: `agl store --backend memory` as AGL's CLI builds it (InMemoryLightningStore,
thread-safe, LightningStoreServer in asyncio mode, no tracker), plus one pure ASGI middleware
that counts requests per (method, route) so the bench can read the mix from the server side:
`GET /__bench/counts` answers the counts as JSON (one dict update per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import Counter
from urllib.parse import urlsplit

import agentlightning as agl
import aiohttp
import requests
from agentlightning.store.client_server import LightningStoreClient, LightningStoreServer
from agentlightning.store.memory import InMemoryLightningStore
from agentlightning.utils.otel import get_tracer

# A stable ~1 KB of attributes per span (AGL's benchmark draws 2-6 keys of 5-300 chars each).
_IDS = re.compile(r"/(ro|at|rs|sp)-[0-9a-zA-Z]+")
_WORKER = re.compile(r"/workers/[^/]+")
ATTRIBUTES = {f"bench.attr.{i}": f"value {i} " + "x" * 100 for i in range(8)}


def make_agent(rounds: int, returns_reward: bool) -> agl.LitAgent:
    @agl.rollout
    async def agent(task: str, llm: agl.LLM) -> float | None:
        tracer = get_tracer()
        for i in range(rounds):
            with tracer.start_as_current_span(f"agent{i}"):
                with tracer.start_as_current_span(f"round{i}_1") as span:
                    span.set_attributes(ATTRIBUTES)
                    span.set_attribute("task", task)
                with tracer.start_as_current_span(f"round{i}_2") as span:
                    span.set_attributes(ATTRIBUTES)
            if i % 2 == 1:
                agl.emit_reward(0.5)
        with tracer.start_as_current_span("final") as span:
            span.set_attributes(ATTRIBUTES)
        if returns_reward:
            return 1.5
        agl.emit_reward(1.5)
        return None

    return agent


def _route(method: str, path: str) -> str:
    path = _WORKER.sub("/workers/<id>", _IDS.sub(lambda m: f"/<{m.group(1)}>", path))
    return f"{method.upper()} {path}"


def time_requests(samples: list) -> None:
    """Record (end time, route, seconds) of every request of this process's HTTP clients."""
    clock = time.perf_counter
    aio_request = aiohttp.ClientSession._request

    async def timed_aio(self, method, str_or_url, **kwargs):
        started = clock()
        response = await aio_request(self, method, str_or_url, **kwargs)
        samples.append((time.time(), _route(method, urlsplit(str(str_or_url)).path),
                        clock() - started))
        return response

    sync_request = requests.Session.request

    def timed_sync(self, method, url, *args, **kwargs):
        started = clock()
        response = sync_request(self, method, url, *args, **kwargs)
        samples.append((time.time(), _route(method, urlsplit(url).path), clock() - started))
        return response

    aiohttp.ClientSession._request = timed_aio
    requests.Session.request = timed_sync


def run_one(worker_id: int, url: str, out_dir: str, rounds: int, returns_reward: bool,
            ready) -> None:
    samples: list = []

    def dump(*_) -> None:
        with open(os.path.join(out_dir, f"runner-{worker_id}.jsonl"), "w") as out:
            out.writelines(json.dumps(sample) + "\n" for sample in list(samples))
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    time_requests(samples)
    store = LightningStoreClient(url)
    runner = agl.LitAgentRunner(tracer=agl.AgentOpsTracer())
    runner.init(make_agent(rounds, returns_reward))
    runner.init_worker(worker_id, store)
    ready.release()
    asyncio.run(runner.iter())


def runners(count: int, rounds: int, returns_reward: bool) -> None:
    """Reads commands from stdin: "run URL DIR" forks `count` runners against URL (prints
    "ready N" once all are set up), "stop" ends them (they write their timings to DIR)."""
    context = multiprocessing.get_context("fork")  # the imports above are paid once
    procs: list = []
    for line in sys.stdin:
        command = line.split()
        if command and command[0] == "run":
            url, out_dir = command[1], command[2]
            ready = context.Semaphore(0)
            procs = [context.Process(target=run_one, daemon=True,
                                     args=(i, url, out_dir, rounds, returns_reward, ready))
                     for i in range(count)]
            for proc in procs:
                proc.start()
            for _ in procs:
                ready.acquire()
            print(f"ready {count}", flush=True)
        elif command and command[0] == "stop":
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.join(timeout=10)
            print("stopped", flush=True)


class CountRoutes:
    """Counts requests per (method, path with ids replaced by their kind)."""

    def __init__(self, app) -> None:
        self.app, self.counts = app, Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == "/__bench/counts":
                body = json.dumps(self.counts).encode()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
            self.counts[_route(scope["method"], path)] += 1
        await self.app(scope, receive, send)


def store(port: int) -> None:
    agl.setup_logging("WARNING")
    server = LightningStoreServer(InMemoryLightningStore(thread_safe=True), host="127.0.0.1",
                                  port=port, launch_mode="asyncio")
    server.app.add_middleware(CountRoutes)
    asyncio.run(server.run_forever())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("runners")
    run.add_argument("--runners", type=int, default=16)
    run.add_argument("--rounds", type=int, default=4)
    run.add_argument("--agent", choices=["returns-reward", "emits-reward"],
                     default="returns-reward")
    serve = sub.add_parser("store")
    serve.add_argument("port", type=int)
    args = parser.parse_args()
    if args.what == "runners":
        agl.setup_logging("WARNING")
        runners(args.runners, args.rounds, args.agent == "returns-reward")
    else:
        store(args.port)
    sys.exit(0)


if __name__ == "__main__":
    main()
