"""Agent Lightning 0.3's store API under /v1/agl/: one thin view per operation.

Each view parses its input with a serializer, calls one service (writes) or selector (reads)
and formats the output with a serializer. Views that share a URL are combined in urls.py.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from store import selectors, services
from store.api import limits
from store.api import serializers as s
from store.api.auth import ADMIN_ONLY, ALGORITHM_ROLES, PROJECT_ROLES, SITE_ADMIN_ONLY
from store.api.base import StoreView, respond
from store.api.errors import PayloadTooLarge
from store.errors import NotFound
from store.services.longpoll import rollout_dequeue_wait
from store.services.resources import resources_delete
from store.statemachine import ATTEMPT_FINAL, RolloutStatus

IDEMPOTENCY_HEADER = "Idempotency-Key"
_IDEMPOTENCY_MAX = 180


class HealthView(StoreView):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: dict}, operation_id="health")
    def get(self, request: Request) -> Response:
        return Response({"status": "ok"})


# --- rollouts and the queue ------------------------------------------------------------------


def _spec(data: dict[str, Any]) -> services.RolloutSpec:
    return services.RolloutSpec(
        input=data.get("input"),
        mode=data.get("mode"),
        resources_id=data.get("resources_id") or None,
        config=data.get("config"),
        metadata=data.get("metadata"),
        priority=data.get("priority", 0),
        idempotency_key=data.get("idempotency_key"),
        queue_timeout_seconds=data.get("queue_timeout_seconds"),
    )


def _idempotency_keys(request: Request, count: int) -> list[str | None]:
    """Per-item keys derived from the Idempotency-Key header: item i gets `KEY/i`."""
    header = request.headers.get(IDEMPOTENCY_HEADER)
    if not header:
        return [None] * count
    if len(header) > _IDEMPOTENCY_MAX:
        raise s.serializers.ValidationError(
            {IDEMPOTENCY_HEADER: f"at most {_IDEMPOTENCY_MAX} characters"}
        )
    return [f"{header}/{index}" for index in range(count)]


class EnqueueRolloutsView(StoreView):
    post_roles = ALGORITHM_ROLES

    @extend_schema(
        request=s.EnqueueManyIn, responses={201: s.RolloutOut(many=True)},
        operation_id="enqueue_rollouts",
        parameters=[OpenApiParameter(IDEMPOTENCY_HEADER, str, OpenApiParameter.HEADER,
                                     description="Retry-safe enqueue: item i gets key KEY/i.")],
    )
    def post(self, request: Request) -> Response:
        items = self.body(s.EnqueueManyIn)["rollouts"]
        keys = _idempotency_keys(request, len(items))
        specs = []
        for item, key in zip(items, keys, strict=True):
            spec = _spec(item)
            spec.idempotency_key = spec.idempotency_key or key
            specs.append(spec)
        rollouts = services.rollout_enqueue_many(project=self.project, specs=specs)
        return respond(s.RolloutOut, rollouts, many=True, status=status.HTTP_201_CREATED)


class DequeueRolloutsView(StoreView):
    @extend_schema(request=s.DequeueIn, responses={200: s.AttemptedRolloutOut(many=True)},
                   operation_id="dequeue_rollouts")
    def post(self, request: Request) -> Response:
        data = self.body(s.DequeueIn)
        if data["limit"] <= 0:
            return respond(s.AttemptedRolloutOut, [], many=True)
        claimed = rollout_dequeue_wait(
            project=self.project, worker_id=data.get("worker_id"), limit=data["limit"],
            wait_seconds=data["wait_seconds"],
        )
        rollouts = [s.attempted(rollout, attempt) for rollout, attempt in claimed]
        return respond(s.AttemptedRolloutOut, rollouts, many=True)


class ClaimRolloutView(StoreView):
    """Extension: claim one named rollout if it is still queued (`null` when it is not)."""

    @extend_schema(request=s.ClaimRolloutIn, responses={200: s.AttemptedRolloutOut},
                   operation_id="claim_rollout")
    def post(self, request: Request, rollout_id: str) -> Response:
        data = self.body(s.ClaimRolloutIn)
        claimed = services.rollout_claim(
            project=self.project, rollout_id=rollout_id, worker_id=data.get("worker_id")
        )
        return respond(s.AttemptedRolloutOut, s.attempted(*claimed) if claimed else None)


class StartRolloutView(StoreView):
    post_roles = ALGORITHM_ROLES

    @extend_schema(request=s.StartRolloutIn, responses={201: s.AttemptedRolloutOut},
                   operation_id="start_rollout")
    def post(self, request: Request) -> Response:
        data = self.body(s.StartRolloutIn)
        rollout, attempt = services.rollout_start(
            project=self.project, spec=_spec(data), worker_id=data.get("worker_id")
        )
        return respond(s.AttemptedRolloutOut, s.attempted(rollout, attempt), status=201)


def _query_rollouts(view: StoreView, data: dict[str, Any]) -> Response:
    page = selectors.rollout_query(project=view.project, **data)
    return respond(s.RolloutPageOut, page)


class QueryRolloutsView(StoreView):
    @extend_schema(parameters=[s.QueryRolloutsIn], responses={200: s.RolloutPageOut},
                   operation_id="query_rollouts")
    def get(self, request: Request) -> Response:
        return _query_rollouts(self, self.query(s.QueryRolloutsIn))


class SearchRolloutsView(StoreView):
    @extend_schema(request=s.QueryRolloutsIn, responses={200: s.RolloutPageOut},
                   operation_id="search_rollouts")
    def post(self, request: Request) -> Response:
        return _query_rollouts(self, self.body(s.QueryRolloutsIn))


class GetRolloutView(StoreView):
    @extend_schema(responses={200: s.RolloutOrAttemptedOut}, operation_id="get_rollout_by_id")
    def get(self, request: Request, rollout_id: str) -> Response:
        rollout = selectors.rollout_get(project=self.project, rollout_id=rollout_id)
        return respond(s.RolloutOrAttemptedOut, rollout)


class UpdateRolloutView(StoreView):
    post_roles = ALGORITHM_ROLES

    @extend_schema(request=s.UpdateRolloutIn, responses={200: s.RolloutOut},
                   operation_id="update_rollout")
    def post(self, request: Request, rollout_id: str) -> Response:
        data = self.body(s.UpdateRolloutIn)
        self.refuse_nulls("status", "config")
        rollout = services.rollout_update(project=self.project, rollout_id=rollout_id, **data)
        return respond(s.RolloutOut, rollout)


class WaitForRolloutsView(StoreView):
    @extend_schema(request=s.WaitForRolloutsIn, responses={200: s.RolloutOut(many=True)},
                   operation_id="wait_for_rollouts")
    def post(self, request: Request) -> Response:
        data = self.body(s.WaitForRolloutsIn)
        timeout = data.get("timeout")
        # AGL: no timeout means "until done"; ours waits at most MAX_WAIT_SECONDS.
        timeout = limits.MAX_WAIT_SECONDS if timeout is None else timeout
        rollouts = selectors.rollouts_wait(
            project=self.project, rollout_ids=data["rollout_ids"], timeout=timeout
        )
        return respond(s.RolloutOut, rollouts, many=True)


# --- attempts --------------------------------------------------------------------------------


class StartAttemptView(StoreView):
    post_roles = ALGORITHM_ROLES

    @extend_schema(request=s.StartAttemptIn, responses={201: s.AttemptedRolloutOut},
                   operation_id="start_attempt")
    def post(self, request: Request, rollout_id: str) -> Response:
        data = self.body(s.StartAttemptIn)
        rollout, attempt = services.attempt_start(
            project=self.project, rollout_id=rollout_id, worker_id=data.get("worker_id")
        )
        return respond(s.AttemptedRolloutOut, s.attempted(rollout, attempt), status=201)


def _query_attempts(view: StoreView, rollout_id: str, data: dict[str, Any]) -> Response:
    page = selectors.attempt_query(project=view.project, rollout_id=rollout_id, **data)
    return respond(s.AttemptPageOut, page)


class QueryAttemptsView(StoreView):
    @extend_schema(parameters=[s.QueryAttemptsIn], responses={200: s.AttemptPageOut},
                   operation_id="query_attempts")
    def get(self, request: Request, rollout_id: str) -> Response:
        return _query_attempts(self, rollout_id, self.query(s.QueryAttemptsIn))


class SearchAttemptsView(StoreView):
    @extend_schema(request=s.QueryAttemptsIn, responses={200: s.AttemptPageOut},
                   operation_id="search_attempts")
    def post(self, request: Request, rollout_id: str) -> Response:
        return _query_attempts(self, rollout_id, self.body(s.QueryAttemptsIn))


class GetAttemptView(StoreView):
    """`latest` (AGL's get_latest_attempt: null when the rollout has none) or an attempt id."""

    @extend_schema(responses={200: s.AttemptOut}, operation_id="get_attempt")
    def get(self, request: Request, rollout_id: str, attempt_id: str) -> Response:
        if attempt_id == "latest":
            attempt = selectors.attempt_latest(project=self.project, rollout_id=rollout_id)
        else:
            attempt = selectors.attempt_get(
                project=self.project, rollout_id=rollout_id, attempt_id=attempt_id
            )
        return respond(s.AttemptOut, attempt)


class UpdateAttemptView(StoreView):
    """A runner's report or heartbeat; `X-Cancelled-Rollouts` names the rollout when it was
    cancelled, so the runner can stop."""

    @extend_schema(request=s.UpdateAttemptIn, responses={200: s.AttemptOut},
                   operation_id="update_attempt")
    def post(self, request: Request, rollout_id: str, attempt_id: str) -> Response:
        data = self.body(s.UpdateAttemptIn)
        self.refuse_nulls("status", "worker_id", "last_heartbeat_time", "metadata")
        if data.get("last_heartbeat_time", ...) is None:
            del data["last_heartbeat_time"]
        attempt = services.attempt_update(
            project=self.project, rollout_id=rollout_id, attempt_id=attempt_id, **data
        )
        cancelled: set[str] = set()
        if attempt.status not in ATTEMPT_FINAL:  # a runner that gave its verdict is done
            cancelled = _cancelled([attempt])
        return respond(s.AttemptOut, attempt, cancelled=cancelled)


class FinishAttemptView(StoreView):
    """Extension: a runner's final verdict, with its error merged into the attempt's metadata
    under the row lock (the watchdog's verdict is kept). Idempotent per final status."""

    @extend_schema(request=s.FinishAttemptIn, responses={200: s.AttemptOut},
                   operation_id="finish_attempt")
    def post(self, request: Request, rollout_id: str, attempt_id: str) -> Response:
        _at_most_spans(request)
        data = self.body(s.FinishAttemptIn)
        usage = data.pop("usage", None)
        attempt = services.attempt_finish(
            project=self.project, rollout_id=rollout_id, attempt_id=attempt_id,
            usage=services.Usage(**usage) if usage else None, **data
        )
        return respond(s.AttemptOut, attempt)


def _cancelled(attempts: list) -> set[str]:
    """Cancelled rollouts among the attempts' (as the update's transaction read them)."""
    return {a.rollout_id for a in attempts if a.rollout.status == RolloutStatus.CANCELLED}


class UpdateAttemptsBatchView(StoreView):
    """Extension: many attempt reports in one transaction (our batched client ends a batch of
    rollouts with one request). All or nothing: one unknown id or illegal move fails it."""

    @extend_schema(request=s.AttemptBatchIn, responses={200: s.AttemptBatchOut},
                   operation_id="update_attempts_batch")
    def post(self, request: Request) -> Response:
        items = self.body(s.AttemptBatchIn)["updates"]
        updates = [services.AttemptUpdate(**item) for item in items]
        attempts = services.attempt_update_many(project=self.project, updates=updates)
        cancelled = _cancelled(attempts)
        result = {"attempts": attempts, "cancelled_rollout_ids": sorted(cancelled)}
        return respond(s.AttemptBatchOut, result, cancelled=cancelled)


# --- workers ---------------------------------------------------------------------------------


def _query_workers(view: StoreView, data: dict[str, Any]) -> Response:
    return respond(s.WorkerPageOut, selectors.worker_query(project=view.project, **data))


class QueryWorkersView(StoreView):
    @extend_schema(parameters=[s.QueryWorkersIn], responses={200: s.WorkerPageOut},
                   operation_id="query_workers")
    def get(self, request: Request) -> Response:
        return _query_workers(self, self.query(s.QueryWorkersIn))


class SearchWorkersView(StoreView):
    @extend_schema(request=s.QueryWorkersIn, responses={200: s.WorkerPageOut},
                   operation_id="search_workers")
    def post(self, request: Request) -> Response:
        return _query_workers(self, self.body(s.QueryWorkersIn))


class GetWorkerView(StoreView):
    """`null` for a worker this project never saw, as AGL answers (AGL's client expects it)."""

    @extend_schema(responses={200: s.WorkerOut}, operation_id="get_worker")
    def get(self, request: Request, worker_id: str) -> Response:
        try:
            worker = selectors.worker_get(project=self.project, worker_id=worker_id)
        except NotFound:
            worker = None
        return respond(s.WorkerOut, worker)


class UpdateWorkerView(StoreView):
    @extend_schema(request=s.UpdateWorkerIn, responses={200: s.WorkerOut},
                   operation_id="update_worker")
    def post(self, request: Request, worker_id: str) -> Response:
        data = self.body(s.UpdateWorkerIn)
        self.refuse_nulls("heartbeat_stats")
        if len(worker_id) > s.WORKER_ID_MAX:
            raise s.serializers.ValidationError({"worker_id": "too long"})
        worker = services.worker_update(
            project=self.project, worker_id=worker_id, heartbeat_stats=data.get("heartbeat_stats")
        )
        return respond(s.WorkerOut, worker)


class StatisticsView(StoreView):
    @extend_schema(responses={200: dict}, operation_id="get_statistics")
    def get(self, request: Request) -> Response:
        return Response(selectors.statistics(project=self.project))


# --- resources -------------------------------------------------------------------------------


class QueryResourcesView(StoreView):
    @extend_schema(parameters=[s.QueryResourcesIn], responses={200: s.ResourcesPageOut},
                   operation_id="query_resources")
    def get(self, request: Request) -> Response:
        data = self.query(s.QueryResourcesIn)
        return respond(s.ResourcesPageOut, selectors.resources_query(project=self.project, **data))


class AddResourcesView(StoreView):
    post_roles = ALGORITHM_ROLES

    @extend_schema(request=s.ResourcesIn, responses={201: s.ResourcesUpdateOut},
                   operation_id="add_resources")
    def post(self, request: Request) -> Response:
        resources = _resources(request)
        version = services.resources_add(project=self.project, resources=resources)
        return respond(s.ResourcesUpdateOut, version, status=201)


def _resources(request: Request) -> dict[str, Any]:
    field = s.ResourcesIn()
    try:
        return field.run_validation(request.data)
    except s.serializers.ValidationError as exc:
        raise s.serializers.ValidationError({"resources": exc.detail}) from None


class LatestResourcesView(StoreView):
    @extend_schema(responses={200: s.ResourcesUpdateOut}, operation_id="get_latest_resources")
    def get(self, request: Request) -> Response:
        return respond(s.ResourcesUpdateOut, selectors.resources_latest(project=self.project))


class GetResourcesView(StoreView):
    @extend_schema(
        responses={200: s.ResourcesUpdateOut}, operation_id="get_resources_by_id",
        parameters=[OpenApiParameter("version", int, description="Extension: one version.")],
    )
    def get(self, request: Request, resources_id: str) -> Response:
        self.validation_location = "query"
        version = s.serializers.IntegerField(required=False, min_value=1, max_value=2**31 - 1)
        raw = request.query_params.get("version")
        try:
            wanted = version.run_validation(raw) if raw is not None else None
        except s.serializers.ValidationError as exc:
            raise s.serializers.ValidationError({"version": exc.detail}) from None
        row = selectors.resources_get(
            project=self.project, resources_id=resources_id, version=wanted
        )
        return respond(s.ResourcesUpdateOut, row)


class UpdateResourcesView(StoreView):
    post_roles = ALGORITHM_ROLES

    @extend_schema(request=s.ResourcesIn, responses={200: s.ResourcesUpdateOut},
                   operation_id="update_resources")
    def post(self, request: Request, resources_id: str) -> Response:
        resources = _resources(request)
        version = services.resources_update(
            project=self.project, resources_id=resources_id, resources=resources
        )
        return respond(s.ResourcesUpdateOut, version)


class DeleteResourcesView(StoreView):
    """Extension: delete a resources id and its versions (409 while rollouts use it)."""

    delete_roles = ALGORITHM_ROLES

    @extend_schema(responses={204: None}, operation_id="delete_resources")
    def delete(self, request: Request, resources_id: str) -> Response:
        resources_delete(project=self.project, resources_id=resources_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- spans -----------------------------------------------------------------------------------


class AddSpanView(StoreView):
    """AGL's add_span: the stored span, or `null` when it was a duplicate."""

    @extend_schema(request=s.SpanIn, responses={201: s.SpanOut}, operation_id="add_span")
    def post(self, request: Request) -> Response:
        data = request.data
        span = s.SpanField().run_validation({} if data is None else data)
        ingested = services.spans_ingest(project=self.project, spans=[span])
        return respond(s.SpanOut, ingested.rows[0], status=201, cancelled=ingested.cancelled)


def _at_most_spans(request: Request) -> None:
    """413 for a body with more spans than a request may carry, before any is checked."""
    raw = request.data.get("spans") if isinstance(request.data, dict) else None
    if isinstance(raw, list) and len(raw) > limits.MAX_SPANS_PER_REQUEST:
        raise PayloadTooLarge(f"more than {limits.MAX_SPANS_PER_REQUEST} spans")


class AddSpanBatchView(StoreView):
    """Extension: many spans in one batched insert (our client uses it)."""

    @extend_schema(request=s.SpanBatchIn, responses={200: s.SpanBatchOut},
                   operation_id="add_spans_batch")
    def post(self, request: Request) -> Response:
        _at_most_spans(request)
        spans = self.body(s.SpanBatchIn)["spans"]
        ingested = services.spans_ingest(project=self.project, spans=spans)
        rows, cancelled = ingested.rows, ingested.cancelled
        added = sum(1 for row in rows if row is not None)
        result = {"added": added, "duplicates": len(rows) - added,
                  "cancelled_rollout_ids": sorted(cancelled)}
        return respond(s.SpanBatchOut, result, cancelled=cancelled)


def _query_spans(view: StoreView, data: dict[str, Any]) -> Response:
    return respond(s.SpanPageOut, selectors.span_query(project=view.project, **data))


class QuerySpansView(StoreView):
    @extend_schema(parameters=[s.QuerySpansIn], responses={200: s.SpanPageOut},
                   operation_id="query_spans")
    def get(self, request: Request) -> Response:
        return _query_spans(self, self.query(s.QuerySpansIn))


class SearchSpansView(StoreView):
    @extend_schema(request=s.QuerySpansIn, responses={200: s.SpanPageOut},
                   operation_id="search_spans")
    def post(self, request: Request) -> Response:
        return _query_spans(self, self.body(s.QuerySpansIn))


class NextSpanSequenceIdView(StoreView):
    @extend_schema(request=s.NextSequenceIdIn, responses={200: s.NextSequenceIdOut},
                   operation_id="get_next_span_sequence_id")
    def post(self, request: Request) -> Response:
        data = self.body(s.NextSequenceIdIn)
        sequence_id = services.span_next_sequence_id(project=self.project, **data)
        return respond(s.NextSequenceIdOut, {"sequence_id": sequence_id})


# --- projects (extension) --------------------------------------------------------------------


class QuotaView(StoreView):
    """Extension: the key's project's quotas (README "Quotas"); an admin key sets them."""

    patch_roles = ADMIN_ONLY

    @extend_schema(responses={200: s.QuotaOut}, operation_id="get_quota")
    def get(self, request: Request) -> Response:
        return self._answer(self.project)

    @extend_schema(request=s.QuotaIn, responses={200: s.QuotaOut}, operation_id="set_quota")
    def patch(self, request: Request) -> Response:
        return self._answer(services.project_quota_set(project=self.project,
                                                       **self.body(s.QuotaIn)))

    def _answer(self, project: Any) -> Response:
        quota = selectors.gpu_quotas(project_ids=[project.pk]).get(project.pk)
        return respond(s.QuotaOut, {
            "project": project.name, "gpu_seconds_per_day": project.gpu_seconds_per_day,
            "gpu_seconds_used": quota.used if quota else None,
            "reached": bool(quota and quota.reached),
            "next_free": quota.next_free if quota else None,
            "reason": quota.describe() if quota and quota.reached else None})


class ShareView(StoreView):
    """Extension (README "Scheduling"): the key's project's fair share, and why its rollouts
    wait (GET, any role); its weight, cap and a party's weight (POST, its admin)."""

    post_roles = ADMIN_ONLY

    @extend_schema(responses={200: dict}, operation_id="get_share")
    def get(self, request: Request) -> Response:
        return Response(selectors.share_state(project=self.project).as_json())

    @extend_schema(request=s.ShareIn, responses={200: dict}, operation_id="set_share")
    def post(self, request: Request) -> Response:
        serializer = s.ShareIn(data=request.data)  # a body is required (`null` is refused)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        services.share_set(
            project=self.project, weight=data.get("weight"), party=data.get("party"),
            party_weight=data.get("party_weight"),
            max_concurrent_rollouts=data.get("max_concurrent_rollouts", services.UNCHANGED))
        return Response(selectors.share_state(project=self.project).as_json())


class CreateProjectView(StoreView):
    """Extension: a site_admin key creates a project; the answer holds one new key per role
    (runner, algorithm, admin), shown this once."""

    post_roles = SITE_ADMIN_ONLY

    @extend_schema(request=s.ProjectIn, responses={201: s.ProjectOut},
                   operation_id="create_project")
    def post(self, request: Request) -> Response:
        data = self.body(s.ProjectIn)
        project = services.project_create(name=data["name"], description=data["description"])
        keys = {
            role: services.api_key_create(project=project, role=role)[1]
            for role in PROJECT_ROLES
        }
        return respond(s.ProjectOut, {"name": project.name, "keys": keys}, status=201)
