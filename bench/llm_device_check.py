"""The LLM path's device check: engine tokens/s and one grpo_lm step, on the CPU and on CUDA
when this machine has it. Prints figures; asserts nothing. Needs no database.

    .venv/bin/python bench/llm_device_check.py [--batch 16] [--tokens 16]

The model is the example's (examples/llm_cipher, built on first use under MODELS_DIR) and a
larger GPT-2 of the same tokenizer (12 layers, 768 wide, random weights: for speed only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
os.environ.setdefault("LOG_LEVEL", "WARNING")

import django  # noqa: E402

django.setup()

import torch  # noqa: E402
from django.conf import settings  # noqa: E402

from examples.llm_cipher.model import base_checkpoint  # noqa: E402
from trainer.algorithms import algorithm_load  # noqa: E402
from trainer.algorithms.token_adapter import TokenSample  # noqa: E402
from trainer.llm.engine import Engine, Params, Sequence_  # noqa: E402
from trainer.llm.server import quiet_transformers  # noqa: E402
from trainer.llm.tokenizer import render_chat  # noqa: E402


def larger_model(small: Path) -> Path:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = Path(tempfile.mkdtemp(prefix="gpt2-base-"))
    tokenizer = AutoTokenizer.from_pretrained(small)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=12, n_head=12, n_embd=768,
                        n_positions=256, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def engine_tokens_per_second(path: Path, device: str, batch: int, tokens: int) -> float:
    engine = Engine(path, device=device)
    prompt = render_chat(engine.tokenizer, [{"role": "user", "content": "abc 7"}])
    params = Params(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    engine.generate([Sequence_(list(prompt), params) for _ in range(batch)])  # warm up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    rounds = 3
    for _ in range(rounds):
        engine.generate([Sequence_(list(prompt), params, index=i) for i in range(batch)])
    if device == "cuda":
        torch.cuda.synchronize()
    return rounds * batch * tokens / (time.perf_counter() - start)


def grpo_step_seconds(path: Path, device: str, samples: int, tokens: int) -> float:
    algorithm = algorithm_load("grpo_lm", {"model": str(path), "epochs": 1, "micro_batch": 32})
    engine = Engine(path, device="cpu")
    prompt = render_chat(engine.tokenizer, [{"role": "user", "content": "abc 7"}])
    batch = [TokenSample(f"r{i}", f"g{i % 4}", prompt + [10 + (i % 5)] * tokens,
                         [0] * len(prompt) + [1] * tokens, [0.0] * len(prompt) + [-1.6] * tokens,
                         float(i % 2)) for i in range(samples)]
    state = {"dir": str(path), "owned": False}
    start = time.perf_counter()
    update = algorithm.update(step=0, state=state, samples=batch, device=device)
    seconds = time.perf_counter() - start
    shutil.rmtree(update.state["dir"], ignore_errors=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--samples", type=int, default=64)
    args = parser.parse_args()
    quiet_transformers()
    small = base_checkpoint(settings.MODELS_DIR)
    large = larger_model(small)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"devices: {devices}" + (f" ({torch.cuda.get_device_name(0)})" if "cuda" in devices
                                   else " (no CUDA here)"))
    for name, path in (("example GPT-2 (2x64)", small), ("GPT-2 124M-shaped (12x768)", large)):
        for device in devices:
            tps = engine_tokens_per_second(path, device, args.batch, args.tokens)
            step = grpo_step_seconds(path, device, args.samples, args.tokens)
            print(f"{name:28s} {device:4s}: engine {tps:9.0f} tokens/s (batch {args.batch}, "
                  f"{args.tokens} tokens each); grpo_lm step on {args.samples} samples "
                  f"{step:6.2f} s")
    shutil.rmtree(large, ignore_errors=True)


if __name__ == "__main__":
    main()
