"""Fair capacity under the ASGI front (lightning_site/asgi.py), over real HTTP: server-side
waits hold no thread, concurrent waits are capped per key and per project (429 with
Retry-After), and slow uploads pin nothing. Each test runs its own small server (1 process,
2 threads), so a handful of waits or slow clients would block it if they held threads."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from store import services
from tests.api.conftest import Server, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_server(django_db_setup: None, django_db_blocker) -> Iterator[Server]:
    server = start_server(workers=1, threads=2, env={
        "STORE_API_MAX_WAITS_PER_KEY": "3", "STORE_API_MAX_WAITS_PER_PROJECT": "4",
        "WEB_BODY_TIMEOUT_SECONDS": "2"})
    try:
        yield server
    finally:
        server.stop()


def _client(server: Server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url + "/v1/agl", timeout=60,
                        headers={"Authorization": f"Bearer {key}"})


def _tenant(name: str) -> tuple[str, str, str]:
    project = services.project_create(name=name)
    return tuple(services.api_key_create(project=project, role=role)[1]
                 for role in ("algorithm", "runner", "admin"))


def _started_rollout(client: httpx.Client) -> tuple[str, str]:
    answer = client.post("/rollouts", json={"input": {"x": 1}})
    assert answer.status_code == 201, answer.text
    body = answer.json()
    return body["rollout_id"], body["attempt"]["attempt_id"]


class Waits:
    """`count` waits/rollouts requests on threads, each for `rollout_id`, up to 30 s."""

    def __init__(self, server: Server, key: str, rollout_id: str, count: int) -> None:
        self.answers: list[httpx.Response] = []
        self.threads = [threading.Thread(target=self._wait, args=(server, key, rollout_id))
                        for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _wait(self, server: Server, key: str, rollout_id: str) -> None:
        with _client(server, key) as client:
            self.answers.append(_retrying(client, "/waits/rollouts",
                                          {"rollout_ids": [rollout_id], "timeout": 30}))

    def pending(self) -> int:
        return sum(thread.is_alive() for thread in self.threads)

    def join(self) -> list[httpx.Response]:
        for thread in self.threads:
            thread.join(timeout=60)
        return self.answers


def _retrying(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    """As a client should: after a 429, again (sooner than Retry-After says, for the test).
    A parked probe may hold a slot for a moment."""
    while True:
        answer = client.post(path, json=body)
        if answer.status_code != 429:
            return answer
        time.sleep(0.05)


def _until_refused(client: httpx.Client, rollout_id: str, attempts: int = 100) -> httpx.Response:
    """Probe with short waits until one is refused (the parked waits have taken their slots
    by then: probes are sequential, so the holders are the parked waits); a probe that is let
in just times out after 0.3 s and answers []."""
    for _ in range(attempts):
        answer = client.post("/waits/rollouts", json={"rollout_ids": [rollout_id],
                                                      "timeout": 0.3})
        if answer.status_code != 200:
            return answer
        assert answer.json() == []
    raise AssertionError("no probe was refused")


def test_waits_hold_no_thread_and_wake_on_completion(small_server, transactional_db):
    algorithm, runner, _ = _tenant("waiting")
    other_algorithm, _, _ = _tenant("bystander")
    with _client(small_server, algorithm) as algo, _client(small_server, runner) as run, \
            _client(small_server, other_algorithm) as other:
        rollout_id, attempt_id = _started_rollout(algo)
        waits = Waits(small_server, algorithm, rollout_id, 3)  # more waits than threads
        _until_refused(algo, rollout_id)  # all three are parked now
        # With the waits parked, the 2 threads still serve others: another tenant, and the
        # runner that finishes the rollout.
        assert other.get("/statistics").status_code == 200
        assert other.post("/rollouts", json={"input": {}}).status_code == 201
        assert waits.pending() == 3
        finished = run.post(f"/rollouts/{rollout_id}/attempts/{attempt_id}",
                            json={"status": "succeeded"})
        assert finished.status_code == 200, finished.text
        answers = waits.join()
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert all([r["rollout_id"] for r in a.json()] == [rollout_id] for a in answers)
    assert all(a.json()[0]["status"] == "succeeded" for a in answers)


def test_waits_past_the_cap_per_key_and_per_project_answer_429(small_server,
                                                               transactional_db):
    algorithm, runner, admin = _tenant("capped")
    other_algorithm, _, _ = _tenant("uncapped")
    with _client(small_server, algorithm) as algo, _client(small_server, runner) as run, \
            _client(small_server, admin) as adm, _client(small_server, other_algorithm) as other:
        rollout_id, attempt_id = _started_rollout(algo)
        per_key = Waits(small_server, algorithm, rollout_id, 3)  # the key's cap: 3
        refused = _until_refused(algo, rollout_id)
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "2"
        assert refused.json() == {"detail": "too many waiting requests for this API key (at "
                                            "most 3 at a time); retry later"}
        # Another key of the project takes the project's 4th and last slot, then the
        # project is full for every key.
        fourth = Waits(small_server, runner, rollout_id, 1)
        refused = _until_refused(adm, rollout_id)
        assert refused.status_code == 429
        assert "in this project (at most 4 at a time)" in refused.json()["detail"]
        # A wait that need not wait is never refused; other projects are not affected.
        assert adm.post("/waits/rollouts", json={"rollout_ids": [rollout_id],
                                                 "timeout": 0}).json() == []
        other_id, _ = _started_rollout(other)
        assert other.post("/waits/rollouts", json={"rollout_ids": [other_id],
                                                   "timeout": 0.3}).status_code == 200
        assert per_key.pending() == 3 and fourth.pending() == 1
        assert run.post(f"/rollouts/{rollout_id}/attempts/{attempt_id}",
                        json={"status": "succeeded"}).status_code == 200
        assert {a.status_code for a in per_key.join() + fourth.join()} == {200}
        # The slots are given back when the waits end.
        again = algo.post("/waits/rollouts", json={"rollout_ids": [rollout_id], "timeout": 5})
        assert again.status_code == 200 and again.json()[0]["status"] == "succeeded"


def test_long_polled_dequeue_holds_no_thread_and_is_capped(small_server, transactional_db):
    algorithm, runner, _ = _tenant("polling")
    with _client(small_server, algorithm) as algo, _client(small_server, runner) as run:
        results: list[httpx.Response] = []

        def poll() -> None:
            with _client(small_server, runner) as client:
                results.append(_retrying(client, "/queues/rollouts/dequeue",
                                         {"worker_id": "w", "wait_seconds": 20}))

        pollers = [threading.Thread(target=poll) for _ in range(3)]
        for thread in pollers:
            thread.start()
        for _ in range(100):
            probe = run.post("/queues/rollouts/dequeue", json={"wait_seconds": 0.3})
            if probe.status_code == 429:
                break
            assert probe.json() == []
        assert probe.status_code == 429 and probe.headers["Retry-After"] == "2"
        answer = algo.post("/queues/rollouts/enqueue",
                           json={"rollouts": [{"input": {"i": i}} for i in range(3)]})
        assert answer.status_code == 201
        for thread in pollers:
            thread.join(timeout=60)
    assert sorted(len(r.json()) for r in results) == [1, 1, 1]


def _slow_upload(server: Server) -> socket.socket:
    """A request without a key whose declared body never finishes arriving."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/agl/queues/rollouts/dequeue HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    return sock


def test_slow_uploads_pin_no_thread_and_time_out_with_408(small_server, transactional_db):
    algorithm, _, _ = _tenant("patient")
    slow = [_slow_upload(small_server) for _ in range(6)]  # 3x the threads
    try:
        with _client(small_server, algorithm) as algo:
            # Served while six uploads hang (before their 2 s body timeout ends them).
            assert algo.get("/statistics").status_code == 200
        for sock in slow:
            sock.settimeout(30)
            answer = b""
            while chunk := sock.recv(4096):  # the server closes the connection after it
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b'{"detail": "request body not received in time"}' in answer
    finally:
        for sock in slow:
            sock.close()
