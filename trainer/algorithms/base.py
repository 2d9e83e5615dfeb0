"""The Algorithm interface: what the trainer asks of a training algorithm.

The trainer owns rows, files and delivery; an algorithm owns the maths. For each step the
trainer calls, in order: `plan` (which rollouts to run against the current checkpoint), then,
once they are terminal, `update` with the finished rollouts turned into samples by the
algorithm's adapter, and stores what `update` returns as the next checkpoint and the step's
metrics. Algorithms are plain objects built from the job's config; they must be deterministic
given it (seeds are derived from the job's seed and the step index).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, ClassVar

from trainer import checkpoints
from trainer.algorithms.adapter import FinishedRollout, Sample, TripletAdapter
from trainer.config_keys import Rule


@dataclass(frozen=True)
class PlannedRollout:
    """One rollout a step asks for: its input and mode (`train` or `val`)."""

    input: Any
    mode: str = "train"


@dataclass
class Update:
    """What one train step produced: the next checkpoint payload (None: no new version, as
    for an evaluation-only algorithm) and metrics (numbers, JSON-serializable)."""

    state: dict[str, Any] | None
    metrics: dict[str, Any] = field(default_factory=dict)


def step_seed(seed: int, step: int, index: int = 0) -> int:
    """A per-(step, index) seed: the same job config always draws the same numbers."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)


# The keys the base class reads (`__init__` below): every algorithm accepts them.
BASE_CONFIG_KEYS: frozenset[str] = frozenset({"seed", "agents", "aggregation"})


class Algorithm(ABC):
    """Subclass this to write your own algorithm; see README "Training"."""

    #: True when `update` changes the model (False: evaluation only).
    trains: bool = True
    #: True when the job's rollouts call the model through the model gateway (grpo_lm): the
    #: embedded default then runs the gateway in its process.
    serves_llm: bool = False
    #: True when `update` can run as one rank of a DDP group (job config `world_size` > 1):
    #: it wraps its model with `trainer.distributed.wrap`, trains on its shard of the batch
    #: and normalizes its loss over the global batch (see trainer/distributed.py, grpo.py).
    runs_ddp: bool = False
    #: True when, with job config `parallel: fsdp`, `update` shards its model with
    #: `trainer.distributed.wrap` (FSDP2), makes its optimizer after it, loads the optimizer
    #: with `distributed.optimizer_load` and returns `distributed.save_sharded(...)` as its
    #: state when `distributed.sharded()` (grpo.py).
    runs_fsdp: bool = False
    #: The job config keys this algorithm reads besides the trainer's own (README "Job
    #: config") and the base class's (`BASE_CONFIG_KEYS`). When declared, a job whose config
    #: holds a key that nobody reads is refused at creation (a typo is an error, not a setting
    #: silently ignored); None: not declared, not checked.
    config_keys: ClassVar[frozenset[str] | None] = None
    #: What the values of its keys must be (`trainer.config_keys.Rule`: an integer or a finite
    #: number, a minimum, a maximum), checked at job creation with the trainer's own
    #: (`JOB_RULES`): a value that cannot work (`val_every: 0`) is refused there, naming the key.
    config_rules: ClassVar[Mapping[str, Rule]] = {}
    #: What `samples` makes samples of, named when a step's rollouts gave none (`no_samples`).
    sample_source: ClassVar[str] = ("`lightning.decision` spans (trainer/conventions.py), "
                                    "each with a reward in its rollout")

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.seed = int(config.get("seed", 0))
        self.adapter = TripletAdapter(
            agents=frozenset(config["agents"]) if config.get("agents") else None,
            aggregation=config.get("aggregation", "transition"),
        )

    @abstractmethod
    def init_state(self) -> dict[str, Any]:
        """The payload of checkpoint 0 (e.g. freshly initialized weights)."""

    @abstractmethod
    def plan(
        self, *, step: int, final: bool, train_dataset: Sequence[Any], val_dataset: Sequence[Any]
    ) -> list[PlannedRollout]:
        """The rollouts of step `step`; `final` is the evaluation after the last update."""

    @abstractmethod
    def update(
        self, *, step: int, state: dict[str, Any], samples: list[Sample], device: str
    ) -> Update:
        """Train on `samples` starting from checkpoint payload `state`, on `device`."""

    def save(self, state: dict[str, Any], *, name_prefix: str, step: int,
             metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Store a state as a checkpoint; returns its resource (default: one torch.save file)."""
        return checkpoints.checkpoint_save(payload=state, name_prefix=name_prefix, step=step,
                                           metrics=metrics)

    def load(self, resource: dict[str, Any]) -> dict[str, Any]:
        """The state of a checkpoint resource `save` returned."""
        return checkpoints.checkpoint_load(resource)

    def published_resources(self, checkpoint: dict[str, Any], *, job_id: int) -> dict[str, Any]:
        """Resources published beside each checkpoint, in the same version (an `llm` endpoint,
        say); rollouts pin them together."""
        return {}

    def samples(self, rollouts: Sequence[FinishedRollout]) -> list[Sample]:
        """Training samples from the step's finished train rollouts (through the adapter)."""
        return [
            sample
            for rollout in rollouts
            if rollout.mode == "train" and rollout.succeeded
            for sample in self.adapter.samples(rollout)
        ]

    def no_samples(self, rollouts: Sequence[FinishedRollout]) -> str | None:
        """Why succeeded train rollouts gave `samples` nothing to train on: a step that trains
        on nothing is a broken agent or config, not a step done (the job fails saying this).
        None when there is no succeeded train rollout to explain."""
        done = [r for r in rollouts if r.mode == "train" and r.succeeded]
        if not done:
            return None
        unrewarded = sum(1 for r in done if r.reward is None)
        why = [f"{len(done)} succeeded train rollouts gave no training samples"]
        if unrewarded:
            why.append(f"{unrewarded} of them have no reward (the agent returned None and "
                       "emitted none: return the reward, or call emit_reward)")
        why.append(f"the algorithm trains on {self.sample_source}")
        if self.config.get("agents"):
            why.append(f"config agents={sorted(self.config['agents'])} keeps only those "
                       "agents' decisions")
        return "; ".join(why)

    def report(self, rollouts: Sequence[FinishedRollout]) -> dict[str, Any]:
        """Metrics every algorithm shares: rewards of train and validation rollouts."""
        metrics: dict[str, Any] = {}
        for mode in ("train", "val"):
            mine = [r for r in rollouts if r.mode == mode]
            if not mine:
                continue
            # a rollout's reward is read from its spans: once each
            succeeded = [r.reward for r in mine if r.succeeded]
            rewards = [reward for reward in succeeded if reward is not None]
            metrics[f"{mode}_rollouts"] = len(mine)
            metrics[f"{mode}_rollouts_failed"] = len(mine) - len(succeeded)
            if unrewarded := len(succeeded) - len(rewards):
                metrics[f"{mode}_rollouts_without_reward"] = unrewarded
            if rewards:
                metrics[f"{mode}_reward"] = fmean(rewards)
        return metrics
