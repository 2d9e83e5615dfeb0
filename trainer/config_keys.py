"""Which keys a job's config may hold: the trainer's own and those its algorithm declares.

A key nobody reads is a typo or a setting of another algorithm; a job created with one would
run as if it were not there (a failure that looks like success: `--set lrr=0.1` trains at the
default rate), so job creation refuses it, naming the key and the nearest known one. Likewise
a value that cannot work (`val_every=0`, a group of one rollout, a negative learning rate):
the rules below, checked at job creation, name the key and what it must be.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


def unknown_key_error(config: Mapping[str, Any], *, job_keys: Iterable[str],
                      algorithm: str, declared: Iterable[str] | None) -> tuple[str, str] | None:
    """(field, message) for the first key (sorted) of `config` that is neither in `job_keys`
    nor in `declared` (the algorithm's `config_keys` plus the base class's); None when every
    key is known or when the algorithm declares nothing (`declared` None: not checked)."""
    if declared is None:
        return None
    known = set(job_keys) | set(declared)
    unknown = sorted(str(key) for key in config if key not in known)
    if not unknown:
        return None
    key = unknown[0]
    near = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    others = f"; also unknown: {', '.join(unknown[1:])}" if len(unknown) > 1 else ""
    return (f"config.{key}",
            f"unknown key{hint}: neither the trainer nor the algorithm {algorithm!r} reads it"
            f"{others} (an algorithm declares the keys it reads in `config_keys`). Known keys: "
            f"{', '.join(sorted(known))}")


@dataclass(frozen=True)
class Rule:
    """What a numeric config value must be: an integer (`kind` int) or a finite number, at
    least `minimum` (above it when `above`), at most `maximum`; `why` ends the message."""

    kind: type
    minimum: float | None = None
    above: bool = False
    maximum: float | None = None
    why: str = ""

    def problem(self, value: Any) -> str | None:
        if isinstance(value, bool) or not (
                isinstance(value, int) if self.kind is int
                else isinstance(value, int | float) and math.isfinite(value)):
            kind = "an integer" if self.kind is int else "a finite number"
            return f"must be {kind}, got {value!r}"
        low = self.minimum is not None and (
            value <= self.minimum if self.above else value < self.minimum)
        if low or (self.maximum is not None and value > self.maximum):
            bounds = [f"{'>' if self.above else '>='} {self.minimum:g}"] if (
                self.minimum is not None) else []
            bounds += [f"<= {self.maximum:g}"] if self.maximum is not None else []
            return f"must be {' and '.join(bounds)}, got {value!r}{self.why}"
        return None


COUNT = Rule(int, 1)
SECONDS = Rule(float, 0, above=True)

# The trainer's own keys (JOB_DEFAULTS, trainer/services.py). Other keys check themselves
# where they are read (world_size, nodes, parallel: trainer/distributed.py; max_staleness and
# the pacing: trainer/staleness.py; resources: core/devices.py; rollout_config: the store).
JOB_RULES: Mapping[str, Rule] = {
    "steps": COUNT, "seed": Rule(int), "max_step_attempts": COUNT, "keep_last": COUNT,
    "max_failed_rollout_share": Rule(float, 0, maximum=1),
    "step_lease_seconds": SECONDS, "step_timeout_seconds": SECONDS, "resend_seconds": SECONDS,
    "gang_wait_seconds": SECONDS, "gang_peer_timeout_seconds": SECONDS,
}

# The group-relative algorithms' keys (grpo, grpo_lm): a group of one rollout has nothing to
# be compared with, so every advantage is 0 and a job "trains" on nothing.
GROUP_RULES: Mapping[str, Rule] = {
    "lr": Rule(float, 0, above=True), "group_size": Rule(
        int, 2, why=" (a group's rewards are compared with each other: with one rollout "
                    "every advantage is 0 and nothing is learned)"),
    "tasks_per_step": COUNT, "epochs": COUNT, "val_every": COUNT,
    "clip": Rule(float, 0, above=True), "clip_high": Rule(float, 0, above=True),
    "entropy_coef": Rule(float, 0),
    "importance_cap": Rule(float, 1), "kl_coef": Rule(float, 0), "micro_batch": COUNT,
    "max_grad_norm": Rule(float, 0, above=True), "target_kl": Rule(float, 0, above=True),
}


def value_error(config: Mapping[str, Any], rules: Mapping[str, Rule]) -> tuple[str, str] | None:
    """(field, message) for the first key (sorted) of `config` whose value its rule refuses;
    None when each is fine."""
    for key in sorted(key for key in config if key in rules):
        if (problem := rules[key].problem(config[key])) is not None:
            return f"config.{key}", problem
    return None
