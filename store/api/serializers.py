"""Input and output serializers of the AGL 0.3 wire protocol (see the reference OpenAPI
document). Times go out as epoch seconds (floats). Output serializers declare their fields
for the schema and build plain dicts directly, because they run on every row of a page."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from django.core.validators import validate_slug
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import exceptions, serializers

from store import selectors
from store.api import limits
from store.models import Attempt, ResourceVersion, Rollout, Span, Worker
from store.services.shares import MAX_WEIGHT, MIN_WEIGHT
from store.statemachine import (
    ATTEMPT_FINAL,
    MAX_LIMIT_SECONDS,
    AttemptStatus,
    RolloutMode,
    RolloutStatus,
    WorkerStatus,
)

ID_MAX = 40
WORKER_ID_MAX = 200
ERROR_MAX = 20_000  # the executor sends at most 8000 characters of traceback
SEQUENCE_MAX = 2**31 - 1  # span sequence ids are below it (the next one fits an int column)


def epoch(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def from_epoch(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, tz=UTC) if value is not None else None


MAX_SECONDS = MAX_LIMIT_SECONDS  # the store's rule: beyond it a deadline would not fit


class StrictCharField(serializers.CharField):
    """A string, not a number made into one (AGL's pydantic refuses `0` for a string; the
    schema says string)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)  # AGL keeps strings as sent
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class FiniteFloatField(serializers.FloatField):
    """A float that is a real number (no NaN or infinity, which JSON parsers let through,
    and no `true`/`false`, which Python takes for 1 and 0)."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool):
            self.fail("invalid")
        value = super().to_internal_value(data)
        if math.isnan(value) or math.isinf(value):
            raise serializers.ValidationError("must be a finite number")
        return value


class SecondsField(FiniteFloatField):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("min_value", 0)
        kwargs.setdefault("max_value", MAX_SECONDS)
        super().__init__(**kwargs)


EPOCH_MIN, EPOCH_MAX = -62135596800.0, 253402300799.0  # 0001-01-01 to 9999-12-31 23:59:59


@extend_schema_field({"type": "number", "minimum": EPOCH_MIN, "maximum": EPOCH_MAX})
class EpochField(FiniteFloatField):
    """Epoch seconds on the wire (years 1 to 9999), an aware datetime inside."""

    def to_internal_value(self, data: Any) -> datetime:
        value = super().to_internal_value(data)
        if not EPOCH_MIN <= value <= EPOCH_MAX:
            raise serializers.ValidationError("not a valid epoch time")
        try:
            return datetime.fromtimestamp(value, tz=UTC)
        except (OverflowError, OSError, ValueError):
            raise serializers.ValidationError("not a valid epoch time") from None

    def to_representation(self, value: datetime) -> float:
        return value.timestamp()


class AnyJSONField(serializers.JSONField):
    """Any JSON value, null included."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_null", True)
        super().__init__(**kwargs)


class ObjectField(serializers.DictField):
    """A JSON object of anything (AGL's `metadata`, `heartbeat_stats`)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("child", AnyJSONField())
        super().__init__(**kwargs)


class SpanTooLarge(exceptions.APIException):
    """A size limit inside a span: 400, not a validation error (it is not a field's shape)."""

    status_code = 400
    default_code = "too_large"


# --- inputs ----------------------------------------------------------------------------------


class RolloutConfigIn(serializers.Serializer):
    timeout_seconds = SecondsField(required=False, allow_null=True)
    unresponsive_seconds = SecondsField(required=False, allow_null=True)
    max_attempts = serializers.IntegerField(required=False, min_value=1, max_value=1000)
    retry_condition = serializers.ListField(
        child=serializers.ChoiceField(choices=AttemptStatus.values), required=False
    )

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        value = super().to_internal_value(data)
        # 0 means "not set" for the timeouts, as None does.
        for name in ("timeout_seconds", "unresponsive_seconds"):
            if value.get(name) == 0:
                value[name] = None
        return value


class RolloutFieldsIn(serializers.Serializer):
    """EnqueueRolloutRequest, plus our extensions (priority, idempotency_key,
    queue_timeout_seconds)."""

    input = AnyJSONField()
    mode = serializers.ChoiceField(choices=RolloutMode.values, required=False, allow_null=True)
    resources_id = StrictCharField(
        required=False, allow_null=True, allow_blank=True, max_length=ID_MAX
    )
    config = RolloutConfigIn(required=False, allow_null=True)
    metadata = ObjectField(required=False, allow_null=True)
    priority = serializers.IntegerField(
        required=False, default=0, min_value=-(2**31), max_value=2**31 - 1,
        help_text="Extension: higher is claimed first.",
    )
    idempotency_key = StrictCharField(
        required=False, allow_null=True, max_length=200,
        help_text="Extension: a retried enqueue with the same key returns the same rollout.",
    )
    queue_timeout_seconds = SecondsField(
        required=False, allow_null=True,
        help_text="Extension: fail the rollout if it waits longer in the queue (0: forever).",
    )


class EnqueueManyIn(serializers.Serializer):
    rollouts = RolloutFieldsIn(many=True, max_length=limits.MAX_ROLLOUTS_PER_REQUEST)


class StartRolloutIn(RolloutFieldsIn):
    worker_id = StrictCharField(required=False, allow_null=True, max_length=WORKER_ID_MAX)


class DequeueIn(serializers.Serializer):
    # AGL answers `[]` for a limit of 0 or less.
    limit = serializers.IntegerField(
        required=False, default=1, min_value=-(2**31), max_value=limits.MAX_ROLLOUTS_PER_REQUEST
    )
    worker_id = StrictCharField(required=False, allow_null=True, max_length=WORKER_ID_MAX)
    wait_seconds = SecondsField(
        required=False, default=0.0, max_value=limits.MAX_DEQUEUE_WAIT_SECONDS,
        help_text="Extension: long-poll up to this long while the queue is empty.",
    )


class UpdateRolloutIn(serializers.Serializer):
    input = AnyJSONField(required=False)
    mode = serializers.ChoiceField(choices=RolloutMode.values, required=False, allow_null=True)
    resources_id = StrictCharField(required=False, allow_null=True, max_length=ID_MAX)
    status = serializers.ChoiceField(
        choices=RolloutStatus.values, required=False, allow_null=True
    )
    config = RolloutConfigIn(required=False, allow_null=True)
    metadata = ObjectField(required=False, allow_null=True)


class ClaimRolloutIn(serializers.Serializer):
    worker_id = StrictCharField(required=False, allow_null=True, max_length=WORKER_ID_MAX)


class StartAttemptIn(serializers.Serializer):
    worker_id = StrictCharField(required=False, allow_null=True, max_length=WORKER_ID_MAX)


class UpdateAttemptIn(serializers.Serializer):
    status = serializers.ChoiceField(
        choices=AttemptStatus.values, required=False, allow_null=True
    )
    # "" clears the worker, as in AGL.
    worker_id = StrictCharField(
        required=False, allow_null=True, allow_blank=True, max_length=WORKER_ID_MAX
    )
    last_heartbeat_time = EpochField(required=False, allow_null=True)
    metadata = ObjectField(required=False, allow_null=True)


class UsageIn(serializers.Serializer):
    """What the attempt used, measured by the runner (README "Cost")."""

    cpu_seconds = SecondsField(required=False, default=0.0)
    gpu_seconds = SecondsField(required=False, default=0.0)
    gpu_type = StrictCharField(required=False, default="", allow_blank=True, max_length=100)


class AttemptUpdateItemIn(UpdateAttemptIn):
    rollout_id = StrictCharField(max_length=ID_MAX)
    attempt_id = StrictCharField(max_length=ID_MAX)


class AttemptBatchIn(serializers.Serializer):
    updates = AttemptUpdateItemIn(many=True, max_length=limits.MAX_ROLLOUTS_PER_REQUEST)


class UpdateWorkerIn(serializers.Serializer):
    heartbeat_stats = ObjectField(required=False, allow_null=True)


BIGINT_MAX = 2**63 - 1  # what the database takes as a LIMIT or OFFSET


@extend_schema_field({
    "anyOf": [{"type": "integer", "enum": [-1]},
              {"type": "integer", "minimum": 1, "maximum": BIGINT_MAX}],
    "default": -1, "description": "-1: no limit.",
})
class PageLimitField(serializers.IntegerField):
    """A page's `limit`: -1 or at least 1 (the selector answers AGL's 400 otherwise)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, default=-1, min_value=-(2**31), max_value=BIGINT_MAX,
                         **kwargs)


@extend_schema_field({"type": "integer", "minimum": 0, "maximum": BIGINT_MAX, "default": 0})
class PageOffsetField(serializers.IntegerField):
    """A page's `offset`: at least 0 (the selector answers AGL's 400 otherwise)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, default=0, min_value=-(2**31), max_value=BIGINT_MAX,
                         **kwargs)


def sort_by_field(fields: Any, default: str | None = None) -> serializers.CharField:
    """`sort_by`: one of the object's fields (any other name is AGL's 400, by the selector)."""

    @extend_schema_field({"type": "string", "enum": list(fields), "nullable": True,
                          **({"default": default} if default else {})})
    class SortByField(StrictCharField):
        pass

    extra = {"default": default} if default else {}
    return SortByField(required=False, allow_null=True, max_length=40, **extra)


class _PageIn(serializers.Serializer):
    # Bounds are checked by the selector, with AGL's 400 messages.
    limit = PageLimitField()
    offset = PageOffsetField()
    sort_order = serializers.ChoiceField(choices=["asc", "desc"], required=False, default="asc")


class _FilteredPageIn(_PageIn):
    filter_logic = serializers.ChoiceField(choices=["and", "or"], required=False, default="and")


class QueryRolloutsIn(_FilteredPageIn):
    status_in = serializers.ListField(
        child=serializers.ChoiceField(choices=RolloutStatus.values), required=False,
        allow_null=True,
    )
    rollout_id_in = serializers.ListField(
        child=StrictCharField(max_length=ID_MAX), required=False, allow_null=True,
        max_length=10000,
    )
    rollout_id_contains = StrictCharField(required=False, allow_null=True, max_length=ID_MAX)
    sort_by = sort_by_field(selectors.ROLLOUT_FIELDS)


@extend_schema_field({
    "anyOf": [{"type": "integer", "enum": [-1]},
              {"type": "integer", "minimum": 0, "maximum": BIGINT_MAX}],
    "default": -1, "description": "-1: no limit; 0: no items (the total only), as AGL's store.",
})
class AttemptPageLimitField(PageLimitField):
    """A page of attempts' `limit`: 0 is an empty page (AGL's store suite), not a 400."""


class QueryAttemptsIn(_PageIn):
    limit = AttemptPageLimitField()
    sort_by = sort_by_field(selectors.ATTEMPT_FIELDS, default="sequence_id")


class QueryWorkersIn(_FilteredPageIn):
    status_in = serializers.ListField(
        child=serializers.ChoiceField(choices=WorkerStatus.values), required=False,
        allow_null=True,
    )
    worker_id_contains = StrictCharField(
        required=False, allow_null=True, max_length=WORKER_ID_MAX
    )
    sort_by = sort_by_field(selectors.WORKER_FIELDS)


class QueryResourcesIn(_PageIn):
    resources_id = StrictCharField(required=False, allow_null=True, max_length=ID_MAX)
    resources_id_contains = StrictCharField(
        required=False, allow_null=True, max_length=ID_MAX
    )
    sort_by = sort_by_field(selectors.RESOURCES_FIELDS)


class QuerySpansIn(_FilteredPageIn):
    rollout_id = StrictCharField(max_length=ID_MAX)
    attempt_id = StrictCharField(required=False, allow_null=True, max_length=ID_MAX)
    sort_by = sort_by_field(selectors.SPAN_FIELDS, default="sequence_id")
    trace_id = StrictCharField(required=False, allow_null=True, max_length=64)
    trace_id_contains = StrictCharField(required=False, allow_null=True, max_length=64)
    span_id = StrictCharField(required=False, allow_null=True, max_length=32)
    span_id_contains = StrictCharField(required=False, allow_null=True, max_length=32)
    parent_id = StrictCharField(required=False, allow_null=True, max_length=32)
    parent_id_contains = StrictCharField(required=False, allow_null=True, max_length=32)
    name = StrictCharField(required=False, allow_null=True, max_length=500)
    name_contains = StrictCharField(required=False, allow_null=True, max_length=500)


class NextSequenceIdIn(serializers.Serializer):
    rollout_id = StrictCharField(max_length=ID_MAX)
    attempt_id = StrictCharField(max_length=ID_MAX)


class WaitForRolloutsIn(serializers.Serializer):
    rollout_ids = serializers.ListField(
        child=StrictCharField(max_length=ID_MAX), max_length=10000
    )
    timeout = SecondsField(
        required=False, allow_null=True,
        help_text=f"Seconds to wait on the server; capped at {limits.MAX_WAIT_SECONDS:g}.",
    )


class ResourcesIn(serializers.DictField):
    """`{name: resource}`; each resource an object tagged by `resource_type`."""

    child = ObjectField()

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        value = super().to_internal_value(data)
        for name, resource in value.items():
            if len(name) > 200:
                raise serializers.ValidationError({name: "resource names are at most 200 chars"})
            kind = resource.get("resource_type")
            if kind is not None and not isinstance(kind, str):
                raise serializers.ValidationError({name: "resource_type must be a string"})
        return value


@extend_schema_field(OpenApiTypes.OBJECT)
class SpanField(serializers.Field):
    """One AGL span object, checked cheaply (a batch may hold thousands); the store checks
    the required fields and types."""

    default_error_messages = {"invalid": "a span must be a JSON object"}

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            self.fail("invalid")
        check_span_sizes(data)
        for name, size in (("rollout_id", ID_MAX), ("attempt_id", ID_MAX), ("trace_id", 64),
                           ("span_id", 32), ("parent_id", 32), ("name", 500)):
            value = data.get(name)
            if isinstance(value, str) and len(value) > size:
                raise serializers.ValidationError({name: f"at most {size} characters"})
        seq = data.get("sequence_id")
        # The attempt's next id (seq + 1) must fit the column too.
        if isinstance(seq, int) and not -(2**31) <= seq < SEQUENCE_MAX:
            raise serializers.ValidationError({"sequence_id": "out of range"})
        return data

    def to_representation(self, value: Any) -> Any:
        return value


def check_span_sizes(span: dict[str, Any]) -> None:
    """Refuse (400) a span with too many or too long attributes."""
    attributes = span.get("attributes")
    if not isinstance(attributes, dict):
        return
    if len(attributes) > limits.MAX_ATTRIBUTES_PER_SPAN:
        raise SpanTooLarge(
            {"attributes": f"at most {limits.MAX_ATTRIBUTES_PER_SPAN} attributes per span"}
        )
    for key, value in attributes.items():
        if isinstance(value, str) and len(value) > limits.MAX_ATTRIBUTE_LENGTH:
            raise SpanTooLarge(
                {"attributes": {key: f"longer than {limits.MAX_ATTRIBUTE_LENGTH} characters"}}
            )


class SpanIn(serializers.Serializer):
    """AGL's Span-Input, as our store checks it (`SpanField`, services.spans); other fields
    are kept as they come."""

    rollout_id = StrictCharField(max_length=ID_MAX)
    attempt_id = StrictCharField(max_length=ID_MAX)
    sequence_id = serializers.IntegerField(
        required=False, allow_null=True, min_value=-(2**31), max_value=SEQUENCE_MAX - 1,
        help_text="null or absent: the attempt's next one.",
    )
    trace_id = StrictCharField(max_length=64)
    span_id = StrictCharField(max_length=32)
    parent_id = StrictCharField(allow_null=True, required=False, max_length=32)
    name = StrictCharField(max_length=500)
    status = AnyJSONField(required=False)
    attributes = ObjectField(required=False, allow_null=True)
    events = AnyJSONField(required=False)
    links = AnyJSONField(required=False)
    start_time = FiniteFloatField(allow_null=True, required=False)
    end_time = FiniteFloatField(allow_null=True, required=False)
    context = AnyJSONField(required=False)
    parent = AnyJSONField(required=False)
    resource = ObjectField(required=False, allow_null=True)


# A batch's spans are checked as one span is.
extend_schema_field(SpanIn)(SpanField)


class SpanBatchIn(serializers.Serializer):
    spans = serializers.ListField(
        child=SpanField(), help_text=f"At most {limits.MAX_SPANS_PER_REQUEST} spans (else 413)."
    )


class FinishAttemptIn(serializers.Serializer):
    status = serializers.ChoiceField(choices=sorted(ATTEMPT_FINAL))
    error = StrictCharField(required=False, allow_null=True, trim_whitespace=False,
                                  max_length=ERROR_MAX)
    usage = UsageIn(required=False, allow_null=True)
    spans = serializers.ListField(
        child=SpanField(), required=False, help_text=(
            f"The attempt's last spans, stored before the verdict (as `/spans/batch` stores "
            f"them): a verdict is never stored without them. At most "
            f"{limits.MAX_SPANS_PER_REQUEST} (else 413)."))


class ProjectIn(serializers.Serializer):
    name = StrictCharField(max_length=100, validators=[validate_slug])
    description = StrictCharField(required=False, allow_blank=True, default="")


class QuotaIn(serializers.Serializer):
    """A field left out stays as it is; null removes the cap (README "Quotas")."""

    gpu_seconds_per_day = FiniteFloatField(
        required=False, allow_null=True, min_value=0,
        help_text="cap on the project's ledger GPU-seconds over the last 24 h; null: no cap")


class ShareIn(serializers.Serializer):
    """Extension (README "Scheduling"): what to set; an omitted field is left as it is."""

    weight = serializers.FloatField(required=False, min_value=MIN_WEIGHT, max_value=MAX_WEIGHT,
                                    help_text="the project's weight")
    max_concurrent_rollouts = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2**31 - 1,
        help_text="cap on claimed, unfinished rollouts; null lifts it")
    party = StrictCharField(required=False, allow_blank=True, max_length=200,
                            help_text="a party of the project (a job's: trainer/job/<id>)")
    party_weight = serializers.FloatField(required=False, min_value=MIN_WEIGHT,
                                          max_value=MAX_WEIGHT, help_text="the party's weight")


# --- outputs ---------------------------------------------------------------------------------


class RolloutConfigOut(serializers.Serializer):
    timeout_seconds = serializers.FloatField(allow_null=True)
    unresponsive_seconds = serializers.FloatField(allow_null=True)
    max_attempts = serializers.IntegerField()
    retry_condition = serializers.ListField(child=serializers.CharField())


class AttemptOut(serializers.Serializer):
    rollout_id = serializers.CharField()
    attempt_id = serializers.CharField()
    sequence_id = serializers.IntegerField()
    start_time = serializers.FloatField()
    end_time = serializers.FloatField(allow_null=True)
    status = serializers.ChoiceField(choices=AttemptStatus.values)
    worker_id = serializers.CharField(allow_null=True)
    last_heartbeat_time = serializers.FloatField(allow_null=True)
    metadata = ObjectField(allow_null=True)

    def to_representation(self, a: Attempt) -> dict[str, Any]:
        return {
            "rollout_id": a.rollout_id,
            "attempt_id": a.attempt_id,
            "sequence_id": a.sequence_id,
            "start_time": epoch(a.start_time),
            "end_time": epoch(a.end_time),
            "status": a.status,
            "worker_id": a.worker_id,
            "last_heartbeat_time": epoch(a.last_heartbeat_time),
            "metadata": a.metadata or {},
        }


class RolloutOut(serializers.Serializer):
    rollout_id = serializers.CharField()
    input = AnyJSONField()
    start_time = serializers.FloatField()
    end_time = serializers.FloatField(allow_null=True)
    mode = serializers.CharField(allow_null=True)
    resources_id = serializers.CharField(allow_null=True)
    status = serializers.ChoiceField(choices=RolloutStatus.values)
    config = RolloutConfigOut()
    metadata = ObjectField(allow_null=True)
    resources_version = serializers.IntegerField(
        allow_null=True, help_text="Extension: the version of resources_id pinned at enqueue."
    )

    def to_representation(self, r: Rollout) -> dict[str, Any]:
        return {
            "rollout_id": r.pk,
            "input": r.input,
            "start_time": epoch(r.start_time),
            "end_time": epoch(r.end_time),
            "mode": r.mode,
            "resources_id": r.resources_id,
            "status": r.status,
            "config": r.config,
            "metadata": r.metadata or {},
            "resources_version": r.resources_version,
        }


class AttemptedRolloutOut(RolloutOut):
    attempt = AttemptOut()

    def to_representation(self, r: Rollout) -> dict[str, Any]:
        data = super().to_representation(r)
        data["attempt"] = AttemptOut().to_representation(r.latest_attempt)
        return data


class RolloutOrAttemptedOut(AttemptedRolloutOut):
    """A rollout with its latest attempt under `attempt` when it has one (AGL's
    Union[AttemptedRollout, Rollout])."""

    attempt = AttemptOut(required=False)

    def to_representation(self, r: Rollout) -> dict[str, Any]:
        if r.latest_attempt_id is None:
            return RolloutOut.to_representation(self, r)
        return super().to_representation(r)


def attempted(rollout: Rollout, attempt: Attempt) -> Rollout:
    rollout.latest_attempt = attempt
    return rollout


class ResourcesUpdateOut(serializers.Serializer):
    resources_id = serializers.CharField()
    create_time = serializers.FloatField()
    update_time = serializers.FloatField()
    version = serializers.IntegerField()
    resources = serializers.DictField(child=ObjectField())

    def to_representation(self, v: ResourceVersion) -> dict[str, Any]:
        return {
            "resources_id": v.resource_set.resources_id,
            "create_time": epoch(v.resource_set.create_time),
            "update_time": epoch(v.created_at),
            "version": v.version,
            "resources": v.resources,
        }


class SpanOut(SpanIn):
    def to_representation(self, s: Span) -> dict[str, Any]:
        data = dict(s.extra or {})
        data.update({
            "rollout_id": s.rollout_id,
            "attempt_id": s.attempt.attempt_id,
            "sequence_id": s.sequence_id,
            "trace_id": s.trace_id,
            "span_id": s.span_id,
            "parent_id": s.parent_id,
            "name": s.name,
            "status": s.status,
            "attributes": s.attributes,
            "events": s.events,
            "links": s.links,
            "start_time": s.start_time,
            "end_time": s.end_time,
            "context": s.context,
            "parent": s.parent,
            "resource": s.resource,
        })
        return data


class WorkerOut(serializers.Serializer):
    worker_id = serializers.CharField()
    status = serializers.ChoiceField(choices=WorkerStatus.values)
    heartbeat_stats = ObjectField(allow_null=True)
    last_heartbeat_time = serializers.FloatField(allow_null=True)
    last_dequeue_time = serializers.FloatField(allow_null=True)
    last_busy_time = serializers.FloatField(allow_null=True)
    last_idle_time = serializers.FloatField(allow_null=True)
    current_rollout_id = serializers.CharField(allow_null=True)
    current_attempt_id = serializers.CharField(allow_null=True)

    def to_representation(self, w: Worker) -> dict[str, Any]:
        return {
            "worker_id": w.worker_id,
            "status": w.status,
            "heartbeat_stats": w.heartbeat_stats,
            "last_heartbeat_time": epoch(w.last_heartbeat_time),
            "last_dequeue_time": epoch(w.last_dequeue_time),
            "last_busy_time": epoch(w.last_busy_time),
            "last_idle_time": epoch(w.last_idle_time),
            "current_rollout_id": w.current_rollout_id,
            "current_attempt_id": w.current_attempt_id,
        }


def page_serializer(item: type[serializers.Serializer], name: str) -> type[serializers.Serializer]:
    """PaginatedResult[item]: {items, limit, offset, total}."""

    class PageOut(serializers.Serializer):
        items = item(many=True)
        limit = serializers.IntegerField()
        offset = serializers.IntegerField()
        total = serializers.IntegerField()

    PageOut.__name__ = PageOut.__qualname__ = name
    return PageOut


RolloutPageOut = page_serializer(RolloutOrAttemptedOut, "RolloutPageOut")
AttemptPageOut = page_serializer(AttemptOut, "AttemptPageOut")
WorkerPageOut = page_serializer(WorkerOut, "WorkerPageOut")
ResourcesPageOut = page_serializer(ResourcesUpdateOut, "ResourcesPageOut")
SpanPageOut = page_serializer(SpanOut, "SpanPageOut")


class NextSequenceIdOut(serializers.Serializer):
    sequence_id = serializers.IntegerField()


class SpanBatchOut(serializers.Serializer):
    added = serializers.IntegerField()
    duplicates = serializers.IntegerField()
    cancelled_rollout_ids = serializers.ListField(child=serializers.CharField())


class AttemptBatchOut(serializers.Serializer):
    attempts = AttemptOut(many=True)
    cancelled_rollout_ids = serializers.ListField(child=serializers.CharField())


class ProjectOut(serializers.Serializer):
    name = serializers.CharField()
    keys = serializers.DictField(
        child=serializers.CharField(), help_text="role -> raw key; shown once, never again"
    )


class QuotaOut(serializers.Serializer):
    project = serializers.CharField()
    gpu_seconds_per_day = serializers.FloatField(allow_null=True)
    gpu_seconds_used = serializers.FloatField(
        allow_null=True, help_text="the ledger's GPU-seconds over the last 24 h (with a cap)")
    reached = serializers.BooleanField(help_text="the project's training steps wait")
    next_free = EpochField(allow_null=True, help_text="when enough usage ages out (reached)")
    reason = serializers.CharField(allow_null=True, help_text="as train_show words it")
