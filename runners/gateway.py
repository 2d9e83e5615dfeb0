"""What the executor needs from the store, as one small interface.

The executor (runners/executor.py) runs one attempt end to end and talks to the store only
through a `StoreGateway`. Two implementations exist:

- `runners.local_gateway.LocalGateway`: calls `store.services` directly (Celery rollout tasks,
  the embedded default);
- `runners.remote.HttpGateway`: speaks the REST API through `runners.client` (the remote
  runner, `manage.py runner`, on machines with no database access).

Both must behave the same: tests/api/test_gateway_contract.py runs the same scenarios through
each, and tests run the executor against each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from store.services import Usage

# Why a heartbeat tells the runner to stop (StoreGateway.heartbeat).
STOP_CANCELLED = "cancelled"
STOP_ENDED = "ended"


@dataclass(frozen=True)
class Claim:
    """A claimed attempt: what the agent needs to run it."""

    rollout_id: str
    attempt_id: str
    input: Any
    mode: str | None
    resources_id: str | None
    resources_version: int | None
    config: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    # The agent's dotted path when the rollout was dispatched with one (Celery execution).
    agent: str | None = None
    sequence_id: int = 1  # the attempt's number (AGL agents see it in their Rollout)


class StoreGateway(Protocol):
    def claim(self, *, worker_id: str, limit: int = 1) -> list[Claim]:
        """Claim up to `limit` queued rollouts (each gets a new attempt)."""

    def claim_rollout(self, *, rollout_id: str, worker_id: str) -> Claim | None:
        """Claim one named rollout if it is still queued; None when someone else has it."""

    def resources(self, *, resources_id: str, version: int | None) -> dict[str, Any]:
        """The resources a rollout pinned (a `{name: resource}` mapping)."""

    def add_spans(self, *, spans: list[dict[str, Any]]) -> set[str]:
        """Store spans (AGL span dicts; they count as heartbeats). Returns the ids of the
        rollouts among them that were cancelled, so the runner can stop."""

    def heartbeat(self, *, rollout_id: str, attempt_id: str, worker_id: str) -> str | None:
        """Mark the attempt alive (and running). None to go on; else why the runner must
        stop: STOP_CANCELLED (its rollout was cancelled: the runner still ends the attempt)
        or STOP_ENDED (the store already ended the attempt, e.g. timed out: its verdict
        stands, the runner reports nothing)."""

    def llm_api_key(self, *, rollout_id: str, attempt_id: str) -> str | None:
        """The key an agent's LLM calls through the model gateway use (runners/llm.py)."""

    def finish(
        self, *, rollout_id: str, attempt_id: str, status: str, error: str | None = None,
        usage: Usage | None = None, spans: Sequence[dict[str, Any]] = (),
    ) -> None:
        """End the attempt as `succeeded` or `failed` (error recorded in its metadata under
        "error"); `usage`: what it used, for the ledger row the verdict writes; `spans`: its
        last spans (as `add_spans` takes them), stored before the verdict or with it."""
