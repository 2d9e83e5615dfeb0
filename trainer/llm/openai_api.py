"""OpenAI request bodies in, OpenAI response bodies out (chat completions and completions).

Validation is strict and names the field at fault; errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`. As vLLM does, a request may ask for
`return_token_ids: true` and then gets `prompt_token_ids` and each choice's `token_ids` back
(the gateway's upstream mode relies on it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from trainer.llm import tools as llm_tools
from trainer.llm.engine import Params, Sequence_

MAX_N = 16
MAX_TOP_LOGPROBS = 20
# A positive temperature below this is decoded greedily (as 0): dividing logits by less
# overflows float32 and the sampling distribution becomes NaN.
MIN_TEMPERATURE = 1e-6


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = (
            message, param, status, code, kind)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class Parsed:
    kind: str  # "chat" or "completion"
    body: dict[str, Any]
    model: str
    params: Params
    n: int
    stream: bool
    logprobs: bool
    return_token_ids: bool
    include_usage: bool
    tools: llm_tools.Tools | None = None  # chat only: the functions offered (tools.py)

    def sequences(self, prompt_ids: list[int]) -> list[Sequence_]:
        return [Sequence_(list(prompt_ids), self.params, index=i) for i in range(self.n)]


def parse(body: Any, kind: str, *, max_tokens_cap: int | None = None) -> Parsed:
    """A request checked so that nothing it carries can fail inside the shared decode or
    the recording: every bad value is a 400 naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_strings(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", "model")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a 'role'",
                                 f"messages[{i}]")
            _check_content(m.get("content"), f"messages[{i}].content")
        try:
            tools = llm_tools.check(body)
        except llm_tools.Invalid as exc:
            raise BadRequest(str(exc), exc.param) from None
    else:
        tools = None
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if max_tokens is None:
        max_tokens = 16
    _integer(max_tokens, "max_tokens", 1, max_tokens_cap)
    temperature = _number(body.get("temperature", 1.0), "temperature", 0.0, 2.0)
    if temperature < MIN_TEMPERATURE:  # logits / 1e-39 overflow to NaN: decoded greedily
        temperature = 0.0
    top_p = _number(body.get("top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("'top_p' must be greater than 0", "top_p")
    n = _integer(body.get("n", 1), "n", 1, MAX_N)
    seed = body.get("seed")
    if seed is not None:
        _integer(seed, "seed", -(2**63), 2**64 - 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of up to 4 strings", "stop")
    if kind == "chat":
        logprobs = _boolean(body.get("logprobs", False), "logprobs")
        top = body.get("top_logprobs") or 0
        top = _integer(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        top = body.get("logprobs")
        logprobs = top is not None
        top = _integer(top or 0, "logprobs", 0, MAX_TOP_LOGPROBS) if logprobs else 0
    stream = _boolean(body.get("stream", False), "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return Parsed(
        kind=kind, body=body, model=model,
        params=Params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stops,
                      seed=seed, top_logprobs=top,
                      ignore_eos=_boolean(body.get("ignore_eos", False), "ignore_eos")),
        n=n, stream=stream, logprobs=logprobs,
        return_token_ids=_boolean(body.get("return_token_ids", False), "return_token_ids"),
        include_usage=bool(options.get("include_usage")),
        tools=tools,
    )


def _check_content(content: Any, name: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"'{name}' must be a string or a list of content parts", name)
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)):
            raise BadRequest(f"'{name}[{j}]' must be a text part: "
                             '{"type": "text", "text": "..."} (only text is supported)',
                             f"{name}[{j}]")


def _check_strings(body: dict[str, Any]) -> None:
    """No string anywhere in the body holds NUL (the store cannot keep it) or a lone
    surrogate (not text: the tokenizer cannot encode it). Iterative: any depth json.loads
    accepted."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                raise BadRequest(f"'{path}' contains a NUL character", path or None)
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"'{path}' is not valid text (a lone surrogate)",
                                 path or None) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path or "body"))
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", name)
    return value


def _integer(value: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"'{name}' must be between {low} and {high}" if high is not None
                         else f"'{name}' must be at least {low}", name)
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}", name)
    return float(value)


# --- responses --------------------------------------------------------------------------------
def _logprobs_chat(seq: Sequence_, text_of) -> dict[str, Any]:
    return {"content": [
        {"token": text_of(t), "logprob": lp, "bytes": list(text_of(t).encode()),
         "top_logprobs": [{"token": text_of(a), "logprob": v, "bytes": list(text_of(a).encode())}
                          for a, v in top]}
        for t, lp, top in zip(seq.token_ids, seq.logprobs, seq.top, strict=True)
    ]}


def _logprobs_text(seq: Sequence_, text_of) -> dict[str, Any]:
    return {"tokens": [text_of(t) for t in seq.token_ids], "token_logprobs": list(seq.logprobs),
            "top_logprobs": [{text_of(a): v for a, v in top} for top in seq.top],
            "text_offset": []}


def usage(prompt_ids: list[int], choices: list[Sequence_]) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def response(parsed: Parsed, *, rid: str, model: str, prompt_ids: list[int],
             choices: list[Sequence_], text_of, created: int | None = None,
             outputs: dict[int, llm_tools.Output] | None = None) -> dict[str, Any]:
    """`outputs`: each chat choice as parsed for tool calls (by index; else its text)."""
    created = created or int(time.time())
    out_choices = []
    for seq in choices:
        if parsed.kind == "chat":
            out = (outputs or {}).get(seq.index) or llm_tools.Output(
                seq.text, None, seq.finish_reason)
            message: dict[str, Any] = {"role": "assistant", "content": out.content}
            if out.tool_calls:
                message["tool_calls"] = out.tool_calls
            choice: dict[str, Any] = {
                "index": seq.index, "message": message, "finish_reason": out.finish_reason,
                "logprobs": _logprobs_chat(seq, text_of) if parsed.logprobs else None,
            }
        else:
            choice = {"index": seq.index, "text": seq.text, "finish_reason": seq.finish_reason,
                      "logprobs": _logprobs_text(seq, text_of) if parsed.logprobs else None}
        if parsed.return_token_ids:
            choice["token_ids"] = list(seq.token_ids)
        out_choices.append(choice)
    body = {"id": rid, "object": "chat.completion" if parsed.kind == "chat" else
            "text_completion", "created": created, "model": model, "choices": out_choices,
            "usage": usage(prompt_ids, choices)}
    if parsed.return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def chunk(parsed: Parsed, *, rid: str, model: str, created: int, index: int, text: str | None,
          finish_reason: str | None, role: bool = False, token_ids: list[int] | None = None,
          logprobs: dict[str, Any] | None = None,
          tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if parsed.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:  # OpenAI's streamed shape: each call whole, with its index
            delta["tool_calls"] = [dict(call, index=k) for k, call in enumerate(tool_calls)]
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason,
                                  "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason,
                  "logprobs": logprobs}
    if parsed.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk" if parsed.kind == "chat" else
            "text_completion", "created": created, "model": model, "choices": [choice]}
