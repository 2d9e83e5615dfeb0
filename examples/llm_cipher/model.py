"""The example's model: a small GPT-2 built from a config with `transformers`, a character
tokenizer built with `tokenizers`, and a short supervised warm start. Nothing is downloaded.

The warm start teaches the answer's format (one of the letters, then stop) and to read the
digit, with a *decoy* code: half its targets are `DECOY[digit]`, a letter that is never the
right one, the other half letters drawn at random. So before RL the model answers every
prompt wrongly when decoding greedily (validation reward 0, measured and shown in the job's
output), yet samples every letter often enough to explore; RL must find the real code from
rewards alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

from examples.llm_cipher.task import ALPHABET, LETTERS, SECRET, make_dataset, prompt

log = logging.getLogger(__name__)

ARCH = {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 32}
WARM_START = {"steps": 300, "batch": 64, "lr": 3e-3, "seed": 0, "decoy_share": 0.5}
# A wrong letter for every digit: the letter after the right one. The two digits of a letter
# share their decoy, so RL relabels the warm start's groups; a decoy that grouped the digits
# otherwise ({5, 8} and {6, 7} against the code's {5, 7} and {6, 8}, as an earlier formula did)
# made the last step an exclusive-or the 2-layer model found late and lost again (README
# "Benchmarks": the asynchronous LLM pairs at 40 steps).
DECOY = {d: LETTERS[(LETTERS.index(a) + 1) % len(LETTERS)] for d, a in SECRET.items()}


def base_checkpoint(root: str | Path) -> Path:
    """The warm-started checkpoint directory under `root`, built on first use (a few
    seconds on a CPU) and reused after; its name changes when the recipe does."""
    recipe = json.dumps({"arch": ARCH, "warm": WARM_START, "alphabet": ALPHABET,
                         "letters": LETTERS, "secret": SECRET, "decoy": DECOY, "v": 2},
                        sort_keys=True)
    path = Path(root) / f"llm-cipher-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if not (path / "config.json").exists():
        log.warning("building the example model in %s (first use only)", path)
        _build(path)
    return path


def _build(path: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer.llm.server import quiet_transformers
    from trainer.llm.tokenizer import char_tokenizer, render_chat

    quiet_transformers()
    torch.manual_seed(WARM_START["seed"])
    tokenizer = char_tokenizer(ALPHABET)
    config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ARCH)
    model = GPT2LMHeadModel(config)
    rng = random.Random(WARM_START["seed"])
    tasks = make_dataset(512, seed=1234)
    letter_ids = [tokenizer.convert_tokens_to_ids(letter) for letter in LETTERS]
    optimizer = torch.optim.Adam(model.parameters(), lr=WARM_START["lr"])
    model.train()
    for _ in range(WARM_START["steps"]):
        rows, targets = [], []
        for task in rng.sample(tasks, WARM_START["batch"]):
            ids = render_chat(tokenizer, [{"role": "user", "content": prompt(task)}])
            if rng.random() < WARM_START["decoy_share"]:
                letter = tokenizer.convert_tokens_to_ids(DECOY[task["digit"]])
            else:
                letter = rng.choice(letter_ids)
            answer = [letter, tokenizer.eos_token_id]
            rows.append(ids + answer)
            targets.append([-100] * len(ids) + answer)
        width = max(len(r) for r in rows)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    tmp = path.with_name(path.name + f".tmp{random.randrange(1 << 30)}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: a concurrent builder's copy wins, ours is dropped
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
