"""Asynchronous training's rules, as pure functions (no rows): the staleness bound, the
pacing of steps planned ahead, and how old a sample is.

Versions are the job's resources versions (version k = checkpoint k-1). Step n trains from
version n+1 (the one step n-1 produced) and produces n+2. A job's config `max_staleness` (s,
default 0: the synchronous loop) is the bound: the step that trains from version v uses a
sample only if every decision or token of it was produced by a version >= v - s. `steps_ahead`
(default s, at most s) is the pacing: once step n-1 has produced version L, steps up to
n + steps_ahead may be rolling, pinned to L, so their samples are at most `steps_ahead`
versions old when their step trains; the runners keep working while a step trains.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from trainer import conventions as c

# The most versions a sample may lag that a job may ask for (each step ahead holds a group of
# rollouts in flight; more than this is a typo, not a plan).
MAX_BOUND = 16


# What the step at version v trains on (job config `consume`, asynchronous jobs): "groups",
# the first complete groups within the bound, oldest first, wherever planned; "step", its
# own planned groups only (it waits for their last episode).
CONSUME_RULES = ("groups", "step")

# The most spare groups a job may ask for (each holds a group's rollouts in flight for the
# whole job, and at most this many are left untrained at its end).
MAX_SPARE = 64

# A spare group's rollouts carry this in their metadata (trainer/pool.py): planned beyond
# what the steps train on, they are not part of any step's own count.
SPARE = "trainer.spare"


def bound(config: Mapping[str, Any]) -> int:
    """The job's `max_staleness` (0: synchronous)."""
    return int(config.get("max_staleness") or 0)


def steps_ahead(config: Mapping[str, Any]) -> int:
    """How many steps after the one training may have their groups in flight."""
    ahead = config.get("steps_ahead")
    return bound(config) if ahead is None else int(ahead)


def spare_groups(config: Mapping[str, Any], *, planned: int) -> int:
    """How many groups beyond what the steps train on the job plans (config `spare_groups`;
    unset: half of the `planned` groups step 0 trains on, rounded up), only when consuming
    groups, else 0."""
    if not consumes_groups(config):
        return 0
    asked = config.get("spare_groups")
    return -(-planned // 2) if asked is None else int(asked)


def config_error(config: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, why) when the async settings are unusable, else None."""
    s = config.get("max_staleness", 0)
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_BOUND:
        return "config.max_staleness", f"must be an integer from 0 to {MAX_BOUND} (versions)"
    ahead = config.get("steps_ahead")
    if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int)
                              or not 0 <= ahead <= s):
        return ("config.steps_ahead", f"must be an integer from 0 to max_staleness ({s}): a "
                "step planned further ahead would always be too stale to train on")
    partial = config.get("partial_rollouts", False)
    if not isinstance(partial, bool) or (partial and not s):
        return ("config.partial_rollouts", "must be true or false, and true only with "
                "max_staleness > 0 (a synchronous step's rollouts all run on one version)")
    if config.get("consume", "groups") not in CONSUME_RULES:
        return "config.consume", f"must be one of {', '.join(CONSUME_RULES)}"
    spare = config.get("spare_groups")
    if spare is not None and (isinstance(spare, bool) or not isinstance(spare, int)
                              or not 0 <= spare <= MAX_SPARE
                              or (spare and not consumes_groups(config))):
        return ("config.spare_groups", f"must be an integer from 0 to {MAX_SPARE} (groups), "
                "and above 0 only with max_staleness > 0 and consume: groups (a step that "
                "trains on its own groups has no use for another's), or null (the default: "
                "half the groups a step trains on)")
    cap = config.get("importance_cap", 2.0)
    if isinstance(cap, bool) or not isinstance(cap, int | float) or cap < 1:
        return "config.importance_cap", "must be a number >= 1"
    return None


def steps_in_flight(config: Mapping[str, Any], *, done: int | None, total: int) -> range:
    """The steps that may exist (planned) once step `done` finished (None: at the start). The
    final, evaluation-only step (n == total) is planned only after the last update, so it
    evaluates the final version."""
    first = 0 if done is None else done + 1
    if first >= total:
        return range(first, first + 1)
    return range(first, min(first + steps_ahead(config), total - 1) + 1)


def partial_rollouts(config: Mapping[str, Any]) -> bool:
    """Whether the job's LLM rollouts continue on each newly published version (each call
    served by the newest one: partial rollouts)."""
    return bound(config) > 0 and config.get("partial_rollouts") is True


def rollout_version(pinned: int | None, spans: Iterable[Mapping[str, Any]], *,
                    partial: bool = False) -> int | None:
    """The oldest version that produced any part of a rollout: its pinned resources version,
    or older when an LLM call span says an older checkpoint served it (the gateway records
    `lightning.llm.version`, a checkpoint index: resources version = index + 1). A partial
    rollout's calls were each served by the newest version: its oldest token's version when
    it has LLM calls (the pin may predate them all), else its pin."""
    served = []
    for span in spans:
        version = (span.get("attributes") or {}).get(c.LLM_VERSION)
        if isinstance(version, int) and not isinstance(version, bool):
            served.append(version + 1)
    if partial and served:
        return min(served)
    versions = served + ([] if pinned is None else [pinned])
    return min(versions) if versions else None


def too_stale(versions: Iterable[int | None], *, base: int, limit: int) -> int:
    """How many of the versions lag `base` by more than `limit`."""
    return sum(1 for v in versions if v is not None and base - v > limit)


def staleness_metrics(versions: list[int | None], *, base: int) -> dict[str, Any]:
    """Per-step figures of the samples used: mean and max staleness (versions behind the one
    the step trains from) and the fraction produced by an older version."""
    ages = [base - v for v in versions if v is not None]
    if not ages:
        return {}
    return {"staleness_mean": fmean(ages), "staleness_max": max(ages),
            "stale_sample_fraction": sum(1 for a in ages if a > 0) / len(ages)}


def consumes_groups(config: Mapping[str, Any]) -> bool:
    """Whether an asynchronous job's steps train on the first complete groups, oldest first."""
    return bound(config) > 0 and config.get("consume", "groups") == "groups"


@dataclass(frozen=True)
class Unit:
    """A group of rollouts trained together or not at all (GRPO's rollouts of one task, from
    one round of one step's plan): `order` is plan order (step, round, first rollout);
    `version` is the oldest version that produced any of them (None: unknown); `cancelled`:
    one of them was cancelled (a cancelled job, a step past its deadline), so it can only be
    planned again."""

    key: tuple[Any, ...]
    order: tuple[Any, ...]
    rollout_ids: tuple[str, ...]
    version: int | None
    complete: bool
    cancelled: bool = False


def usable(unit: Unit, *, base: int, limit: int) -> bool:
    return unit.version is None or base - unit.version <= limit


def units_pick(units: Iterable[Unit], *, base: int, limit: int, count: int) -> list[Unit]:
    """The first `count` complete units within the bound, oldest first (plan order): what the
    step training from version `base` consumes."""
    ready = sorted((u for u in units if u.complete and not u.cancelled
                    and usable(u, base=base, limit=limit)), key=lambda u: u.order)
    return ready[:count]


def units_past(units: Iterable[Unit], *, base: int, limit: int) -> list[Unit]:
    """The units no step from version `base` on may train on: planned again, never dropped."""
    return [u for u in units if u.cancelled or not usable(u, base=base, limit=limit)]
