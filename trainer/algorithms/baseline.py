"""Evaluation only: every step runs the validation set against the initial checkpoint and
reports rewards; nothing is trained (the yardstick an algorithm must beat)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer.algorithms.adapter import Sample
from trainer.algorithms.base import Algorithm, PlannedRollout, Update
from trainer.algorithms.grpo import GRPO, build_policy, plan_validation, policy_check


class Baseline(Algorithm):
    trains = False
    # It reads `policy` and `policy_kwargs`, and takes grpo's settings too: the yardstick runs
    # on the same spec as the algorithm it measures (`--algorithm baseline`).
    config_keys = GRPO.config_keys

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        policy_check(self.config)

    def init_state(self) -> dict[str, Any]:
        torch.manual_seed(self.seed)
        return {"model": build_policy(self.config).state_dict()}

    def plan(
        self, *, step: int, final: bool, train_dataset: Sequence[Any], val_dataset: Sequence[Any]
    ) -> list[PlannedRollout]:
        return plan_validation(val_dataset or train_dataset, self.seed, step)

    def update(
        self, *, step: int, state: dict[str, Any], samples: list[Sample], device: str
    ) -> Update:
        return Update(state=None)
