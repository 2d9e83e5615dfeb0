"""The OTLP lean path (store/api/fastpath.py) answers exactly what Django's path answers, and
leaves everything but the well-formed common case to Django (None), having stored nothing."""

from __future__ import annotations

import gzip
import os

import pytest
from django.test import Client
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from store import services
from store.api import fastpath
from store.models import Span
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)
PROTOBUF = "application/x-protobuf"


def _export(rollout_id: str, attempt_id: str, name: str = "step") -> bytes:
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add()
    spans.resource.attributes.extend([
        KeyValue(key="agentlightning.rollout_id", value=AnyValue(string_value=rollout_id)),
        KeyValue(key="agentlightning.attempt_id", value=AnyValue(string_value=attempt_id)),
    ])
    span = spans.scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = os.urandom(16), os.urandom(8), name
    span.start_time_unix_nano, span.end_time_unix_nano = 1_000_000_000, 2_000_000_000
    return request.SerializeToString()


@pytest.fixture
def setup(project):
    enqueue(project, 2)
    first, first_attempt = claim(project)
    second, second_attempt = claim(project)
    key = services.api_key_create(project=project, role="runner")[1]
    return key, (first.pk, first_attempt.attempt_id), (second.pk, second_attempt.attempt_id)


def _headers(key: str | None, **extra: str) -> dict[bytes, bytes]:
    headers = {b"content-type": PROTOBUF.encode(), b"host": b"127.0.0.1"}
    if key:
        headers[b"authorization"] = f"Bearer {key}".encode()
    headers.update({k.encode(): v.encode() for k, v in extra.items()})
    return headers


def _django(key: str, body: bytes):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="127.0.0.1")
    return client.post("/v1/traces", data=body, content_type=PROTOBUF)


def _comparable(status: int, headers, body: bytes) -> tuple:
    return status, {k.lower(): v for k, v in headers if k.lower() != "content-length"}, body


def test_the_lean_path_answers_what_django_answers(setup):
    key, (rid, aid), (other_rid, other_aid) = setup
    services.rollout_update(project=services.api_key_authenticate(raw=key).project,
                            rollout_id=other_rid, status="cancelled")
    for make in (lambda n: _export(rid, aid, n),                 # stored
                 lambda n: _export("ro-nope", "at-nope", n),     # partial success: unknown
                 lambda n: _export(other_rid, other_aid, n)):    # X-Cancelled-Rollouts
        fast = fastpath.otlp_traces(_headers(key), make("fast"))
        assert fast is not None
        status, headers, body = fast
        slow = _django(key, make("django"))
        assert _comparable(status, [(k.decode(), v.decode()) for k, v in headers], body) == \
            _comparable(slow.status_code, slow.headers.items(), slow.content)
    assert Span.objects.filter(rollout_id=rid).count() == 2


def test_anything_but_the_common_case_is_left_to_django(setup, settings):
    key, (rid, aid), _ = setup
    body = _export(rid, aid)
    for headers, payload in [
        (_headers(None), body),                                        # no key: 401
        (_headers("agl_" + "x" * 40), body),                           # unknown key: 401
        ({**_headers(key), b"authorization": b"Token x"}, body),       # bad scheme: 401
        (_headers(key, **{"content-type": "application/json"}), b"{}"),  # OTLP JSON
        (_headers(key, **{"content-encoding": "gzip"}), gzip.compress(body)),
        (_headers(key), b"\xff\x00garbage"),                           # not protobuf: 400
        (_headers(key), b""),                                          # empty
        (_headers(key, host="evil.example"), body),                    # Host not allowed: 400
    ]:
        assert fastpath.otlp_traces(headers, payload) is None, headers
    assert Span.objects.count() == 0
    settings.SECURE_SSL_REDIRECT = True  # Django's answer would depend on the scheme
    assert not fastpath.enabled()
