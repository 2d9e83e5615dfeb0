"""Keeping a training step's lease while it trains.

A claimed step is held until `lease_until`; past it, the trainer's sweep takes the worker
for dead and sends the step again. A step that trains longer than the lease must not look
dead, so while it trains a thread pushes `lease_until` forward every third of the lease. The
renewal is a compare-and-swap on (status, attempts): once another try has taken the step,
this one stops renewing (and its finish will find the step lost).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from django.db import connection
from django.db.models import Q
from django.utils import timezone

from trainer.models import StepStatus, TrainingStep
from trainer.statemachine import step_move

log = logging.getLogger(__name__)


@contextmanager
def lease_kept(step: TrainingStep, lease_seconds: float) -> Iterator[None]:
    if connection.in_atomic_block:
        # The claim is not committed yet: nobody else sees the lease, and our open
        # transaction holds the row a renewing thread would wait for.
        yield
        return
    stop = threading.Event()

    def renew() -> None:
        try:
            while not stop.wait(lease_seconds / 3):
                try:
                    held = step_move(
                        step.pk, expect=[StepStatus.TRAINING], to=None,
                        where=Q(attempts=step.attempts),
                        lease_until=timezone.now() + timedelta(seconds=lease_seconds))
                except Exception:  # the database is briefly away: try again next time
                    log.warning("step %s: could not renew its lease", step.pk, exc_info=True)
                    continue
                if not held:
                    log.warning("step %s: another try holds it now; no longer renewing",
                                step.pk)
                    return
        finally:
            connection.close()  # this thread's own connection

    thread = threading.Thread(target=renew, name=f"lease-step-{step.pk}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
