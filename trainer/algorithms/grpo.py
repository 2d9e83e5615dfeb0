"""GRPO: group-relative policy optimization for discrete-action policies, in torch.

Each step samples `tasks_per_step` tasks and runs `group_size` rollouts of each against the
current checkpoint. A rollout's advantage is its reward standardized within its group (same
task), so no value network is needed; decisions are trained with PPO's clipped objective
against the log-probabilities the acting policy recorded in its spans.
"""

from __future__ import annotations

import random
import shutil
from collections import defaultdict
from collections.abc import Sequence
from statistics import fmean, pstdev
from typing import Any

import torch
from django.utils.module_loading import import_string

from store.errors import InvalidInput
from trainer import checkpoints, distributed
from trainer.algorithms.adapter import Sample
from trainer.algorithms.base import Algorithm, PlannedRollout, Update, step_seed
from trainer.config_keys import GROUP_RULES

DEFAULTS: dict[str, Any] = {
    "policy_kwargs": {},
    "lr": 0.05,
    "group_size": 8,
    "tasks_per_step": 8,
    "epochs": 4,
    "clip": 0.2,
    "entropy_coef": 0.0,
    "val_every": 5,
    # Asynchronous jobs (max_staleness > 0): the truncation of the importance weight
    # pi_prox / pi_behaviour (see `off_policy_correct`)
    "importance_cap": 2.0,
}


def build_policy(config: dict[str, Any]) -> torch.nn.Module:
    """The policy network named by the job's config (`policy`: dotted path of a factory)."""
    return import_string(config["policy"])(**config.get("policy_kwargs", {}))


def policy_check(config: dict[str, Any]) -> None:
    """InvalidInput naming `config.policy` when it does not name an importable factory (so
    a job is refused when it is created, not when its first checkpoint is written)."""
    path = config.get("policy")
    if not path or not isinstance(path, str):
        raise InvalidInput("config.policy", "missing: the dotted path of a policy factory (a "
                           "function returning a torch module), e.g. 'examples.cipher.task."
                           "build_policy'")
    try:
        factory = import_string(path)
    except ImportError as exc:
        raise InvalidInput("config.policy", f"{path!r} does not import: {exc}") from None
    if not callable(factory):
        raise InvalidInput("config.policy", f"{path!r} is not callable")


def plan_validation(val_dataset: Sequence[Any], seed: int, step: int) -> list[PlannedRollout]:
    return [
        PlannedRollout(
            input={"task": task, "group": f"val-{i}", "seed": step_seed(seed, step, 100_000 + i),
                   "greedy": True},
            mode="val",
        )
        for i, task in enumerate(val_dataset)
    ]


def plan_groups(config: dict[str, Any], seed: int, *, step: int, final: bool,
                train_dataset: Sequence[Any], val_dataset: Sequence[Any]) -> list[PlannedRollout]:
    """`tasks_per_step` tasks, `group_size` rollouts each (one group per task), then the
    validation set every `val_every` steps and after the last update (greedy)."""
    planned: list[PlannedRollout] = []
    if not final:
        rng = random.Random(step_seed(seed, step))
        count = min(int(config["tasks_per_step"]), len(train_dataset))
        for t, index in enumerate(rng.sample(range(len(train_dataset)), count)):
            for g in range(int(config["group_size"])):
                planned.append(PlannedRollout(
                    input={"task": train_dataset[index], "group": f"train-{index}",
                           "seed": step_seed(seed, step, t * 1000 + g), "greedy": False},
                ))
    if final or step % int(config["val_every"]) == 0:
        planned += plan_validation(val_dataset, seed, step)
    return planned


def group_advantages(samples: Sequence[Sample]) -> dict[str, float]:
    """Rollout id -> reward standardized within its group; groups where every reward is the
    same carry no signal and are left out."""
    rewards: dict[Any, dict[str, float]] = defaultdict(dict)
    for sample in samples:
        rewards[sample.group][sample.rollout_id] = sample.reward
    advantages: dict[str, float] = {}
    for group in rewards.values():
        values = list(group.values())
        spread = pstdev(values) if len(values) > 1 else 0.0
        if spread < 1e-8:
            continue
        mean = fmean(values)
        for rollout_id, reward in group.items():
            advantages[rollout_id] = (reward - mean) / (spread + 1e-6)
    return advantages


class GRPO(Algorithm):
    runs_ddp = True  # world_size > 1: DDP over local ranks (trainer/distributed.py)
    runs_fsdp = True  # ... or FSDP2 with `parallel: fsdp`
    config_keys = frozenset(DEFAULTS) | {"policy"}
    config_rules = GROUP_RULES

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__({**DEFAULTS, **config})
        policy_check(self.config)

    def init_state(self) -> dict[str, Any]:
        torch.manual_seed(self.seed)
        policy = build_policy(self.config)
        optimizer = torch.optim.Adam(policy.parameters(), lr=float(self.config["lr"]))
        return {"model": policy.state_dict(), "optimizer": optimizer.state_dict()}

    def save(self, state: dict[str, Any], *, name_prefix: str, step: int,
             metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """One torch.save file; an FSDP step's state is its torch.distributed.checkpoint
        directory ({"dcp": directory}), stored as a directory checkpoint that
        `checkpoint_load` reads at any world size."""
        if "dcp" not in state:
            return super().save(state, name_prefix=name_prefix, step=step, metrics=metrics)
        try:
            return checkpoints.checkpoint_save_dir(directory=state["dcp"],
                                                   name_prefix=name_prefix, step=step,
                                                   metrics=metrics)
        finally:
            shutil.rmtree(state["dcp"], ignore_errors=True)

    def plan(
        self, *, step: int, final: bool, train_dataset: Sequence[Any], val_dataset: Sequence[Any]
    ) -> list[PlannedRollout]:
        return plan_groups(self.config, self.seed, step=step, final=final,
                           train_dataset=train_dataset, val_dataset=val_dataset)

    def update(
        self, *, step: int, state: dict[str, Any], samples: list[Sample], device: str
    ) -> Update:
        torch.manual_seed(step_seed(self.seed, step))
        policy = build_policy(self.config).to(device)
        policy.load_state_dict(state["model"])
        # DDP or FSDP2 in a process group (FSDP's parameters become DTensors, so the
        # optimizer is made after), else the policy itself.
        model = distributed.wrap(policy)
        optimizer = torch.optim.Adam(policy.parameters(), lr=float(self.config["lr"]))
        distributed.optimizer_load(policy, optimizer, state["optimizer"])
        # Advantages are over the whole batch (a group may straddle two ranks' shards).
        advantages = group_advantages(samples)
        batch = _Batch.build([s for s in samples if s.rollout_id in advantages], advantages,
                             device)
        metrics: dict[str, Any] = {"samples": len(samples), "trained_samples": batch.size}
        if batch.size and int(self.config.get("max_staleness") or 0) > 0:
            metrics.update(off_policy_correct(policy, batch,
                                              float(self.config["importance_cap"])))
        if batch.size:
            rank, world_size = distributed.world()
            mine = batch.shard(rank, world_size) if world_size > 1 else batch
            for _ in range(int(self.config["epochs"])):
                metrics.update(self._epoch(model, optimizer, mine))
        if distributed.sharded():  # every rank writes its shards (torch.distributed.checkpoint)
            return Update(state=distributed.save_sharded(policy, optimizer), metrics=metrics)
        return Update(
            state={"model": _to_cpu(policy.state_dict()), "optimizer": optimizer.state_dict()},
            metrics=metrics,
        )

    def _epoch(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batch: _Batch) -> dict[str, float]:
        logits = policy(batch.observations)
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(1, batch.actions.unsqueeze(1)).squeeze(1)
        # Trajectory samples: the ratio is over the episode (sum of its decisions' log-probs).
        new = torch.zeros(batch.size, device=logp.device).index_add(0, batch.owner, logp)
        ratio = torch.exp(new - batch.old_logprobs)
        clip = float(self.config["clip"])
        clipped = torch.clamp(ratio, 1 - clip, 1 + clip)
        objective = torch.min(ratio * batch.advantages, clipped * batch.advantages)
        if batch.weights is not None:  # an asynchronous job's samples (off_policy_correct)
            objective = objective * batch.weights
        entropies = -(logp_all.exp() * logp_all).sum(-1)
        if batch.totals is None:  # one process: the whole batch
            policy_loss = -objective.mean()
            entropy = entropies.mean()
        else:
            # A shard of a DDP group: DDP averages gradients over the ranks, so each rank's
            # sum is scaled by world_size / global count, making the update the mean over
            # the global batch (the shards' sizes may differ), as in one process.
            samples_total, decisions_total, world_size = batch.totals
            policy_loss = -objective.sum() * (world_size / samples_total)
            entropy = entropies.sum() * (world_size / decisions_total)
        loss = policy_loss - float(self.config["entropy_coef"]) * entropy
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if batch.totals is not None:  # the global batch's figures, as one process reports
            clipped_count = float(((ratio - 1).abs() > clip).float().sum())
            loss_sum, entropy_sum, clipped_sum = distributed.all_sum(
                [float(loss.detach()), float(entropy.detach()), clipped_count], ratio.device)
            return {"loss": loss_sum / world_size, "entropy": entropy_sum / world_size,
                    "clip_fraction": clipped_sum / samples_total}
        return {
            "loss": float(loss.detach()),
            "entropy": float(entropy.detach()),
            "clip_fraction": float(((ratio - 1).abs() > clip).float().mean()),
        }


class _Batch:
    """Samples as tensors: decisions flattened, each pointing at its sample (`owner`)."""

    def __init__(self, observations, actions, owner, old_logprobs, advantages, size) -> None:
        self.observations, self.actions, self.owner = observations, actions, owner
        self.old_logprobs, self.advantages, self.size = old_logprobs, advantages, size
        # truncated importance weights of an asynchronous job's samples; None: on-policy
        self.weights = None
        # (global samples, global decisions, world size) for a rank's shard; None: whole
        self.totals: tuple[int, int, int] | None = None

    def shard(self, rank: int, world_size: int) -> _Batch:
        """Rank `rank`'s contiguous slice of the samples (and of their decisions, which are
        in sample order), the same on every call."""
        start, stop = distributed.shard_bounds(self.size, rank, world_size)
        first = int(torch.searchsorted(self.owner, start))
        last = int(torch.searchsorted(self.owner, stop))
        part = _Batch(self.observations[first:last], self.actions[first:last],
                      self.owner[first:last] - start, self.old_logprobs[start:stop],
                      self.advantages[start:stop], stop - start)
        part.totals = (self.size, int(self.actions.numel()), world_size)
        if self.weights is not None:
            part.weights = self.weights[start:stop]
        return part

    @classmethod
    def build(cls, samples: list[Sample], advantages: dict[str, float], device: str) -> _Batch:
        observations, actions, owner = [], [], []
        for index, sample in enumerate(samples):
            observations += sample.observations
            actions += sample.actions
            owner += [index] * len(sample.actions)
        if not samples:
            return cls(None, None, None, None, None, 0)
        return cls(
            torch.tensor(observations, dtype=torch.float32, device=device),
            torch.tensor(actions, dtype=torch.long, device=device),
            torch.tensor(owner, dtype=torch.long, device=device),
            torch.tensor([sum(s.logprobs) for s in samples], dtype=torch.float32, device=device),
            torch.tensor([advantages[s.rollout_id] for s in samples], dtype=torch.float32,
                         device=device),
            len(samples),
        )


def off_policy_correct(policy: torch.nn.Module, batch: _Batch, cap: float) -> dict[str, float]:
    """Decoupled PPO for samples that older versions acted (asynchronous jobs): the clipped
    ratio is taken against the proximal policy (the checkpoint the step trains from), and each
    sample's objective is weighted by the importance weight pi_prox / pi_behaviour of its
    recorded log-probabilities, truncated at `cap` (truncated importance sampling: a sample
    the current policy likes far more than the acting one did cannot dominate the step).
    Rewrites `batch.old_logprobs` to the proximal ones and sets `batch.weights`; returns the
    weights' statistics."""
    with torch.no_grad():
        logp = torch.log_softmax(policy(batch.observations), dim=-1)
        logp = logp.gather(1, batch.actions.unsqueeze(1)).squeeze(1)
        proximal = torch.zeros(batch.size, device=logp.device).index_add(0, batch.owner, logp)
        raw = torch.exp(proximal - batch.old_logprobs)
    batch.weights = raw.clamp(max=cap)
    batch.old_logprobs = proximal
    return {"is_weight_mean": float(batch.weights.mean()), "is_weight_max": float(raw.max()),
            "is_weight_truncated_fraction": float((raw > cap).float().mean())}


def _to_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu() for name, tensor in state.items()}
