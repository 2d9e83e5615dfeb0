"""Measuring what a task used, in the process that ran it, for the store's cost ledger
(README "Cost"): CPU time from getrusage, not wall time; the CUDA devices the process holds.
Shared by the rollout task (runners) and the train-step task (trainer)."""

from __future__ import annotations

import resource
import sys
import threading
import time


def _process_cpu() -> float:
    """This process's CPU time and that of the children it waited for (an agent's tools,
    a step's torch.distributed ranks)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cuda_held() -> tuple[int, str]:
    """(devices, the first one's name) when something in this process initialised CUDA;
    (0, "") otherwise. Never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0, ""
    count = torch.cuda.device_count()
    return count, torch.cuda.get_device_name(0) if count else ""


class CpuMeter:
    """Started when a task starts; `cpu_seconds()` and `wall_seconds()` give what it used so far.

    A task running in its process's main thread (Celery's prefork and solo pools: one task
    per process at a time) is charged the whole process's CPU (RUSAGE_SELF, its helper
    threads included, plus waited-for children); a task on another thread (the threads pool,
    the embedded default, the remote runner's slots) only its own thread's (RUSAGE_THREAD via
    time.thread_time): threads it starts are not counted there."""

    def __init__(self) -> None:
        self.whole_process = threading.current_thread() is threading.main_thread()
        self.started = time.perf_counter()
        self.cpu_at_start = self._cpu()

    def _cpu(self) -> float:
        return _process_cpu() if self.whole_process else time.thread_time()

    def cpu_seconds(self) -> float:
        return max(0.0, self._cpu() - self.cpu_at_start)

    def wall_seconds(self) -> float:
        return time.perf_counter() - self.started
