"""Per-project fairness under a flood (bench/llm_bench.py --mode fairness).

The gateway (`manage.py llm_serve`, its own process, settings as deployed) serves two
projects. Project B makes ordinary calls one after another (chat, 8 tokens, attributed and
recorded), first alone, then while project A floods it from another process
(bench/llm_flood.py: 80 concurrent streams of n=4 to the end of the context, `ignore_eos`,
retrying 429s at once). The gateway's settings are the environment's (e.g.
`LLM_GATEWAY_PROJECT_BATCH_ROWS=0` for no per-project cap on the batch's rows). Printed: B's
p50/p99 in both phases, their ratio (the issue's goal: at most 2x), how many of A's calls
were served and refused (429), the p50 of each Server-Timing phase and B's slowest call's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
from django.conf import settings

from bench.benchdb import empty_bench_database
from bench.llm_common import MESSAGES, ROOT, pct, running_attempts, start_gateway, stop
from examples.llm_cipher.model import base_checkpoint
from store import services

B_CALLS = 40
FLOOD = {"streams": 80, "n": 4, "max_tokens": 64}


def run(calls: int = B_CALLS, flood_seconds: float = 25.0) -> None:
    empty_bench_database()
    a, b = services.project_create(name="bench-a"), services.project_create(name="bench-b")
    _, a_key = services.api_key_create(project=a, role="runner")
    _, b_key = services.api_key_create(project=b, role="runner")
    a_attempts, (b_attempt,) = running_attempts(a, 16), running_attempts(b, 1)
    server, url = start_gateway(base_checkpoint(settings.MODELS_DIR))
    flood = None
    try:
        rid, aid = b_attempt
        client = openai.OpenAI(base_url=f"{url}/rollout/{rid}/attempt/{aid}/v1", api_key=b_key,
                               http_client=httpx.Client(timeout=120), max_retries=0)

        inside: list[dict[str, float]] = []  # Server-Timing: engine (waiting + decoding), rest

        def b_call() -> float:
            began = time.perf_counter()
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0,
                extra_body={"ignore_eos": True})
            raw.parse()
            inside.append({k: float(v) / 1000 for k, v in (
                part.strip().split(";dur=") for part in raw.headers["server-timing"].split(","))})
            return time.perf_counter() - began

        for _ in range(5):  # warm up
            b_call()
        alone = [b_call() for _ in range(calls)]
        alone_inside, inside[:] = inside[-calls:], []
        flood = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "llm_flood.py"), "--key", a_key,
             "--streams", str(FLOOD["streams"]), "--n", str(FLOOD["n"]),
             "--max-tokens", str(FLOOD["max_tokens"]), "--seconds", str(flood_seconds),
             *[f"{url}/rollout/{r}/attempt/{t}/v1" for r, t in a_attempts]],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        time.sleep(3)  # the flood at full strength
        flooded = []
        while len(flooded) < calls and flood.poll() is None:
            flooded.append(b_call())
        out, _ = flood.communicate(timeout=flood_seconds + 300)
        flood = None
        a_counts = json.loads(out.strip().splitlines()[-1])
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        stop(server)
    _report(alone, flooded, a_counts, alone_inside, inside)


def _report(alone: list[float], flooded: list[float], a_counts: dict, alone_inside: list[dict],
            flooded_inside: list[dict]) -> None:
    statuses = a_counts["statuses"]
    other = {k: v for k, v in statuses.items() if k not in ("200", "429")}
    print(f"fairness: project B's call (8 tokens, attributed) alone and while project A floods "
          f"({FLOOD['streams']} concurrent streams of n={FLOOD['n']}, to the end of the "
          f"context, ignore_eos; A's calls: {statuses.get('200', 0)} served, "
          f"{statuses.get('429', 0)} refused with 429, other {other}; "
          f"{a_counts['lines']} SSE lines streamed; LLM_GATEWAY_PROJECT_BATCH_ROWS="
          f"{settings.LLM_GATEWAY_PROJECT_BATCH_ROWS}, LLM_GATEWAY_MAX_BATCH="
          f"{settings.LLM_GATEWAY_MAX_BATCH})")
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        print(f"  {name}: alone {pct(alone, q) * 1000:7.1f} ms ({len(alone)} calls)   "
              f"under the flood {pct(flooded, q) * 1000:7.1f} ms ({len(flooded)} calls)   "
              f"ratio {pct(flooded, q) / pct(alone, q):.2f}x")
    for name, parts in (("alone", alone_inside), ("under the flood", flooded_inside)):
        print(f"  {name}: p50 of the gateway's Server-Timing: engine (waiting and decoding) "
              f"{pct([p['engine'] for p in parts], 0.5) * 1000:.1f} ms, the gateway itself "
              f"{pct([p['gateway'] for p in parts], 0.5) * 1000:.1f} ms; p50 of each phase: "
              + ", ".join(f"{k} {pct([p[k] for p in parts if k in p], 0.5) * 1000:.1f}"
                          for k in parts[0] if k not in ("engine", "gateway", "store_group")))
    slowest = flooded_inside[max(range(len(flooded)), key=flooded.__getitem__)]
    print(f"  B's slowest call under the flood ({max(flooded) * 1000:.1f} ms), its phases: "
          + ", ".join(f"{k} {v * 1000:.1f}" for k, v in slowest.items() if k != "store_group"))
    print(f"fairness b_p50_ratio={pct(flooded, 0.5) / pct(alone, 0.5):.2f} "
          f"b_p99_ratio={pct(flooded, 0.99) / pct(alone, 0.99):.2f}")
