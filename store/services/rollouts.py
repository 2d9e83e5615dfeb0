"""Rollout services: enqueue, claim (dequeue), start, update."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from store import hooks, rules, wakeups
from store.errors import FieldFrozen, InvalidInput, NotFound
from store.ids import new_rollout_id
from store.models import Attempt, Party, Project, ResourceSet, Rollout, RolloutGroup
from store.services._claim import Scope, attach, claim_queued, new_attempt
from store.services._common import (
    get_rollout,
    lock_resource_set_shared,
    queue_deadline,
    worker_sync_for_attempts,
)
from store.services._rows import LiveKey, server_epoch
from store.services.groups import groups_add_members, rollouts_finished, rollouts_terminal
from store.statemachine import (
    QUEUED,
    ROLLOUT_TERMINAL,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    check_limit_seconds,
    check_rollout_transition,
)

MAX_IDEMPOTENCY_KEY = 200
_ID_RETRIES = 3


@dataclass
class RolloutSpec:
    """One rollout to create: AGL's EnqueueRolloutRequest plus our extensions."""

    input: Any = None
    mode: str | None = None
    resources_id: str | None = None
    config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = field(default=None)
    priority: int = 0
    idempotency_key: str | None = None
    # None: the STORE_QUEUE_TIMEOUT_SECONDS default; 0: wait forever.
    queue_timeout_seconds: float | None = None


def _validate(spec: RolloutSpec) -> RolloutConfig:
    if spec.mode is not None and spec.mode not in RolloutMode.values:
        raise InvalidInput("mode", f"must be one of {RolloutMode.values} or null")
    if spec.metadata is not None and not isinstance(spec.metadata, dict):
        raise InvalidInput("metadata", "must be an object")
    if isinstance(spec.priority, bool) or not isinstance(spec.priority, int):
        raise InvalidInput("priority", "must be an integer")
    key = spec.idempotency_key
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_IDEMPOTENCY_KEY):
        raise InvalidInput("idempotency_key", f"must be 1-{MAX_IDEMPOTENCY_KEY} characters")
    check_limit_seconds(spec.queue_timeout_seconds, "queue_timeout_seconds")
    return RolloutConfig.parse(spec.config)


@dataclass
class _Pins:
    """The version each resources id is at now, and the project's latest set."""

    versions: dict[str, int]
    latest: ResourceSet | None

    def pick(self, resources_id: str | None) -> tuple[str | None, int | None]:
        if resources_id:
            # An id that does not exist (yet) is kept as given, unpinned, as AGL keeps it.
            return resources_id, self.versions.get(resources_id)
        if self.latest is None:
            return None, None
        return self.latest.resources_id, self.latest.version


def _pin_resources(project: Project, specs: Sequence[RolloutSpec]) -> _Pins:
    # Lock before reading the version, so retention cannot delete what we are about to pin.
    named = {s.resources_id for s in specs if s.resources_id}
    latest_id = None
    if any(not s.resources_id for s in specs):
        # AGL gives a rollout enqueued without resources the latest ones.
        latest_id = (
            ResourceSet.objects.filter(project=project)
            .order_by("-update_time")
            .values_list("resources_id", flat=True)
            .first()
        )
    wanted = named | ({latest_id} if latest_id else set())
    for rid in sorted(wanted):
        lock_resource_set_shared(project.pk, rid)
    sets = {r.resources_id: r
            for r in ResourceSet.objects.filter(project=project, resources_id__in=wanted)}
    return _Pins({rid: rs.version for rid, rs in sets.items()}, sets.get(latest_id))


def _build(project: Project, spec: RolloutSpec, config: RolloutConfig, now: datetime,
           pins: _Pins, epoch: datetime | None) -> Rollout:
    resources_id, resources_version = pins.pick(spec.resources_id)
    rollout = Rollout(
        id=new_rollout_id(),
        project=project,
        input=spec.input,
        mode=spec.mode,
        resources_id=resources_id,
        resources_version=resources_version,
        status=RolloutStatus.QUEUING,
        config=config.as_json(),
        metadata=spec.metadata or {},
        start_time=now,
        priority=spec.priority,
        enqueue_time=now,
        queue_timeout_seconds=_queue_timeout(spec),
        idempotency_key=spec.idempotency_key,
        # Its span counter's epoch: the enqueue commits synchronously, so `spans/next` may
        # hand out the first SPAN_ID_BLOCK ids asynchronously (rules.SPAN_IDS_DURABLE;
        # None, unknown: the first commits synchronously).
        span_epoch=epoch,
    )
    rollout.queue_deadline = queue_deadline(rollout, now)
    return rollout


def _queue_timeout(spec: RolloutSpec) -> float | None:
    value = spec.queue_timeout_seconds
    if value is None:
        value = settings.STORE_QUEUE_TIMEOUT_SECONDS
    return value or None


def rollout_enqueue_many(*, project: Project, specs: Sequence[RolloutSpec],
                         group: RolloutGroup | None = None, party: str = "") -> list[Rollout]:
    """Queue rollouts in order. A spec whose idempotency key was seen before returns the
    rollout first created with it (a retried enqueue creates nothing). With `group` (the
    algorithm's own services; never from a client's request) the new rollouts join it. The
    new rollouts belong to the fair share's party `party` of the project (README
    "Scheduling"; the trainer's: "trainer/job/<pk>"; "" the project's own)."""
    if group is not None and group.project_id != project.pk:
        raise InvalidInput("group", "belongs to another project")
    if len(party) > Party._meta.get_field("key").max_length:
        raise InvalidInput("party", "must be at most 200 characters")
    configs = [_validate(spec) for spec in specs]
    for attempt in range(_ID_RETRIES):
        try:
            with transaction.atomic():
                return _enqueue_once(project, specs, configs, group, party)
        except IntegrityError:
            # A concurrent enqueue took one of our idempotency keys, or (rarely) an id
            # collided: re-read the keys and draw new ids.
            if attempt == _ID_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def _enqueue_once(project: Project, specs: Sequence[RolloutSpec],
                  configs: list[RolloutConfig], group: RolloutGroup | None,
                  party_key: str) -> list[Rollout]:
    keys = {s.idempotency_key for s in specs if s.idempotency_key}
    existing = {
        r.idempotency_key: r
        for r in Rollout.objects.filter(project=project, idempotency_key__in=keys)
    } if keys else {}
    pins = _pin_resources(project, [s for s in specs if s.idempotency_key not in existing])
    epoch = server_epoch()
    now = timezone.now()
    result: list[Rollout] = []
    new: list[Rollout] = []
    party = None
    for index, (spec, config) in enumerate(zip(specs, configs, strict=True)):
        key = spec.idempotency_key
        if key and key in existing:
            result.append(existing[key])
            continue
        # Microsecond steps keep FIFO order inside one batch.
        rollout = _build(project, spec, config, now + timedelta(microseconds=index), pins,
                         epoch)
        if key:
            existing[key] = rollout
        rollout.group = group
        if party is None:  # get_or_create survives a concurrent first enqueue (savepoint)
            party, _ = Party.objects.get_or_create(project=project, key=party_key)
        rollout.party = party
        new.append(rollout)
        result.append(rollout)
    Rollout.objects.bulk_create(new)
    if new and group is not None:
        groups_add_members({group.pk: len(new)})
    if new:
        wakeups.announce(wakeups.QUEUED, project.pk)
    return result


def rollout_enqueue(*, project: Project, spec: RolloutSpec) -> Rollout:
    return rollout_enqueue_many(project=project, specs=[spec])[0]


def rollout_dequeue_many(
    *, project: Project, worker_id: str | None = None, limit: int = 1, idle_if_none: bool = True,
    live_key: LiveKey | None = None,
) -> list[tuple[Rollout, Attempt]]:
    """Claim up to `limit` queued rollouts (highest priority, then oldest first), each with
    a new attempt, in one transaction; rows another claimer holds are skipped, not waited on.
    With `idle_if_none` False, a claim that finds nothing stores nothing (the worker is not
    marked idle). With `live_key` (a lean request's key), KeyNotLive and nothing stored
    unless that key is live (checked by the claim itself)."""
    if limit < 1:
        raise InvalidInput("limit", "must be >= 1")
    now = timezone.now()
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        # On Postgres the claim is one statement (_claim.py), atomic by itself: without
        # BEGIN and COMMIT it is two round trips shorter.
        return claim_queued(project, worker_id, limit, now, idle_if_none=idle_if_none,
                            live_key=live_key)
    with transaction.atomic():
        claimed = claim_queued(project, worker_id, limit, now, idle_if_none=idle_if_none,
                               live_key=live_key)
    return claimed


def rollout_claim(
    *, project: Project, rollout_id: str, worker_id: str | None = None
) -> tuple[Rollout, Attempt] | None:
    """Claim one named rollout if it is still queued (compare-and-swap); None when it is not
    queued any more. A row another writer holds is waited for (briefly), not skipped. A Celery
    rollout task uses this, so a duplicated message finds the rollout claimed and does
    nothing."""
    now = timezone.now()
    with transaction.atomic():
        claimed = claim_queued(
            project, worker_id, 1, now, rollout_id=rollout_id, idle_if_none=False
        )
    return claimed[0] if claimed else None


def rollout_claim_next(
    *, dispatch: str, max_timeout: float | None, worker_id: str
) -> tuple[Rollout, Attempt] | None:
    """A message's ticket (README "Scheduling"): claim the rollout due next among every
    project's queued rollouts delivered by `dispatch` whose timeout is at most `max_timeout`
    (None: any), in the store's order: priority, then fair share, then age; projects at their
    cap are skipped. None when none is claimable."""
    scope = Scope(None, dispatch=dispatch, max_timeout=max_timeout)
    now = timezone.now()
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        claimed = claim_queued(scope, worker_id, 1, now, idle_if_none=False)
    else:
        with transaction.atomic():
            claimed = claim_queued(scope, worker_id, 1, now, idle_if_none=False)
    return claimed[0] if claimed else None


def rollout_dequeue(
    *, project: Project, worker_id: str | None = None
) -> tuple[Rollout, Attempt] | None:
    claimed = rollout_dequeue_many(project=project, worker_id=worker_id, limit=1)
    return claimed[0] if claimed else None


def rollout_start(
    *, project: Project, spec: RolloutSpec, worker_id: str | None = None
) -> tuple[Rollout, Attempt]:
    """Create a rollout that skips the queue: already preparing, with attempt 1."""
    config = _validate(spec)
    now = timezone.now()
    key = spec.idempotency_key
    try:
        with transaction.atomic():
            if key and Rollout.objects.filter(project=project, idempotency_key=key).exists():
                raise IntegrityError(key)
            pins = _pin_resources(project, [spec])
            rollout = _build(project, spec, config, now, pins, server_epoch())
            rollout.queue_deadline = None
            rollout.save(force_insert=True)
            attempt = new_attempt(rollout, worker_id, now)
            attach([rollout], [attempt])
            worker_sync_for_attempts(project.pk, [attempt], now)
    except IntegrityError:
        if not key:
            raise
        # Unlike enqueue, a start is not retried by returning the first rollout: its attempt
        # may be running already. The key is refused instead (nothing was written).
        raise InvalidInput("idempotency_key", "already used by another rollout") from None
    return rollout, attempt


def attempt_start(
    *, project: Project, rollout_id: str, worker_id: str | None = None
) -> tuple[Rollout, Attempt]:
    """Start a new attempt by hand (ignores max_attempts, as AGL does). The algorithm's
    explicit command: a terminal rollout is reopened (preparing), as in AGL."""
    now = timezone.now()
    with transaction.atomic():
        rollout = get_rollout(project, rollout_id, lock=True)
        reopened = rollout.status in ROLLOUT_TERMINAL
        if rollout.end_time is not None:
            rollout.end_time = None
            rollout.save(update_fields=["end_time"])
        attempt = new_attempt(rollout, worker_id, now)
        attach([rollout], [attempt])
        # The worker before the group: the one lock order (a verdict of this worker on
        # another member of the group holds the worker and then takes the group).
        rules.locks_in_order("rollout", "worker", "group")
        worker_sync_for_attempts(project.pk, [attempt], now)
        if reopened:
            rollouts_terminal([rollout], -1, now)  # its group waits for it again
    return rollout, attempt


_UNSET = object()


def rollout_update(
    *,
    project: Project,
    rollout_id: str,
    input: Any = _UNSET,
    mode: Any = _UNSET,
    resources_id: Any = _UNSET,
    status: Any = _UNSET,
    config: Any = _UNSET,
    metadata: Any = _UNSET,
) -> Rollout:
    """AGL's update_rollout; fields left out are unchanged. An explicit status is the
    algorithm's command and may reopen a terminal rollout (requeue a failed one), as in AGL."""
    now = timezone.now()
    with transaction.atomic():
        try:
            rollout = get_rollout(project, rollout_id, lock=True)
        except NotFound:
            # AGL's store words its update this way (its suite matches `Item.*does not exist`).
            raise NotFound("rollout", rollout_id, "Item does not exist with primary key(s): "
                           f"rollout_id={rollout_id!r} (Rollout {rollout_id} not found)") from None
        changed: list[str] = []
        if status is not _UNSET and status is not None:
            _apply_rollout_status(rollout, status, now, changed)
        if input is not _UNSET and input != rollout.input:
            if rollout.status in ROLLOUT_TERMINAL:
                # Deliberately stricter than AGL 0.3 (README): a finished rollout's spans and
                # reward answer its input; changing it would make them lie. Requeue first.
                raise FieldFrozen("rollout", rollout.pk, "input", rollout.status)
            rollout.input = input
            changed.append("input")
        if mode is not _UNSET:
            if mode is not None and mode not in RolloutMode.values:
                raise InvalidInput("mode", f"must be one of {RolloutMode.values} or null")
            rollout.mode = mode
            changed.append("mode")
        if resources_id is not _UNSET:
            _apply_resources(project, rollout, resources_id, changed)
        if config is not _UNSET and config is not None:
            rollout.config = RolloutConfig.parse(config).as_json()
            changed.append("config")
        if metadata is not _UNSET:
            if metadata is not None and not isinstance(metadata, dict):
                raise InvalidInput("metadata", "must be an object")
            rollout.metadata = metadata or {}
            changed.append("metadata")
        if changed:
            rollout.save(update_fields=sorted(set(changed)))
    return rollout


def _apply_rollout_status(rollout: Rollout, status: str, now: datetime, changed: list) -> None:
    try:
        moved = check_rollout_transition(rollout.status, status, explicit=True)
    except ValueError as exc:
        raise InvalidInput("status", str(exc)) from None
    if not moved:
        return
    was_terminal = rollout.status in ROLLOUT_TERMINAL
    rollout.status = status
    changed += ["status", "end_time"]
    rollout.end_time = None
    if was_terminal and status not in ROLLOUT_TERMINAL:
        rollouts_terminal([rollout], -1, now)  # reopened: its group waits for it again
    if status in ROLLOUT_TERMINAL:
        rollout.end_time = now
        if was_terminal:  # one verdict for another: counted once already
            hooks.notify_rollouts_finished([rollout])
        else:
            rollouts_finished([rollout], now)
    elif status in QUEUED:
        rollout.enqueue_time = now
        rollout.queue_deadline = queue_deadline(rollout, now)
        changed += ["enqueue_time", "queue_deadline"]
        wakeups.announce(wakeups.QUEUED, rollout.project_id)


def _apply_resources(project: Project, rollout: Rollout, resources_id: str | None,
                     changed: list) -> None:
    if resources_id is None:
        rollout.resources_id = rollout.resources_version = None
    else:
        lock_resource_set_shared(project.pk, resources_id)
        rs = ResourceSet.objects.filter(project=project, resources_id=resources_id).first()
        # Kept as given when it does not exist (yet), as AGL keeps it; pinned when it does.
        rollout.resources_id = resources_id
        rollout.resources_version = rs.version if rs is not None else None
    changed += ["resources_id", "resources_version"]
