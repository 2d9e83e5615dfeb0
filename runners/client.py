"""Our HTTP client of the store API (/v1/agl/, AGL 0.3's wire protocol plus our extensions).

- Bearer key authentication.
- Retries with exponential backoff (core/retry.py's policy, shared with the in-process
  gateway) on network errors and on 5xx/408/429 answers, waiting at least the server's
  `Retry-After` (a 503 while its database is down); a 4xx is the caller's mistake and raises
  `ApiError` at once, with the status and the server's detail.
- Requests that are not safe to repeat blindly (a dequeue: a lost answer would leave claimed
  rollouts behind) are retried only when the connection was never made.
- Enqueues always carry an `Idempotency-Key` (one is made up when the caller gives none), so a
  retried enqueue never duplicates rollouts.
- Batching: `dequeue(limit=N)` claims many at once; `add_spans` sends spans in batches.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import httpx

from core.retry import RetryPolicy

log = logging.getLogger(__name__)

CANCELLED_HEADER = "X-Cancelled-Rollouts"
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
SPAN_BATCH = 1000


class ApiError(Exception):
    """The server refused a request (4xx), or kept failing (5xx) after every retry."""

    def __init__(self, status: int, detail: Any, method: str, path: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        self.method = method
        self.path = path


class StoreUnavailable(ConnectionError):
    """The server could not be reached after every retry."""


def _cancelled(response: httpx.Response) -> set[str]:
    raw = response.headers.get(CANCELLED_HEADER, "")
    return {rid for rid in raw.split(",") if rid}


class StoreClient:
    def __init__(
        self, server: str, key: str, *, timeout: float = 30.0, retries: int = 8,
        backoff: float = 0.2, backoff_max: float = 5.0, span_batch: int = SPAN_BATCH,
    ) -> None:
        self.server = server.rstrip("/")
        self.retry = RetryPolicy(retries=retries, backoff=backoff, backoff_max=backoff_max)
        self.key = key  # also what agents' LLM calls use (runners/llm.py)
        self.span_batch = span_batch
        self._http = httpx.Client(
            base_url=self.server + "/v1/agl",
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport ---------------------------------------------------------------------------

    def request(
        self, method: str, path: str, *, json: Any = None, params: Any = None,
        headers: dict[str, str] | None = None, safe: bool = True,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send with retries; returns a 2xx response or raises ApiError / StoreUnavailable.
        `safe=False`: retry only errors where the request surely never reached the server."""
        delays = self.retry.delays()
        while True:
            delay = next(delays, None)
            last = delay is None
            try:
                extra = {"timeout": timeout} if timeout is not None else {}
                response = self._http.request(method, path, json=json, params=params,
                                              headers=headers, **extra)
            except httpx.TransportError as exc:
                never_sent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                if last or not (safe or never_sent):
                    raise StoreUnavailable(f"{method} {path}: {exc!r}") from exc
                log.warning("%s %s: %r; retrying in %.1fs", method, path, exc, delay)
            else:
                if response.status_code < 400:
                    return response
                if response.status_code not in RETRY_STATUSES or last or not safe:
                    raise ApiError(response.status_code, _detail(response), method, path)
                delay = max(delay, _retry_after(response, self.retry.backoff_max))
                log.warning("%s %s: HTTP %s; retrying in %.1fs", method, path,
                            response.status_code, delay)
            time.sleep(delay)

    # --- algorithm side ----------------------------------------------------------------------

    def enqueue(self, rollouts: Sequence[dict[str, Any]], *,
                idempotency_key: str | None = None) -> list[dict[str, Any]]:
        """Queue rollouts (AGL EnqueueRolloutRequest dicts); retry-safe."""
        key = idempotency_key or f"client-{uuid.uuid4().hex}"
        response = self.request("POST", "/queues/rollouts/enqueue",
                                json={"rollouts": list(rollouts)},
                                headers={"Idempotency-Key": key})
        return response.json()

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return self.request("GET", f"/rollouts/{rollout_id}").json()

    def cancel(self, rollout_id: str) -> dict[str, Any]:
        return self.request("POST", f"/rollouts/{rollout_id}", json={"status": "cancelled"}).json()

    def wait_for_rollouts(self, rollout_ids: Sequence[str], *,
                          timeout: float = 0.0) -> list[dict[str, Any]]:
        """The finished ones among `rollout_ids`; the server waits up to `timeout` (<= 60 s)."""
        return self.request("POST", "/waits/rollouts",
                            json={"rollout_ids": list(rollout_ids), "timeout": timeout},
                            timeout=timeout + 30).json()

    def query_spans(self, rollout_id: str, attempt_id: str | None = None) -> list[dict[str, Any]]:
        params = {"rollout_id": rollout_id}
        if attempt_id:
            params["attempt_id"] = attempt_id
        return self.request("GET", "/spans", params=params).json()["items"]

    def add_resources(self, resources: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/resources", json=resources).json()

    # --- runner side -------------------------------------------------------------------------

    def dequeue(self, *, worker_id: str | None = None, limit: int = 1,
                wait_seconds: float = 0.0) -> list[dict[str, Any]]:
        """Claim up to `limit` rollouts (AttemptedRollout dicts); the server may hold the
        request up to `wait_seconds` while the queue is empty."""
        body = {"limit": limit, "worker_id": worker_id, "wait_seconds": wait_seconds}
        response = self.request("POST", "/queues/rollouts/dequeue", json=body, safe=False,
                                timeout=wait_seconds + 30)
        return response.json()

    def claim(self, rollout_id: str, *, worker_id: str | None = None) -> dict[str, Any] | None:
        response = self.request("POST", f"/rollouts/{rollout_id}/claim",
                                json={"worker_id": worker_id}, safe=False)
        return response.json()

    def get_resources(self, resources_id: str, version: int | None = None) -> dict[str, Any]:
        params = {"version": version} if version is not None else None
        return self.request("GET", f"/resources/{resources_id}", params=params).json()

    def get_attempt(self, rollout_id: str, attempt_id: str) -> dict[str, Any]:
        return self.request("GET", f"/rollouts/{rollout_id}/attempts/{attempt_id}").json()

    def update_attempt(self, rollout_id: str, attempt_id: str,
                       **fields: Any) -> tuple[dict[str, Any], bool]:
        """AGL's update_attempt; returns the attempt and whether its rollout was cancelled."""
        response = self.request("POST", f"/rollouts/{rollout_id}/attempts/{attempt_id}",
                                json=fields)
        return response.json(), rollout_id in _cancelled(response)

    def finish_attempt(self, rollout_id: str, attempt_id: str, *, status: str,
                       error: str | None = None, usage: dict[str, Any] | None = None,
                       spans: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """Extension: the runner's final verdict, its error merged into the attempt's metadata
        by the server, and what the attempt used (`usage`: cpu_seconds, gpu_seconds,
        gpu_type) for the ledger; repeating it with the same status is harmless (so it is
        retried). `spans`: the attempt's last spans, stored before the verdict in the same
        request (more than one batch's worth: the earlier ones are posted first)."""
        spans = list(spans)
        head, tail = spans[:-self.span_batch], spans[-self.span_batch:]
        if head:
            self.add_spans(head)
        body: dict[str, Any] = {"status": status, "error": error}
        if usage is not None:
            body["usage"] = usage
        if tail:
            body["spans"] = tail
        response = self.request("POST", f"/rollouts/{rollout_id}/attempts/{attempt_id}/finish",
                                json=body)
        return response.json()

    def update_attempts(self, updates: Sequence[dict[str, Any]]) -> set[str]:
        """Many attempt reports in one request (each a dict with rollout_id, attempt_id and
        AGL's update_attempt fields); returns the ids of cancelled rollouts among them."""
        response = self.request("POST", "/attempts/batch", json={"updates": list(updates)})
        return set(response.json()["cancelled_rollout_ids"])

    def add_spans(self, spans: Iterable[dict[str, Any]]) -> set[str]:
        """Store spans in batches (duplicates are ignored by the server, so retries are safe);
        returns the ids of cancelled rollouts among them."""
        cancelled: set[str] = set()
        batch: list[dict[str, Any]] = []
        for span in spans:
            batch.append(span)
            if len(batch) >= self.span_batch:
                cancelled |= self._post_spans(batch)
                batch = []
        if batch:
            cancelled |= self._post_spans(batch)
        return cancelled

    def _post_spans(self, batch: list[dict[str, Any]]) -> set[str]:
        response = self.request("POST", "/spans/batch", json={"spans": batch})
        return set(response.json()["cancelled_rollout_ids"])

    def update_worker(self, worker_id: str, heartbeat_stats: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
        body = {"heartbeat_stats": heartbeat_stats} if heartbeat_stats is not None else {}
        return self.request("POST", f"/workers/{worker_id}", json=body).json()

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False


def _retry_after(response: httpx.Response, at_most: float) -> float:
    """The server's Retry-After in seconds (0 when absent or a date), capped."""
    try:
        return min(float(response.headers.get("Retry-After", 0)), at_most)
    except ValueError:
        return 0.0


def _detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    return body.get("detail", body) if isinstance(body, dict) else body
