"""One loaded checkpoint decoding a batch of requests together.

An `Engine` holds a Hugging Face causal LM and its tokenizer, loaded from a checkpoint
directory (safetensors weights, config, tokenizer files) with `AutoModelForCausalLM` /
`AutoTokenizer` (or anything models.resolve takes: a known name, a GGUF file; or a LoRA
checkpoint: its base with the adapter merged in, lora.py), on CUDA when the process has it.
`generate` decodes a batch of sequences of different prompts and sampling settings in one
forward pass per token (left padding, a KV cache; decoding.py, which the batcher also uses to
let requests join a batch in progress), and reports each generated token to its
sequence as it comes (streaming), with its log-probability under the distribution it was
sampled from (sampling.py: the request's temperature and top_p, greedy = argmax, computed in
float32 from the model's logits; `Sequence_.logprobs_of` says so, with the model's dtype,
bfloat16 on CUDA) and the top alternatives under that distribution when asked.
"""

from __future__ import annotations

import inspect
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from trainer.llm import decoding

TokenCallback = Callable[["Sequence_", int, float, list[tuple[int, float]]], None]


class PromptTooLong(ValueError):
    """The prompt leaves no room to generate within the model's context."""


@dataclass
class Params:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever comes


@dataclass(eq=False)
class Sequence_:
    """One sequence being decoded (a request with `n` > 1 has n of them)."""

    prompt_ids: list[int]
    params: Params
    index: int = 0
    on_token: TokenCallback | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # How `logprobs` were computed ("sampled:float32" by the engine; "" = not said: upstream)
    logprobs_of: str = ""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def reset(self) -> None:
        """Back to before decoding (the batcher decodes a failed batch's requests again,
        each alone)."""
        for f in fields(self):
            if f.name in ("prompt_ids", "params", "index", "on_token", "logprobs_of"):
                continue
            setattr(self, f.name, f.default_factory() if f.default_factory is not MISSING
                    else f.default)


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Engine:
    """A model and tokenizer from one checkpoint directory (`version` says which). `base`: a
    LoRA checkpoint's base as found on this machine (default: as the adapter recorded it)."""

    def __init__(self, path: str | Path, *, version: int = 0, name: str = "model",
                 device: str | None = None, share_base: bool = False,
                 base: str | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trainer.llm import lora, models

        self.path, self.version, self.name = str(path), version, name
        self.device = device or pick_device()
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        # One decode at a time per engine (or per shared base): torch on a CPU is already
        # parallel inside.
        self.lock = threading.Lock()
        self.shared, self.adapter = None, None
        if lora.is_adapter(self.path) and share_base:  # an adapter on its process-wide base
            from trainer.llm import adapters

            self.shared, self.adapter = adapters.attach(self.path, dtype=dtype,
                                                        device=self.device, base=base)
            self.model, self.tokenizer, self.lock = (self.shared.model, self.shared.tokenizer,
                                                     self.shared.lock)
            self.tokenizer_dir = str(self.shared.directory)
            weakref.finalize(self, self.shared.drop, self.adapter)
        else:
            if lora.is_adapter(self.path):  # a base of its own, the adapter merged in
                self.model, directory = lora.load_for_inference(self.path, dtype=dtype)
            else:  # a directory, a known name, a GGUF file, a cached id (models.py)
                directory = models.resolve(self.path)
                self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.tokenizer_dir = str(directory)  # where its tokenizer came from
            self.model.to(self.device).eval()
        # Requests of engines with the same key decode in one batch (batcher.py).
        self.batch_key = id(self.shared) if self.shared is not None else id(self)
        self.dtype_name = str(dtype).removeprefix("torch.")
        config = self.model.config
        self.context = int(getattr(config, "n_positions", None)
                           or getattr(config, "max_position_embeddings", 2048))
        self.eos_ids = _eos_ids(self.tokenizer, config)
        self.vocab_size = int(getattr(config, "vocab_size", 0) or 0)  # rows of its embedding
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0] if self.eos_ids else 0
        # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns).
        inner = self.shared.base_model if self.shared is not None else self.model
        params = inspect.signature(inner.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty")
        if len(prompt_ids) >= self.context:
            raise PromptTooLong(
                f"the prompt is {len(prompt_ids)} tokens; this model's context is "
                f"{self.context} tokens (prompt plus completion)"
            )

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(self, sequences: list[Sequence_], adapters: list[str | None] | None = None,
                 ) -> None:
        """Decode every sequence to its end (EOS, a stop string, max_tokens or the context),
        together (decoding.py). `adapters`: each sequence's adapter on this engine's shared
        base (default: this engine's). The first sequence that fails raises."""
        for seq in sequences:
            self.check_prompt(seq.prompt_ids)
        names = adapters if adapters is not None else [self.adapter] * len(sequences)
        rows = [decoding.Row(seq, adapter=name) for seq, name in zip(sequences, names,
                                                                     strict=True)]
        with self.lock:
            running, failures = decoding.Decoding.start(self, rows)
            while running.rows and not failures:
                failures = running.step()
        if failures:
            raise failures[0].error

    def _advance(self, seq: Sequence_, token: int, logprobs: torch.Tensor, budget: int) -> None:
        logprob = float(logprobs[token])
        top: list[tuple[int, float]] = []
        if seq.params.top_logprobs:
            values, ids = torch.topk(logprobs, seq.params.top_logprobs)
            top = [(int(t), max(float(v), -1e9))  # greedy: -inf beyond the argmax
                   for t, v in zip(ids.tolist(), values.tolist(), strict=True)]
        seq.token_ids.append(token)
        seq.logprobs.append(logprob if math.isfinite(logprob) else -1e9)
        seq.top.append(top)
        if token in self.eos_ids and not seq.params.ignore_eos:
            seq.finish_reason = "stop"
        else:
            seq.text = self.decode(seq.token_ids)
            hit = _first_stop(seq.text, seq.params.stop)
            if hit is not None:
                seq.text = seq.text[:hit]
                seq.finish_reason = "stop"
            elif len(seq.token_ids) >= budget:
                seq.finish_reason = "length"
        if seq.on_token is not None:
            seq.on_token(seq, token, logprob, top)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [text.find(s) for s in stops if s and s in text]
    return min(found) if found else None


def _eos_ids(tokenizer: Any, config: Any) -> set[int]:
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids
