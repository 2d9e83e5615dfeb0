"""The sampling distribution, shared by the engine (which samples from it and records each
token's log-probability under it) and grpo_lm (which computes the same log-probabilities under
the policy it trains), so that the PPO ratio is exactly 1 before the first update.

`logprobs(logits, temperature, top_p)` is in float32 whatever the model's dtype:
- temperature <= 0 (greedy): the argmax has log-probability 0, every other token -inf;
- else log softmax(logits / temperature), restricted to the nucleus when top_p < 1 (the
  smallest set of most likely tokens whose mass reaches top_p; the most likely always kept),
  renormalised there; tokens outside it have -inf.
"""

from __future__ import annotations

import torch

#: What the span's `lightning.llm.logprobs_of` says when the engine recorded these.
SAMPLED = "sampled"


def logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities over the last dimension of the distribution sampled from."""
    logits = logits.float()
    if temperature <= 0:
        out = torch.full_like(logits, float("-inf"))
        return out.scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
    scaled = logits / temperature
    if top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        keep_sorted = probs.cumsum(-1) - probs < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def logprobs_rows(logits: torch.Tensor, temperatures: list[float],
                  top_ps: list[float]) -> torch.Tensor:
    """`logprobs` of each row of `logits` [rows, vocab] at its own temperature and top_p, equal
    to it row by row (bit for bit: tested); the rows sampled without a nucleus in one pass."""
    logits = logits.float()
    plain = [i for i, (t, p) in enumerate(zip(temperatures, top_ps, strict=True))
             if t > 0 and p >= 1.0]
    if len(plain) == len(temperatures):
        scale = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
        return torch.log_softmax(logits / scale[:, None], dim=-1)
    out = torch.empty_like(logits)
    if plain:
        index = torch.tensor(plain, device=logits.device)
        scale = torch.tensor([temperatures[i] for i in plain], dtype=logits.dtype,
                             device=logits.device)
        out[index] = torch.log_softmax(logits[index] / scale[:, None], dim=-1)
    chosen = set(plain)
    for i, (t, p) in enumerate(zip(temperatures, top_ps, strict=True)):
        if i not in chosen:
            out[i] = logprobs(logits[i], t, p)
    return out


def choose(logprobs_row: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """One token from a row of `logprobs` (the argmax when greedy)."""
    if temperature <= 0:
        return int(torch.argmax(logprobs_row))
    return int(torch.multinomial(logprobs_row.exp().cpu(), 1, generator=generator))


def generator(seed: int | None, index: int) -> torch.Generator:
    """The random source of one sequence: seeded by the request's seed and the sequence's
    index (a request's n sequences differ), or from the system when no seed is given."""
    source = torch.Generator()
    if seed is None:
        source.seed()
    else:
        # Any 64-bit seed (OpenAI's clients send them): torch takes at most 2**64 - 1.
        source.manual_seed((int(seed) * 1_000_003 + index) % 2**63)
    return source
