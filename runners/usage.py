"""An attempt's usage for the ledger: the task's CPU (core/usage.py) and, when the
agent initialised CUDA in this process, wall time x the devices it holds."""

from __future__ import annotations

from core.usage import CpuMeter, cuda_held
from store.services import Usage


class UsageMeter(CpuMeter):
    def read(self) -> Usage:
        devices, name = cuda_held()
        return Usage(cpu_seconds=self.cpu_seconds(),
                     gpu_seconds=self.wall_seconds() * devices, gpu_type=name)
