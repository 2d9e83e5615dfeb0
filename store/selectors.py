"""Reads: AGL's queries with their filters, sorting and pagination, plus lookups by id."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from operator import and_, or_
from typing import Any, Generic, TypeVar

from django.db.models import Count, F, Q, QuerySet

from store import wakeups
from store.errors import InvalidInput, NotFound
from store.models import Attempt, Project, ResourceSet, ResourceVersion, Rollout, Span, Worker
from store.statemachine import ROLLOUT_TERMINAL

T = TypeVar("T")

MAX_WAIT_SECONDS = 60.0


@dataclass
class Page(Generic[T]):
    items: list[T]
    limit: int
    offset: int
    total: int


def _paginate(
    qs: QuerySet, *, limit: int, offset: int, sort_by: str | None, sort_order: str,
    sortable: dict[str, str], default: str,
) -> Page:
    if sort_order not in ("asc", "desc"):
        raise InvalidInput("sort_order", "must be 'asc' or 'desc'")
    if sort_by is not None and sort_by not in sortable:
        raise InvalidInput("sort_by", f"must be one of {sorted(sortable)}")
    if offset < 0:
        raise InvalidInput("offset", "must be >= 0")
    column = sortable[sort_by] if sort_by else default
    ordered = qs.order_by(F(column).desc() if sort_order == "desc" else F(column).asc(), "pk")
    total = qs.count()
    window = ordered[offset:] if limit < 0 else ordered[offset : offset + limit]
    return Page(list(window), limit, offset, total)


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
    sortable = {"rollout_id": "id", "start_time": "start_time", "end_time": "end_time",
                "status": "status", "mode": "mode", "priority": "priority"}
    return _paginate(qs, limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                     sortable=sortable, default="start_time")


def attempt_query(
    *, project: Project, rollout_id: str, limit: int = -1, offset: int = 0,
    sort_by: str | None = None, sort_order: str = "asc",
) -> Page[Attempt]:
    if not Rollout.objects.filter(project=project, pk=rollout_id).exists():
        raise NotFound("rollout", rollout_id)
    qs = Attempt.objects.filter(rollout_id=rollout_id)
    sortable = {"sequence_id": "sequence_id", "start_time": "start_time", "status": "status",
                "attempt_id": "attempt_id"}
    return _paginate(qs, limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                     sortable=sortable, default="sequence_id")


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
    rollout = rollout_get(project=project, rollout_id=rollout_id)
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
    sortable = {"sequence_id": "sequence_id", "start_time": "start_time",
                "end_time": "end_time", "name": "name", "span_id": "span_id"}
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
    sortable = {"worker_id": "worker_id", "status": "status",
                "last_heartbeat_time": "last_heartbeat_time"}
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
    sortable = {"resources_id": "resource_set__resources_id",
                "update_time": "resource_set__update_time",
                "create_time": "resource_set__create_time", "version": "version"}
    return _paginate(qs, limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order,
                     sortable=sortable, default="resource_set__update_time")


def rollouts_wait(
    *, project: Project, rollout_ids: Sequence[str], timeout: float | None,
) -> list[Rollout]:
    """The listed rollouts that are terminal, waiting up to `timeout` seconds (capped at 60)
    for all of them. Between checks it sleeps until a rollout of the project finishes
    (store/wakeups.py: Postgres NOTIFY), never spinning."""
    deadline = time.monotonic() + min(max(timeout or 0.0, 0.0), MAX_WAIT_SECONDS)
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
        if len(done) == len(ids) or remaining <= 0:
            order = {rid: i for i, rid in enumerate(ids)}
            return sorted(done, key=lambda r: order[r.pk])
        waiter.sleep(remaining)


def rollout_cancelled_ids(*, project: Project, rollout_ids: Sequence[str]) -> set[str]:
    """Which of these rollouts were cancelled (runners learn it from their next report)."""
    return {pk for pk, status in _of_project(project, rollout_ids, "pk", "status")
            if status == "cancelled"}


def _of_project(project: Project, rollout_ids: Sequence[str], *fields: str) -> list[tuple]:
    """Rows of these rollouts that belong to the project. Looked up by primary key alone:
    with `project_id = ...` in the query, Postgres may scan the whole project instead (a new
    project's stale statistics make it look small)."""
    rows = Rollout.objects.filter(pk__in=list(rollout_ids)).values_list("project_id", *fields)
    return [row[1:] for row in rows if row[0] == project.pk]


def statistics(*, project: Project) -> dict[str, Any]:
    by_status = dict(
        Rollout.objects.filter(project=project).values_list("status").annotate(n=Count("pk"))
    )
    return {
        "total_rollouts": sum(by_status.values()),
        "rollouts_by_status": by_status,
        "total_attempts": Attempt.objects.filter(rollout__project=project).count(),
        "total_spans": Span.objects.filter(rollout__project=project).count(),
        "total_resources": ResourceSet.objects.filter(project=project).count(),
        "total_workers": Worker.objects.filter(project=project).count(),
    }
