"""Following a job from a terminal: a tqdm bar of steps with reward and throughput."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from trainer import selectors
from trainer.models import JOB_TERMINAL, StepStatus, TrainingJob


@dataclass
class Snapshot:
    job: TrainingJob
    steps_done: int
    current: int | None
    train_reward: float | None
    val_reward: float | None
    rollouts_finished: int


def snapshot(job_id: int) -> Snapshot:
    job = TrainingJob.objects.get(pk=job_id)
    done = list(job.steps.filter(status=StepStatus.DONE).order_by("n")
                .values_list("n", "metrics"))
    current = job.steps.order_by("-n").values_list("n", flat=True).first()
    train = next((m["train_reward"] for _, m in reversed(done) if "train_reward" in m), None)
    val = next((m["val_reward"] for _, m in reversed(done) if "val_reward" in m), None)
    return Snapshot(job, len(done), current, train, val, selectors.job_finished_count(job=job))


def follow(job_id: int, *, poll: float = 0.5, file: TextIO | None = None,
           disable: bool = False) -> Snapshot:
    """Show progress until the job is terminal; returns the last snapshot."""
    snap = snapshot(job_id)
    started, first_finished = time.monotonic(), snap.rollouts_finished
    # `initial`: a resumed job starts with steps done, and tqdm's rate counts from there.
    with tqdm(total=snap.job.total_steps + 1, initial=snap.steps_done, unit="step",
              desc=f"job {job_id}", file=file, disable=disable, dynamic_ncols=True) as bar:
        while True:
            bar.n = snap.steps_done
            elapsed = max(time.monotonic() - started, 1e-6)
            postfix: dict[str, Any] = {"step": snap.current}
            if snap.train_reward is not None:
                postfix["reward"] = f"{snap.train_reward:.3f}"
            if snap.val_reward is not None:
                postfix["val"] = f"{snap.val_reward:.3f}"
            postfix["rollouts/s"] = f"{(snap.rollouts_finished - first_finished) / elapsed:.1f}"
            bar.set_postfix(postfix, refresh=True)
            if snap.job.status in JOB_TERMINAL:
                return snap
            time.sleep(poll)
            snap = snapshot(job_id)
