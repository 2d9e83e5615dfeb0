"""The cipher task and its policy network (shared by the agent and GRPO's update)."""

from __future__ import annotations

import random

import torch

VOCAB = 10
LENGTH = 4
# The hidden substitution the agent must discover (a fixed permutation of the symbols).
SECRET = tuple(random.Random(7).sample(range(VOCAB), VOCAB))


def make_dataset(size: int, *, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"message": [rng.randrange(VOCAB) for _ in range(LENGTH)]} for _ in range(size)]


def answer(symbol: int) -> int:
    return SECRET[symbol]


def observe(symbol: int, position: int, vocab: int = VOCAB, length: int = LENGTH) -> list[float]:
    """The policy's input for one decision: the symbol and its position, one-hot."""
    features = [0.0] * (vocab + length)
    features[symbol] = 1.0
    features[vocab + position] = 1.0
    return features


def build_policy(*, vocab: int = VOCAB, length: int = LENGTH, hidden: int = 32) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(vocab + length, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, vocab),
    )
