"""Progress display shared by the runners' commands."""

from __future__ import annotations

import time
from collections.abc import Sequence

from django.core.management.base import CommandError
from tqdm import tqdm

from runners import selectors
from runners.held_slots import held_slots
from store import services
from store.models import Project
from store.rewards import mean_reward


def project_named(name: str, *, create: bool = False) -> Project:
    project = Project.objects.filter(name=name).first()
    if project is None and create:
        # Local convenience for the embedded default; deployments use project_create.
        project = services.project_create(name=name)
    if project is None:
        raise CommandError(f"project {name!r} not found (create it with project_create)")
    return project


def reward_line(rollout_ids: Sequence[str]) -> str:
    mean, n = mean_reward(rollout_ids=rollout_ids)
    if mean is None:
        return f"mean reward: - (none of the {len(rollout_ids)} rollouts recorded a reward)"
    return f"mean reward: {mean:.3f} over {n} of {len(rollout_ids)} rollouts"


def summary(project: Project, by_status: dict[str, int]) -> str:
    queue = selectors.project_queue(project=project)
    counts = " ".join(f"{status}={n}" for status, n in sorted(by_status.items())) or "none"
    live = selectors.celery_workers_live()
    text = f"{counts} | live workers: {len(live)}"
    if queue.waiting_reason:
        text += f" | waiting: {queue.waiting_reason}"
    held = held_slots()
    if held:
        text += f" | slots held by ended attempts: {len(held)}"
    return text


def follow(project: Project, rollout_ids: Sequence[str] | None, *, interval: float,
           timeout: float | None, out) -> dict[str, int]:
    """Show progress until every listed rollout (or every rollout of the project) is terminal,
    or until `timeout` seconds pass. Returns the last counts by status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    by_status = selectors.rollouts_by_status(project=project, rollout_ids=rollout_ids)
    total = sum(by_status.values())
    with tqdm(total=total, unit="rollout", file=out, dynamic_ncols=True) as bar:
        while True:
            by_status = selectors.rollouts_by_status(project=project, rollout_ids=rollout_ids)
            done = selectors.finished_count(by_status)
            bar.total = sum(by_status.values())
            bar.update(done - bar.n)
            bar.set_postfix_str(summary(project, by_status), refresh=True)
            if done >= bar.total or (deadline is not None and time.monotonic() > deadline):
                return by_status
            time.sleep(interval)
