"""Cancelling agents that share one HTTP client does not wedge the client (runners/cancel_guard.py).

An asynchronous LLM job's embedded worker stalled for good: the trainer cancelled stale
groups' running rollouts, `AttemptCancelled` landed inside httpx's connection pool that every
agent of the process shares (the example agent's module-level client), and from then on every
call of every thread waited forever (64 slots held, nothing claimed). Here: threads calling a
local server through one `httpx.Client`, a canceller stopping them at random; before, the
client stopped answering within about a second (five stops)."""

from __future__ import annotations

import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from runners.agent import RolloutInfo
from runners.cancel_guard import AttemptCancelled, CancelGuard, agent_home


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(random.random() * 0.01)
        body = b'{"ok": 1}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_stopping_agents_mid_call_leaves_their_shared_client_working():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/call"
    client = httpx.Client(timeout=5.0)  # one pool for every agent, as agents usually share it
    stop_at = time.monotonic() + 6.0
    guards: dict[int, CancelGuard] = {}
    counts = {"calls": 0, "stopped": 0}
    errors: list[str] = []

    def agent(task) -> float:
        for _ in range(3):
            time.sleep(0.002)  # the agent's own work between calls (its frame, not httpx's)
            client.post(url, json=task)
            counts["calls"] += 1
        return 1.0

    def runner(n: int) -> None:
        while time.monotonic() < stop_at:
            guard = CancelGuard(RolloutInfo(rollout_id=f"ro-{n}", attempt_id="at-1"))
            try:
                try:
                    guard.enter(agent)
                    guards[n] = guard
                    agent({"n": n})
                finally:
                    guard.leave()
            except AttemptCancelled:
                counts["stopped"] += 1
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)

    threads = [threading.Thread(target=runner, args=(n,), daemon=True) for n in range(32)]
    for thread in threads:
        thread.start()
    while time.monotonic() < stop_at:
        time.sleep(random.random() * 0.01)
        if guards:
            random.choice(list(guards.values())).cancel()
    deadline = time.monotonic() + 30  # a wedged client's callers never come back
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), counts  # none waits forever
    assert counts["stopped"] >= 20, counts  # agents were stopped, many times
    assert not [e for e in errors if "Timeout" in e], errors  # no call waited on a wedged pool
    assert client.post(url, json={}).status_code == 200  # the client still works
    server.shutdown()


def test_the_stop_lands_only_in_the_agents_own_code():
    assert agent_home(test_the_stop_lands_only_in_the_agents_own_code).endswith("tests/")
    assert agent_home(httpx.Client.post).endswith("httpx/")
    assert agent_home(len) is None  # builtins: nowhere to stop (the grace applies)
