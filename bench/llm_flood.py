"""A tenant flooding the gateway (bench/llm_fairness.py runs it as its own process): `streams`
concurrent streamed chat calls of `n` sequences each, to the end of the context
(`ignore_eos`), one after another on each stream, retrying a 429 after 50 ms (no backoff: a
hostile tenant), until `seconds` have passed; prints one JSON line of counts.

    python bench/llm_flood.py --key KEY --streams 80 --n 4 --seconds 20 BASE_URL...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("urls", nargs="+")  # base URLs (.../v1), used in turn
    parser.add_argument("--key", required=True)
    parser.add_argument("--streams", type=int, default=80)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20)
    args = parser.parse_args()
    counts: dict[str, int] = {}
    chunks = [0]
    deadline = time.monotonic() + args.seconds
    body = {"model": "tiny", "messages": [{"role": "user", "content": "abc 7"}], "n": args.n,
            "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True}

    async def stream(i: int, client: httpx.AsyncClient) -> None:
        url = args.urls[i % len(args.urls)] + "/chat/completions"
        while time.monotonic() < deadline:
            try:
                async with client.stream("POST", url, json=body) as reply:
                    key = str(reply.status_code)
                    async for _ in reply.aiter_lines():
                        chunks[0] += 1
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            counts[key] = counts.get(key, 0) + 1
            if key == "429":
                await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {args.key}"},
                                 limits=httpx.Limits(max_connections=args.streams)) as client:
        await asyncio.gather(*(stream(i, client) for i in range(args.streams)))
    print(json.dumps({"statuses": counts, "lines": chunks[0]}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
