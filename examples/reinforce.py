"""Writing your own algorithm: plain REINFORCE with a mean baseline (README "Training").

    ./lightning train examples.cipher --algorithm examples.reinforce.REINFORCE
"""

from __future__ import annotations

import random

import torch

from trainer.algorithms import Algorithm, PlannedRollout, Update
from trainer.algorithms.grpo import build_policy


class REINFORCE(Algorithm):
    def init_state(self):
        torch.manual_seed(self.seed)
        return {"model": build_policy(self.config).state_dict()}

    def plan(self, *, step, final, train_dataset, val_dataset):
        tasks = [] if final else random.Random(step).sample(train_dataset, 32)
        train = [PlannedRollout({"task": t, "group": i, "seed": step * 1000 + i})
                 for i, t in enumerate(tasks)]
        val = [PlannedRollout({"task": t, "group": "val", "seed": 0, "greedy": True}, mode="val")
               for t in val_dataset] if final or step % 5 == 0 else []
        return train + val

    def update(self, *, step, state, samples, device):
        policy = build_policy(self.config).to(device)
        policy.load_state_dict(state["model"])
        optimizer = torch.optim.Adam(policy.parameters(), lr=self.config.get("lr", 0.05))
        obs = torch.tensor([o for s in samples for o in s.observations], device=device)
        actions = torch.tensor([a for s in samples for a in s.actions], device=device)
        returns = torch.tensor([s.reward for s in samples for _ in s.actions], device=device)
        logp = torch.log_softmax(policy(obs), -1).gather(1, actions[:, None]).squeeze(1)
        loss = -((returns - returns.mean()) * logp).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return Update(state={"model": policy.state_dict()}, metrics={"loss": float(loss.detach())})
