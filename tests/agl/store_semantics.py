"""Runs inside .venv-agl: AGL 0.3's own `LightningStoreClient` checks the store semantics of
issue 9 (points 1-8) against our server, each as AGL's in-process store behaves. Usage:

    .venv-agl/bin/python tests/agl/store_semantics.py http://algo:KEY@127.0.0.1:PORT

Prints one JSON line with what it saw; exits non-zero (with the traceback) on any mismatch.
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
from agentlightning.store.client_server import LightningStoreClient
from agentlightning.types import RolloutConfig, Span
from opentelemetry.sdk.trace import TracerProvider


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


async def status_of(call) -> int:
    try:
        await call
    except aiohttp.ClientResponseError as exc:
        return exc.status
    return 200


def span(tracer, rid: str, aid: str, sequence_id: int) -> Span:
    otel = tracer.start_span(f"s{sequence_id}")
    otel.end()
    return Span.from_opentelemetry(otel, rollout_id=rid, attempt_id=aid, sequence_id=sequence_id)


async def sequence_ids(store: LightningStoreClient, tracer) -> list[int]:
    """Point 1: one counter per rollout, shared by its attempts; explicit ids raise it."""
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    rollout = await store.enqueue_rollout(input={"seq": 1}, config=config)
    first = await store.dequeue_rollout(worker_id="w-seq")
    rid, a1 = rollout.rollout_id, first.attempt.attempt_id
    otel = tracer.start_span("one")
    otel.end()
    issued = [(await store.add_otel_span(rid, a1, otel)).sequence_id]
    await store.update_attempt(rid, a1, status="failed")
    second = await store.dequeue_rollout(worker_id="w-seq")
    for name in ("two", "three", "four"):
        otel = tracer.start_span(name)
        otel.end()
        issued.append((await store.add_otel_span(rid, second.attempt.attempt_id, otel)).sequence_id)
    check(issued == [1, 2, 3, 4], f"per-rollout ids: {issued}")
    await store.add_span(span(tracer, rid, a1, 100))
    after = await store.get_next_span_sequence_id(rid, "at-any")
    check(after == 101, f"after an explicit 100: {after}")
    return issued + [after]


async def detail(url: str, path: str, body: dict) -> tuple[int, str]:
    """The status and message of a refused call (AGL's client keeps only the status)."""
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.hostname}:{parts.port}"
    auth = aiohttp.BasicAuth(parts.username or "", parts.password or "")
    async with aiohttp.ClientSession(auth=auth) as session:
        async with session.post(base + "/v1/agl" + path, json=body) as response:
            return response.status, (await response.json())["detail"]


async def agl_suite_cases(store: LightningStoreClient, url: str) -> dict:
    """Issue 23, point 4: the four cases of AGL 0.3's own store suite we answered otherwise."""
    import re
    seen = {}
    # test_update_nonexistent_rollout: ValueError matching `Item.*does not exist`.
    check(await status_of(store.update_rollout("nonexistent", status="failed")) == 404,
          "update of an unknown rollout")
    status, message = await detail(url, "/rollouts/nonexistent", {"status": "failed"})
    check(re.search("Item.*does not exist", message) is not None, f"update_rollout: {message}")
    seen["update_nonexistent_rollout"] = message
    # test_update_nonexistent_attempt: a rollout with no attempt yet, `No attempts found`.
    queued = await store.enqueue_rollout(input="no attempt")
    check(await status_of(store.update_attempt(queued.rollout_id, "nonexistent",
                                               status="failed")) == 404, "update_attempt")
    status, message = await detail(
        url, f"/rollouts/{queued.rollout_id}/attempts/nonexistent", {"status": "failed"})
    check("No attempts found" in message, f"update_attempt: {message}")
    seen["update_nonexistent_attempt"] = message
    # test_status_propagation_latest_changes_when_new_attempt_added: an older attempt's
    # verdict may change; the rollout follows its latest attempt.
    started = await store.start_rollout(input="propagation")
    rid, first = started.rollout_id, started.attempt.attempt_id
    await store.update_attempt(rid, first, status="succeeded")
    second = await store.start_attempt(rid)
    changed = await store.update_attempt(rid, first, status="failed")
    latest = await store.get_rollout_by_id(rid)
    check(changed.status == "failed", f"older attempt: {changed.status}")
    check(latest.status == "preparing" and latest.attempt.attempt_id == second.attempt.attempt_id,
          f"the rollout follows its latest attempt: {latest.status}")
    # test_query_attempts_zero_limit_returns_no_items.
    page = await store.query_attempts(rid, limit=0)
    check(page.items == [] and page.total == 2, f"limit 0: {page}")
    seen["zero_limit_total"] = page.total
    return seen


async def main(url: str) -> dict:
    store = LightningStoreClient(url, retry_delays=(0.2,), health_retry_delays=(0.2,))
    tracer = TracerProvider().get_tracer("semantics")
    seen: dict = {}
    try:
        seen["sequence_ids"] = await sequence_ids(store, tracer)

        # Point 2: a resources id that does not exist yet is kept as given.
        later = await store.enqueue_rollout(input=1, resources_id="rs-not-yet")
        check(later.resources_id == "rs-not-yet", "unknown resources_id on enqueue")
        started = await store.start_rollout(input=2, resources_id="rs-other", worker_id="w-a")
        check(started.resources_id == "rs-other", "unknown resources_id on start")

        # Point 3: explicit null is 400; "" clears the worker; omitted fields stay.
        rid, aid = started.rollout_id, started.attempt.attempt_id
        nulls = [await status_of(store.update_attempt(rid, aid, metadata=None)),
                 await status_of(store.update_worker("w-a", heartbeat_stats=None))]
        check(nulls == [400, 400], f"explicit nulls: {nulls}")
        cleared = await store.update_attempt(rid, aid, worker_id="")
        check(cleared.worker_id == "" and cleared.status == "preparing", "worker_id ''")

        # Point 4: any field sorts; None first ascending; bad paging is 400.
        await store.update_rollout(later.rollout_id, mode="val")
        by_mode = await store.query_rollouts(sort_by="mode")
        check(by_mode.items[-1].rollout_id == later.rollout_id, "None sorts first")
        by_mode = await store.query_rollouts(sort_by="mode", sort_order="desc")
        check(by_mode.items[0].rollout_id == later.rollout_id, "None sorts last descending")
        check(await status_of(store.query_rollouts(sort_by="nonsense")) == 400, "bad sort_by")
        check(await status_of(store.query_rollouts(offset=-1)) == 400, "offset < 0")

        # Points 5 and 6: searches of unknown rollouts are empty; statistics keys.
        check((await store.query_spans("ro-000000000000")).total == 0, "spans of unknown")
        check(await store.get_rollout_by_id("ro-000000000000") is None, "unknown rollout")
        stats = await store.statistics()
        check("name" in stats and stats["uptime"] >= 0, f"statistics: {stats}")

        # Point 7: the algorithm may requeue a failed rollout, retry a finished one by hand.
        await store.update_attempt(rid, aid, status="failed")
        check((await store.get_rollout_by_id(rid)).status == "failed", "failed")
        requeued = await store.update_rollout(rid, status="requeuing")
        check(requeued.status == "requeuing", "requeue a failed rollout")
        await store.update_rollout(later.rollout_id, status="succeeded")
        by_hand = await store.start_attempt(later.rollout_id, worker_id="w-b")
        check(by_hand.status == "preparing", "start_attempt on a finished rollout")

        # Point 8: a timed-out attempt is seen as such within 0.25 s of its deadline.
        timed = await store.start_rollout(input=3, config=RolloutConfig(timeout_seconds=0.5))
        await asyncio.sleep(0.75)
        got = await store.get_rollout_by_id(timed.rollout_id)
        check(got.status == "failed" and got.attempt.status == "timeout",
              f"timeout seen late: {got.status}/{got.attempt.status}")
        seen["statistics"] = {k: stats[k] for k in ("name", "total_rollouts")}
        seen["agl_suite"] = await agl_suite_cases(store, url)
    finally:
        await store.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
