"""Reconcilers: periodic "send again what lost its message" work that apps plug in.

The control sweep (runners' `reconcile` task, run by celery-beat, or the embedded default's
sweep thread) calls every registered reconciler. The trainer registers the one that re-sends
training steps left by a dead worker, from its AppConfig.ready():

    from core.control import register_reconciler
    register_reconciler("training_steps", trainer.services.steps_redispatch)

A reconciler takes no arguments, returns how many things it re-sent, does bounded work in
short transactions and sends its messages after commit. `runners` and `trainer` never import
each other; both may import this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

Reconciler = Callable[[], int]
_reconcilers: dict[str, Reconciler] = {}


def register_reconciler(name: str, reconciler: Reconciler) -> Reconciler:
    """Register (or replace) the reconciler called `name`."""
    _reconcilers[name] = reconciler
    return reconciler


def unregister_reconciler(name: str) -> None:
    _reconcilers.pop(name, None)


def run_reconcilers() -> dict[str, int]:
    """Run each reconciler; one that raises is logged and reported as -1, the others run."""
    counts: dict[str, int] = {}
    for name, reconciler in list(_reconcilers.items()):
        try:
            counts[name] = int(reconciler() or 0)
        except Exception:  # one app's bug must not stop the others' reconciliation
            log.exception("reconciler %s failed", name)
            counts[name] = -1
    return counts


# Takeovers: what a Celery worker starting under its node name runs first, to take over work
# that dead processes of that node still hold (a worker killed with -9 and restarted). Each
# takes (node name, this process's pid) and returns how many things it took over.
Takeover = Callable[[str, int], int]
_takeovers: dict[str, Takeover] = {}


def register_takeover(name: str, takeover: Takeover) -> Takeover:
    """Register (or replace) the takeover called `name`."""
    _takeovers[name] = takeover
    return takeover


def run_takeovers(node: str, pid: int) -> dict[str, int]:
    """Run each takeover; one that raises is logged and reported as -1, the others run."""
    counts: dict[str, int] = {}
    for name, takeover in list(_takeovers.items()):
        try:
            counts[name] = int(takeover(node, pid) or 0)
        except Exception:  # one app's bug must not stop the others' takeover
            log.exception("takeover %s failed", name)
            counts[name] = -1
    return counts


# The live workers' devices per queue: the runners app (the worker registry) provides them;
# the trainer reads them to say why a step that needs resources waits (lightning_site/
# devices.py). A list of (worker name, its CUDA devices).
WorkerDevices = Callable[[str], list[tuple[str, list[dict]]]]
_worker_devices: list[WorkerDevices] = []


def register_worker_devices(provider: WorkerDevices) -> WorkerDevices:
    """Register (or replace) the provider of live workers' devices."""
    _worker_devices[:] = [provider]
    return provider


def live_worker_devices(queue: str) -> list[tuple[str, list[dict]]] | None:
    """(name, devices) of the live workers serving `queue`; None when no provider is wired."""
    return _worker_devices[0](queue) if _worker_devices else None


# Whether the process holding an attempt (its `worker_id`) is known to run now: the runners
# app answers from the worker registry (a Celery worker's process on this machine). The trainer
# asks before it takes back a resumed job's live attempts (`job_resume(reclaim=True)`), so
# that work a worker started since is not taken from it.
HolderAlive = Callable[[str], bool]
_holder_alive: list[HolderAlive] = []


def register_holder_alive(check: HolderAlive) -> HolderAlive:
    """Register (or replace) the check of an attempt holder's liveness."""
    _holder_alive[:] = [check]
    return check


def holder_alive(worker_id: str | None) -> bool:
    """True only when the registered check knows the holder runs; False when it does not
    know (another machine's process, no check wired) or knows it is gone."""
    return bool(worker_id and _holder_alive and _holder_alive[0](worker_id))


# What waits, and why, for pages and commands of another app (queue_watch is runners', the
# training steps are the trainer's): each reporter takes a project id (None: every project)
# and returns one line per waiting thing.
WaitingReporter = Callable[[int | None], list[str]]
_waiting: dict[str, WaitingReporter] = {}


def register_waiting(name: str, reporter: WaitingReporter) -> WaitingReporter:
    """Register (or replace) the waiting reporter called `name`."""
    _waiting[name] = reporter
    return reporter


def waiting_lines(project_id: int | None = None) -> list[str]:
    lines: list[str] = []
    for name, reporter in list(_waiting.items()):
        try:
            lines.extend(reporter(project_id))
        except Exception:  # a report must not break the page or command that shows it
            log.exception("waiting reporter %s failed", name)
    return lines
