"""Reconcilers: periodic "send again what lost its message" work that apps plug in.

The control sweep (runners' `reconcile` task, run by celery-beat, or the embedded default's
sweep thread) calls every registered reconciler. The trainer registers the one that re-sends
training steps left by a dead worker, from its AppConfig.ready():

    from lightning_site.control import register_reconciler
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
