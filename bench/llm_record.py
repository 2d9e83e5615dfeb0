"""The gateway's recording measured alone (issue 22 point 2): the spans of 16 calls of 8
tokens, one per attempt, as the gateway builds them (trainer/llm/calls.py), written as its
recorder writes a group (one `spans_ingest`: group commit), against each call on its own
(`spans_export`, the store's one-statement path). Wall and CPU time (this thread) per group,
medians of 20 groups. Prints figures; asserts nothing.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lightning_llm_bench \\
        .venv/bin/python bench/llm_record.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/lightning_llm_bench")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench")
os.environ.setdefault("LOG_LEVEL", "WARNING")

import django  # noqa: E402

django.setup()

from bench.benchdb import empty_bench_database  # noqa: E402
from bench.llm_common import MESSAGES, running_attempts  # noqa: E402
from store import services  # noqa: E402
from trainer.llm import calls  # noqa: E402
from trainer.llm.engine import Params, Sequence_  # noqa: E402

CALLS, GROUPS = 16, 20


def call_spans(project, rollout_id: str, attempt_id: str) -> list[dict]:
    seq = Sequence_(list(range(10)), Params(max_tokens=8, temperature=1.0))
    seq.token_ids, seq.logprobs, seq.top = list(range(8)), [-1.0] * 8, [[]] * 8
    seq.text, seq.finish_reason = "abcdefgh", "length"
    now = time.time()
    call = calls.Call(kind="chat", model="tiny", version=0,
                      request={"model": "tiny", "messages": MESSAGES, "max_tokens": 8},
                      prompt_ids=list(range(10)), choices=[seq], started=now, finished=now,
                      response_id="chatcmpl-bench", token_text=str)
    return calls.spans_of(calls.Attribution(project, rollout_id, attempt_id, None), call)


def timed(work) -> str:
    wall, cpu = [], []
    for _ in range(GROUPS):
        began, thread = time.perf_counter(), time.thread_time()
        work()
        wall.append((time.perf_counter() - began) * 1000)
        cpu.append((time.thread_time() - thread) * 1000)
    w, c = statistics.median(wall), statistics.median(cpu)
    return f"{w:.2f} ms wall / {c:.2f} ms CPU ({w / CALLS:.2f} / {c / CALLS:.2f} a call)"


def main() -> None:
    empty_bench_database()
    project = services.project_create(name="bench")
    attempts = running_attempts(project, CALLS)

    def group() -> list[list[dict]]:
        return [call_spans(project, r, a) for r, a in attempts]

    built = timed(group)
    together = iter([group() for _ in range(GROUPS)])
    grouped = timed(lambda: services.spans_ingest(
        project=project, spans=[s for spans in next(together) for s in spans]))
    apart = iter([group() for _ in range(GROUPS)])
    alone = timed(lambda: [services.spans_export(project=project, spans=spans)
                           for spans in next(apart)])
    print(f"recording {CALLS} calls (load average {os.getloadavg()[0]:.2f}):")
    print(f"  spans built: {built}")
    print(f"  one group write (the recorder's): {grouped}")
    print(f"  each call on its own: {alone}")


if __name__ == "__main__":
    main()
