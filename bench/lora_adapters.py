"""Many LoRA adapters over one base in one process: memory and decode speed.

    .venv/bin/python bench/lora_adapters.py ADAPTER_DIR [ADAPTER_DIR ...] [--tokens 8]

Loads the first adapter (its base with it), then the others, printing the process's RSS after
each; then decodes a batch of 4 sequences per adapter (mixed-adapter batch) against a batch of
the same size on one adapter, and on a merged copy of the first (a base of its own), the better
of two runs each. Prints one
JSON line of figures. Needs no database (tests/llm/test_smollm2.py runs it on SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    import django

    django.setup()
    import torch

    from trainer.llm.engine import Engine, Params, Sequence_
    from trainer.llm.server import quiet_transformers
    from trainer.llm.tokenizer import render_chat

    parser = argparse.ArgumentParser()
    parser.add_argument("adapters", nargs="+")
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    quiet_transformers()
    torch.set_grad_enabled(False)
    start = rss_mb()
    engines, rss = [], []
    per = 4
    n = per * len(args.adapters)
    for path in args.adapters:
        engines.append(Engine(path, device="cpu", share_base=True))
        prompt = render_chat(engines[0].tokenizer, [{"role": "user", "content": "What is 2+2?"}])
        # RSS after a decode: the weights are mapped from the files until they are touched
        engines[-1].generate([Sequence_(list(prompt), Params(max_tokens=2)) for _ in range(n)])
        rss.append(rss_mb())

    def batch() -> list:
        return [Sequence_(list(prompt), Params(max_tokens=args.tokens, temperature=1.0, seed=i,
                                               ignore_eos=True)) for i in range(n)]

    def tokens_per_s(engine, adapters=None) -> float:
        best = float("inf")
        for _ in range(2):  # the better of two (the machine may be shared)
            started = time.perf_counter()
            engine.generate(batch(), adapters)
            best = min(best, time.perf_counter() - started)
        return n * args.tokens / best

    single = tokens_per_s(engines[0])
    mixed = tokens_per_s(engines[0], [e.adapter for e in engines for _ in range(per)])
    merged = tokens_per_s(Engine(args.adapters[0], device="cpu"))
    print(json.dumps({
        "adapters": len(engines), "rss_mb_before": round(start), "rss_mb": [round(r) for r in rss],
        "extra_over_one": round((rss[-1] - rss[0]) / (rss[0] - start), 4),
        "batch": n, "tokens": args.tokens, "tps_single_adapter": round(single, 1),
        "tps_mixed": round(mixed, 1), "tps_merged_copy": round(merged, 1)}))


if __name__ == "__main__":
    main()
