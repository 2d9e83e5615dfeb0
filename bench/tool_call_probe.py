"""How often a model writes a valid calculator tool call before any training (issue 24.6's
groundwork): N two-digit multiplications, sampled at T=1, three prompt styles. Prints, per
style, valid calls, calls with the right arguments, and the seconds taken.

    .venv/bin/python bench/tool_call_probe.py [--model smollm2] [-n 16] [--tokens 40]

Uses transformers directly (no gateway, no store): what the untrained policy can do.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")

TOOL = {"name": "calculator", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}
CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _call(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def hermes(question: str) -> list[dict]:
    system = ("You are a function calling AI model. You are provided with function signatures "
              "within <tools></tools> XML tags. Here are the available tools: <tools> "
              + json.dumps(TOOL) + " </tools> For each function call return a json object with "
              "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
              "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-dict>}\n</tool_call>")
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def short(question: str) -> list[dict]:
    return [{"role": "system", "content": "To compute, reply only with " + _call("...")},
            {"role": "user", "content": question}]


def two_examples(question: str) -> list[dict]:
    messages = [{"role": "system", "content": "You can use the calculator tool. Call it as "
                 + _call("...")}]
    for a, b in ((12, 34), (56, 21)):
        messages += [{"role": "user", "content": f"What is {a} * {b}?"},
                     {"role": "assistant", "content": _call(f"{a} * {b}")},
                     {"role": "user", "content": f"<tool_response>{a * b}</tool_response>"},
                     {"role": "assistant", "content": str(a * b)}]
    return messages + [{"role": "user", "content": question}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    import django

    django.setup()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.llm.models import resolve

    torch.manual_seed(0)
    directory = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    rng = random.Random(0)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(args.n)]
    for name, build in (("hermes", hermes), ("short", short), ("two-examples", two_examples)):
        texts = [tokenizer.apply_chat_template(build(f"What is {a} * {b}?"), tokenize=False,
                                               add_generation_prompt=True) for a, b in pairs]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=args.tokens, do_sample=True,
                                 temperature=1.0, top_p=1.0,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        seconds = time.perf_counter() - started
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                         skip_special_tokens=True)
        valid = right = 0
        for (a, b), answer in zip(pairs, answers, strict=True):
            found = CALL.search(answer)
            try:
                call = json.loads(found.group(1)) if found else None
            except json.JSONDecodeError:
                call = None
            if isinstance(call, dict) and call.get("name") == "calculator":
                valid += 1
                expression = str((call.get("arguments") or {}).get("expression", ""))
                right += str(a) in expression and str(b) in expression
        print(f"{name:>13}: valid calls {valid}/{args.n}, right arguments {right}/{args.n}, "
              f"prompt {batch['input_ids'].shape[1]} tokens, {seconds:.1f} s")


if __name__ == "__main__":
    main()
