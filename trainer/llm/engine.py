"""One loaded checkpoint decoding a batch of requests together.

An `Engine` holds a Hugging Face causal LM and its tokenizer, loaded from a checkpoint
directory (safetensors weights, config, tokenizer files) with `AutoModelForCausalLM` /
`AutoTokenizer` (or anything models.resolve takes: a known name, a GGUF file; or a LoRA
checkpoint: its base with the adapter merged in, lora.py), on CUDA when the process has it.
`generate` decodes a batch of sequences of different prompts and sampling settings in one
forward pass per token (left padding, a KV cache), and reports each generated token to its
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

from trainer.llm import sampling

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
            weakref.finalize(self, self.shared.drop, self.adapter)
        else:
            if lora.is_adapter(self.path):  # a base of its own, the adapter merged in
                self.model, directory = lora.load_for_inference(self.path, dtype=dtype)
            else:  # a directory, a known name, a GGUF file, a cached id (models.py)
                directory = models.resolve(self.path)
                self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.model.to(self.device).eval()
        # Requests of engines with the same key decode in one batch (batcher.py).
        self.batch_key = id(self.shared) if self.shared is not None else id(self)
        self.dtype_name = str(dtype).removeprefix("torch.")
        config = self.model.config
        self.context = int(getattr(config, "n_positions", None)
                           or getattr(config, "max_position_embeddings", 2048))
        self.eos_ids = _eos_ids(self.tokenizer, config)
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

    @torch.inference_mode()
    def generate(self, sequences: list[Sequence_], adapters: list[str | None] | None = None,
                 ) -> None:
        """Decode every sequence to its end (EOS, a stop string, max_tokens or the context).
        `adapters`: each sequence's adapter on this engine's shared base (the batcher's
        mixed-adapter batches; default: this engine's)."""
        for seq in sequences:
            self.check_prompt(seq.prompt_ids)
        extra = {}
        if self.shared is not None:
            names = adapters if adapters is not None else [self.adapter] * len(sequences)
            extra["adapter_names"] = [n or "__base__" for n in names]
        with self.lock:
            self._generate(sequences, extra)

    def _generate(self, sequences: list[Sequence_], extra: dict[str, Any]) -> None:
        width = max(len(s.prompt_ids) for s in sequences)
        rows = [[self.pad_id] * (width - len(s.prompt_ids)) + list(s.prompt_ids)
                for s in sequences]
        mask = [[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in sequences]
        input_ids = torch.tensor(rows, device=self.device)
        attention = torch.tensor(mask, device=self.device)
        budget = [min(s.params.max_tokens, self.context - len(s.prompt_ids)) for s in sequences]
        generators = [_generator(s.params.seed, s.index) for s in sequences]
        for seq in sequences:
            seq.logprobs_of = f"{sampling.SAMPLED}:{self.dtype_name}"
        past, shared = None, _shared_prefix(sequences, extra)
        if shared:  # the prefix every prompt starts with, computed once (see _shared_prefix)
            input_ids, attention = _prefix_first(sequences, shared, self.pad_id, self.device)
            head = self.model(input_ids=input_ids[:1, :shared], use_cache=True,
                              **_first_row(extra))
            past = getattr(head, "cache", None) or head.past_key_values
            past.batch_repeat_interleave(len(sequences))
        for _ in range(max(budget)):
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            step_ids = input_ids[:, shared:] if past is None or shared else input_ids[:, -1:]
            step_pos = positions[:, shared:] if past is None or shared else positions[:, -1:]
            shared = 0
            out = self.model(input_ids=step_ids, attention_mask=attention, position_ids=step_pos,
                             use_cache=True, **{self._cache_arg: past}, **extra)
            past = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            logits = out.logits[:, -1, :].float()
            chosen = [self.pad_id] * len(sequences)
            for i, seq in enumerate(sequences):
                if not seq.done:
                    p = seq.params
                    logprobs = sampling.logprobs(logits[i], p.temperature, p.top_p)
                    chosen[i] = sampling.choose(logprobs, p.temperature, generators[i])
                    self._advance(seq, chosen[i], logprobs, budget[i])
            if all(s.done for s in sequences):
                break
            next_ids = torch.tensor(chosen, device=self.device).unsqueeze(1)
            input_ids = torch.cat([input_ids, next_ids], dim=1)
            attention = torch.cat([attention, torch.ones_like(next_ids)], dim=1)

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


# A prefix of at least this many ids common to every prompt of a batch runs once (an agent's
# system prompt, tools and worked examples: most of each prompt).
SHARED_MIN = 32


def _shared_prefix(sequences: list[Sequence_], extra: dict[str, Any]) -> int:
    """How many leading prompt ids every sequence of the batch shares (0 when under
    SHARED_MIN, for a single sequence, or when the rows decode with different adapters,
    whose caches differ). Each prompt keeps at least one id of its own."""
    names = extra.get("adapter_names")
    if len(sequences) < 2 or (names and len(set(names)) > 1):
        return 0
    first, limit = sequences[0].prompt_ids, min(len(s.prompt_ids) for s in sequences) - 1
    k = 0
    while k < limit and all(s.prompt_ids[k] == first[k] for s in sequences[1:]):
        k += 1
    return k if k >= SHARED_MIN else 0


def _prefix_first(sequences: list[Sequence_], shared: int, pad_id: int,
                  device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the shared prefix, then left padding, then each prompt's own ids; the padding
    masked out (positions count only attended ids, so each row's own ids sit where they
    would without the padding)."""
    width = max(len(s.prompt_ids) for s in sequences) - shared
    rows, mask = [], []
    for s in sequences:
        own = list(s.prompt_ids[shared:])
        rows.append(list(s.prompt_ids[:shared]) + [pad_id] * (width - len(own)) + own)
        mask.append([1] * shared + [0] * (width - len(own)) + [1] * len(own))
    return torch.tensor(rows, device=device), torch.tensor(mask, device=device)


def _first_row(extra: dict[str, Any]) -> dict[str, Any]:
    return {k: v[:1] for k, v in extra.items()}


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [text.find(s) for s in stops if s and s in text]
    return min(found) if found else None


def _generator(seed: int | None, index: int) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        # Any 64-bit seed (OpenAI's clients send them): torch takes at most 2**64 - 1.
        generator.manual_seed((int(seed) * 1_000_003 + index) % 2**63)
    return generator


def _eos_ids(tokenizer: Any, config: Any) -> set[int]:
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids
