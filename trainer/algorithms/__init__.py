"""Training algorithms: the interface and the built-ins, found by name or dotted path."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from django.utils.module_loading import import_string

from trainer.algorithms.adapter import FinishedRollout, Sample, TripletAdapter
from trainer.algorithms.base import Algorithm, PlannedRollout, Update, step_seed

# The built-ins import torch, so they load on first use: a process that never trains (the
# API server, say) never pays torch's start-up time and memory.
BUILTINS: dict[str, str] = {
    "grpo": "trainer.algorithms.grpo.GRPO",
    "baseline": "trainer.algorithms.baseline.Baseline",
    "grpo_lm": "trainer.algorithms.grpo_lm.GRPOLM",
}


def __getattr__(name: str) -> Any:
    if name in {"GRPO", "Baseline"}:
        return import_string(BUILTINS[name.lower()])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def algorithm_class(name: str) -> type[Algorithm]:
    """A built-in by name (`grpo`, `grpo_lm`, `baseline`) or an Algorithm subclass by path.
    ValueError or ImportError saying what was expected (a module named instead of its class
    names the classes it holds)."""
    if name not in BUILTINS and "." not in name:
        raise ValueError(f"unknown algorithm {name!r}: a built-in ({', '.join(BUILTINS)}) or "
                         "the dotted path of an Algorithm subclass")
    try:
        cls = import_string(BUILTINS.get(name, name))
    except ImportError as exc:
        try:
            cls = importlib.import_module(name)
        except ImportError:
            raise exc from None
    if inspect.ismodule(cls):
        held = sorted(
            f"{name}.{attr}" for attr, value in vars(cls).items()
            if isinstance(value, type) and issubclass(value, Algorithm)
            and value.__module__ == cls.__name__
        )
        raise ValueError(f"{name!r} is a module: name the Algorithm class in it"
                         + (f" ({', '.join(held)})" if held else "; it defines none"))
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ValueError(f"{name!r} is not an Algorithm")
    return cls


def algorithm_load(name: str, config: dict[str, Any]) -> Algorithm:
    return algorithm_class(name)(config)


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
    "algorithm_class",
    "algorithm_load",
    "step_seed",
]
