"""Many LoRA adapters over one base in a process: one copy of each base model, each loaded LoRA
checkpoint a named adapter on it, requests for different adapters decoded in one batch. Used
by engines made with `share_base=True` (the gateway's LLM_GATEWAY_SHARE_BASE); otherwise an
engine merges its adapter into a base of its own (faster decoding, a base copy each).

`attach(adapter_dir, dtype, device)` finds (or loads) the `SharedBase` for the base the adapter
records (lora.py: resolved by name, checked by sha256), loads the adapter into it under a new
name and returns both. Engines of LoRA checkpoints share that base's model, tokenizer and decode
lock; the batcher groups their requests by base (`Engine.batch_key`) and the engine passes each
row's adapter name to the forward pass (peft's mixed-adapter batches: every row computes the
base once plus its own adapter). An adapter is removed from its base when its engine is dropped
(at the next load); the base goes when no engine holds it. Loading an adapter holds the base's
decode lock for the load only (milliseconds for a few MB): calls in flight wait, none fails.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from pathlib import Path
from typing import Any

from trainer.llm import lora

_lock = threading.Lock()
_bases: weakref.WeakValueDictionary[tuple[str, str, str], SharedBase] = \
    weakref.WeakValueDictionary()


class SharedBase:
    def __init__(self, base: str, *, dtype: Any, device: str) -> None:
        from transformers import AutoTokenizer

        self.base_model, directory, self.sha256 = lora.load_base(base, dtype=dtype)
        self.base_model.to(device).eval()
        self.directory, self.device = Path(directory), device
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model: Any = None  # the PeftModel, from the first adapter on
        self.lock = threading.Lock()  # one decode (or adapter load) at a time on this base
        self._names = itertools.count()
        self._dropped: list[str] = []

    def add(self, adapter_dir: str | Path, base: str) -> str:
        from peft import PeftModel

        lora.check_base(adapter_dir, self.sha256, base)
        name = f"adapter-{next(self._names)}"
        with self.lock:
            self._sweep()
            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base_model, str(adapter_dir),
                                                       adapter_name=name)
            else:
                self.model.load_adapter(str(adapter_dir), adapter_name=name)
            self.model.to(self.device).eval()
        return name

    def drop(self, name: str) -> None:
        """Called when an adapter's engine is collected: removed at the next load."""
        self._dropped.append(name)

    def adapters(self) -> list[str]:
        return list(self.model.peft_config) if self.model is not None else []

    def _sweep(self) -> None:
        while self._dropped:
            name = self._dropped.pop()
            if name in self.model.peft_config and len(self.model.peft_config) > 1:
                self.model.delete_adapter(name)


def attach(adapter_dir: str | Path, *, dtype: Any, device: str,
           base: str | None = None) -> tuple[SharedBase, str]:
    """`base`: where the base is on this machine (default: as the adapter recorded it); its
    sha256 must be the one the adapter recorded in any case."""
    base = base or str(lora.meta(adapter_dir)["base"])
    key = (base, str(dtype), device)
    with _lock:  # one load of a base at a time (another adapter of it waits, then shares it)
        shared = _bases.get(key)
        if shared is None:
            shared = SharedBase(base, dtype=dtype, device=device)
            _bases[key] = shared
    return shared, shared.add(adapter_dir, base)


def loaded_bases() -> int:
    return len(_bases)


def shared_bases() -> list[tuple[str, SharedBase]]:
    """The bases loaded in this process: (the name they were loaded by, the base)."""
    with _lock:
        return [(key[0], shared) for key, shared in _bases.items()]
