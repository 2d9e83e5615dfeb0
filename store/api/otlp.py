"""OTLP/HTTP ingest: `POST /v1/traces` (protobuf or JSON, gzip or not) becomes AGL spans,
attributed by the `agentlightning.rollout_id` / `attempt_id` / `span_sequence_id` resource
or span attributes (span attributes win), as AGL 0.3's server does, and stored in one
batched insert per request. `/v1/metrics`, `/v1/logs` and `/v1/development/profiles` are
accepted and dropped (AGL 0.3 answers 501 there; an exporter would log errors forever).
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import orjson
from django.http import HttpResponse, JsonResponse
from drf_spectacular.utils import OpenApiTypes, extend_schema
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from rest_framework.parsers import BaseParser
from rest_framework.request import Request

from store import services
from store.api import limits
from store.api.base import CANCELLED_HEADER, StoreView
from store.api.errors import PayloadTooLarge, UnsupportedMediaType
from store.api.serializers import check_span_sizes
from store.models import Project
from store.services._rows import LiveKey

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
ROLLOUT_ID = "agentlightning.rollout_id"
ATTEMPT_ID = "agentlightning.attempt_id"
SEQUENCE_ID = "agentlightning.span_sequence_id"
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


class OtlpError(ValueError):
    """The body is not a valid OTLP message."""


def read_body(request: Request) -> bytes:
    """The raw body, gunzipped, within the size limit (a gzip bomb stops at the limit)."""
    raw = request.stream.read(limits.MAX_BODY_BYTES + 1) if request.stream else b""
    if len(raw) > limits.MAX_BODY_BYTES:
        raise PayloadTooLarge(f"request body over {limits.MAX_BODY_BYTES} bytes")
    if request.headers.get("Content-Encoding", "").lower() != "gzip":
        return raw
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        body = inflater.decompress(raw, limits.MAX_BODY_BYTES + 1)
    except zlib.error as exc:
        raise OtlpError(f"bad gzip body: {exc}") from None
    if len(body) > limits.MAX_BODY_BYTES or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed body over {limits.MAX_BODY_BYTES} bytes")
    return body


def media_type(request: Request) -> str:
    kind = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if kind not in (PROTOBUF, JSON):
        raise UnsupportedMediaType(f"Content-Type must be {PROTOBUF} or {JSON}")
    return kind


_HEX_ID_KEYS = {"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"}


def _hex_ids_to_base64(node: Any) -> Any:
    """OTLP JSON writes trace and span ids as hex; protobuf's JSON mapping wants base64."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key in _HEX_ID_KEYS and isinstance(value, str):
                try:
                    value = base64.b64encode(bytes.fromhex(value)).decode()
                except ValueError:
                    raise OtlpError(f"{key} must be hex") from None
            out[key] = _hex_ids_to_base64(value)
        return out
    if isinstance(node, list):
        return [_hex_ids_to_base64(item) for item in node]
    return node


def parse(message: Message, body: bytes, kind: str) -> Message:
    if not body:
        return message
    try:
        if kind == PROTOBUF:
            message.ParseFromString(body)
        else:
            json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), message)
    except (DecodeError, json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise OtlpError(f"unable to parse the OTLP payload: {str(exc)[:200]}") from None
    return message


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return int(value.int_value)
    if kind == "double_value":
        return float(value.double_value)
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _seconds(nanos: int) -> float | None:
    if not nanos:
        return None
    return nanos / 1e9 if nanos > 1e12 else float(nanos)


def _trace_hex(raw: bytes) -> str:
    return raw.hex().rjust(32, "0") if raw else "0" * 32


def _span_hex(raw: bytes) -> str:
    return raw.hex().rjust(16, "0") if raw else "0" * 16


def _context(trace_id: str, span_id: str) -> dict[str, Any]:
    return {"trace_id": trace_id, "span_id": span_id, "is_remote": False, "trace_state": {}}


def _sequence(raw: Any) -> int | None:
    try:
        value = int(str(raw))
    except (TypeError, ValueError):
        return None
    return value if 0 <= value < 2**31 - 1 else None  # the next id must fit the column too


def spans_from_request(request: ExportTraceServiceRequest) -> tuple[list[dict[str, Any]], int]:
    """AGL span dicts (sequence_id None where the sender gave none) and how many spans were
    rejected for lacking a rollout or attempt id."""
    spans: list[dict[str, Any]] = []
    rejected = 0
    for resource_spans in request.resource_spans:
        resource_attrs = _attributes(resource_spans.resource.attributes)
        resource = {"attributes": resource_attrs, "schema_url": resource_spans.schema_url or ""}
        for scope_spans in resource_spans.scope_spans:
            for proto in scope_spans.spans:
                attrs = _attributes(proto.attributes)
                rollout_id = attrs.get(ROLLOUT_ID, resource_attrs.get(ROLLOUT_ID))
                attempt_id = attrs.get(ATTEMPT_ID, resource_attrs.get(ATTEMPT_ID))
                if rollout_id is None or attempt_id is None:
                    rejected += 1
                    continue
                spans.append(_span(proto, attrs, resource, str(rollout_id), str(attempt_id),
                                   _sequence(attrs.get(SEQUENCE_ID,
                                                       resource_attrs.get(SEQUENCE_ID)))))
    return spans, rejected


def _span(proto: Any, attrs: dict[str, Any], resource: dict[str, Any], rollout_id: str,
          attempt_id: str, sequence_id: int | None) -> dict[str, Any]:
    trace_id, span_id = _trace_hex(proto.trace_id), _span_hex(proto.span_id)
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "sequence_id": sequence_id,
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_id": _span_hex(proto.parent_span_id) if proto.parent_span_id else None,
        "name": proto.name,
        "status": {"status_code": _STATUS.get(proto.status.code, "UNSET"),
                   "description": proto.status.message or None},
        "attributes": attrs,
        "events": [
            {"name": e.name, "attributes": _attributes(e.attributes),
             "timestamp": _seconds(e.time_unix_nano)}
            for e in proto.events
        ],
        "links": [
            {"context": _context(_trace_hex(link.trace_id), _span_hex(link.span_id)),
             "attributes": _attributes(link.attributes) or None}
            for link in proto.links
        ],
        "start_time": _seconds(proto.start_time_unix_nano),
        "end_time": _seconds(proto.end_time_unix_nano),
        "context": _context(trace_id, span_id),
        "parent": None,
        "resource": resource,
    }


def resource_copy_bytes(request: ExportTraceServiceRequest) -> int:
    """Bytes the request's resources add by being stored with every span after the first
    (the JSON of each resource times its spans less one)."""
    extra = 0
    for resource_spans in request.resource_spans:
        count = sum(len(scope.spans) for scope in resource_spans.scope_spans)
        if count > 1 and resource_spans.resource.attributes:
            resource = {"attributes": _attributes(resource_spans.resource.attributes),
                        "schema_url": resource_spans.schema_url or ""}
            extra += len(orjson.dumps(resource, option=orjson.OPT_NON_STR_KEYS)) * (count - 1)
    return extra


def check_resource_copies(request: ExportTraceServiceRequest, body_bytes: int) -> None:
    """413 when the copies of the resources would store more than limits allow for a
    request of this size (README "Errors and limits")."""
    extra = resource_copy_bytes(request)
    allowed = limits.RESOURCE_COPY_FACTOR * body_bytes + limits.RESOURCE_COPY_ALLOWANCE
    if extra > allowed:
        raise PayloadTooLarge(
            f"the resource is stored with every span: its copies would add {extra} bytes, "
            f"more than {allowed} for a request of {body_bytes} bytes; send fewer spans per "
            "request or a smaller resource"
        )


def otlp_response(message: Message, kind: str, status: int = 200) -> HttpResponse:
    if kind == PROTOBUF:
        return HttpResponse(message.SerializeToString(), status=status, content_type=PROTOBUF)
    return HttpResponse(json_format.MessageToJson(message), status=status, content_type=JSON)


class RawParser(BaseParser):
    """Leaves the body to the view (protobuf, maybe gzipped)."""

    media_type = "*/*"

    def parse(self, stream: Any, media_type: str | None = None,
              parser_context: dict | None = None) -> None:
        return None


class OtlpView(StoreView):
    parser_classes = [RawParser]
    request_message: type[Message]
    response_message: type[Message]

    def export(self, request: Request) -> HttpResponse:
        kind = media_type(request)
        try:
            body = read_body(request)
            message = parse(self.request_message(), body, kind)
        except OtlpError as exc:
            return JsonResponse({"detail": str(exc)}, status=400)
        self.check(message, len(body))
        return self.handle(message, kind)

    def check(self, message: Message, body_bytes: int) -> None:
        """Limits that depend on the whole message (before anything is stored)."""

    def handle(self, message: Message, kind: str) -> HttpResponse:
        return otlp_response(self.response_message(), kind)


@extend_schema(request={PROTOBUF: OpenApiTypes.BINARY, JSON: OpenApiTypes.OBJECT},
               responses={200: OpenApiTypes.OBJECT})
class OtlpTracesView(OtlpView):
    """Spans over OTLP/HTTP. `X-Cancelled-Rollouts` names cancelled rollouts among them."""

    request_message = ExportTraceServiceRequest
    response_message = ExportTraceServiceResponse

    @extend_schema(operation_id="otlp_traces")
    def post(self, request: Request) -> HttpResponse:
        return self.export(request)

    def check(self, message: Message, body_bytes: int) -> None:
        check_resource_copies(message, body_bytes)

    def handle(self, message: Message, kind: str) -> HttpResponse:
        reply, cancelled = export_spans(self.project, message)
        response = otlp_response(reply, kind)
        if cancelled:
            response[CANCELLED_HEADER] = ",".join(sorted(cancelled))
        return response


def export_spans(project: Project, message: ExportTraceServiceRequest,
                 live_key: LiveKey | None = None) -> tuple[ExportTraceServiceResponse, set[str]]:
    """Stores a parsed export's spans: the reply, and the ids of cancelled rollouts among
    them. Also the ASGI front's lean path (store/api/fastpath.py), with `live_key`: its
    key (pk, role) when the key came from its cache (`spans_export`)."""
    spans, rejected = spans_from_request(message)
    if len(spans) > limits.MAX_SPANS_PER_REQUEST:
        raise PayloadTooLarge(f"more than {limits.MAX_SPANS_PER_REQUEST} spans")
    for span in spans:
        check_span_sizes(span)
    # A span naming an attempt this project does not have is rejected alone (an exporter
    # drops a whole batch answered 404). Spans without agentlightning.span_sequence_id get
    # their attempt's next ids. One (asynchronous) commit; one statement in the common case.
    exported = services.spans_export(project=project, spans=spans, live_key=live_key)
    unknown, cancelled = exported.unknown, exported.cancelled
    reply = ExportTraceServiceResponse()
    if rejected or unknown:
        reply.partial_success.rejected_spans = rejected + unknown
        reply.partial_success.error_message = "; ".join(
            text for count, text in [
                (rejected, f"{rejected} spans lack {ROLLOUT_ID} or {ATTEMPT_ID}"),
                (unknown, f"{unknown} spans name an unknown attempt"),
            ] if count
        )
    return reply, cancelled


@extend_schema(request={PROTOBUF: OpenApiTypes.BINARY, JSON: OpenApiTypes.OBJECT},
               responses={200: OpenApiTypes.OBJECT})
class OtlpMetricsView(OtlpView):
    """Accepted and dropped."""

    request_message = ExportMetricsServiceRequest
    response_message = ExportMetricsServiceResponse

    @extend_schema(operation_id="otlp_metrics")
    def post(self, request: Request) -> HttpResponse:
        return self.export(request)


@extend_schema(request={PROTOBUF: OpenApiTypes.BINARY, JSON: OpenApiTypes.OBJECT},
               responses={200: OpenApiTypes.OBJECT})
class OtlpLogsView(OtlpView):
    """Accepted and dropped."""

    request_message = ExportLogsServiceRequest
    response_message = ExportLogsServiceResponse

    @extend_schema(operation_id="otlp_logs")
    def post(self, request: Request) -> HttpResponse:
        return self.export(request)


@extend_schema(request={PROTOBUF: OpenApiTypes.BINARY, JSON: OpenApiTypes.OBJECT},
               responses={200: OpenApiTypes.OBJECT})
class OtlpProfilesView(OtlpView):
    """Accepted and dropped, without parsing (the profiles signal is still in development)."""

    @extend_schema(operation_id="otlp_profiles")
    def post(self, request: Request) -> HttpResponse:
        kind = media_type(request)
        read_body(request)
        return HttpResponse(b"" if kind == PROTOBUF else b"{}", content_type=kind)
