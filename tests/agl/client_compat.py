"""Runs inside .venv-agl (the real agentlightning==0.3.0): calls every LightningStore method of
AGL's own `LightningStoreClient` against our server and checks the answers. Usage:

    .venv-agl/bin/python tests/agl/client_compat.py http://algo:KEY@127.0.0.1:PORT

Prints one JSON line with what it saw; exits non-zero (with the traceback) on any mismatch.
"""

from __future__ import annotations

import asyncio
import json
import sys

from agentlightning.store.client_server import LightningStoreClient
from agentlightning.types import (
    LLM,
    EnqueueRolloutRequest,
    PromptTemplate,
    RolloutConfig,
    Span,
)
from opentelemetry.sdk.trace import TracerProvider


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


async def main(url: str) -> dict:
    store = LightningStoreClient(url, retry_delays=(0.2,), health_retry_delays=(0.2,))
    seen: dict = {}
    try:
        llm = LLM(endpoint="http://127.0.0.1:9/v1", model="m", sampling_parameters={"t": 0.1})
        added = await store.add_resources({"main_llm": llm})
        check(added.resources_id.startswith("rs-") and added.version == 1, "add_resources")
        updated = await store.update_resources(
            added.resources_id,
            {"main_llm": llm, "prompt": PromptTemplate(template="hi {x}", engine="f-string")},
        )
        check(updated.version == 2, "update_resources bumps the version")
        got = await store.get_resources_by_id(added.resources_id)
        check(got is not None and "prompt" in got.resources, "get_resources_by_id")
        check((await store.get_latest_resources()).resources_id == added.resources_id,
              "get_latest_resources")
        check(await store.get_resources_by_id("rs-000000000000") is None, "unknown resources")
        page = await store.query_resources()
        check(page.total == 1, "query_resources")

        config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
        one = await store.enqueue_rollout(input={"q": 1}, mode="train", config=config,
                                          metadata={"k": "v"})
        check(one.status == "queuing" and one.config.max_attempts == 2, "enqueue_rollout")
        many = await store.enqueue_many_rollouts([
            EnqueueRolloutRequest(input={"q": 2}), EnqueueRolloutRequest(input={"q": 3}),
        ])
        check(len(many) == 2, "enqueue_many_rollouts")

        claimed = await store.dequeue_rollout(worker_id="agl-worker")
        check(claimed is not None and claimed.rollout_id == one.rollout_id, "dequeue_rollout FIFO")
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
        batch = await store.dequeue_many_rollouts(limit=5, worker_id="agl-worker-2")
        check(len(batch) == 2, "dequeue_many_rollouts")
        check(await store.dequeue_rollout(worker_id="agl-worker") is None, "empty queue -> None")

        seq = await store.get_next_span_sequence_id(rid, aid)
        seqs = await store.get_many_span_sequence_ids([(rid, aid), (rid, aid)])
        check(seqs == [seq + 1, seq + 2], "span sequence ids")
        tracer = TracerProvider().get_tracer("compat")
        otel_span = tracer.start_span("compat.span", attributes={"answer": 42})
        otel_span.end()
        stored = await store.add_otel_span(rid, aid, otel_span)
        check(stored is not None and stored.attributes["answer"] == 42, "add_otel_span")
        check(await store.add_span(stored) is None, "a duplicate span is None")
        second = tracer.start_span("compat.second")
        second.end()
        extra = Span.from_opentelemetry(second, rollout_id=rid, attempt_id=aid, sequence_id=99)
        added_many = await store.add_many_spans([extra])
        check(len(added_many) == 1, "add_many_spans")
        spans = await store.query_spans(rid, "latest")
        check([s.name for s in spans] == ["compat.span", "compat.second"], "query_spans")
        check((await store.query_spans(rid, name_contains="second")).total == 1, "span filters")
        check((await store.get_rollout_by_id(rid)).status == "running", "a span is a heartbeat")

        attempt = await store.update_attempt(rid, aid, status="failed", metadata={"why": "x"})
        check(attempt.status == "failed" and attempt.end_time is not None, "update_attempt")
        check((await store.get_rollout_by_id(rid)).status == "requeuing", "retry condition")
        retried = await store.start_attempt(rid, worker_id="agl-worker")
        check(retried.attempt.sequence_id == 2, "start_attempt")
        latest = await store.get_latest_attempt(rid)
        check(latest is not None and latest.attempt_id == retried.attempt.attempt_id,
              "get_latest_attempt")
        attempts = await store.query_attempts(rid)
        check([a.sequence_id for a in attempts] == [1, 2], "query_attempts")
        await store.update_attempt(rid, "latest", status="succeeded")
        done = await store.wait_for_rollouts(rollout_ids=[rid], timeout=0.1)
        check([r.rollout_id for r in done] == [rid] and done[0].status == "succeeded",
              "wait_for_rollouts")

        started = await store.start_rollout(input="direct", worker_id="agl-worker-3")
        check(started.status == "preparing" and started.attempt.sequence_id == 1,
              "start_rollout")
        cancelled = await store.update_rollout(started.rollout_id, status="cancelled")
        check(cancelled.status == "cancelled", "update_rollout")
        renamed = await store.update_rollout(many[0].rollout_id, metadata={"tag": "t"})
        check(renamed.metadata == {"tag": "t"}, "update_rollout metadata")

        everything = await store.query_rollouts()
        check(everything.total == 4, "query_rollouts")
        running = await store.query_rollouts(status_in=["preparing"], sort_by="start_time",
                                             sort_order="desc")
        check(all(r.status == "preparing" for r in running), "query_rollouts filters")
        check(await store.get_rollout_by_id("ro-000000000000") is None, "unknown rollout")

        worker = await store.update_worker("agl-worker", heartbeat_stats={"cpu": 1})
        check(worker.heartbeat_stats == {"cpu": 1}, "update_worker")
        check((await store.update_worker("agl-worker-4")).worker_id == "agl-worker-4",
              "update_worker without stats")
        check((await store.get_worker_by_id("agl-worker")).worker_id == "agl-worker",
              "get_worker_by_id")
        check(await store.get_worker_by_id("nobody") is None, "unknown worker -> None")
        workers = await store.query_workers(worker_id_contains="agl-worker")
        check(workers.total == 4, f"query_workers: {workers.total}")

        stats = await store.statistics()
        check(stats["total_rollouts"] == 4, "statistics")
        seen = {"rollouts": everything.total, "spans": len(spans), "workers": workers.total,
                "stats": stats}
    finally:
        await store.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
