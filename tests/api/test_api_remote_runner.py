"""Our client and `manage.py runner` against a live server: rollouts complete, a server restart
is waited out, SIGTERM finishes the work in hand, and a runner killed with -9 leaves its
rollout to the watchdog (retried or failed per its config), never stuck."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from runners.client import ApiError, StoreClient
from runners.remote import HttpGateway
from store.models import Attempt
from store.watchdog import sweep
from tests.api.conftest import ROOT, Keys, Server, start_server

pytestmark = pytest.mark.slow
TERMINAL = {"succeeded", "failed", "cancelled"}


class RunnerProcess:
    def __init__(self, server_url: str, key: str, agent: str, tmp: Path, *extra: str) -> None:
        self.log = tmp / f"runner-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "manage.py", "runner", "--server", server_url, "--key", key,
               "--agent", agent, "--wait-seconds", "0.5", "--heartbeat-seconds", "0.2", *extra]
        env = {**os.environ, "LIGHTNING_DATA_DIR": str(tmp / "runner-data"),
               "LOG_LEVEL": "INFO"}
        env.pop("DATABASE_URL", None)  # a remote runner has no database access
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def runners_started(tmp_path: Path) -> Iterator[list[RunnerProcess]]:
    started: list[RunnerProcess] = []
    yield started
    for runner_process in started:
        runner_process.stop()


@pytest.fixture
def client(api_server: Server, keys: Keys) -> Iterator[StoreClient]:
    with StoreClient(api_server.url, keys.algorithm, retries=2, backoff=0.05) as store_client:
        yield store_client


def wait_until(predicate, *, attempts: int = 600, pause: float = 0.1) -> bool:
    for _ in range(attempts):
        if predicate():
            return True
        time.sleep(pause)
    return False


def statuses(client: StoreClient, rollout_ids: list[str]) -> list[str]:
    return [client.get_rollout(rid)["status"] for rid in rollout_ids]


def test_client_raises_a_clear_error_on_4xx(client: StoreClient):
    with pytest.raises(ApiError) as caught:
        client.get_rollout("ro-000000000000")
    assert caught.value.status == 404 and "not found" in str(caught.value.detail)
    with pytest.raises(ApiError) as caught:
        client.enqueue([{"input": 1, "mode": "nope"}])
    assert caught.value.status == 422 and caught.value.detail[0]["loc"][-1] == "mode"


def test_client_enqueue_retries_are_idempotent_and_spans_go_in_batches(client, api_server, keys):
    first = client.enqueue([{"input": i} for i in range(3)], idempotency_key="k-1")
    again = client.enqueue([{"input": i} for i in range(3)], idempotency_key="k-1")
    assert [r["rollout_id"] for r in first] == [r["rollout_id"] for r in again]
    with StoreClient(api_server.url, keys.runner, span_batch=2) as runner_client:
        claimed = runner_client.dequeue(worker_id="w", limit=3)
        assert len(claimed) == 3 and claimed[0]["resources_version"] is None
        rid, aid = claimed[0]["rollout_id"], claimed[0]["attempt"]["attempt_id"]
        spans = [{"rollout_id": rid, "attempt_id": aid, "sequence_id": i, "trace_id": "f" * 32,
                  "span_id": f"{i:016x}", "name": "s"} for i in range(5)]
        assert runner_client.add_spans(spans) == set()
        assert len(client.query_spans(rid)) == 5


def test_the_remote_runners_verdict_carries_its_usage_into_the_ledger(client, api_server, keys):
    """What a remote runner measured travels with its verdict (POST .../finish `usage`) and
    lands in the attempt's ledger row; a bad usage is refused with the field named."""
    from store.models import UsageEntry
    from store.services import Usage

    rid = client.enqueue([{"input": 1}])[0]["rollout_id"]
    with StoreClient(api_server.url, keys.runner) as runner_client:
        gateway = HttpGateway(runner_client)
        claim = gateway.claim_rollout(rollout_id=rid, worker_id="w")
        for bad in ({"cpu_seconds": -1}, {"gpu_seconds": False}, {"cpu_seconds": 1e300}):
            with pytest.raises(ApiError) as refused:
                runner_client.finish_attempt(rid, claim.attempt_id, status="succeeded",
                                             usage=bad)
            assert refused.value.status == 422 and next(iter(bad)) in str(refused.value.detail)
        gateway.finish(rollout_id=rid, attempt_id=claim.attempt_id, status="succeeded",
                       usage=Usage(cpu_seconds=1.5, gpu_seconds=2.0, gpu_type="NVIDIA L4"))
    row = UsageEntry.objects.get(rollout_id=rid)
    assert (row.attempt_id, row.cpu_seconds, row.gpu_seconds, row.gpu_type) == (
        claim.attempt_id, 1.5, 2.0, "NVIDIA L4")


def test_http_gateway_reports_like_the_local_one(client, api_server, keys):
    rid = client.enqueue([{"input": 1}])[0]["rollout_id"]
    with StoreClient(api_server.url, keys.runner) as runner_client:
        gateway = HttpGateway(runner_client)
        claim = gateway.claim_rollout(rollout_id=rid, worker_id="w")
        assert claim is not None and gateway.claim_rollout(rollout_id=rid, worker_id="w") is None
        assert gateway.heartbeat(rollout_id=rid, attempt_id=claim.attempt_id,
                                 worker_id="w") is None
        assert client.get_rollout(rid)["status"] == "running"
        gateway.finish(rollout_id=rid, attempt_id=claim.attempt_id, status="failed",
                       error="boom")
        attempt = runner_client.get_attempt(rid, claim.attempt_id)
        assert attempt["status"] == "failed" and attempt["metadata"]["error"] == "boom"
        assert gateway.heartbeat(rollout_id=rid, attempt_id=claim.attempt_id,
                                 worker_id="w") == "ended"  # the runner must stop


def test_remote_runner_completes_rollouts_with_spans_and_rewards(
    client, api_server, keys, tmp_path, runners_started
):
    rids = [r["rollout_id"] for r in client.enqueue([{"input": {"i": i}} for i in range(6)])]
    runner = RunnerProcess(api_server.url, keys.runner, "tests.celery_agents:ok_agent", tmp_path,
                           "--concurrency", "3", "--max-rollouts", "6")
    runners_started.append(runner)
    assert runner.proc.wait(timeout=120) == 0, runner.output()
    assert statuses(client, rids) == ["succeeded"] * 6
    spans = client.query_spans(rids[4])
    names = {span["name"] for span in spans}
    assert {"llm.call", "agentlightning.annotation"} <= names
    reward = next(s for s in spans if s["name"] == "agentlightning.annotation")
    assert reward["attributes"]["agentlightning.reward.0.value"] == 4.0


def test_remote_runner_survives_a_server_restart(keys, tmp_path, runners_started, client):
    server = start_server(workers=1)
    try:
        with StoreClient(server.url, keys.algorithm) as own:
            rids = [r["rollout_id"] for r in
                    own.enqueue([{"input": {"seconds": 0.3}} for _ in range(8)])]
        runner = RunnerProcess(server.url, keys.runner, "tests.celery_agents:looping_agent",
                               tmp_path, "--concurrency", "2", "--max-rollouts", "8")
        runners_started.append(runner)
        assert wait_until(lambda: "succeeded" in statuses(client, rids))
        server.stop()  # mid-run: the runner holds attempts and cannot reach the store
        time.sleep(1.0)
        server.start()
        assert runner.proc.wait(timeout=120) == 0, runner.output()
    finally:
        server.stop()
    assert statuses(client, rids) == ["succeeded"] * 8


def test_sigterm_finishes_the_attempt_in_hand_then_exits(
    client, api_server, keys, tmp_path, runners_started
):
    rid = client.enqueue([{"input": {"seconds": 1.5}}])[0]["rollout_id"]
    runner = RunnerProcess(api_server.url, keys.runner, "tests.celery_agents:looping_agent",
                           tmp_path)
    runners_started.append(runner)
    assert wait_until(lambda: client.get_rollout(rid)["status"] == "running")
    runner.proc.send_signal(signal.SIGTERM)
    assert runner.proc.wait(timeout=60) == 0, runner.output()
    assert client.get_rollout(rid)["status"] == "succeeded"


def test_cancelling_a_rollout_stops_the_remote_runner_work(
    client, api_server, keys, tmp_path, runners_started
):
    rid = client.enqueue([{"input": {"seconds": 60}}])[0]["rollout_id"]
    runner = RunnerProcess(api_server.url, keys.runner, "tests.celery_agents:looping_agent",
                           tmp_path, "--max-rollouts", "1")
    runners_started.append(runner)
    assert wait_until(lambda: client.get_rollout(rid)["status"] == "running")
    client.cancel(rid)
    assert runner.proc.wait(timeout=60) == 0, runner.output()  # the agent was stopped
    attempt = client.get_rollout(rid)["attempt"]
    assert attempt["status"] == "failed" and "cancelled" in attempt["metadata"]["error"]


@pytest.mark.parametrize("max_attempts,expected", [(2, "succeeded"), (1, "failed")])
def test_kill_9_mid_rollout_is_retried_or_failed_per_config(
    client, api_server, keys, tmp_path, runners_started, max_attempts: int, expected: str
):
    marker = tmp_path / "marker"
    config = {"unresponsive_seconds": 2, "max_attempts": max_attempts,
              "retry_condition": ["unresponsive"]}
    rid = client.enqueue([{"input": {"marker": str(marker), "seconds": 120},
                           "config": config}])[0]["rollout_id"]
    doomed = RunnerProcess(api_server.url, keys.runner, "tests.celery_agents:die_once_agent",
                           tmp_path)
    runners_started.append(doomed)
    assert wait_until(lambda: marker.exists() and
                      client.get_rollout(rid)["status"] == "running")
    doomed.proc.kill()  # SIGKILL: no report, no more heartbeats
    doomed.proc.wait(timeout=10)
    # The watchdog, as celery-beat runs it, seen from a moment past the unresponsive limit.
    sweep(now=timezone.now() + timedelta(seconds=5))
    after = client.get_rollout(rid)
    assert after["attempt"]["status"] == "unresponsive"
    if expected == "failed":
        assert after["status"] == "failed"
        return
    assert after["status"] == "requeuing"
    rescuer = RunnerProcess(api_server.url, keys.runner, "tests.celery_agents:die_once_agent",
                            tmp_path, "--max-rollouts", "1")
    runners_started.append(rescuer)
    assert rescuer.proc.wait(timeout=60) == 0, rescuer.output()
    final = client.get_rollout(rid)
    assert final["status"] == "succeeded" and final["attempt"]["sequence_id"] == 2


def test_a_runner_killed_right_after_its_claim_is_given_up_on_within_seconds(
    client, api_server, keys, tmp_path, runners_started, capsys
):
    """Issue 23: a runner killed (-9) right after it claimed, before any report, left the
    rollout to its limit (the attempt ended `timeout` 60.7 s after the kill). Its worker's
    silence now ends the attempt (`unresponsive`, STORE_SILENT_WORKER_SECONDS) and another
    runner retries it. Default heartbeat (5 s); the watchdog runs as beat runs it (5 s)."""
    config = {"timeout_seconds": 60, "max_attempts": 2,
              "retry_condition": ["unresponsive", "timeout"]}
    rid = client.enqueue([{"input": {"i": 1, "seconds": 30}, "config": config}])[0]["rollout_id"]
    doomed = RunnerProcess(api_server.url, keys.runner, "tests.celery_agents:looping_agent",
                           tmp_path, "--heartbeat-seconds", "5")
    runners_started.append(doomed)
    assert wait_until(lambda: client.get_rollout(rid)["status"] == "preparing",
                      attempts=3000, pause=0.02)
    doomed.proc.kill()  # SIGKILL right after the claim: no heartbeat, no report
    killed = time.monotonic()
    doomed.proc.wait(timeout=10)
    rescuer = RunnerProcess(api_server.url, keys.runner, "tests.celery_agents:ok_agent",
                            tmp_path, "--heartbeat-seconds", "5", "--max-rollouts", "1")
    runners_started.append(rescuer)
    first = Attempt.objects.get(rollout_id=rid, sequence_id=1)
    while first.status == "preparing" and time.monotonic() - killed < 120:
        sweep()  # what celery-beat runs every LIGHTNING_SWEEP_SECONDS (5 s)
        time.sleep(5)
        first.refresh_from_db()
    judged = time.monotonic() - killed
    assert first.status == "unresponsive", first.metadata
    assert "STORE_SILENT_WORKER_SECONDS" in first.metadata["error"]
    assert rescuer.proc.wait(timeout=120) == 0, rescuer.output()
    done = time.monotonic() - killed
    final = client.get_rollout(rid)
    assert final["status"] == "succeeded" and final["attempt"]["sequence_id"] == 2
    with capsys.disabled():
        print(f"\nrunner killed right after its claim: attempt 1 {first.status} {judged:.1f} s "
              f"after the kill, the rollout succeeded on another runner {done:.1f} s after")
