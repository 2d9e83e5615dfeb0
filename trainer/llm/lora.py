"""LoRA adapters (peft) over a base model: grpo_lm's `lora` config, and checkpoints that hold
the adapter only.

A LoRA checkpoint directory holds peft's `adapter_config.json` and
`adapter_model.safetensors`, grpo_lm's optimizer state, and `lightning-lora.json`:
{"base": the job's `model` as given (a name, directory or file: models.resolve), "base_sha256":
models.base_sha256 of it}. Loading one onto a base whose sha256 differs is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.llm import models

META = "lightning-lora.json"
DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}


class BaseMismatch(ValueError):
    """An adapter trained on another base model."""


def settings(config: Any) -> dict[str, Any]:
    """The `lora` config with defaults, validated (ValueError: one line per bad field)."""
    if not isinstance(config, dict):
        raise ValueError("lora must be a mapping like {r: 8, alpha: 16, dropout: 0.0, "
                         "target_modules: all-linear}")
    unknown = sorted(set(config) - set(DEFAULTS))
    errors = [f"lora.{k}: unknown key (known: {', '.join(DEFAULTS)})" for k in unknown]
    out = {**DEFAULTS, **config}
    r, alpha, dropout, targets = out["r"], out["alpha"], out["dropout"], out["target_modules"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        errors.append(f"lora.r: must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        errors.append(f"lora.alpha: must be a positive number, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        errors.append(f"lora.dropout: must be a number in [0, 1), got {dropout!r}")
    if not (targets == "all-linear" or (isinstance(targets, list) and targets and
                                         all(isinstance(t, str) and t for t in targets))):
        errors.append(f"lora.target_modules: must be 'all-linear' or a non-empty list of "
                      f"module names, got {targets!r}")
    if errors:
        raise ValueError("\n".join(errors))
    return out


def is_adapter(directory: str | Path) -> bool:
    return (Path(directory) / META).is_file()


def meta(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / META).read_text())


def load_base(base: str, *, dtype: Any = None) -> tuple[Any, Path, str]:
    """The base model (float32 unless told), its directory and its sha256."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = models.resolve(base)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or torch.float32)
    return model, directory, models.base_sha256(directory)


def check_base(adapter_dir: str | Path, sha: str, base: str) -> None:
    recorded = meta(adapter_dir).get("base_sha256")
    if recorded != sha:
        raise BaseMismatch(f"the LoRA adapter in {adapter_dir} was trained on a base model with "
                           f"sha256 {str(recorded)[:16]}..., but {base!r} has sha256 "
                           f"{sha[:16]}...: load it onto the base it was trained on")


def new_adapter(base_model: Any, lora: dict[str, Any]) -> Any:
    """A fresh trainable adapter over `base_model` (its B matrices are 0: the base's output)."""
    from peft import LoraConfig, get_peft_model

    # GPT-2's Conv1D layers store their weights transposed (peft warns and flips it itself).
    transposed = getattr(base_model.config, "model_type", "") == "gpt2"
    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=lora["target_modules"], task_type="CAUSAL_LM",
                        fan_in_fan_out=transposed)
    return get_peft_model(base_model, config)


def load_adapter(base_model: Any, adapter_dir: str | Path, *, trainable: bool) -> Any:
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model, str(adapter_dir), is_trainable=trainable)


def save_adapter(model: Any, out: str | Path, *, base: str, sha: str) -> None:
    model.save_pretrained(str(out))
    (Path(out) / "README.md").unlink(missing_ok=True)  # peft's model card template
    (Path(out) / META).write_text(json.dumps({"base": base, "base_sha256": sha}))


def load_for_inference(adapter_dir: str | Path, *, dtype: Any) -> tuple[Any, Path]:
    """The base with the adapter merged in (for the gateway), and the base's directory (its
    tokenizer). The base is found from the adapter's record and must match its sha256."""
    info = meta(adapter_dir)
    base, directory, sha = load_base(str(info["base"]))
    check_base(adapter_dir, sha, str(info["base"]))
    merged = load_adapter(base, adapter_dir, trainable=False).merge_and_unload()
    return merged.to(dtype), directory
