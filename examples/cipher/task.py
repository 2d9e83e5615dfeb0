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


def act_samples(model_state: dict, *, tasks: int, group_size: int, seed: int) -> list:
    """Training samples as the agent's rollouts of one step make them (`tasks` messages,
    `group_size` sampled episodes of each), without the store: for the parity test and
    bench/train_bench.py. Same policy, features, sampling and reward as agent.py."""
    from trainer.algorithms.adapter import Sample

    policy = build_policy()
    policy.load_state_dict(model_state)
    samples = []
    for t, task in enumerate(make_dataset(tasks, seed=seed)):
        for g in range(group_size):
            generator = torch.Generator().manual_seed(seed * 100_003 + t * 1000 + g)
            observations, actions, logprobs, correct = [], [], [], 0
            for position, symbol in enumerate(task["message"]):
                features = observe(symbol, position)
                with torch.no_grad():
                    logp = torch.log_softmax(policy(torch.tensor([features])), dim=-1)[0]
                action = int(torch.multinomial(logp.exp(), 1, generator=generator))
                observations.append(features)
                actions.append(action)
                logprobs.append(float(logp[action]))
                correct += int(action == answer(symbol))
            samples.append(Sample(rollout_id=f"r-{t}-{g}", group=f"train-{t}", agent="decoder",
                                  observations=observations, actions=actions,
                                  logprobs=logprobs, reward=correct / len(task["message"])))
    return samples
