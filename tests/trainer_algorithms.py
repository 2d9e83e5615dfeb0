"""Algorithms the trainer's Celery tests run in real workers (found by dotted path)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainer.algorithms import GRPO


class BlockOnceGRPO(GRPO):
    """The first try of a step's update writes `block_marker` and hangs (the test kills its
    worker there); later tries train normally."""

    def update(self, **kwargs):
        marker = Path(self.config["block_marker"])
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            time.sleep(600)
        return super().update(**kwargs)


class SlowGRPO(GRPO):
    """Each update takes `update_seconds` longer (a training step with time to be killed in)."""

    def update(self, **kwargs):
        time.sleep(float(self.config.get("update_seconds", 1.0)))
        return super().update(**kwargs)
