"""OTLP/HTTP span ingest (/v1/traces) and the accepted-and-dropped signals, over real HTTP."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from store.models import Span

PB = {"Content-Type": "application/x-protobuf"}


def _kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def export_request(spans: list[dict], resource: dict | None = None) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(_kv(k, v) for k, v in (resource or {}).items())
    scope = resource_spans.scope_spans.add()
    for index, span in enumerate(spans):
        proto = scope.spans.add()
        proto.trace_id = bytes.fromhex("ab" * 16)
        proto.span_id = bytes.fromhex(f"{index + 1:016x}")
        if index:
            proto.parent_span_id = bytes.fromhex(f"{1:016x}")
        proto.name = span.get("name", f"span-{index}")
        proto.start_time_unix_nano = 1_700_000_000_000_000_000 + index
        proto.end_time_unix_nano = 1_700_000_001_000_000_000 + index
        proto.status.code = Status.STATUS_CODE_OK
        proto.attributes.extend(_kv(k, v) for k, v in span.get("attributes", {}).items())
        event = proto.events.add()
        event.name = "evt"
        event.time_unix_nano = 1_700_000_000_500_000_000
    return request


@pytest.fixture
def attempt(algo, runner) -> tuple[str, str]:
    rid = algo.post("/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]}).json()[0][
        "rollout_id"]
    aid = runner.post("/queues/rollouts/dequeue", json={}).json()[0]["attempt"]["attempt_id"]
    return rid, aid


@pytest.fixture
def otlp(api_server, keys) -> httpx.Client:
    with httpx.Client(base_url=api_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {keys.runner}"}) as client:
        yield client


def _spans(algo: httpx.Client, rid: str) -> list[dict]:
    return algo.get("/spans", params={"rollout_id": rid}).json()["items"]


def test_protobuf_export_with_resource_ids_stores_spans_and_heartbeats(otlp, algo, attempt):
    rid, aid = attempt
    ids = {"agentlightning.rollout_id": rid, "agentlightning.attempt_id": aid}
    body = export_request([
        {"name": "agentlightning.annotation",
         "attributes": {"agentlightning.reward.0.name": "primary",
                        "agentlightning.reward.0.value": 0.75}},
        {"attributes": {"n": 3, "ok": True}},
    ], resource=ids).SerializeToString()
    response = otlp.post("/v1/traces", content=body, headers=PB)
    assert response.status_code == 200
    ExportTraceServiceResponse.FromString(response.content)
    spans = _spans(algo, rid)
    assert [s["sequence_id"] for s in spans] == [1, 2]
    reward = spans[0]
    assert reward["name"] == "agentlightning.annotation"
    assert reward["attributes"]["agentlightning.reward.0.value"] == 0.75
    assert reward["trace_id"] == "ab" * 16 and reward["span_id"] == f"{1:016x}"
    assert reward["start_time"] == pytest.approx(1.7e9)
    assert reward["status"]["status_code"] == "OK"
    assert reward["resource"]["attributes"]["agentlightning.rollout_id"] == rid
    assert spans[1]["parent_id"] == f"{1:016x}" and spans[1]["attributes"]["n"] == 3
    assert spans[1]["events"][0]["name"] == "evt"
    assert algo.get(f"/rollouts/{rid}").json()["status"] == "running"


def test_span_attributes_override_resource_ones_and_carry_the_sequence(otlp, algo, attempt):
    rid, aid = attempt
    body = export_request(
        [{"attributes": {"agentlightning.rollout_id": rid, "agentlightning.attempt_id": aid,
                         "agentlightning.span_sequence_id": "7"}}],
        resource={"agentlightning.rollout_id": "ro-elsewhere"},
    ).SerializeToString()
    assert otlp.post("/v1/traces", content=body, headers=PB).status_code == 200
    assert [s["sequence_id"] for s in _spans(algo, rid)] == [7]


def test_gzipped_protobuf_is_accepted(otlp, algo, attempt):
    rid, aid = attempt
    body = export_request([{}], resource={"agentlightning.rollout_id": rid,
                                          "agentlightning.attempt_id": aid})
    response = otlp.post("/v1/traces", content=gzip.compress(body.SerializeToString()),
                         headers={**PB, "Content-Encoding": "gzip"})
    assert response.status_code == 200
    assert len(_spans(algo, rid)) == 1


def test_otlp_json_with_hex_ids_is_accepted(otlp, algo, attempt):
    rid, aid = attempt
    message = export_request([{}], resource={"agentlightning.rollout_id": rid,
                                             "agentlightning.attempt_id": aid})
    data = json_format.MessageToDict(message)
    span = data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"], span["spanId"] = "cd" * 16, "ef" * 8  # OTLP JSON: hex, not base64
    response = otlp.post("/v1/traces", content=json.dumps(data),
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    stored = _spans(algo, rid)[0]
    assert (stored["trace_id"], stored["span_id"]) == ("cd" * 16, "ef" * 8)


def test_spans_without_ids_are_reported_as_rejected(otlp, algo, attempt):
    response = otlp.post("/v1/traces", content=export_request([{}]).SerializeToString(),
                         headers=PB)
    assert response.status_code == 200
    reply = ExportTraceServiceResponse.FromString(response.content)
    assert reply.partial_success.rejected_spans == 1


def test_a_duplicate_export_stores_nothing_twice(otlp, algo, attempt):
    rid, aid = attempt
    body = export_request([{}, {}], resource={"agentlightning.rollout_id": rid,
                                              "agentlightning.attempt_id": aid,
                                              "agentlightning.span_sequence_id": 1})
    for _ in range(2):
        assert otlp.post("/v1/traces", content=body.SerializeToString(),
                         headers=PB).status_code == 200
    assert len(_spans(algo, rid)) == 2


def test_cancelled_rollouts_are_named_in_the_export_response(otlp, algo, attempt):
    rid, aid = attempt
    algo.post(f"/rollouts/{rid}", json={"status": "cancelled"})
    body = export_request([{}], resource={"agentlightning.rollout_id": rid,
                                          "agentlightning.attempt_id": aid})
    response = otlp.post("/v1/traces", content=body.SerializeToString(), headers=PB)
    assert response.headers["X-Cancelled-Rollouts"] == rid


@pytest.mark.parametrize("body,headers", [
    (b"\x0a\xff\xff\xff\xff\x0f garbage", PB),
    (b"not gzip at all", {**PB, "Content-Encoding": "gzip"}),
    (b"{not json", {"Content-Type": "application/json"}),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
     {"Content-Type": "application/json"}),
])
def test_malformed_otlp_is_400(otlp, body: bytes, headers: dict):
    response = otlp.post("/v1/traces", content=body, headers=headers)
    assert response.status_code == 400
    assert "Traceback" not in response.text


def test_spans_of_unknown_attempts_are_rejected_alone_and_other_projects_cannot_post(
    api_server, keys, attempt, otlp
):
    """One unknown attempt id made a whole export 404 (an exporter then drops the batch)."""
    rid, aid = attempt
    body = export_request([{}], resource={"agentlightning.rollout_id": rid,
                                          "agentlightning.attempt_id": aid})
    response = httpx.post(api_server.url + "/v1/traces", content=body.SerializeToString(),
                          headers={**PB, "Authorization": f"Bearer {keys.other}"})
    reply = ExportTraceServiceResponse.FromString(response.content)
    assert response.status_code == 200 and reply.partial_success.rejected_spans == 1
    assert Span.objects.count() == 0
    mixed = export_request([{"attributes": {"agentlightning.attempt_id": "at-nope"}}, {}],
                           resource={"agentlightning.rollout_id": rid,
                                     "agentlightning.attempt_id": aid})
    response = otlp.post("/v1/traces", content=mixed.SerializeToString(), headers=PB)
    reply = ExportTraceServiceResponse.FromString(response.content)
    assert response.status_code == 200 and reply.partial_success.rejected_spans == 1
    assert "unknown attempt" in reply.partial_success.error_message
    assert Span.objects.count() == 1
    assert httpx.post(api_server.url + "/v1/traces", content=body.SerializeToString(),
                      headers=PB).status_code == 401


def test_a_gzip_bomb_is_413(otlp):
    bomb = gzip.compress(b"\0" * (20 * 1024 * 1024))
    response = otlp.post("/v1/traces", content=bomb, headers={**PB, "Content-Encoding": "gzip"})
    assert response.status_code == 413


def test_wrong_content_type_is_415(otlp):
    assert otlp.post("/v1/traces", content=b"x",
                     headers={"Content-Type": "text/plain"}).status_code == 415


@pytest.mark.parametrize("path", ["/v1/metrics", "/v1/logs", "/v1/development/profiles"])
def test_other_signals_are_accepted_and_dropped(otlp, path: str):
    assert otlp.post(path, content=b"", headers=PB).status_code == 200
    assert otlp.post(path, content=b"{}",
                     headers={"Content-Type": "application/json"}).status_code == 200
