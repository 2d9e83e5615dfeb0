"""Reads: AGL's queries with their filters, sorting and pagination, plus lookups by id."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import reduce
from operator import and_, or_
from types import SimpleNamespace
from typing import Any, Generic, TypeVar

from django.db import connection
from django.db.models import Count, F, FloatField, OrderBy, OuterRef, Q, QuerySet, Subquery, Sum
from django.utils import timezone

from store import rules, waits, wakeups
from store.errors import BadQuery, InvalidInput, NotFound
from store.models import (
    Attempt,
    Party,
    Project,
    ResourceSet,
    ResourceVersion,
    Rollout,
    Span,
    UsageEntry,
    Worker,
)
from store.services._rows import (
    KEY_LIVE_SQL,
    KeyNotLive,
    LiveKey,
    fetch_one_prepared,
    require_key_live,
)
from store.services._rows import _loads as json_loads
from store.statemachine import ROLLOUT_TERMINAL, AttemptStatus, RolloutStatus
from store.statuses import QUEUED, ROLLOUT_ACTIVE

T = TypeVar("T")

MAX_WAIT_SECONDS = 60.0

# Each AGL object's fields in AGL's order (its "allowed fields" message), with their columns.
ROLLOUT_FIELDS = {
    "rollout_id": "id", "input": "input", "start_time": "start_time", "end_time": "end_time",
    "mode": "mode", "resources_id": "resources_id", "status": "status", "config": "config",
    "metadata": "metadata",
}
ATTEMPT_FIELDS = {
    name: name for name in ("rollout_id", "attempt_id", "sequence_id", "start_time", "end_time",
                            "status", "worker_id", "last_heartbeat_time", "metadata")
}
WORKER_FIELDS = {
    name: name for name in ("worker_id", "status", "heartbeat_stats", "last_heartbeat_time",
                            "last_dequeue_time", "last_busy_time", "last_idle_time",
                            "current_rollout_id", "current_attempt_id")
}
RESOURCES_FIELDS = {
    "resources_id": "resource_set__resources_id", "create_time": "resource_set__create_time",
    "update_time": "created_at", "version": "version", "resources": "resources",
}
SPAN_FIELDS = {
    name: name for name in ("rollout_id", "attempt_id", "sequence_id", "trace_id", "span_id",
                            "parent_id", "name", "status", "attributes", "events", "links",
                            "start_time", "end_time", "context", "parent", "resource")
}
SPAN_FIELDS["attempt_id"] = "attempt__attempt_id"


@dataclass
class Page(Generic[T]):
    items: list[T]
    limit: int
    offset: int
    total: int


def _paginate(
    qs: QuerySet, *, limit: int, offset: int, sort_by: str | None, sort_order: str,
    sortable: dict[str, str], default: str, zero_is_empty: bool = False,
) -> Page:
    """AGL's paging: `sortable` maps each field of the AGL object, in AGL's order, to its
    column. None sorts as AGL's in-memory store sorts it: `*_time` fields as infinity (last
    ascending), others as the empty value (first ascending). `zero_is_empty`: a limit of 0
    is a page with no items (AGL's store; its HTTP server answers 400) instead of a 400."""
    check_page(limit=-1 if zero_is_empty and limit == 0 else limit, offset=offset,
               sort_by=sort_by, sort_order=sort_order, fields=sortable)
    if limit == 0:
        return Page([], limit, offset, qs.count())
    column = sortable[sort_by] if sort_by else default
    ordered = qs.order_by(_order(qs.model, column, sort_by or column, sort_order), "pk")
    total = qs.count()
    window = ordered[offset:] if limit < 0 else ordered[offset : offset + limit]
    return Page(list(window), limit, offset, total)


def _order(model: type, column: str, name: str, sort_order: str) -> OrderBy:
    """None first ascending (last for `*_time`); a column that cannot hold NULL gets no
    NULLS clause, so its index still serves the order."""
    field = None
    for part in column.split("__"):
        field = model._meta.get_field(part)
        model = field.related_model or model
    if not field.null:
        return F(column).desc() if sort_order == "desc" else F(column).asc()
    late = name.endswith("_time")
    if sort_order == "desc":
        return F(column).desc(nulls_first=True) if late else F(column).desc(nulls_last=True)
    return F(column).asc(nulls_last=True) if late else F(column).asc(nulls_first=True)


def check_page(*, limit: int, offset: int, sort_by: str | None, sort_order: str,
               fields: Sequence[str]) -> None:
    """AGL 0.3's server checks, with its 400 messages."""
    if sort_by is not None and sort_by not in fields:
        raise BadQuery(f"Invalid sort_by: {sort_by}, allowed fields are: {', '.join(fields)}")
    if sort_order not in ("asc", "desc"):
        raise InvalidInput("sort_order", "must be 'asc' or 'desc'")
    if limit == 0 or limit < -1:
        raise BadQuery("Limit must be greater than 0 or -1 for no limit")
    if offset < 0:
        raise BadQuery("Offset must be greater than or equal to 0")


def _combine(conditions: list[Q], logic: str) -> Q:
    if logic not in ("and", "or"):
        raise InvalidInput("filter_logic", "must be 'and' or 'or'")
    if not conditions:
        return Q()
    return reduce(and_ if logic == "and" else or_, conditions)


def rollout_get(*, project: Project, rollout_id: str) -> Rollout:
    rollout = Rollout.objects.select_related("latest_attempt").filter(
        project=project, pk=rollout_id
    ).first()
    if rollout is None:
        raise NotFound("rollout", rollout_id)
    return rollout


def rollout_query(
    *, project: Project, status_in: Sequence[str] | None = None,
    rollout_id_in: Sequence[str] | None = None, rollout_id_contains: str | None = None,
    filter_logic: str = "and", limit: int = -1, offset: int = 0, sort_by: str | None = None,
    sort_order: str = "asc",
) -> Page[Rollout]:
    conditions = []
    if status_in is not None:
        conditions.append(Q(status__in=status_in))
    if rollout_id_in is not None:
        conditions.append(Q(pk__in=rollout_id_in))
    if rollout_id_contains:
        conditions.append(Q(pk__contains=rollout_id_contains))
    qs = Rollout.objects.select_related("latest_attempt").filter(project=project)
    qs = qs.filter(_combine(conditions, filter_logic))
    sortable = ROLLOUT_FIELDS
    return _paginate(qs, limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                     sortable=sortable, default="start_time")


def attempt_query(
    *, project: Project, rollout_id: str, limit: int = -1, offset: int = 0,
    sort_by: str | None = None, sort_order: str = "asc",
) -> Page[Attempt]:
    # An unknown rollout has no attempts: an empty page, as AGL answers. A limit of 0 too
    # (AGL's store suite: test_query_attempts_zero_limit_returns_no_items).
    qs = Attempt.objects.filter(rollout_id=rollout_id, rollout__project=project)
    sortable = ATTEMPT_FIELDS
    return _paginate(qs, limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                     sortable=sortable, default="sequence_id", zero_is_empty=True)


def attempt_latest(*, project: Project, rollout_id: str) -> Attempt | None:
    rollout = rollout_get(project=project, rollout_id=rollout_id)
    return rollout.latest_attempt


def attempt_get(*, project: Project, rollout_id: str, attempt_id: str) -> Attempt:
    attempt = Attempt.objects.filter(
        rollout__project=project, rollout_id=rollout_id, attempt_id=attempt_id
    ).first()
    if attempt is None:
        raise NotFound("attempt", f"{rollout_id}/{attempt_id}")
    return attempt


_SPAN_TEXT = ("trace_id", "span_id", "parent_id", "name")


def span_query(
    *, project: Project, rollout_id: str, attempt_id: str | None = None,
    filter_logic: str = "and", limit: int = -1, offset: int = 0,
    sort_by: str | None = "sequence_id", sort_order: str = "asc", **text: str | None,
) -> Page[Span]:
    """Spans of a rollout; attempt_id "latest" means its latest attempt. `text` takes AGL's
    exact and `_contains` filters on trace_id, span_id, parent_id and name."""
    allowed = set(_SPAN_TEXT) | {f"{n}_contains" for n in _SPAN_TEXT}
    unknown = set(text) - allowed
    if unknown:
        raise InvalidInput(sorted(unknown)[0], "unknown filter")
    rollout = Rollout.objects.filter(project=project, pk=rollout_id).only(
        "pk", "latest_attempt").first()
    if rollout is None:  # an unknown rollout has no spans: an empty page, as AGL answers
        check_page(limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                   fields=SPAN_FIELDS)
        return Page([], limit, offset, 0)
    qs = Span.objects.filter(rollout_id=rollout.pk).select_related("attempt").defer(
        "attempt__metadata"
    )
    if attempt_id == "latest":
        qs = qs.filter(attempt_id=rollout.latest_attempt_id)
    elif attempt_id is not None:
        qs = qs.filter(attempt__attempt_id=attempt_id)
    conditions = []
    for name, value in text.items():
        if value is not None:
            conditions.append(Q(**{name.replace("_contains", "__contains"): value}))
    qs = qs.filter(_combine(conditions, filter_logic))
    sortable = SPAN_FIELDS
    return _paginate(qs, limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                     sortable=sortable, default="sequence_id")


def worker_query(
    *, project: Project, status_in: Sequence[str] | None = None,
    worker_id_contains: str | None = None, filter_logic: str = "and", limit: int = -1,
    offset: int = 0, sort_by: str | None = None, sort_order: str = "asc",
) -> Page[Worker]:
    conditions = []
    if status_in is not None:
        conditions.append(Q(status__in=status_in))
    if worker_id_contains:
        conditions.append(Q(worker_id__contains=worker_id_contains))
    qs = Worker.objects.filter(project=project).filter(_combine(conditions, filter_logic))
    sortable = WORKER_FIELDS
    return _paginate(qs, limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                     sortable=sortable, default="worker_id")


def worker_get(*, project: Project, worker_id: str) -> Worker:
    worker = Worker.objects.filter(project=project, worker_id=worker_id).first()
    if worker is None:
        raise NotFound("worker", worker_id)
    return worker


def resources_get(
    *, project: Project, resources_id: str, version: int | None = None
) -> ResourceVersion:
    """One version of a resources id; its latest when `version` is None."""
    qs = ResourceVersion.objects.select_related("resource_set").filter(
        resource_set__project=project, resource_set__resources_id=resources_id
    )
    row = (qs.filter(version=version) if version is not None else
           qs.filter(version=F("resource_set__version"))).first()
    if row is None:
        ident = resources_id if version is None else f"{resources_id}@{version}"
        raise NotFound("resources", ident)
    return row


def resources_get_lean(*, project: Project, resources_id: str,
                       live_key: LiveKey | None) -> Any:
    """`resources_get` of the latest version for the lean `GET /v1/agl/resources/{id}`
    (store/api/fastjson.py), with `require_key_live(live_key)`: on Postgres one hand-written
    statement that checks the key too. What ResourcesUpdateOut renders (a ResourceVersion, or
    an object with the fields it reads), or None: an unknown id, another project's, or a dead
    key (the caller leaves those to Django's path)."""
    if connection.vendor != "postgresql":
        try:
            require_key_live(live_key)
            return resources_get(project=project, resources_id=resources_id)
        except (KeyNotLive, NotFound):
            return None
    row = fetch_one_prepared(_resources_latest_sql(live_key is not None),
                             [project.pk, resources_id, *(live_key or ())])
    if row is None:
        return None
    stored = row[4] if not isinstance(row[4], str) else \
        json_loads(row[4], ResourceVersion._meta.get_field("resources"))
    return SimpleNamespace(
        resource_set=SimpleNamespace(resources_id=row[0], create_time=row[1]),
        created_at=row[2], version=row[3], resources=stored)


@functools.cache
def _resources_latest_sql(key_checked: bool) -> str:
    sets, versions = ResourceSet._meta.db_table, ResourceVersion._meta.db_table
    return (
        f"SELECT rs.resources_id, rs.create_time, rv.created_at, rv.version, rv.resources "
        f"FROM {sets} rs JOIN {versions} rv "
        f"ON rv.resource_set_id = rs.id AND rv.version = rs.version "
        f"WHERE rs.project_id = %s AND rs.resources_id = %s"
        + (f" AND {KEY_LIVE_SQL}" if key_checked else "")
        + " ORDER BY rv.id LIMIT 1"  # resources_get's .first()
    )


def resources_latest(*, project: Project) -> ResourceVersion | None:
    rs = ResourceSet.objects.filter(project=project).order_by("-update_time").first()
    if rs is None:
        return None
    return resources_get(project=project, resources_id=rs.resources_id)


def resources_versions(*, project: Project, resources_id: str) -> list[ResourceVersion]:
    rs = ResourceSet.objects.filter(project=project, resources_id=resources_id).first()
    if rs is None:
        raise NotFound("resources", resources_id)
    return list(
        ResourceVersion.objects.select_related("resource_set")
        .filter(resource_set=rs).order_by("version")
    )


def resources_query(
    *, project: Project, resources_id: str | None = None,
    resources_id_contains: str | None = None, limit: int = -1, offset: int = 0,
    sort_by: str | None = None, sort_order: str = "asc",
) -> Page[ResourceVersion]:
    """Each resources id at its latest version (AGL's query_resources)."""
    qs = ResourceVersion.objects.select_related("resource_set").filter(
        resource_set__project=project, version=F("resource_set__version")
    )
    if resources_id:
        qs = qs.filter(resource_set__resources_id=resources_id)
    if resources_id_contains:
        qs = qs.filter(resource_set__resources_id__contains=resources_id_contains)
    sortable = RESOURCES_FIELDS
    return _paginate(qs, limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                     sortable=sortable, default="resource_set__update_time")


def rollouts_wait(
    *, project: Project, rollout_ids: Sequence[str], timeout: float | None,
) -> list[Rollout]:
    """The listed rollouts that are terminal, waiting up to `timeout` seconds (capped at 60)
    for all of them. Between checks it sleeps until a rollout of the project finishes
    (store/wakeups.py: Postgres NOTIFY), never spinning."""
    deadline = waits.deadline_for(min(max(timeout or 0.0, 0.0), MAX_WAIT_SECONDS))
    ids = list(dict.fromkeys(rollout_ids))
    # Ids this project does not have never finish: waiting for them would only burn the timeout.
    known = {pk for pk, _ in _of_project(project, ids, "pk", "status")}
    ids = [rid for rid in ids if rid in known]
    waiter = wakeups.Waiter(wakeups.FINISHED, project.pk)
    while True:
        waiter.start()
        done = [
            r for r in Rollout.objects.select_related("latest_attempt")
            .filter(pk__in=ids, status__in=ROLLOUT_TERMINAL)
            if r.project_id == project.pk
        ]
        remaining = deadline - time.monotonic()
        order = {rid: i for i, rid in enumerate(ids)}
        if len(done) == len(ids) or remaining <= 0:
            return sorted(done, key=lambda r: order[r.pk])
        if waits.defer(wakeups.FINISHED, project.pk, waiter.token, deadline):
            return sorted(done, key=lambda r: order[r.pk])  # the server waits, then reruns
        waiter.sleep(remaining)


def rollouts_first_error(*, rollout_ids: Sequence[str]) -> str | None:
    """What went wrong with the first of these rollouts to fail: its latest attempt's error,
    else the watchdog's or the queue's verdict. None when none failed."""
    failed = (
        Rollout.objects.filter(pk__in=list(rollout_ids), status="failed")
        .select_related("latest_attempt").order_by("end_time", "pk").first()
    )
    if failed is None:
        return None
    attempt = failed.latest_attempt
    error = ((attempt.metadata or {}).get("error") if attempt else None) or (
        (failed.metadata or {}).get("store.failure")
    )
    if not error and attempt is not None:
        error = f"attempt {attempt.attempt_id} ended {attempt.status}"
    return f"rollout {failed.pk}: {_what_then_where(error or 'failed')}"


def _what_then_where(error: str) -> str:
    """A traceback led by its last line (the exception: what a reader needs first), then the
    traceback itself."""
    lines = [line for line in error.splitlines() if line.strip()]
    if len(lines) < 2 or not lines[0].startswith("Traceback (most recent call last)"):
        return error
    return f"{lines[-1]}\n{error}"


def claims_held_by(*, project: Project | None, worker_id: str, since: datetime,
                   rollout_id: str | None = None, limit: int = 1
                   ) -> list[tuple[Rollout, Attempt]]:
    """Rollouts whose latest attempt this worker claimed at or after `since` and has not
    started (preparing): what a claim whose commit landed but whose answer was lost left
    behind, for its retry to adopt (else the attempt would be held by nobody until the
    watchdog's limit). `since`, the first try's time, keeps out attempts the worker already
    holds and runs (a runner with several slots claims under one worker id). `project` None:
    any project's (a Celery ticket's claim)."""
    rollouts = (Rollout.objects.filter(latest_attempt__worker_id=worker_id,
                                       latest_attempt__status=AttemptStatus.PREPARING,
                                       latest_attempt__start_time__gte=since)
                .select_related("latest_attempt").order_by("latest_attempt__start_time"))
    if project is not None:
        rollouts = rollouts.filter(project=project)
    if rollout_id is not None:
        rollouts = rollouts.filter(pk=rollout_id)
    return [(r, r.latest_attempt) for r in rollouts[:limit]]


def rollout_cancelled_ids(*, project: Project, rollout_ids: Sequence[str]) -> set[str]:
    """Which of these rollouts were cancelled (runners learn it from their next report)."""
    return {pk for pk, status in _of_project(project, rollout_ids, "pk", "status")
            if status == RolloutStatus.CANCELLED}


def _of_project(project: Project, rollout_ids: Sequence[str], *fields: str) -> list[tuple]:
    """Rows of these rollouts that belong to the project. Looked up by primary key alone:
    with `project_id = ...` in the query, Postgres may scan the whole project instead (a new
    project's stale statistics make it look small)."""
    rows = Rollout.objects.filter(pk__in=list(rollout_ids)).values_list("project_id", *fields)
    return [row[1:] for row in rows if row[0] == project.pk]


_STARTED = time.time()
# /statistics counts a project's spans only this far, so a call reads at most this many span
# index entries however many millions the project holds (the span table is the store's largest
# by far). Past it, `total_spans` is this number and `total_spans_capped` is true.
STATISTICS_SPAN_LIMIT = 100_000


def statistics(*, project: Project) -> dict[str, Any]:
    """AGL's statistics (`name`, totals, `uptime`: seconds since this process started),
    plus rollouts by status; spans are counted up to STATISTICS_SPAN_LIMIT."""
    by_status = dict(
        Rollout.objects.filter(project=project).values_list("status").annotate(n=Count("pk"))
    )
    # A sliced count is `SELECT COUNT(*) FROM (... LIMIT n)`: the scan stops at the limit.
    spans = (Span.objects.filter(rollout__project=project).values("pk")
             [:STATISTICS_SPAN_LIMIT + 1].count())
    return {
        "name": "DjangoLightningStore",
        "total_rollouts": sum(by_status.values()),
        "rollouts_by_status": by_status,
        "total_attempts": Attempt.objects.filter(rollout__project=project).count(),
        "total_spans": min(spans, STATISTICS_SPAN_LIMIT),
        "total_spans_capped": spans > STATISTICS_SPAN_LIMIT,
        "total_resources": ResourceSet.objects.filter(project=project).count(),
        "total_workers": Worker.objects.filter(project=project).count(),
        "uptime": time.time() - _STARTED,
    }


@dataclass(frozen=True)
class UsageTotals:
    """Sums of ledger rows (README "Cost")."""

    cpu_seconds: float = 0.0
    gpu_seconds: float = 0.0
    tokens: int = 0
    cost: float = 0.0
    rows: int = 0

    def describe(self) -> str:
        return (f"{self.cpu_seconds:.2f} CPU-s, {self.gpu_seconds:.2f} GPU-s, {self.tokens} "
                f"tokens: cost {self.cost:.6f}")


def usage_totals(*, project: Project | None = None, group_ids: Any = None) -> UsageTotals:
    """Ledger totals of a project, or of the rows of the given rollout groups (a job's)."""
    rows = UsageEntry.objects.all()
    if project is not None:
        rows = rows.filter(project=project)
    if group_ids is not None:
        rows = rows.filter(group_id__in=group_ids)
    sums = rows.aggregate(cpu=Sum("cpu_seconds"), gpu=Sum("gpu_seconds"), tokens=Sum("tokens"),
                          cost=Sum("cost"), n=Count("pk"))
    return UsageTotals(sums["cpu"] or 0.0, sums["gpu"] or 0.0, sums["tokens"] or 0,
                       sums["cost"] or 0.0, sums["n"])


# --- Quotas (README "Quotas") --------------------------------------------------------------------

@dataclass(frozen=True)
class GpuQuota:
    """A project's GPU-seconds cap and its use over the window (rules.QUOTA_WINDOW)."""

    cap: float
    used: float
    # When enough of the window's usage ages out to bring it under the cap; None while under
    # it, or never (a cap of 0).
    next_free: datetime | None = None

    @property
    def reached(self) -> bool:
        return rules.GPU_QUOTA.python(self.used, self.cap)

    def describe(self) -> str:
        hours = rules.QUOTA_WINDOW.total_seconds() / 3600
        text = f"quota: {self.used:,.0f} of {self.cap:,.0f} GPU-seconds in the last {hours:g} h"
        if not self.reached:
            return text
        if self.next_free is None:
            return f"{text}; a cap of 0 holds every training step"
        return f"{text}; next free at {self.next_free.astimezone(UTC):%H:%M} UTC"


def _gpu_used_in_window(since: datetime) -> Subquery:
    """The GPU-seconds of the outer project's ledger rows written after `since` (the partial
    index usage_project_gpu_time: rows that used no GPU are not read)."""
    rows = (UsageEntry.objects.filter(project_id=OuterRef("pk"), gpu_seconds__gt=0,
                                      created_at__gt=since)
            .order_by().values("project_id").annotate(total=Sum("gpu_seconds")).values("total"))
    return Subquery(rows, output_field=FloatField())


def gpu_quotas(*, project_ids: Sequence[int], now: datetime | None = None,
               reached_only: bool = False) -> dict[int, GpuQuota]:
    """The GPU quota of each project that has a cap (of those with `reached_only`: the ones
    at or past it, with the time it frees), by project id; one statement, plus one per
    reached project for its time."""
    now = now or timezone.now()
    since = now - rules.QUOTA_WINDOW
    projects = (Project.objects.filter(pk__in=list(project_ids),
                                       gpu_seconds_per_day__isnull=False)
                .annotate(used=_gpu_used_in_window(since)))
    if reached_only:
        projects = projects.filter(rules.GPU_QUOTA.q("used", "gpu_seconds_per_day"))
    found = {}
    for pk, cap, used in projects.values_list("pk", "gpu_seconds_per_day", "used"):
        quota = GpuQuota(cap=cap, used=used or 0.0)
        if quota.reached:
            quota = GpuQuota(cap=cap, used=quota.used,
                             next_free=_gpu_frees_at(pk, quota, since))
        found[pk] = quota
    return found


def _gpu_frees_at(project_id: int, quota: GpuQuota, since: datetime) -> datetime | None:
    """The moment the oldest rows of the window have aged out enough for the rest to be under
    the cap (each row leaves at its created_at + the window)."""
    left = quota.used
    rows = (UsageEntry.objects.filter(project_id=project_id, gpu_seconds__gt=0,
                                      created_at__gt=since)
            .order_by("created_at").values_list("created_at", "gpu_seconds"))
    for created_at, gpu_seconds in rows.iterator():
        left -= gpu_seconds
        if not rules.GPU_QUOTA.python(left, quota.cap):
            return created_at + rules.QUOTA_WINDOW
    return None


def gpu_quota_reason(*, project_id: int, now: datetime | None = None) -> str | None:
    """Why the project's training steps wait (its GPU quota reached), or None."""
    quota = gpu_quotas(project_ids=[project_id], now=now, reached_only=True).get(project_id)
    return quota.describe() if quota is not None else None


# --- The fair share (README "Scheduling") ---------------------------------------------------


@dataclass(frozen=True)
class PartyShare:
    key: str
    weight: float
    usage: float  # decayed to now (rules.DECAYED)
    queued: int
    live: int


@dataclass(frozen=True)
class ShareState:
    """A project's fair share as the claim sees it now, and why its rollouts wait."""

    weight: float
    max_concurrent_rollouts: int | None
    live: int
    queued: int
    parties: list[PartyShare]

    @property
    def waiting_reason(self) -> str | None:
        """Set while the project is at its cap and rollouts wait for it."""
        if self.queued and not rules.UNDER_CAP.python(self.live, self.max_concurrent_rollouts):
            return (f"cap: {self.live} of {self.max_concurrent_rollouts} concurrent rollouts "
                    f"claimed; {self.queued} queued wait for one to end")
        return None

    def describe(self) -> str:
        cap = "none" if self.max_concurrent_rollouts is None else self.max_concurrent_rollouts
        line = (f"share: weight {self.weight:g}, max concurrent rollouts {cap}, "
                f"{self.live} claimed, {self.queued} queued")
        return line + (f" (waiting: {self.waiting_reason})" if self.waiting_reason else "")

    def as_json(self) -> dict[str, Any]:
        return {"weight": self.weight, "max_concurrent_rollouts": self.max_concurrent_rollouts,
                "live": self.live, "queued": self.queued,
                "waiting_reason": self.waiting_reason,
                "parties": [{"key": p.key, "weight": p.weight, "usage": round(p.usage, 6),
                             "queued": p.queued, "live": p.live} for p in self.parties]}


def share_state(*, project: Project, now: datetime | None = None) -> ShareState:
    """Served by rollout_project_status (counts by party of the project's open rollouts)."""
    now = now or timezone.now()
    project.refresh_from_db(fields=["share_weight", "max_concurrent_rollouts"])
    counts = (Rollout.objects.filter(project=project, status__in=(*QUEUED, *ROLLOUT_ACTIVE))
              .values("party_id", "status").annotate(n=Count("pk")))
    queued: dict[int | None, int] = {}
    live: dict[int | None, int] = {}
    for row in counts:
        into = queued if row["status"] in QUEUED else live
        into[row["party_id"]] = into.get(row["party_id"], 0) + row["n"]
    half_life = rules.usage_half_life()
    parties = [PartyShare(p.key, p.weight,
                          rules.DECAYED.python(p.usage, p.usage_at, now, half_life),
                          queued.get(p.pk, 0), live.get(p.pk, 0))
               for p in Party.objects.filter(project=project).order_by("key")]
    return ShareState(project.share_weight, project.max_concurrent_rollouts,
                      sum(live.values()), sum(queued.values()), parties)
