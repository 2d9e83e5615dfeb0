"""The StoreGateway over HTTP (runners/gateway.py): the remote runner's view of the store,
for machines with no database access. Behaves as `runners.local_gateway.LocalGateway` does."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from runners.client import ApiError, StoreClient
from runners.gateway import STOP_CANCELLED, STOP_ENDED, Claim

if TYPE_CHECKING:
    from store.services import Usage

log = logging.getLogger(__name__)

CONFLICT = 409


def claim_from_json(data: dict[str, Any]) -> Claim:
    """A Claim from an AGL AttemptedRollout dict."""
    return Claim(
        rollout_id=data["rollout_id"],
        attempt_id=data["attempt"]["attempt_id"],
        input=data.get("input"),
        mode=data.get("mode"),
        resources_id=data.get("resources_id"),
        resources_version=data.get("resources_version"),
        config=dict(data.get("config") or {}),
        metadata=dict(data.get("metadata") or {}),
        sequence_id=data["attempt"].get("sequence_id") or 1,
    )


class HttpGateway:
    def __init__(self, client: StoreClient, *, wait_seconds: float = 0.0) -> None:
        self.client = client
        # Long-poll of claim(): an idle runner waits on the server instead of polling.
        self.wait_seconds = wait_seconds

    def claim(self, *, worker_id: str, limit: int = 1) -> list[Claim]:
        claimed = self.client.dequeue(worker_id=worker_id, limit=limit,
                                      wait_seconds=self.wait_seconds)
        return [claim_from_json(item) for item in claimed]

    def claim_rollout(self, *, rollout_id: str, worker_id: str) -> Claim | None:
        claimed = self.client.claim(rollout_id, worker_id=worker_id)
        return claim_from_json(claimed) if claimed else None

    def resources(self, *, resources_id: str, version: int | None) -> dict[str, Any]:
        return self.client.get_resources(resources_id, version)["resources"]

    def add_spans(self, *, spans: list[dict[str, Any]]) -> set[str]:
        return self.client.add_spans(spans)

    def llm_api_key(self, *, rollout_id: str, attempt_id: str) -> str:
        return self.client.key  # the runner's project key

    def heartbeat(self, *, rollout_id: str, attempt_id: str, worker_id: str) -> str | None:
        try:
            _, cancelled = self.client.update_attempt(
                rollout_id, attempt_id, status="running", last_heartbeat_time=time.time()
            )
        except ApiError as exc:
            if exc.status != CONFLICT:
                raise
            log.info("attempt %s/%s ended elsewhere: %s", rollout_id, attempt_id, exc.detail)
            return STOP_ENDED
        return STOP_CANCELLED if cancelled else None

    def finish(
        self, *, rollout_id: str, attempt_id: str, status: str, error: str | None = None,
        usage: Usage | None = None, spans: Sequence[dict[str, Any]] = (),
    ) -> None:
        try:  # the last spans travel with the verdict: one request
            self.client.finish_attempt(rollout_id, attempt_id, status=status, error=error,
                                       usage=dataclasses.asdict(usage) if usage else None,
                                       spans=spans)
        except ApiError as exc:
            if exc.status != CONFLICT:
                raise
            log.warning("late report for %s/%s ignored: %s", rollout_id, attempt_id, exc.detail)
