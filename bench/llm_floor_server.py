"""The floor under any gateway on this machine (bench/llm_peer.py's `floor` path): the same
HTTP stack as the gateway (uvicorn, Starlette) answering every chat call at once with one
fixed completion of 8 tokens, no engine, no database. What the openai client and HTTP cost a
call at a given concurrency, whatever serves it.

    python bench/llm_floor_server.py PORT
"""

from __future__ import annotations

import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ANSWER = json.dumps({
    "id": "chatcmpl-floor", "object": "chat.completion", "created": 0, "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "abcdefgh"},
                 "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18},
}).encode()


async def chat(request: Request) -> Response:
    await request.body()
    return Response(ANSWER, media_type="application/json")


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/health", health, methods=["GET"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
