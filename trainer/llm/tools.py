"""Tool calls on `/v1/chat/completions`: the request's `tools` / `tool_choice` checked, the
prompt rendered with them, and the generated text parsed back into OpenAI `tool_calls`.

Rendering: with the tokenizer's own chat template when it supports tools (it mentions
`tools`: `apply_chat_template(messages, tools=...)`), else in Hermes style (the format Qwen
2.5 and Hermes models are trained on): a system block listing the functions' JSON schemas
inside `<tools></tools>` and asking for `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`; an assistant's earlier calls are rendered as those blocks, and `tool` results as
`<tool_response>...</tool_response>` in a user turn. Either way the generated text is parsed
as Hermes-style blocks: the text before the first `<tool_call>` is the content, each block a
call. A malformed call (bad JSON, no or unknown name, arguments not an object, or for a named
`tool_choice` another function) makes the whole answer plain content with finish reason
`stop`. Parsing never re-tokenizes: the recorded token ids stay the generated ones.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from trainer.llm.tokenizer import render_chat

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
SYSTEM_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
REQUIRED = "You must call at least one of the functions."
NAMED = "You must call the function {name}."


class Invalid(ValueError):
    """A malformed tools field; `param` names it (the gateway answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """What a request offers: its function specs and how the model must use them."""

    specs: tuple[dict[str, Any], ...]
    choice: str = "auto"  # none, auto, required, or "function" (named)
    named: str | None = None

    @property
    def offered(self) -> bool:
        return bool(self.specs) and self.choice != "none"

    @property
    def names(self) -> set[str]:
        return {s["function"]["name"] for s in self.specs}


@dataclass(frozen=True)
class Previous:
    """An attempt's last call: prompt plus response ids (one list per choice), and for each
    choice that called tools, its call ids -> (the assistant message as rendered back from what
    the client got, the text generated)."""

    ids: list[list[int]]
    said: dict[tuple[str, ...], tuple[str, str]]


@dataclass(frozen=True)
class Output:
    """A choice as the client sees it."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None


# --- checking ---------------------------------------------------------------------------------
def check(body: dict[str, Any]) -> Tools | None:
    """The request's tools (None when it has none), its messages' tool fields checked."""
    for i, message in enumerate(body.get("messages") or []):
        _check_message(message, f"messages[{i}]")
    raw, choice = body.get("tools"), body.get("tool_choice")
    if body.get("parallel_tool_calls") is not None and not isinstance(
            body["parallel_tool_calls"], bool):
        raise Invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if raw is None:
        if choice is None or choice in ("none", "auto"):
            return None
        raise Invalid("'tool_choice' needs 'tools'", "tool_choice")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TOOLS:
        raise Invalid(f"'tools' must be a list of 1 to {MAX_TOOLS} function specs", "tools")
    seen: set[str] = set()
    for i, spec in enumerate(raw):
        name = _check_spec(spec, f"tools[{i}]")
        if name in seen:
            raise Invalid(f"'tools[{i}]': the function {name!r} is listed twice",
                          f"tools[{i}].function.name")
        seen.add(name)
    tools = Tools(tuple(raw))
    if choice is None or choice in CHOICES:
        return Tools(tools.specs, choice or "auto")
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise Invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                      '{"type": "function", "function": {"name": ...}}', "tool_choice")
    name = choice["function"]["name"]
    if name not in seen:
        raise Invalid(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                      "tool_choice.function.name")
    return Tools(tools.specs, "function", name)


def _check_spec(spec: Any, where: str) -> str:
    if not (isinstance(spec, dict) and spec.get("type") == "function"
            and isinstance(spec.get("function"), dict)):
        raise Invalid(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                      where)
    function = spec["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise Invalid(f"'{where}.function.name' must be 1-64 letters, digits, _ or -",
                      f"{where}.function.name")
    if not isinstance(function.get("description", ""), str):
        raise Invalid(f"'{where}.function.description' must be a string",
                      f"{where}.function.description")
    if not isinstance(function.get("parameters", {}), dict):
        raise Invalid(f"'{where}.function.parameters' must be a JSON schema object",
                      f"{where}.function.parameters")
    return name


def _check_message(message: dict[str, Any], where: str) -> None:
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant":
            raise Invalid(f"'{where}.tool_calls' is only for assistant messages",
                          f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise Invalid(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
        for j, call in enumerate(calls):
            at = f"{where}.tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(call, dict) and isinstance(call.get("id"), str)
                    and call.get("type", "function") == "function"
                    and isinstance(function, dict) and isinstance(function.get("name"), str)
                    and isinstance(function.get("arguments", ""), str)):
                raise Invalid(f"'{at}' must be {{\"id\", \"type\": \"function\", \"function\": "
                              f"{{\"name\", \"arguments\" (a JSON string)}}}}", at)
    if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise Invalid(f"'{where}.tool_call_id' is required for a tool message (a string)",
                      f"{where}.tool_call_id")


# --- rendering --------------------------------------------------------------------------------
def supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: a "tool_use" one, or the default
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: Tools | None,
           previous: Previous | None = None) -> list[int]:
    """Prompt token ids for chat `messages` with their tool calls and results, and the
    tools offered (none for `tool_choice: none`).

    `previous`: the attempt's last call. Its calls, sent back unchanged, render as the text
    that was generated (whatever its spacing); and when the rendered text starts with its
    prompt plus response ids decoded, those ids are kept as they are and only the rest is
    tokenized: the model's own tokens, not a re-tokenization of their text (which may split
    differently), so the turns chain into one trajectory."""
    said = previous.said if previous is not None else {}
    if not getattr(tokenizer, "chat_template", None):  # "role: content" lines
        return render_chat(tokenizer, hermes_messages(messages, tools, said))
    if supports_tools(tokenizer):
        extra = {"tools": list(tools.specs)} if tools is not None and tools.offered else {}
        text = tokenizer.apply_chat_template(native_messages(messages, tools),
                                             add_generation_prompt=True, tokenize=False, **extra)
    else:
        text = tokenizer.apply_chat_template(hermes_messages(messages, tools, said),
                                             add_generation_prompt=True, tokenize=False)
    for ids in previous.ids if previous is not None else []:
        done = tokenizer.decode(ids, skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        if done and text.startswith(done):
            return list(ids) + _encode(tokenizer, text[len(done):])
    return _encode(tokenizer, text)


def _encode(tokenizer: Any, text: str) -> list[int]:
    # As apply_chat_template(tokenize=True) does: the template wrote any BOS itself.
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] if text \
        else []


def native_messages(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict]:
    """Messages for a chat template that supports tools (arguments as objects, as Hugging
    Face templates expect), with the tool_choice instruction in the system message."""
    out = []
    for m in messages:
        message = {"role": m["role"], "content": text(m.get("content"))}
        if m.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": _loads_or_text(c["function"].get("arguments") or "{}")}}
                for c in m["tool_calls"]]
        if m.get("role") == "tool":
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return _with_system(out, instruction(tools)) if instruction(tools) else out


def hermes_messages(messages: list[dict[str, Any]], tools: Tools | None,
                    said: dict[tuple[str, ...], tuple[str, str]] | None = None) -> list[dict]:
    """Plain role/content messages carrying the tools in Hermes style (for a template that
    does not support tools). `said`: see Previous."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = text(m.get("content"))
        if m.get("role") == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        if m.get("tool_calls"):
            content = calls_text(content, [(c["function"]["name"],
                                            c["function"].get("arguments") or "{}")
                                           for c in m["tool_calls"]])
            made = (said or {}).get(tuple(c["id"] for c in m["tool_calls"]))
            if made is not None and made[0] == content:  # as the model wrote it
                content = made[1]
        out.append({"role": m["role"], "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools is not None and tools.offered:
        listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in tools.specs)
        block = SYSTEM_BLOCK.format(tools=listing)
        if instruction(tools):
            block += "\n\n" + instruction(tools)
        out = _with_system(out, block)
    return out


def calls_text(content: str, calls: list[tuple[str, str]]) -> str:
    return content + "\n".join(call_text(name, arguments) for name, arguments in calls)


def said(out: Output, generated: str) -> dict[tuple[str, ...], tuple[str, str]]:
    """A choice's entry in Previous.said ({} when it called no tool)."""
    if not out.tool_calls:
        return {}
    rendered = calls_text(out.content or "", [(c["function"]["name"], c["function"]["arguments"])
                                              for c in out.tool_calls])
    return {tuple(c["id"] for c in out.tool_calls): (rendered, generated)}


def call_text(name: str, arguments: str) -> str:
    """One call as the model is asked to write it (and as its earlier calls are rendered): the
    parser's canonical form, so a call read back renders to the text that was generated."""
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ' \
           f"{arguments}}}\n{CLOSE}"


def instruction(tools: Tools | None) -> str:
    if tools is None or not tools.offered:
        return ""
    if tools.choice == "required":
        return REQUIRED
    return NAMED.format(name=tools.named) if tools.choice == "function" else ""


def _with_system(messages: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{block}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


def text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def extra_chars(body: dict[str, Any]) -> int:
    """Characters the tools add to a prompt (for the length check made before tokenizing)."""
    size = len(json.dumps(body["tools"])) if isinstance(body.get("tools"), list) else 0
    for m in body.get("messages") or []:
        for call in m.get("tool_calls") or []:
            size += len(call["function"]["name"]) + len(call["function"].get("arguments") or "")
    return size


# --- parsing ----------------------------------------------------------------------------------
def parse(generated: str, finish_reason: str | None, tools: Tools | None,
          call_id: str = "call") -> Output:
    """The generated text as the client gets it: content, and tool calls when every block
    after the first `<tool_call>` is a valid call. `call_id` seeds the calls' ids."""
    start = generated.find(OPEN) if tools is not None and tools.offered else -1
    if start < 0:
        return Output(generated, None, finish_reason)
    calls = _calls(generated[start:], tools)
    if calls is None:  # malformed: all of it is content
        return Output(generated, None, finish_reason or "stop")
    out = [{"id": f"call_{hashlib.sha256(f'{call_id}:{k}'.encode()).hexdigest()[:24]}",
            "type": "function", "function": {"name": name, "arguments": arguments}}
           for k, (name, arguments) in enumerate(calls)]
    return Output(generated[:start] or None, out, "tool_calls")


def _calls(rest: str, tools: Tools) -> list[tuple[str, str]] | None:
    calls = []
    while rest.lstrip().startswith(OPEN):
        rest = rest.lstrip()[len(OPEN):]
        end = rest.find(CLOSE)
        body, rest = (rest, "") if end < 0 else (rest[:end], rest[end + len(CLOSE):])
        call = _call(body, tools)
        if call is None:
            return None
        calls.append(call)
    return calls or None  # text after the last call is dropped (it stays in the token ids)


def _call(body: str, tools: Tools) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past what json reads
            return None
    if (not isinstance(name, str) or name not in tools.names or not isinstance(arguments, dict)
            or (tools.named is not None and name != tools.named)):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def safe_end(generated: str, end: int) -> int:
    """How much of `generated` may be streamed as content now (at most `end`): nothing from a
    `<tool_call>` on, nor a tail that could be the start of one."""
    start = generated.find(OPEN)
    if 0 <= start < end:
        return start
    for k in range(min(len(OPEN) - 1, end), 0, -1):
        if generated[end - k:end] == OPEN[:k]:
            return end - k
    return end
