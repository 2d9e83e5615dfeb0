"""Runs inside .venv-agl (the real agentlightning==0.3.0): reads one rollout's spans from our
server with AGL's own `LightningStoreClient` and turns them into triplets with AGL's own
`TracerTraceToTriplet` adapter. Usage:

    .venv-agl/bin/python tests/agl/llm_triplets.py http://algo:KEY@127.0.0.1:PORT ROLLOUT_ID

Prints one JSON line: the triplets' prompt and response token ids and rewards.
"""

from __future__ import annotations

import asyncio
import json
import sys

from agentlightning.adapter import TracerTraceToTriplet
from agentlightning.store.client_server import LightningStoreClient


async def main(url: str, rollout_id: str) -> dict:
    store = LightningStoreClient(url, retry_delays=(0.2,), health_retry_delays=(0.2,))
    try:
        spans = await store.query_spans(rollout_id)
    finally:
        await store.close()
    triplets = TracerTraceToTriplet().adapt(list(spans))
    return {"spans": len(spans), "triplets": [
        {"prompt": t.prompt["token_ids"], "response": t.response["token_ids"],
         "reward": t.reward, "response_id": t.metadata.get("response_id")}
        for t in triplets]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
