"""Our gateway against AGL 0.3's LiteLLM proxy, same engine, same run (bench/llm_bench.py
--mode peer).

Four paths, at 1, 16 and 64 concurrent sessions, each session a thread calling in a row with
the official openai client (chat, `max_tokens` tokens, `ignore_eos`):
- direct: the engine through the same batcher, in this process (no HTTP);
- ours: `manage.py llm_serve` (its own process), each call attributed to a running attempt:
  authenticated, attributed, recorded as a span in Postgres before it is answered;
- plain: the same gateway, a project key and no attempt (nothing recorded): what LiteLLM
  forwards to, as AGL's trainer points it at vLLM's `/v1`;
- litellm: AGL 0.3's `LLMProxy` (bench/agl_litellm_proxy.py, .venv-agl) at its per-attempt
  URL, in front of `plain`;
- floor: the same client against a server that answers at once with a fixed completion
  (bench/llm_floor_server.py: the gateway's HTTP stack, no engine, no database): what the
  client and HTTP alone cost a call at that concurrency on this machine.
Our overhead: ours - direct; LiteLLM's: litellm - plain (at the same percentile). `direct`
has no client or HTTP, so ours - direct counts the floor too (litellm - plain does not: both
have it); `ours - floor - direct` is what the gateway adds beyond it. The paths
take turns in rounds so all see the same machine. CPU ms per call: each server process's
CPU time over its rounds (ours: the gateway process, engine included; the engine's own share
is the direct rounds' CPU of this process).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
from django.conf import settings

from bench.benchdb import empty_bench_database
from bench.llm_common import (
    MESSAGES,
    ROOT,
    cpu_seconds,
    free_port,
    pct,
    run_sessions,
    running_attempts,
    start_gateway,
    stop,
    wait_healthy,
)
from examples.llm_cipher.model import base_checkpoint
from store import services
from store.models import Span
from trainer.llm.engine import Params, Sequence_
from trainer.llm.server import build_gateway
from trainer.llm.tokenizer import render_chat

LEVELS = (1, 16, 64)
CALLS = {1: 24, 16: 96, 64: 128}  # per path and level, over two rounds
READY = "AGL-LLMPROXY "
AGL_PYTHON = ROOT / ".venv-agl" / "bin" / "python"


def _start_litellm(upstream: str, key: str, sessions: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [str(AGL_PYTHON), str(ROOT / "bench" / "agl_litellm_proxy.py"), "--upstream",
         upstream + "/v1", "--model", "tiny", "--api-key", key, "--sessions", str(sessions)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
        # AGL 0.3 runs it without a master key (its health check has none); this LiteLLM
        # refuses that unless told. Our DATABASE_URL is not its (it would keep keys there).
        env={**{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
             "PYTHONPATH": "", "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"})
    try:
        for line in proc.stdout:  # LiteLLM prints a banner first
            if line.startswith(READY):
                break
        else:
            raise RuntimeError("the LiteLLM proxy did not start")
        info = json.loads(line.removeprefix(READY))
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # the pipe drained
        wait_healthy(f"http://127.0.0.1:{info['port']}", path="/health/liveliness")
    except BaseException:
        stop(proc)
        raise
    return proc, info


def _start_floor() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "llm_floor_server.py"),
                             str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def run(max_tokens: int = 8) -> None:
    if not AGL_PYTHON.exists():
        raise SystemExit("needs .venv-agl (bash tests/agl/setup_venv.sh): AGL 0.3 and LiteLLM")
    empty_bench_database()
    project = services.project_create(name="bench")
    _, key = services.api_key_create(project=project, role="runner")
    ours_attempts = running_attempts(project, max(LEVELS))
    model = base_checkpoint(settings.MODELS_DIR)
    server, url = start_gateway(model)
    litellm, info, floor = None, {}, None
    try:
        floor, floor_url = _start_floor()
        litellm, info = _start_litellm(url, key, max(LEVELS))  # stops itself if it fails
        gateway = build_gateway(models=[f"tiny={model}"])  # the direct path, here
        engine = gateway.registry.by_name("tiny")
        prompt = render_chat(engine.tokenizer, MESSAGES)
        params = Params(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        http = httpx.Client(limits=httpx.Limits(max_connections=256), timeout=120)
        lport = info["port"]
        clients = {
            "ours": [openai.OpenAI(base_url=f"{url}/rollout/{r}/attempt/{a}/v1", api_key=key,
                                   http_client=http, max_retries=0) for r, a in ours_attempts],
            "plain": [openai.OpenAI(base_url=f"{url}/v1", api_key=key, http_client=http,
                                    max_retries=0)] * max(LEVELS),
            "litellm": [openai.OpenAI(
                base_url=f"http://127.0.0.1:{lport}/rollout/{r}/attempt/{a}/v1",
                api_key="none", http_client=http, max_retries=0) for r, a in info["attempts"]],
            "floor": [openai.OpenAI(base_url=f"{floor_url}/v1", api_key="none",
                                    http_client=http, max_retries=0)] * max(LEVELS),
        }
        tokens: dict[str, list[int]] = {name: [] for name in clients}

        def direct(i: int, j: int) -> None:
            gateway.batcher.run(engine, [Sequence_(list(prompt), params)])

        failed: dict[str, list[str]] = {name: [] for name in clients}

        def through(name: str):
            def call(i: int, j: int) -> None:
                try:
                    reply = clients[name][i].chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=max_tokens,
                        temperature=1.0, extra_body={"ignore_eos": True})
                except openai.APIError as exc:  # counted, and its time kept
                    failed[name].append(type(exc).__name__)
                    return
                tokens[name].append(reply.usage.completion_tokens)
            return call

        paths = {"direct": (direct, os.getpid()), "ours": (through("ours"), server.pid),
                 "plain": (through("plain"), server.pid),
                 "litellm": (through("litellm"), litellm.pid),
                 "floor": (through("floor"), floor.pid)}
        for call, _ in paths.values():  # warm up every path
            run_sessions(call, 2, 4)
        results = {}
        for sessions in LEVELS:
            per = max(1, CALLS[sessions] // sessions // 2)
            lat = {name: [] for name in paths}
            cpu = {name: 0.0 for name in paths}
            for _ in range(2):
                for name, (call, pid) in paths.items():
                    before = cpu_seconds(pid, children=name != "direct")
                    lat[name] += run_sessions(call, per, sessions)[0]
                    cpu[name] += cpu_seconds(pid, children=name != "direct") - before
            results[sessions] = (lat, {n: 1000 * cpu[n] / len(lat[n]) for n in paths})
            time.sleep(0.5)
        recorded = Span.objects.filter(rollout__project=project).count()
    finally:
        for proc in (litellm, floor):
            if proc is not None:
                stop(proc)
        stop(server)
    _report(results, tokens, recorded, max_tokens)
    print("failed calls: " + ", ".join(f"{n} {len(f)} ({', '.join(sorted(set(f)))})"
                                      for n, f in failed.items() if f) if any(failed.values())
          else "failed calls: none")
    _last_line(results)


def _report(results: dict, tokens: dict, recorded: int, max_tokens: int) -> None:
    print(f"gateway vs AGL 0.3's LiteLLM proxy, same engine ({max_tokens} tokens per call; "
          f"ours: attributed, {recorded} spans recorded; completion tokens per call, mean: "
          + ", ".join(f"{n} {statistics.fmean(t):.1f}" for n, t in tokens.items() if t) + ")")
    print(f"{'sessions':>8} {'pct':>4} {'direct':>8} {'ours':>8} {'plain':>8} {'litellm':>8}"
          f" {'floor':>8} {'ours-direct':>12} {'litellm-plain':>14} {'ours-floor-direct':>18}"
          "   (ms)")
    for sessions, (lat, _) in results.items():
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            v = {n: pct(lat[n], q) * 1000 for n in lat}
            print(f"{sessions:>8} {name:>4} {v['direct']:8.1f} {v['ours']:8.1f} {v['plain']:8.1f}"
                  f" {v['litellm']:8.1f} {v['floor']:8.1f} {v['ours'] - v['direct']:12.1f}"
                  f" {v['litellm'] - v['plain']:14.1f}"
                  f" {v['ours'] - v['floor'] - v['direct']:18.1f}")
    print("CPU ms per call (the serving process over its rounds):")
    for sessions, (lat, cpu) in results.items():
        print(f"  {sessions:>3} sessions: gateway (engine included) {cpu['ours']:.1f} attributed"
              f" / {cpu['plain']:.1f} plain; engine alone (direct) {cpu['direct']:.1f};"
              f" LiteLLM proxy {cpu['litellm']:.1f} (+ the gateway behind it);"
              f" floor server {cpu['floor']:.1f}; "
              f"calls per path {len(lat['direct'])}")


def _last_line(results: dict) -> None:
    lat = results[16][0]
    floor = {q: pct(lat["floor"], q) * 1000 for q in (0.5, 0.99)}
    print(f"client and HTTP floor at 16 sessions (no engine, no database): p50 "
          f"{floor[0.5]:.1f} ms, p99 {floor[0.99]:.1f} ms; load average "
          f"{open('/proc/loadavg').read().split()[0]}")
    over = {q: (pct(lat["ours"], q) - pct(lat["direct"], q)) * 1000 for q in (0.5, 0.99)}
    peer = (pct(lat["litellm"], 0.5) - pct(lat["plain"], 0.5)) * 1000
    print(f"gateway overhead_p50_ms={over[0.5]:.1f} overhead_p99_ms={over[0.99]:.1f} "
          f"litellm_overhead_p50_ms={peer:.1f} sessions=16")
