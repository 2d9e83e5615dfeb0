"""The StoreGateway on the store's own services: Celery rollout tasks and the embedded default.
Calls that must not be lost retry transient database errors (core/retry.py), as the HTTP
gateway retries network errors; a heartbeat is not retried (the next tick is its retry)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django.utils import timezone

from core.retry import DEFAULT, RetryPolicy
from runners.gateway import STOP_CANCELLED, STOP_ENDED, Claim
from store import selectors, services
from store.errors import IllegalTransition
from store.models import Attempt, Project, Rollout
from store.statemachine import AttemptStatus, RolloutStatus
from store.tokens import attempt_token

log = logging.getLogger(__name__)


class LocalGateway:
    def __init__(self, project: Project | int, *, retry: RetryPolicy = DEFAULT) -> None:
        self.project = (
            project if isinstance(project, Project) else Project.objects.get(pk=project)
        )
        self.retry = retry

    def claim(self, *, worker_id: str, limit: int = 1) -> list[Claim]:
        tries, since = 0, timezone.now()

        def dequeue() -> list[tuple[Rollout, Attempt]]:
            nonlocal tries
            tries += 1
            if tries > 1:  # the last try's commit may have landed, its answer lost
                held = selectors.claims_held_by(project=self.project, worker_id=worker_id,
                                                since=since, limit=limit)
                if held:
                    return held
            return services.rollout_dequeue_many(project=self.project, worker_id=worker_id,
                                                 limit=limit)

        claimed = self.retry.call(dequeue, what="dequeue")
        return [_claim(rollout, attempt) for rollout, attempt in claimed]

    def claim_rollout(self, *, rollout_id: str, worker_id: str) -> Claim | None:
        tries, since = 0, timezone.now()

        def claim() -> tuple[Rollout, Attempt] | None:
            nonlocal tries
            tries += 1
            claimed = services.rollout_claim(project=self.project, rollout_id=rollout_id,
                                             worker_id=worker_id)
            if claimed is None and tries > 1:
                # Not queued any more: perhaps because the last try's commit landed and only
                # its answer was lost. Ours then (the worker id is this process's): adopt it.
                held = selectors.claims_held_by(project=self.project, worker_id=worker_id,
                                                since=since, rollout_id=rollout_id)
                claimed = held[0] if held else None
            return claimed

        claimed = self.retry.call(claim, what=f"claim {rollout_id}")
        return _claim(*claimed) if claimed else None

    @classmethod
    def claim_next(cls, *, dispatch: str, max_timeout: float | None, worker_id: str,
                   retry: RetryPolicy = DEFAULT) -> tuple[LocalGateway, Claim] | None:
        """A message's ticket: claim the rollout due next on the queue (any project;
        store.services.rollout_claim_next); the gateway of the claimed rollout's project
        with the claim, or None."""
        tries, since = 0, timezone.now()

        def claim() -> tuple[Rollout, Attempt] | None:
            nonlocal tries
            tries += 1
            if tries > 1:  # the last try's commit may have landed, its answer lost
                held = selectors.claims_held_by(project=None, worker_id=worker_id, since=since)
                if held:
                    return held[0]
            return services.rollout_claim_next(dispatch=dispatch, max_timeout=max_timeout,
                                               worker_id=worker_id)

        claimed = retry.call(claim, what="claim the next rollout")
        if claimed is None:
            return None
        rollout, attempt = claimed
        return cls(rollout.project_id, retry=retry), _claim(rollout, attempt)

    def resources(self, *, resources_id: str, version: int | None) -> dict[str, Any]:
        row = self.retry.call(lambda: selectors.resources_get(
            project=self.project, resources_id=resources_id, version=version
        ), what=f"resources {resources_id}")
        return row.resources

    def add_spans(self, *, spans: list[dict[str, Any]]) -> set[str]:
        ingested = self.retry.call(
            lambda: services.spans_ingest(project=self.project, spans=spans), what="spans"
        )
        return ingested.cancelled

    def heartbeat(self, *, rollout_id: str, attempt_id: str, worker_id: str) -> str | None:
        try:
            attempt = services.attempt_update(
                project=self.project, rollout_id=rollout_id, attempt_id=attempt_id,
                status=AttemptStatus.RUNNING, last_heartbeat_time=timezone.now(),
            )
        except IllegalTransition as exc:
            log.info("attempt %s/%s ended elsewhere: %s", rollout_id, attempt_id, exc)
            return STOP_ENDED
        # The rollout as the update's transaction locked it: no second query.
        return STOP_CANCELLED if attempt.rollout.status == RolloutStatus.CANCELLED else None

    def llm_api_key(self, *, rollout_id: str, attempt_id: str) -> str:
        # No project key here: a token good for this attempt's own calls only.
        return attempt_token(project_id=self.project.pk, rollout_id=rollout_id,
                             attempt_id=attempt_id)

    def finish(
        self, *, rollout_id: str, attempt_id: str, status: str, error: str | None = None,
        usage: services.Usage | None = None, spans: Sequence[dict[str, Any]] = (),
    ) -> None:
        try:
            self.retry.call(lambda: services.attempt_finish(
                project=self.project, rollout_id=rollout_id, attempt_id=attempt_id,
                status=status, error=error, usage=usage, spans=spans,
            ), what=f"finish {rollout_id}/{attempt_id}")
        except IllegalTransition as exc:  # someone already gave the final verdict
            log.warning("late report for %s/%s ignored: %s", rollout_id, attempt_id, exc)


def _claim(rollout: Rollout, attempt: Attempt) -> Claim:
    return Claim(
        rollout_id=rollout.pk,
        attempt_id=attempt.attempt_id,
        input=rollout.input,
        mode=rollout.mode,
        resources_id=rollout.resources_id,
        resources_version=rollout.resources_version,
        config=dict(rollout.config or {}),
        metadata=dict(rollout.metadata or {}),
        agent=rollout.dispatch_target,
        sequence_id=attempt.sequence_id,
    )
