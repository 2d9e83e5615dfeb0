"""Upstream mode: the gateway forwards calls to another OpenAI-compatible server (vLLM,
SGLang, or another gateway) and records the token ids that server returns.

The request goes on as sent, with `logprobs` and vLLM's `return_token_ids: true` added (and
`stream` off: a streamed call is forwarded whole, then streamed to the client). The answer's
`prompt_token_ids`, each choice's `token_ids` and its per-token log-probabilities are what the
span records; an upstream that returns no token ids is an error (502), since a call recorded
without them cannot be trained on. `tools`, `tool_choice` and tool messages go on as sent, and
the upstream's `tool_calls` (parsed by it) come back unchanged, streamed too.
"""

from __future__ import annotations

from typing import Any

import httpx

from trainer.llm.engine import Sequence_
from trainer.llm.openai_api import BadRequest
from trainer.llm.tools import Output


class Upstream:
    def __init__(self, url: str, *, api_key: str = "", model: str = "",
                 timeout: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)

    def close(self) -> None:
        self.client.close()

    def complete(self, prepared: Any) -> None:
        parsed = prepared.parsed
        body = dict(parsed.body, stream=False, return_token_ids=True)
        lease = getattr(prepared, "lease", None)
        if lease is not None:  # the LoRA adapter the rollout pinned (upstream_lora.py)
            body["model"] = lease.name
        body.pop("stream_options", None)
        if parsed.kind == "chat":
            body["logprobs"] = True
            body.setdefault("top_logprobs", parsed.params.top_logprobs or None)
            if body["top_logprobs"] is None:
                body.pop("top_logprobs")
        elif body.get("logprobs") is None:
            body["logprobs"] = 0
        path = "/chat/completions" if parsed.kind == "chat" else "/completions"
        try:
            answer = self.client.post(self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise BadRequest(f"the upstream server failed: {exc}", status=502,
                             kind="upstream_error") from None
        if answer.status_code >= 400:
            try:
                error = answer.json()
            except ValueError:
                error = {"error": {"message": answer.text[:500]}}
            raise _passed_on(answer.status_code, error)
        data = answer.json()
        prompt_ids = data.get("prompt_token_ids")
        if not isinstance(prompt_ids, list):
            raise BadRequest("the upstream server returned no prompt_token_ids (vLLM: "
                             "return_token_ids); calls cannot be recorded for training",
                             status=502, kind="upstream_error")
        prepared.prompt_ids = [int(t) for t in prompt_ids]
        prepared.model_name = (parsed.model if lease is not None  # not the adapter's name
                               else data.get("model") or parsed.model)
        choices = data.get("choices") or []
        prepared.choices = [self._choice(parsed, c) for c in choices]
        if parsed.kind == "chat":  # the answer as the upstream gave it (its tool calls too)
            for seq, choice in zip(prepared.choices, choices, strict=True):
                message = choice.get("message") or {}
                prepared.outputs[seq.index] = Output(
                    message.get("content"), message.get("tool_calls") or None,
                    seq.finish_reason)
        prepared.text_of = _token_texts(data)

    @staticmethod
    def _choice(parsed: Any, choice: dict[str, Any]) -> Sequence_:
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            raise BadRequest("the upstream server returned a choice without token_ids",
                             status=502, kind="upstream_error")
        seq = Sequence_([], parsed.params, index=int(choice.get("index", 0)))
        seq.token_ids = [int(t) for t in ids]
        logprobs = choice.get("logprobs") or {}
        if parsed.kind == "chat":
            content = logprobs.get("content") or []
            seq.logprobs = [float(e["logprob"]) for e in content]
            seq.top = [[(e2["token"], float(e2["logprob"])) for e2 in e.get("top_logprobs") or []]
                       for e in content]
            seq.text = (choice.get("message") or {}).get("content") or ""
        else:
            seq.logprobs = [float(x) for x in logprobs.get("token_logprobs") or []]
            seq.top = [list((t or {}).items()) for t in logprobs.get("top_logprobs") or []]
            seq.text = choice.get("text") or ""
        if len(seq.logprobs) != len(seq.token_ids):
            raise BadRequest("the upstream server's logprobs do not match its token_ids",
                             status=502, kind="upstream_error")
        if len(seq.top) != len(seq.token_ids):
            seq.top = [[] for _ in seq.token_ids]
        seq.finish_reason = choice.get("finish_reason") or "stop"
        return seq


def _token_texts(data: dict[str, Any]):
    """Token id -> text, from what the upstream's logprobs said (ids it never named: str)."""
    names: dict[int, str] = {}
    for choice in data.get("choices") or []:
        content = (choice.get("logprobs") or {}).get("content") or []
        for token_id, entry in zip(choice.get("token_ids") or [], content, strict=False):
            names[int(token_id)] = entry.get("token", str(token_id))
    return lambda t: names.get(t, str(t)) if isinstance(t, int) else str(t)


def _passed_on(status: int, error: dict[str, Any]) -> BadRequest:
    detail = error.get("error") if isinstance(error.get("error"), dict) else {}
    return BadRequest(detail.get("message") or "the upstream server refused the call",
                      detail.get("param"), status=status if status < 500 else 502,
                      code=detail.get("code"), kind=detail.get("type") or "upstream_error")
