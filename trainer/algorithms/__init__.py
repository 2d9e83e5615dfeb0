"""Training algorithms: the interface and the built-ins, found by name or dotted path."""

from __future__ import annotations

from typing import Any

from django.utils.module_loading import import_string

from trainer.algorithms.adapter import FinishedRollout, Sample, TripletAdapter
from trainer.algorithms.base import Algorithm, PlannedRollout, Update, step_seed
from trainer.algorithms.baseline import Baseline
from trainer.algorithms.grpo import GRPO

BUILTINS: dict[str, type[Algorithm]] = {"grpo": GRPO, "baseline": Baseline}


def algorithm_load(name: str, config: dict[str, Any]) -> Algorithm:
    """A built-in by name (`grpo`, `baseline`) or any Algorithm subclass by dotted path."""
    cls = BUILTINS.get(name) or import_string(name)
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ValueError(f"{name!r} is not an Algorithm")
    return cls(config)


__all__ = [
    "Algorithm",
    "BUILTINS",
    "Baseline",
    "FinishedRollout",
    "GRPO",
    "PlannedRollout",
    "Sample",
    "TripletAdapter",
    "Update",
    "algorithm_load",
    "step_seed",
]
