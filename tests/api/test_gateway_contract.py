"""The executor's two gateways keep one contract: the same scenarios through the in-process
gateway (store services, Celery workers) and the HTTP gateway (the remote runner, a live
server) leave the same rows. Scenarios: a finish (and its repeat), a late failure after the
watchdog's verdict, a rollout retried after a failed attempt, and a finish whose answer was
lost (the write committed, the caller saw an error and retried)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
from django.db import OperationalError

from core.retry import RetryPolicy
from runners import local_gateway
from runners.client import StoreClient
from runners.gateway import StoreGateway
from runners.local_gateway import LocalGateway
from runners.remote import HttpGateway
from store import services
from store.models import Attempt, Rollout
from store.services import RolloutSpec
from store.watchdog import sweep
from tests.api.conftest import Keys, Server

pytestmark = pytest.mark.slow
QUICK = {"retries": 3, "backoff": 0.01, "backoff_max": 0.05}


class LoseFirstFinishAnswer(httpx.BaseTransport):
    """Forwards every request; the first finish's answer is dropped on the way back (as when
    the connection breaks after the server committed)."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner, self.lost = inner, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path.endswith("/finish") and not self.lost:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadError("connection reset after the server answered", request=request)
        return response


@pytest.fixture(params=["local", "http"])
def gateway(request, keys: Keys, monkeypatch) -> Iterator[StoreGateway]:
    if request.param == "local":
        yield LocalGateway(keys.project, retry=RetryPolicy(**QUICK))
        return
    server: Server = request.getfixturevalue("api_server")
    with StoreClient(server.url, keys.runner, **QUICK) as client:
        yield HttpGateway(client)


def lose_first_finish_answer(gateway: StoreGateway, monkeypatch) -> None:
    if isinstance(gateway, HttpGateway):
        http = gateway.client._http
        http._transport = LoseFirstFinishAnswer(http._transport)
        return
    real = local_gateway.services.attempt_finish
    lost = []

    def finish_then_lose_the_connection(**kwargs):
        attempt = real(**kwargs)
        if not lost:
            lost.append(1)
            raise OperationalError("server closed the connection unexpectedly")
        return attempt

    monkeypatch.setattr(local_gateway.services, "attempt_finish",
                        finish_then_lose_the_connection)


def enqueue(keys: Keys, **config) -> Rollout:
    return services.rollout_enqueue(project=keys.project, spec=RolloutSpec(
        input={"task": 1}, config=config or None))


def rows(rollout_id: str) -> tuple[Rollout, list[Attempt]]:
    rollout = Rollout.objects.get(pk=rollout_id)
    return rollout, list(rollout.attempts.order_by("sequence_id"))


def test_finish_and_its_repeat(gateway, keys):
    rollout = enqueue(keys)
    claim = gateway.claim_rollout(rollout_id=rollout.pk, worker_id="w1")
    assert claim is not None and claim.sequence_id == 1
    assert gateway.claim_rollout(rollout_id=rollout.pk, worker_id="w2") is None
    assert gateway.heartbeat(rollout_id=rollout.pk, attempt_id=claim.attempt_id,
                             worker_id="w1") is None
    gateway.finish(rollout_id=rollout.pk, attempt_id=claim.attempt_id, status="succeeded")
    gateway.finish(rollout_id=rollout.pk, attempt_id=claim.attempt_id, status="succeeded")
    gateway.finish(rollout_id=rollout.pk, attempt_id=claim.attempt_id, status="failed",
                   error="a late second verdict")  # ignored: the first verdict stands
    stored, attempts = rows(rollout.pk)
    assert stored.status == "succeeded" and [a.status for a in attempts] == ["succeeded"]
    assert "error" not in attempts[0].metadata
    assert gateway.heartbeat(rollout_id=rollout.pk, attempt_id=claim.attempt_id,
                             worker_id="w1") == "ended"  # the runner must stop


def test_a_late_failure_after_the_watchdogs_verdict_keeps_both(gateway, keys):
    rollout = enqueue(keys, unresponsive_seconds=1, max_attempts=1)
    claim = gateway.claim_rollout(rollout_id=rollout.pk, worker_id="w1")
    Attempt.objects.filter(rollout_id=rollout.pk).update(
        start_time=Attempt.objects.get(rollout_id=rollout.pk).start_time - timedelta(seconds=5),
        deadline=Attempt.objects.get(rollout_id=rollout.pk).start_time - timedelta(seconds=4))
    assert len(sweep().unresponsive) == 1
    gateway.finish(rollout_id=rollout.pk, attempt_id=claim.attempt_id, status="failed",
                   error="ValueError: the agent gave up")
    stored, (attempt,) = rows(rollout.pk)
    assert stored.status == "failed" and attempt.status == "failed"
    assert attempt.metadata["store.watchdog_verdict"] == "unresponsive"
    assert attempt.metadata["error"] == "ValueError: the agent gave up"


def test_a_failed_attempt_is_retried_as_a_new_attempt(gateway, keys):
    rollout = enqueue(keys, max_attempts=2, retry_condition=["failed"])
    first = gateway.claim_rollout(rollout_id=rollout.pk, worker_id="w1")
    gateway.finish(rollout_id=rollout.pk, attempt_id=first.attempt_id, status="failed",
                   error="RuntimeError: flaky")
    assert Rollout.objects.get(pk=rollout.pk).status == "requeuing"
    second = gateway.claim_rollout(rollout_id=rollout.pk, worker_id="w2")
    assert second is not None and second.sequence_id == 2
    gateway.finish(rollout_id=rollout.pk, attempt_id=second.attempt_id, status="succeeded")
    stored, attempts = rows(rollout.pk)
    assert stored.status == "succeeded" and stored.attempt_count == 2
    assert [a.status for a in attempts] == ["failed", "succeeded"]
    assert attempts[0].metadata["error"] == "RuntimeError: flaky"


def test_a_finish_whose_answer_was_lost_is_retried_and_counts_once(gateway, keys,
                                                                   monkeypatch):
    rollout = enqueue(keys)
    claim = gateway.claim_rollout(rollout_id=rollout.pk, worker_id="w1")
    lose_first_finish_answer(gateway, monkeypatch)
    gateway.finish(rollout_id=rollout.pk, attempt_id=claim.attempt_id, status="succeeded")
    stored, attempts = rows(rollout.pk)
    assert stored.status == "succeeded" and [a.status for a in attempts] == ["succeeded"]
