"""Algorithms the trainer's Celery tests run in real workers (found by dotted path)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from trainer.algorithms import GRPO


class BlockOnceGRPO(GRPO):
    """The first try of a step's update writes `block_marker` and hangs (the test kills its
    worker there); later tries train normally."""

    config_keys = GRPO.config_keys | {"block_marker"}

    def update(self, **kwargs):
        marker = Path(self.config["block_marker"])
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            time.sleep(600)
        return super().update(**kwargs)


class SlowGRPO(GRPO):
    """Each update takes `update_seconds` longer (a training step with time to be killed in)."""

    config_keys = GRPO.config_keys | {"update_seconds"}

    def update(self, **kwargs):
        time.sleep(float(self.config.get("update_seconds", 1.0)))
        return super().update(**kwargs)


class RankFailsGRPO(GRPO):
    """A DDP step whose rank `fail_rank` raises (or with `hang`, sleeps: a test kills it)
    after every rank wrote its pid into `pid_dir` (the others then wait in the gradient
    all-reduce for it)."""

    config_keys = GRPO.config_keys | {"pid_dir", "fail_rank", "hang"}

    def update(self, **kwargs):
        from trainer import distributed

        rank, size = distributed.world()
        Path(self.config["pid_dir"], f"rank{rank}").write_text(str(os.getpid()))
        if rank == int(self.config["fail_rank"]):
            while len(list(Path(self.config["pid_dir"]).iterdir())) < size:
                time.sleep(0.05)
            if self.config.get("hang"):
                # deaf to SIGINT (torch's spawn signal for an orphan), as a rank blocked in
                # a collective's C++ code is
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                time.sleep(600)
            raise RuntimeError(f"rank {rank} broke on purpose")
        return super().update(**kwargs)


class AbortsAfterUpdateGRPO(GRPO):
    """A DDP step whose rank 1 aborts (SIGABRT) once its update is done, as a rank did in its
    gloo teardown: the update is complete, rank 0 saves it."""

    def update(self, **kwargs):
        from trainer import distributed

        out = super().update(**kwargs)
        if distributed.world()[0] == 1:
            os.abort()
        return out


class GangHoldGRPO(GRPO):
    """A gang step whose every rank writes its pid into `pid_dir` (as rank<global rank>) and,
    while `hold_marker` does not exist, sleeps once all ranks are there (a test kills a
    member then); later tries train normally."""

    config_keys = GRPO.config_keys | {"pid_dir", "hold_marker"}

    def update(self, **kwargs):
        from trainer import distributed

        rank, size = distributed.world()
        pid_dir = Path(self.config["pid_dir"])
        (pid_dir / f"rank{rank}").write_text(str(os.getpid()))
        if not Path(self.config["hold_marker"]).exists():
            while len(list(pid_dir.iterdir())) < size:
                time.sleep(0.05)
            time.sleep(600)
        return super().update(**kwargs)


class FixedBatchGRPO(GRPO):
    """GRPO whose every step trains on one fixed batch: 7 tasks x 5 episodes acted by
    checkpoint 0 (`act_samples`, seed 4; 35 samples, so 4 ranks' shards differ in size),
    the same on every node and in the test that checks the update against one process."""

    def samples(self, rollouts):
        from examples.cipher.task import act_samples

        return act_samples(self.init_state()["model"], tasks=7, group_size=5, seed=4)
