"""Tenants in turn (issue 22, point 0): one project's flood neither fills every batch nor
holds every slot; past its admission, 429 with Retry-After."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from trainer.llm.batcher import Batcher
from trainer.llm.engine import Params, Sequence_

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "abc 7"}]


def test_a_batch_takes_tenants_in_turn(gateway_server):
    gateway, _ = gateway_server
    engine = gateway.registry.by_name("tiny")
    ids = engine.tokenizer("abc 7")["input_ids"]
    batcher = Batcher(window=0.5, max_batch=16)

    def job(tenant):
        return batcher.submit(engine, [Sequence_(list(ids), Params(max_tokens=2, seed=i))
                                       for i in range(8)], tenant=tenant)

    flood = [job("a") for _ in range(10)]  # 80 sequences of a, queued first
    single = job("b")
    assert single.done.wait(60) and single.error is None
    # b rode in the first batch (16 sequences: a's oldest and b's), not after a's 80.
    assert sum(j.done.is_set() for j in flood) <= 1
    for j in flood:
        assert j.done.wait(120) and j.error is None
    assert batcher.batches == 6


def test_a_flooding_project_gets_429_and_another_keeps_being_served(gateway_server, keyed):
    gateway, base = gateway_server
    _, a_key, _, b_key = keyed
    gateway.max_sequences_per_project = 32
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "ignore_eos": True,
            "n": 16}
    ordinary = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}

    def call(key, payload):
        began = time.perf_counter()
        reply = httpx.post(f"{base}/v1/chat/completions", json=payload, timeout=120,
                           headers={"Authorization": f"Bearer {key}"})
        return reply, time.perf_counter() - began

    alone = [call(b_key, ordinary)[1] for _ in range(5)]
    statuses, retry_after, b_times = [], set(), []
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            reply, _ = call(a_key, body)
            statuses.append(reply.status_code)
            if reply.status_code == 429:
                retry_after.add(reply.headers.get("retry-after"))
                assert reply.json()["error"]["code"] == "rate_limit_exceeded"

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        for _ in range(5):
            reply, seconds = call(b_key, ordinary)
            assert reply.status_code == 200, reply.text
            b_times.append(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert 429 in statuses and 200 in statuses
    assert retry_after == {"1"}
    print(f"\nproject b's call: p50 alone {statistics.median(alone) * 1000:.1f} ms, "
          f"under a's flood {statistics.median(b_times) * 1000:.1f} ms; "
          f"a: {statuses.count(200)} served, {statuses.count(429)} refused (429)")
