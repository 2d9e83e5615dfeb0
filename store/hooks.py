"""The one explicit hook from the store to its users (DESIGN.md: the import arrow stays one way).

Other apps register a callback with `on_rollouts_finished`; the store calls it after the
transaction that made rollouts terminal has committed, with the finished rollouts (the rows as
that transaction wrote them, so a listener needs no query to learn, say, their keys).
Callbacks must be quick and must not raise: a failure is logged and the other callbacks run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from django.db import transaction

from store import wakeups

if TYPE_CHECKING:
    from store.models import Rollout

log = logging.getLogger(__name__)

FinishedCallback = Callable[[list["Rollout"]], None]
_finished_callbacks: list[FinishedCallback] = []
# Callbacks that only hurry work a periodic sweep does anyway: a writer that cannot hand
# over the finished rows (the one-statement verdict) may skip them rather than take its
# slower full path for every rollout of every project.
_hurry_only: set[FinishedCallback] = set()
# Hurry-only callbacks that act on rollouts of a group only: a writer without the rows need
# not read a finished rollout that has none for them.
_grouped_only: set[FinishedCallback] = set()


def on_rollouts_finished(callback: FinishedCallback, hurry_only: bool = False,
                         grouped_only: bool = False) -> FinishedCallback:
    """Register `callback(rollouts)`; usable as a decorator. Registering twice is a no-op.
    `hurry_only`: the callback only brings forward what a sweep does later, so writers
    without the rows may skip it (see has_finished_callbacks). `grouped_only` (with
    `hurry_only`): it acts on rollouts of a group only, so such writers need not read the
    others for it (see has_hurry_callbacks)."""
    if callback not in _finished_callbacks:
        _finished_callbacks.append(callback)
    if hurry_only:
        _hurry_only.add(callback)
        if grouped_only:
            _grouped_only.add(callback)
    return callback


def remove_rollouts_finished(callback: FinishedCallback) -> None:
    if callback in _finished_callbacks:
        _finished_callbacks.remove(callback)
    _hurry_only.discard(callback)
    _grouped_only.discard(callback)


def has_finished_callbacks() -> bool:
    """Whether this process registered any rollouts-finished callback (a writer that cannot
    hand them the finished rows leaves the work to one that can); hurry-only ones do not
    count."""
    return any(callback not in _hurry_only for callback in _finished_callbacks)


def has_hurry_callbacks(grouped: bool = True) -> bool:
    """Whether a hurry-only callback wants a finished rollout that is in a group (`grouped`)
    or in none (a writer without the rows reads the rollout for them)."""
    return bool(_hurry_only if grouped else _hurry_only - _grouped_only)


def call_hurry_callbacks(rollouts: list[Rollout]) -> None:
    """Run the hurry-only callbacks with rows a writer read after its commit."""
    for callback in [c for c in _finished_callbacks if c in _hurry_only]:
        try:
            callback(rollouts)
        except Exception:  # a listener's bug must not break the store's writer
            log.exception("rollouts-finished callback %r failed", callback)


def finished_notices(rollouts: Iterable[Rollout]) -> list[tuple[str, int]]:
    """The wake-ups `notify_rollouts_finished` announces for these rollouts."""
    return [
        (wakeups.FINISHED, project_id) for project_id in sorted({r.project_id for r in rollouts})
    ]


def notify_rollouts_finished(rollouts: Iterable[Rollout], announced: bool = False) -> None:
    """Called by the store inside the transaction that made `rollouts` terminal: callbacks of
    this process run after commit, and waiting requests of every process are woken (unless
    `announced`: the writer sent `finished_notices` with its own statement)."""
    finished = list(rollouts)
    if not announced:
        for channel, project_id in finished_notices(finished):
            wakeups.announce(channel, project_id)
    if finished and _finished_callbacks:
        transaction.on_commit(lambda: _call(finished), robust=True)


def _call(rollouts: list[Rollout]) -> None:
    for callback in list(_finished_callbacks):
        try:
            callback(rollouts)
        except Exception:  # a listener's bug must not break the store's writer
            log.exception("rollouts-finished callback %r failed", callback)


# Nudges for rollout groups' owners. A completion is a row (store.models.GroupCompletion)
# written in the transaction that finished the group; the nudge only says "take yours now"
# after commit, in this process. An owner that misses it (this process died) takes the row
# later from its periodic sweep, so the nudge carries no data and losing it loses nothing.
CompletedCallback = Callable[[], None]
_completed_callbacks: dict[str, list[CompletedCallback]] = {}


def on_groups_completed(owner: str, callback: CompletedCallback) -> CompletedCallback:
    """Register `callback()` for completions of groups owned by `owner`. Idempotent."""
    callbacks = _completed_callbacks.setdefault(owner, [])
    if callback not in callbacks:
        callbacks.append(callback)
    return callback


def notify_groups_completed(owners: Iterable[str]) -> None:
    """Called by the store after the commit that wrote completions of these owners' groups."""
    for owner in owners:
        for callback in list(_completed_callbacks.get(owner, ())):
            try:
                callback()
            except Exception:  # a listener's bug must not break the store's writer
                log.exception("groups-completed callback %r failed", callback)
