"""Rollout groups: a batch an algorithm waits on, with its counts kept by the store.

`group_create` names a group; `rollout_enqueue_many(group=...)` adds members (total); every
writer that makes rollouts terminal calls `rollouts_terminal` inside its transaction
(finished), and one that reopens a terminal rollout calls it with -1. Reaching
finished == total writes a `GroupCompletion` row in the same transaction; its owner takes it
with `group_completions_take` (deleting it: a compare-and-swap, so each event is acted on
once, by whichever process gets there first, and consumed events leave no rows).
Lock order (rules.LOCK_ORDER): after attempts, rollouts and workers; groups in id order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import datetime

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from store import hooks, rules
from store.models import GroupCompletion, Project, Rollout, RolloutGroup

MAX_GROUP_KEY = 200


def group_create(*, project: Project, key: str, owner: str) -> tuple[RolloutGroup, bool]:
    """The group named `key` in the project, created empty when new; (group, created)."""
    return RolloutGroup.objects.get_or_create(project=project, key=key[:MAX_GROUP_KEY],
                                              defaults={"owner": owner})


def groups_add_members(counts: dict[int, int]) -> None:
    """`counts[group id]` new rollouts joined the group (inside the enqueue's transaction)."""
    for group_id in sorted(counts):
        RolloutGroup.objects.filter(pk=group_id).update(total=F("total") + counts[group_id])


def rollouts_terminal(rollouts: Iterable[Rollout], delta: int = 1,
                      now: datetime | None = None) -> None:
    """Count rollouts that became terminal (`delta` 1) or were reopened (-1) in their groups,
    inside the caller's transaction; a group that reaches its total gets a completion."""
    counts = Counter(r.group_id for r in rollouts if r.group_id is not None)
    if not counts:
        return
    now = now or timezone.now()
    if connection.vendor == "postgresql":
        completed = _count_sql(counts, delta, now)
    else:  # the embedded SQLite default: transactions are serialized, the ORM is enough
        completed = _count_orm(counts, delta, now)
    if completed:
        owners = sorted({owner for _, owner in completed})
        transaction.on_commit(lambda: hooks.notify_groups_completed(owners), robust=True)


# One statement: the counts in group id order (the lock order), and the completion rows of
# the groups whose `finished` reached `total` with this change (rules.GROUP_COUNT).
_COUNT_SQL = f"""
WITH changed AS (
    UPDATE store_rolloutgroup g
    SET finished = {rules.group_finished_sql("g.finished", "d.n")},
        completed_at = {rules.group_completed_at_sql("g.finished", "g.total", "g.completed_at",
                                                     "d.n", "%s::timestamptz")}
    FROM (SELECT * FROM unnest(%s::bigint[], %s::int[]) AS t(id, n) ORDER BY id) d
    WHERE g.id = d.id
    RETURNING g.id, g.owner, g.finished, g.total, g.finished - d.n AS before
)
INSERT INTO store_groupcompletion (group_id, owner, created_at)
SELECT id, owner, %s::timestamptz FROM changed
WHERE {rules.group_completed_now_sql("before", "total", "finished")}
RETURNING group_id, owner
"""


def _count_sql(counts: Counter, delta: int, now: datetime) -> list[tuple[int, str]]:
    ids = sorted(counts)
    # Lock the rows in id order first: UPDATE ... FROM locks in join order, not ours.
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM store_rolloutgroup WHERE id = ANY(%s) ORDER BY id "
                       "FOR NO KEY UPDATE", [ids])
        cursor.execute(_COUNT_SQL, [now, ids, [counts[i] * delta for i in ids], now])
        return [tuple(row) for row in cursor.fetchall()]


def _count_orm(counts: Counter, delta: int, now: datetime) -> list[tuple[int, str]]:
    completed = []
    groups = RolloutGroup.objects.select_for_update().filter(pk__in=counts).order_by("pk")
    for group in groups:
        group.finished, group.completed_at, completed_now = rules.GROUP_COUNT.python(
            group.finished, group.total, group.completed_at, counts[group.pk] * delta, now)
        group.save(update_fields=["finished", "completed_at"])
        if completed_now:
            GroupCompletion.objects.create(group=group, owner=group.owner, created_at=now)
            completed.append((group.pk, group.owner))
    return completed


def group_completions_take(*, owner: str, limit: int = 100) -> list[GroupCompletion]:
    """Take the owner's completions, oldest first: each one is deleted (a compare-and-swap:
    a concurrent taker waits for the row, then finds it gone), and only the ones this call
    deleted are returned (with their group). Call it inside the transaction that reacts to
    them: a reaction that fails rolls the deletion back and leaves the events for the next
    taker."""
    pending = list(GroupCompletion.objects.filter(owner=owner)
                   .select_related("group").order_by("created_at", "pk")[:limit])
    return [event for event in pending
            if GroupCompletion.objects.filter(pk=event.pk).delete()[0]]


def rollouts_finished(rollouts: Iterable[Rollout], now: datetime | None = None,
                      announced: bool = False) -> None:
    """Every writer's last step for rollouts that it made terminal, inside its transaction:
    their groups count them, and the store's hook and wake-ups are told (`announced`: the
    writer already sent hooks.finished_notices with one of its statements)."""
    finished = list(rollouts)
    rollouts_terminal(finished, 1, now)
    hooks.notify_rollouts_finished(finished, announced=announced)
