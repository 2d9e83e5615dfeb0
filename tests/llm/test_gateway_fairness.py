"""Tenants in turn (issue 22, point 0): one project's flood neither fills every batch nor
holds every slot; past its admission, 429 with Retry-After."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from trainer.llm.batcher import Batcher, Job
from trainer.llm.engine import Engine, Params, Sequence_

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "abc 7"}]


def _greedy(ids, max_tokens, on_token=None, index=0):
    return Sequence_(list(ids), Params(max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True), index=index, on_token=on_token)


def test_a_request_joins_a_batch_in_progress_and_decodes_as_alone(model_dir):
    """Continuous batching: b's request starts at the next step of a's generation, finishes
    while a is still decoding, and gets the tokens it gets alone."""
    engine = Engine(model_dir, name="tiny")  # in this process, whatever the gateway's layout
    ids = engine.tokenizer("abc 7")["input_ids"]
    room = engine.context - len(ids)
    alone = _greedy(ids, 4)
    engine.generate([alone])
    batcher = Batcher(window=0.0, max_batch=16)
    a_started, b_submitted = threading.Event(), threading.Event()
    a_tokens_when_b_ended: list[int] = []

    def a_token(seq, *_):
        a_started.set()
        b_submitted.wait(30)  # a decodes on once b is queued: b joins a batch in progress

    a_seqs = [_greedy(ids, room, a_token, index=i) for i in range(4)]
    a = batcher.submit(engine, a_seqs, tenant="a")
    assert a_started.wait(30)

    def b_token(seq, *_):
        if seq.done:
            a_tokens_when_b_ended.append(len(a_seqs[0].token_ids))

    b = batcher.submit(engine, [_greedy(ids, 4, b_token)], tenant="b")
    b_submitted.set()
    assert b.done.wait(60) and b.error is None
    assert a.done.wait(60) and a.error is None
    assert b.sequences[0].token_ids == alone.token_ids
    assert a_tokens_when_b_ended and a_tokens_when_b_ended[0] < room  # a was not done
    assert all(len(s.token_ids) == room for s in a_seqs)
    assert batcher.batches == 2 and batcher.largest == 5


def test_a_tenant_with_nothing_decoding_joins_a_full_batch_before_the_flood(model_dir):
    """a's 4 requests of 4 sequences each, batch of 8: a's first two fill it; b's request
    joins at once (over max_batch by b's one sequence), before a's queued two start."""
    engine = Engine(model_dir, name="tiny")  # in this process, whatever the gateway's layout
    ids = engine.tokenizer("abc 7")["input_ids"]
    room = engine.context - len(ids)
    batcher = Batcher(window=0.3, max_batch=8)
    a_started, b_submitted, order = threading.Event(), threading.Event(), []

    def a_token(seq, *_):
        a_started.set()
        b_submitted.wait(30)  # a decodes on once b is queued

    flood = [batcher.submit(engine, [_greedy(ids, room, a_token, index=i) for i in range(4)],
                            tenant="a") for _ in range(4)]
    assert a_started.wait(30)
    b = batcher.submit(engine, [_greedy(ids, 3)], tenant="b")
    b_submitted.set()
    assert b.started.wait(60)
    order.append(("b started", [j.started.is_set() for j in flood]))
    assert b.done.wait(60) and b.error is None
    order.append(("b done", [j.done.is_set() for j in flood]))
    for job in flood:
        assert job.done.wait(120) and job.error is None
    assert order == [("b started", [True, True, False, False]),
                     ("b done", [False, False, False, False])]
    assert batcher.largest == 9


def test_a_flood_leaves_another_tenant_its_share_of_the_batch(model_dir):
    """a fills the batch (4 requests of 4 sequences, batch of 16); b's call arrives: while b
    decodes, a keeps 4 rows (tenant_rows) and 12 are set aside with their caches, so b's steps
    are 5 rows wide, not 17; once b is done a's rows decode on to their end, each the tokens
    it decodes alone. Before, a's 16 rows decoded with b's one in every step."""
    engine = Engine(model_dir, name="tiny")  # in this process, whatever the gateway's layout
    ids = engine.tokenizer("abc 7")["input_ids"]
    room = engine.context - len(ids)
    alone = _greedy(ids, room)
    engine.generate([alone])
    batcher = Batcher(window=0.3, max_batch=16, tenant_rows=4)
    a_full, b_submitted = threading.Event(), threading.Event()

    def a_token(seq, *_):
        if batcher.largest == 16:
            a_full.set()
            b_submitted.wait(30)  # a decodes on once b is queued

    flood = [batcher.submit(engine, [_greedy(ids, room, a_token, index=i) for i in range(4)],
                            tenant="a") for _ in range(4)]
    assert a_full.wait(60)
    b = batcher.submit(engine, [_greedy(ids, 3)], tenant="b")
    b_submitted.set()
    assert b.done.wait(60) and b.error is None
    b_finished_first = not any(job.done.is_set() for job in flood)
    for job in flood:
        assert job.done.wait(120) and job.error is None
    assert b_finished_first
    assert batcher.set_aside == 12
    assert batcher.widest_shared == 5
    assert all(seq.token_ids == alone.token_ids for job in flood for seq in job.sequences)


@pytest.mark.parametrize("idle, widest_after_b", [(3600.0, 4), (0.0, 16)])
def test_a_tenant_counts_as_having_work_until_idle_after_its_last_row(model_dir, idle,
                                                                      widest_after_b):
    """b's call done: with `idle` not yet over, a's rows still decode 4 at a time (b's next
    call will find a capped); with idle 0, a's rows set aside join again at once."""
    engine = Engine(model_dir, name="tiny")
    ids = engine.tokenizer("abc 7")["input_ids"]
    room = engine.context - len(ids)
    batcher = Batcher(window=0.3, max_batch=16, tenant_rows=4, idle=idle)
    a_full, b_submitted, after_b = threading.Event(), threading.Event(), []

    def a_token(seq, *_):
        if batcher.largest == 16:
            a_full.set()
            b_submitted.wait(30)
        if b.done.is_set():
            after_b.append(batcher.width)

    b = Job(engine, [])
    flood = [batcher.submit(engine, [_greedy(ids, room, a_token, index=i) for i in range(4)],
                            tenant="a") for _ in range(4)]
    assert a_full.wait(60)
    b = batcher.submit(engine, [_greedy(ids, 3)], tenant="b")
    b_submitted.set()
    for job in [b, *flood]:
        assert job.done.wait(120) and job.error is None
    assert after_b and max(after_b) == widest_after_b


def test_the_share_of_the_batch_is_a_positive_number_of_rows_or_none():
    with pytest.raises(ValueError, match="tenant_rows"):
        Batcher(tenant_rows=-1)
    with pytest.raises(ValueError, match="idle"):
        Batcher(idle=-1.0)


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


def test_calls_waiting_for_the_engine_hold_no_thread(model_dir, keyed, settings):
    """Two database threads; a's four calls wait for the engine (its lock held here): b is
    still authenticated and answered, as each of a's calls once the engine is free. Before,
    a waiting call held a thread, and b's authentication waited for a's generations."""
    from trainer.llm.server import ServerThread, build_gateway

    _, a_key, _, b_key = keyed
    settings.LLM_GATEWAY_THREADS = 2
    gateway = build_gateway(models=[f"tiny={model_dir}"])
    server = ServerThread(gateway.app()).start()
    base = f"http://127.0.0.1:{server.port}"
    engine = gateway.registry.by_name("tiny")
    results: list[int] = []

    def a_call():
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                           json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
                           headers={"Authorization": f"Bearer {a_key}"})
        results.append(reply.status_code)

    try:
        with engine.lock:
            threads = [threading.Thread(target=a_call) for _ in range(4)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while gateway._in_flight.get(keyed[0].pk, 0) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert gateway._in_flight.get(keyed[0].pk) == 4  # all four admitted, waiting
            reply = httpx.get(f"{base}/v1/models", timeout=10,
                              headers={"Authorization": f"Bearer {b_key}"})
            assert reply.status_code == 200 and not results
        for t in threads:
            t.join(60)
        assert results == [200] * 4
    finally:
        server.stop()
