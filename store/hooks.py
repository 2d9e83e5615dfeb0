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


def on_rollouts_finished(callback: FinishedCallback) -> FinishedCallback:
    """Register `callback(rollouts)`; usable as a decorator. Registering twice is a no-op."""
    if callback not in _finished_callbacks:
        _finished_callbacks.append(callback)
    return callback


def remove_rollouts_finished(callback: FinishedCallback) -> None:
    if callback in _finished_callbacks:
        _finished_callbacks.remove(callback)


def has_finished_callbacks() -> bool:
    """Whether this process registered any rollouts-finished callback (a writer that cannot
    hand them the finished rows leaves the work to one that can)."""
    return bool(_finished_callbacks)


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
