"""Size limits of the API. A request over a limit is refused (413 or 400) before the store
sees it, so a bad client cannot make the server fall over."""

from __future__ import annotations

from django.conf import settings

# Bytes of a request body (JSON or OTLP, after gzip decompression for OTLP).
MAX_BODY_BYTES: int = getattr(settings, "STORE_API_MAX_BODY_BYTES", 8 * 1024 * 1024)
# Spans in one request (OTLP export or our batch endpoint).
MAX_SPANS_PER_REQUEST: int = getattr(settings, "STORE_API_MAX_SPANS_PER_REQUEST", 5000)
# Characters of one span attribute value (a string, or the JSON of a list).
MAX_ATTRIBUTE_LENGTH: int = getattr(settings, "STORE_API_MAX_ATTRIBUTE_LENGTH", 256 * 1024)
# Attributes of one span.
MAX_ATTRIBUTES_PER_SPAN: int = 1000
# OTLP: a request's `resource` is stored with each of its spans. The copies beyond the first
# may add at most this many times the request's own size, plus RESOURCE_COPY_ALLOWANCE bytes
# (an exporter's batch of up to 512 spans, however small, sharing a resource of 500 bytes), so
# what a request stores stays a small multiple of what it sent.
RESOURCE_COPY_FACTOR: int = 4
RESOURCE_COPY_ALLOWANCE: int = 256 * 1024
# Rollouts enqueued or dequeued by one request.
MAX_ROLLOUTS_PER_REQUEST: int = 1000
# Server-side waits: wait_for_rollouts up to a minute, a dequeue long-poll briefly.
MAX_WAIT_SECONDS: float = 60.0
MAX_DEQUEUE_WAIT_SECONDS: float = 20.0
