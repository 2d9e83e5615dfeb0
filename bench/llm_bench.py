"""Benchmark of the LLM path. Prints figures; asserts nothing.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_llm_bench \\
        .venv/bin/python bench/llm_bench.py [--mode overhead|peer|fairness] [--requests 400]
        [--skip-example]

`--mode overhead` (the default) runs 1-3 below; `--mode peer` runs 4, `--mode fairness` 5.

1. Gateway overhead: 16 concurrent sessions, each calling the example's model through the
   gateway (`manage.py llm_serve`, its own process) over real HTTP with the official openai
   client, attributed to a running attempt (so every call is authenticated, attributed and
   recorded as a span in Postgres), against 16 threads calling the same engine through the
   same batcher in this process. Printed: both latencies, their difference, and the time a
   call spends in the gateway itself (its Server-Timing header: the whole call less the time
   waiting for and in the engine): HTTP, authentication, attribution, recording.
2. Dynamic batching: generated tokens/s for 16 concurrent requests of 16 tokens each
   (`ignore_eos`), with the batcher's window against one request at a time (max_batch 1).
3. The example's time to threshold: `manage.py train examples.llm_cipher` on the embedded
   default, its summary line.
4. Against the peer (bench/llm_peer.py): the engine called directly, through our gateway and
   through AGL 0.3's LiteLLM proxy in front of the same engine, at 1, 16 and 64 concurrent
   sessions; last line `gateway overhead_p50_ms=.. overhead_p99_ms=.. litellm_overhead_p50_ms=..
   sessions=16`.
5. Fairness (bench/llm_fairness.py): project B's call latency alone and while project A floods
   the gateway with many concurrent long streams; the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/lightning_llm_bench")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench")
os.environ.setdefault("LOG_LEVEL", "WARNING")

import django  # noqa: E402

django.setup()

import httpx  # noqa: E402
import openai  # noqa: E402
from django.conf import settings  # noqa: E402

from bench import llm_common, llm_fairness, llm_peer  # noqa: E402
from bench.benchdb import empty_bench_database  # noqa: E402
from bench.llm_common import pct  # noqa: E402
from examples.llm_cipher.model import base_checkpoint  # noqa: E402
from store import services  # noqa: E402
from store.models import Span  # noqa: E402
from store.services import RolloutSpec  # noqa: E402
from trainer.llm.batcher import Batcher  # noqa: E402
from trainer.llm.engine import Params, Sequence_  # noqa: E402
from trainer.llm.server import build_gateway, quiet_transformers  # noqa: E402
from trainer.llm.tokenizer import render_chat  # noqa: E402

SESSIONS = 16
MESSAGES = [{"role": "user", "content": "abc 7"}]


def run_sessions(call, per_session: int) -> tuple[list[float], float]:
    return llm_common.run_sessions(call, per_session, SESSIONS)


def overhead(requests: int, max_tokens: int) -> None:
    empty_bench_database()
    project = services.project_create(name="bench")
    _, key = services.api_key_create(project=project, role="runner")
    services.rollout_enqueue_many(project=project, specs=[RolloutSpec(input={}) for _ in
                                                          range(SESSIONS)])
    attempts = [services.rollout_dequeue(project=project, worker_id="bench")
                for _ in range(SESSIONS)]
    model = base_checkpoint(settings.MODELS_DIR)
    port = _free_port()
    # The gateway in its own process, as deployed (llm_serve), so the clients' own work is
    # not counted against it; the direct path runs the same engine and batcher here.
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "llm_serve", "--port", str(port),
         "--model", f"tiny={model}"], env=os.environ.copy(), cwd=ROOT)
    try:
        _wait_healthy(port)
        gateway = build_gateway(models=[f"tiny={model}"])  # for the direct path
        engine = gateway.registry.by_name("tiny")
        prompt = render_chat(engine.tokenizer, MESSAGES)
        params = Params(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        per = max(1, requests // SESSIONS // 3)
        http = httpx.Client(limits=httpx.Limits(max_connections=64))
        clients = [openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/rollout/{r.pk}/attempt/{a.attempt_id}/v1",
            api_key=key, http_client=http, max_retries=0) for r, a in attempts]

        def direct(i: int, j: int) -> None:
            gateway.batcher.run(engine, [Sequence_(list(prompt), params)])

        inside: list[float] = []

        def through_gateway(i: int, j: int) -> None:
            raw = clients[i].chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, max_tokens=max_tokens,
                extra_body={"ignore_eos": True})
            raw.parse()
            timing = dict(part.strip().split(";dur=")
                          for part in raw.headers["server-timing"].split(","))
            inside.append(float(timing["gateway"]) / 1000)

        run_sessions(direct, 2)  # warm up both paths
        run_sessions(through_gateway, 2)
        inside.clear()
        rounds = {"direct": [], "gateway": []}
        for _ in range(3):  # interleaved, so both see the same machine
            rounds["direct"] += run_sessions(direct, per)[0]
            rounds["gateway"] += run_sessions(through_gateway, per)[0]
    finally:
        server.terminate()
        server.wait(30)
    d, g = rounds["direct"], rounds["gateway"]
    recorded = Span.objects.filter(rollout__project=project).count()
    print(f"gateway overhead at {SESSIONS} concurrent sessions ({len(g)} calls each way, "
          f"{max_tokens} tokens per call; gateway calls attributed, {recorded} spans recorded):")
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        print(f"  {name}: direct {pct(d, q) * 1000:7.2f} ms   gateway {pct(g, q) * 1000:7.2f} ms"
              f"   end-to-end difference {(pct(g, q) - pct(d, q)) * 1000:6.2f} ms   "
              f"time in the gateway itself {pct(inside, q) * 1000:6.2f} ms")
    print(f"  mean: direct {statistics.fmean(d) * 1000:.2f} ms, gateway "
          f"{statistics.fmean(g) * 1000:.2f} ms")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("llm_serve did not start")


def batching(max_tokens: int, rounds: int) -> None:
    engine_dir = base_checkpoint(settings.MODELS_DIR)
    from trainer.llm.engine import Engine

    engine = Engine(engine_dir)
    prompt = render_chat(engine.tokenizer, MESSAGES)
    params = Params(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    figures = {}
    for name, batcher in (("dynamic batching", Batcher(window=0.005, max_batch=64)),
                          ("one at a time", Batcher(window=0.0, max_batch=1))):
        def call(i: int, j: int, batcher=batcher) -> None:
            batcher.run(engine, [Sequence_(list(prompt), params)])

        run_sessions(call, 1)
        _, seconds = run_sessions(call, rounds)
        tokens = SESSIONS * rounds * max_tokens
        figures[name] = tokens / seconds
        print(f"  {name:16s}: {tokens / seconds:8.0f} generated tokens/s "
              f"({batcher.batches} batches, largest {batcher.largest})")
    print(f"  ratio: {figures['dynamic batching'] / figures['one at a time']:.1f}x")


def example() -> None:
    with tempfile.TemporaryDirectory() as data:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL",)}
        env.update(LIGHTNING_DATA_DIR=data, LIGHTNING_MODELS_DIR=str(settings.MODELS_DIR),
                   LOG_LEVEL="WARNING")
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"], env=env, cwd=ROOT)
        done = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "train", "examples.llm_cipher", "--quiet"],
            env=env, cwd=ROOT, capture_output=True, text=True)
        print(f"  wall time of the command: {time.perf_counter() - start:.1f}s "
              f"(exit {done.returncode})")
        for line in done.stdout.splitlines():
            print("  " + line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=480)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--skip-example", action="store_true")
    parser.add_argument("--mode", choices=["overhead", "peer", "fairness"], default="overhead")
    args = parser.parse_args()
    quiet_transformers()
    base_checkpoint(settings.MODELS_DIR)  # built before anything is timed
    if args.mode == "peer":
        return llm_peer.run(max_tokens=args.max_tokens)
    if args.mode == "fairness":
        return llm_fairness.run()
    overhead(args.requests, args.max_tokens)
    print(f"generated tokens/s at {SESSIONS} concurrent requests of 16 tokens:")
    batching(16, 8)
    if not args.skip_example:
        print("the example (embedded default), `manage.py train examples.llm_cipher`:")
        example()


if __name__ == "__main__":
    main()
