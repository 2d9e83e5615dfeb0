"""A tiny randomly initialised causal LM (GPT-2 shape, character tokenizer) built in a
directory in a second, for the mechanics tests of sampling and LoRA."""

from __future__ import annotations

from pathlib import Path

from trainer.llm.tokenizer import char_tokenizer


def tiny_model(path: Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = char_tokenizer("abcdefghij0123456789 ")
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2,
                        n_head=2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
