"""A batch being decoded one token at a time, which sequences join and leave between steps
(continuous batching).

`Decoding.start(engine, rows)` runs the rows' prompts through the model (left padding) and
samples each row's first token; `step()` decodes one more token for every row; `join(other)`
merges another started batch of the same engine (or of the same shared base) into this one, so
a request that arrives while others decode starts at the next step instead of after the batch;
`split(leaving)` moves rows out, with their caches, into a batch of their own (one tenant's
rows set aside while another's decode, joined back later: batcher.py); finished rows leave
after each call. Each row's KV cache and attention mask are kept aligned
on the right: joining pads the shorter side's cache on the left with masked positions, and
leaving drops the columns no remaining row attends to. A row's positions come from its own
mask, so a row decodes the same tokens whoever it shares the batch with.

A failure in sampling one row (`Failure`) ends only that row; a failed forward pass raises
(the caller decides who it fails). The caller holds the engine's lock around each call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.llm import sampling

if TYPE_CHECKING:  # engine.py imports this module
    from trainer.llm.engine import Sequence_


@dataclass(eq=False)
class Row:
    seq: Sequence_
    adapter: str | None = None  # on a shared base (adapters.py); None: the engine's own
    owner: Any = None  # the batcher's job
    budget: int = 0
    generator: torch.Generator | None = None


@dataclass
class Failure:
    row: Row
    error: BaseException


class Decoding:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rows: list[Row] = []
        self.cache: Any = None
        self.attention: torch.Tensor | None = None  # [rows, cached + 1]: the last is pending
        self.pending: torch.Tensor | None = None  # [rows, 1]: the tokens not yet in the cache

    @classmethod
    def start(cls, engine: Any, rows: list[Row]) -> tuple[Decoding, list[Failure]]:
        """The rows' prompts through the model, each row's first token sampled."""
        self = cls(engine)
        for row in rows:
            engine.check_prompt(row.seq.prompt_ids)
            row.budget = min(row.seq.params.max_tokens, engine.context - len(row.seq.prompt_ids))
            row.generator = sampling.generator(row.seq.params.seed, row.seq.index)
            row.seq.logprobs_of = f"{sampling.SAMPLED}:{engine.dtype_name}"
        self.rows = list(rows)
        known = _PREFIXES.get(engine.model)
        reused = known.usable(rows) if known is not None else 0
        shared = reused or shared_prefix(rows)
        ids, mask = _prompt_rows(rows, shared, engine.pad_id, engine.device)
        positions, cache = (mask.cumsum(-1) - 1).clamp(min=0), None
        if reused:  # an earlier prompt's prefix, already computed (prefix caching)
            cache = known.cache(reused, len(rows))
        elif shared:  # the prefix every prompt starts with, once; its cache repeated per row
            self.rows = rows[:1]
            self._forward(ids[:1, :shared], mask[:1, :shared], positions[:1, :shared], None)
            self.rows, cache = list(rows), self.cache
            Prefix.remember(engine.model, rows[0], shared, cache)
            cache.batch_repeat_interleave(len(rows))
        logits = self._forward(ids[:, shared:], mask, positions[:, shared:], cache)
        if not shared and len(rows) == 1 and len(rows[0].seq.prompt_ids) > SHARED_MIN:
            Prefix.remember(engine.model, rows[0], len(rows[0].seq.prompt_ids), self.cache)
        self.attention = mask
        return self, self._sample(logits)

    def step(self) -> list[Failure]:
        """One more token for every row."""
        positions = self.attention.sum(-1, keepdim=True) - 1
        logits = self._forward(self.pending, self.attention, positions, self.cache)
        return self._sample(logits)

    def join(self, other: Decoding) -> None:
        """`other`'s rows decode with these from the next step on."""
        if not self.rows:
            self.rows, self.cache = other.rows, other.cache
            self.attention, self.pending = other.attention, other.pending
            return
        width = max(self.attention.shape[1], other.attention.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width - 1, -2),
                                   _pad_left(theirs.keys, width - 1, -2)])
            mine.values = torch.cat([_pad_left(mine.values, width - 1, -2),
                                     _pad_left(theirs.values, width - 1, -2)])
        self.attention = torch.cat([_pad_left(self.attention, width, -1),
                                    _pad_left(other.attention, width, -1)])
        self.pending = torch.cat([self.pending, other.pending])
        self.rows += other.rows

    def drop(self, leaving: Callable[[Row], bool]) -> None:
        """The rows `leaving` says leave now (their requests failed)."""
        self._keep([i for i, row in enumerate(self.rows) if not leaving(row)])

    def split(self, leaving: Callable[[Row], bool]) -> Decoding:
        """The rows `leaving` says, moved with their caches into a new batch (merge caches
        only, `joinable`); they decode as before once joined back."""
        from transformers import DynamicCache

        out = Decoding(self.engine)
        moving = [i for i, row in enumerate(self.rows) if leaving(row)]
        if not moving:
            return out
        index = torch.tensor(moving, device=self.attention.device)
        out.rows = [self.rows[i] for i in moving]
        out.attention, out.pending = self.attention[index], self.pending[index]
        out.cache = DynamicCache()
        for number, layer in enumerate(self.cache.layers):
            out.cache.update(layer.keys[index], layer.values[index], number)
        out._trim()
        self.drop(leaving)
        return out

    def joinable(self) -> bool:
        """Whether the cache is one whose layers this module knows how to merge."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any) -> torch.Tensor:
        engine, extra = self.engine, {}
        if engine.shared is not None:
            extra["adapter_names"] = [r.adapter or "__base__" for r in self.rows]
        with torch.inference_mode():
            out = engine.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                               use_cache=True, **{engine._cache_arg: cache}, **extra)
        self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :].float()

    def _sample(self, logits: torch.Tensor) -> list[Failure]:
        failures, chosen = [], []
        params = [row.seq.params for row in self.rows]
        with torch.inference_mode():  # every row's distribution in one pass (sampling.py)
            rows = sampling.logprobs_rows(logits, [p.temperature for p in params],
                                          [p.top_p for p in params])
            probs = rows.exp().cpu() if any(p.temperature > 0 for p in params) else None
            for i, row in enumerate(self.rows):
                p, token = params[i], self.engine.pad_id
                try:
                    if p.temperature <= 0:
                        token = int(torch.argmax(rows[i]))
                    else:  # as sampling.choose, on the row's own generator
                        token = int(torch.multinomial(probs[i], 1, generator=row.generator))
                    self.engine._advance(row.seq, token, rows[i], row.budget)
                except Exception as exc:  # this row's own failure (its caller's callback too)
                    failures.append(Failure(row, exc))
                chosen.append(token)
        self.pending = torch.tensor(chosen, device=self.engine.device).unsqueeze(1)
        self.attention = torch.cat([self.attention, torch.ones_like(self.pending)], dim=1)
        failed = {id(f.row) for f in failures}
        self._keep([i for i, r in enumerate(self.rows)
                    if not r.seq.done and id(r) not in failed])
        return failures

    def _keep(self, indices: list[int]) -> None:
        if len(indices) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            self.cache = self.attention = self.pending = None
            return
        index = torch.tensor(indices, device=self.attention.device)
        self.attention, self.pending = self.attention[index], self.pending[index]
        if not self.joinable():
            for layer in self.cache.layers:
                layer.batch_select_indices(index)
            return
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self._trim()

    def _trim(self) -> None:
        """The columns no row attends to go."""
        first = int(self.attention.any(0).nonzero()[0])
        if not first:
            return
        self.attention = self.attention[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, first:]
            layer.values = layer.values[:, :, first:]


# A prefix of at least this many ids common to every prompt starting together runs once (an
# agent's system prompt, tools and worked examples: most of each prompt).
SHARED_MIN = 32


@dataclass
class Prefix:
    """The keys and values of one prompt prefix (batch size 1), to start later prompts that
    begin with the same ids from (an agent sends the same system prompt, tools and examples
    with every call): per model object (a new checkpoint version is a new one) and adapter."""

    adapter: str | None
    ids: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @staticmethod
    def remember(model: Any, row: Row, length: int, cache: Any) -> None:
        """Keep `row`'s first `length` prompt ids' keys and values for `model` (plain caches
        only: a sliding-window or quantized one is not reused)."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if layers and all(type(layer) is DynamicLayer for layer in layers):
            _PREFIXES[model] = Prefix(
                row.adapter, tuple(row.seq.prompt_ids[:length]),
                [(layer.keys[:1, :, :length].clone(), layer.values[:1, :, :length].clone())
                 for layer in layers])

    def usable(self, rows: list[Row]) -> int:
        """How many of these ids every row's prompt starts with (0 under SHARED_MIN or on
        another adapter); each row keeps one id of its own."""
        if any(r.adapter != self.adapter for r in rows):
            return 0
        k = min(len(self.ids), *(len(r.seq.prompt_ids) - 1 for r in rows))
        for r in rows:
            prompt = r.seq.prompt_ids
            k = next((i for i in range(k) if prompt[i] != self.ids[i]), k)
        return k if k >= SHARED_MIN else 0

    def cache(self, length: int, rows: int) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache()
        for index, (keys, values) in enumerate(self.layers):
            cache.update(keys[:, :, :length].repeat_interleave(rows, 0),
                         values[:, :, :length].repeat_interleave(rows, 0), index)
        return cache


# The last prefix computed per model (weakly held: it goes with the model).
_PREFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_prefix(rows: list[Row]) -> int:
    """How many leading prompt ids every row shares (0 when under SHARED_MIN, for one row, or
    for rows on different adapters, whose caches differ); each row keeps one id of its own."""
    if len(rows) < 2 or len({r.adapter for r in rows}) > 1:
        return 0
    prompts = [r.seq.prompt_ids for r in rows]
    first, limit, k = prompts[0], min(len(p) for p in prompts) - 1, 0
    while k < limit and all(p[k] == first[k] for p in prompts[1:]):
        k += 1
    return k if k >= SHARED_MIN else 0


def _prompt_rows(rows: list[Row], shared: int, pad_id: int,
                 device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prefix, left padding (masked), then each row's own prompt ids: a row's
    positions count only the ids it attends to, so they are where they would be alone."""
    width = max(len(r.seq.prompt_ids) for r in rows) - shared
    ids, mask = [], []
    for r in rows:
        own = list(r.seq.prompt_ids[shared:])
        ids.append(list(r.seq.prompt_ids[:shared]) + [pad_id] * (width - len(own)) + own)
        mask.append([1] * shared + [0] * (width - len(own)) + [1] * len(own))
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
