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
