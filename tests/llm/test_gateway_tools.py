"""Tool calls (issue 24, point 4): `tools` / `tool_choice` / tool messages checked and
rendered, generated text parsed into `tool_calls` (whole and streamed), and a tool-using
episode recorded so that `aggregation: trajectory` makes one sample of it.

The parser and the stream's hold-back are driven with crafted texts. End to end, a real
gateway serves a *scripted* model: a 1-layer GPT-2 whose blocks add nothing (zero output
projections, zero position embeddings), so its next token depends on the current token only,
and whose output layer is set so that after `<|assistant|>` it writes, greedily, a Hermes
tool call for `get_weather` and stops. Real engine, tokenizer, HTTP and store: only the
weights are chosen instead of trained.
"""

from __future__ import annotations

import json
import string
from types import SimpleNamespace

import httpx
import openai
import pytest

from trainer import conventions as c
from trainer.algorithms.adapter import FinishedRollout
from trainer.algorithms.token_adapter import TokenAdapter
from trainer.llm import calls, tools
from trainer.llm.openai_api import BadRequest, parse
from trainer.llm.server import ServerThread, build_gateway
from trainer.llm.tokenizer import char_tokenizer
from trainer.llm.turns import Turns

from .test_gateway import client, llm_spans, started_attempt

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
ARGS = '{"city": "Paris"}'
CALL_BODY = '\n{"name": "get_weather", "arguments": ' + ARGS + '}\n'
USER = [{"role": "user", "content": "Weather in Paris?"}]


def offered(*specs, choice=None):
    body = {"model": "m", "messages": USER, "tools": list(specs)}
    if choice is not None:
        body["tool_choice"] = choice
    return parse(body, "chat").tools


# --- parsing ----------------------------------------------------------------------------------
def test_a_hermes_call_becomes_tool_calls_and_the_text_before_it_content():
    out = tools.parse(f"Let me look.<tool_call>{CALL_BODY}</tool_call>", "stop",
                      offered(WEATHER, LOOKUP), "rid:0")
    assert out.content == "Let me look." and out.finish_reason == "tool_calls"
    (call,) = out.tool_calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_several_calls_no_content_and_arguments_as_a_string_or_parameters():
    text = (f"<tool_call>{CALL_BODY}</tool_call>\n<tool_call>{{\"name\": \"lookup\", "
            f"\"parameters\": {{\"q\": 1}}}}</tool_call>\n<tool_call>{{\"name\": \"lookup\", "
            f"\"arguments\": \"{{\\\"q\\\": 2}}\"}}</tool_call>")
    out = tools.parse(text, "stop", offered(WEATHER, LOOKUP), "x")
    assert out.content is None and out.finish_reason == "tool_calls"
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in out.tool_calls] == [("get_weather", {"city": "Paris"}),
                                         ("lookup", {"q": 1}), ("lookup", {"q": 2})]
    assert len({t["id"] for t in out.tool_calls}) == 3
    # an unclosed last call that is whole JSON still counts (the model stopped at EOS)
    assert tools.parse(f"<tool_call>{CALL_BODY}", "stop", offered(WEATHER)).tool_calls


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
    "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": [1]}\n</tool_call>",
    "<tool_call>\n[\"get_weather\"]\n</tool_call>",
    f"<tool_call>{CALL_BODY}</tool_call><tool_call>oops</tool_call>",
    "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",  # deeper than json reads
])
def test_a_malformed_call_is_plain_content_with_finish_stop(text):
    out = tools.parse("ok " + text, "stop", offered(WEATHER))
    assert out == tools.Output("ok " + text, None, "stop")


def test_tool_choice_none_or_no_tools_never_parses_and_a_named_choice_admits_only_its_function():
    text = f"<tool_call>{CALL_BODY}</tool_call>"
    assert tools.parse(text, "stop", offered(WEATHER, choice="none")).tool_calls is None
    assert tools.parse(text, "stop", None).tool_calls is None
    named = offered(WEATHER, LOOKUP, choice={"type": "function", "function": {"name": "lookup"}})
    assert tools.parse(text, "stop", named).finish_reason == "stop"
    assert tools.parse(text, "stop", offered(WEATHER, choice="required")).tool_calls


def test_stream_holdback_sends_content_until_a_call_could_start():
    text = f"Hi <tool_call>{CALL_BODY}</tool_call>"
    ends = [tools.safe_end(text[:n], n) for n in range(len(text) + 1)]
    assert ends[3] == 3  # "Hi " goes out
    assert ends[4] == 3 and ends[8] == 3  # "<", "<too" could open a call: held
    assert all(e == 3 for e in ends[3:])  # nothing of the call goes out as content
    assert tools.safe_end("a < b", 5) == 5  # a "<" followed by what no tag starts with: sent
    assert tools.safe_end("x<tool_c", 8) == 1


def test_turns_compare_each_call_with_the_attempts_last_one_and_a_retry_with_the_one_before():
    attempt = calls.Attribution(SimpleNamespace(pk=1), "ro-1", "at-1", None)
    turns = Turns()
    assert turns.previous(attempt) is None and turns.follow(attempt, [1, 2], [[3], [4]]) is None
    assert turns.previous(attempt).ids == [[1, 2, 3], [1, 2, 4]]
    assert turns.follow(attempt, [1, 2, 4, 9], [[5]], key="k") is True  # extends choice 1
    # the same call again under its key: compared with nothing, spliced as its first try was
    assert turns.previous(attempt, key="k").ids == [[1, 2, 3], [1, 2, 4]]
    assert turns.follow(attempt, [1, 2, 4, 9], [[5]], key="k") is None
    assert turns.follow(attempt, [1, 2, 4], [[6]]) is False  # does not extend [1, 2, 4, 9, 5]
    other = calls.Attribution(SimpleNamespace(pk=1), "ro-1", "at-2", None)
    assert turns.follow(other, [7], [[8]]) is None  # attempts apart
    # a bounded memory: past max_tokens ids held, the least recently used attempts go
    small = Turns(max_tokens=10)
    small.follow(attempt, [1, 2, 3], [[4]])
    small.follow(other, [5, 6, 7], [[8]])
    small.follow(other, [5, 6, 7, 8, 9], [[10]])  # 6 ids + the 4 before them: attempt goes
    assert small.previous(attempt) is None and small.held == 10
    assert small.follow(other, [5, 6, 7, 8, 9, 10], [[11]]) is True


# --- checking ---------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": {"a": 1}}}]}]}, "messages[1].tool_calls[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
])
def test_bad_tool_fields_are_400_naming_the_field(extra, param):
    with pytest.raises(BadRequest) as caught:
        parse({"model": "m", "messages": USER, **extra}, "chat")
    assert caught.value.status == 400 and caught.value.param == param


# --- rendering --------------------------------------------------------------------------------
def test_without_template_support_tools_render_in_hermes_style_and_calls_render_back_as_made():
    tok = scripted_tokenizer()
    assert not tools.supports_tools(tok)
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tok.decode(tools.render(tok, history, offered(WEATHER)))
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert f"<|assistant|><tool_call>{CALL_BODY}</tool_call><eos>" in text
    assert "<|user|><tool_response>\nsunny\n</tool_response><|assistant|>" in text
    # tool_choice none: the functions are not offered
    assert "<tools>" not in tok.decode(tools.render(tok, USER, offered(WEATHER, choice="none")))
    required = tok.decode(tools.render(tok, USER, offered(WEATHER, choice="required")))
    assert tools.REQUIRED in required


def test_a_template_that_supports_tools_renders_them_itself():
    tok = scripted_tokenizer()
    tok.chat_template = (
        "{% if tools %}<|system|>TOOLS {% for t in tools %}{{ t.function.name }};{% endfor %}"
        "{% endif %}{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls %}"
        "{% for t in m.tool_calls %}CALL {{ t.function.name }} {{ t.function.arguments.city }}"
        "{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert tools.supports_tools(tok)
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]}]
    text = tok.decode(tools.render(tok, history, offered(WEATHER, LOOKUP)))
    assert text.startswith("<|system|>TOOLS get_weather;lookup;")
    assert "CALL get_weather Paris" in text  # arguments reach the template as an object
    deep = "[" * 5000 + "]" * 5000  # not JSON that json reads: passed on as the string
    history[1]["tool_calls"][0]["function"]["arguments"] = deep
    assert tools.render(tok, history, offered(WEATHER))


# --- end to end -------------------------------------------------------------------------------
def scripted_tokenizer(*extra):
    tok = char_tokenizer(string.printable)
    tok.add_tokens(["<tool_call>", "</tool_call>", CALL_BODY, *extra])
    return tok


@pytest.fixture(scope="session")
def scripted_dir(tmp_path_factory):
    """The scripted model: after `<|assistant|>`, greedily `<tool_call>`, the call's JSON,
    `</tool_call>`, EOS (four tokens)."""
    return scripted(tmp_path_factory.mktemp("scripted"), scripted_tokenizer(),
                    ["<|assistant|>", "<tool_call>", CALL_BODY, "</tool_call>", "<eos>"])


def scripted(path, tok, chain):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tok), n_layer=1, n_head=2, n_embd=64, n_positions=1024,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for block in model.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        model.transformer.wpe.weight.zero_()
        hidden = model.transformer.ln_f(model.transformer.wte.weight)  # what each token leaves
        model.lm_head.weight.zero_()
        ids = tok.convert_tokens_to_ids
        for now, then in zip(chain, chain[1:], strict=False):
            h = hidden[ids(now)]
            model.lm_head.weight[ids(then)] += 20 * h / h.dot(h)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def tool_gateway(scripted_dir, transactional_db):
    gateway = build_gateway(models=[f"scripted={scripted_dir}"])
    server = ServerThread(gateway.app()).start()
    try:
        yield gateway, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def ask(openai_client, messages, **extra):
    return openai_client.chat.completions.create(
        model="scripted", messages=messages, max_tokens=8, temperature=0, **extra)


@pytest.mark.slow
def test_a_tool_episode_is_answered_recorded_and_aggregated_as_one_trajectory(tool_gateway,
                                                                             keyed):
    gateway, base = tool_gateway
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    agent = client(base, key, rid, aid)
    first = ask(agent, USER, tools=[WEATHER, LOOKUP])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == (
        "function", "get_weather", ARGS)
    history = [*USER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = ask(agent, history, tools=[WEATHER, LOOKUP])
    assert second.choices[0].finish_reason == "tool_calls"

    spans = llm_spans(rid)
    assert len(spans) == 2
    one, two = (s.attributes for s in spans)
    tok = gateway.registry.by_name("scripted").tokenizer
    assert json.dumps(WEATHER) in tok.decode(one[c.LLM_PROMPT_IDS])  # the schema was rendered
    assert tok.convert_ids_to_tokens(one[c.LLM_RESPONSE_IDS]) == [
        "<tool_call>", CALL_BODY, "</tool_call>", "<eos>"]  # the ids generated, not re-made
    assert one[c.LLM_FINISH] == "tool_calls"
    assert one["gen_ai.completion.0.tool_calls.0.name"] == "get_weather"
    assert one["gen_ai.completion.0.tool_calls.0.id"] == call.id
    assert c.LLM_RETOKENIZED not in one and two[c.LLM_RETOKENIZED] is False
    assert two["gen_ai.prompt.2.tool_call_id"] == call.id
    # the second prompt extends the first call's prompt and response: one trajectory
    assert two[c.LLM_PROMPT_IDS][:len(one[c.LLM_PROMPT_IDS]) + 4] == (
        one[c.LLM_PROMPT_IDS] + one[c.LLM_RESPONSE_IDS])
    rollout = FinishedRollout(rollout_id=rid, mode="train", status="succeeded", input={},
                              spans=[{"name": s.name, "sequence_id": s.sequence_id,
                                      "attributes": s.attributes} for s in spans]
                              + [{"name": c.REWARD_ANNOTATION_SPAN, "sequence_id": 99,
                                  "attributes": {c.REWARD_VALUE_ATTR.format(index=0): 1.0}}])
    (sample,) = TokenAdapter("trajectory").samples(rollout)
    assert sample.input_ids == two[c.LLM_PROMPT_IDS] + two[c.LLM_RESPONSE_IDS]
    assert sample.generated == 8  # both turns' four tokens, and nothing else

    # a turn whose prompt does not extend the last: counted, on the span and the metric
    before = _metric(gateway, "lightning_gateway_retokenization_mismatches_total")
    ask(agent, [{"role": "user", "content": "something else"}], tools=[WEATHER])
    assert llm_spans(rid)[-1].attributes[c.LLM_RETOKENIZED] is True
    assert _metric(gateway, "lightning_gateway_retokenization_mismatches_total") == before + 1


def _metric(gateway, name):
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"model": "scripted"}) or 0.0


@pytest.mark.slow
def test_malformed_and_declined_calls_come_back_as_content(tool_gateway, keyed):
    _, base = tool_gateway
    _, key, *_ = keyed
    agent = client(base, key)
    expected = f"<tool_call>{CALL_BODY}</tool_call>"
    # the model calls get_weather, which this request does not offer: content, stop
    unknown = ask(agent, USER, tools=[LOOKUP]).choices[0]
    assert (unknown.message.content, unknown.message.tool_calls, unknown.finish_reason) == (
        expected, None, "stop")
    named = ask(agent, USER, tools=[WEATHER, LOOKUP],
                tool_choice={"type": "function", "function": {"name": "lookup"}}).choices[0]
    assert (named.message.content, named.finish_reason) == (expected, "stop")
    declined = ask(agent, USER, tools=[WEATHER], tool_choice="none").choices[0]
    assert (declined.message.content, declined.finish_reason) == (expected, "stop")
    with pytest.raises(openai.BadRequestError) as caught:
        ask(agent, USER, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert caught.value.body["param"] == "tool_choice.function.name"


@pytest.mark.slow
def test_a_streamed_call_holds_the_call_back_and_sends_it_whole(tool_gateway, keyed):
    gateway, base = tool_gateway
    project, key, *_ = keyed
    rid, aid = started_attempt(project)
    agent = client(base, key, rid, aid)
    chunks = list(ask(agent, USER, tools=[WEATHER], stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == ""  # nothing of the call leaked out as content
    deltas = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or []]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in deltas] == [
        (0, "function", "get_weather", ARGS)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert llm_spans(rid)[0].attributes["gen_ai.completion.0.tool_calls.0.id"] == deltas[0].id
    # malformed (not offered) in a stream: flushed as content at the end, finish stop
    chunks = list(ask(agent, USER, tools=[LOOKUP], stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == f"<tool_call>{CALL_BODY}</tool_call>"
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_upstream_mode_passes_tools_and_tool_calls_through(tool_gateway, keyed):
    _, engine_base = tool_gateway
    project, key, *_ = keyed
    front = build_gateway(upstream_url=f"{engine_base}/v1", upstream_key=key)
    server = ServerThread(front.app()).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        rid, aid = started_attempt(project)
        agent = client(base, key, rid, aid)
        reply = ask(agent, USER, tools=[WEATHER]).choices[0]
        assert reply.finish_reason == "tool_calls"
        assert reply.message.tool_calls[0].function.arguments == ARGS
        streamed = list(ask(agent, USER, tools=[WEATHER], stream=True))
        deltas = [t for ch in streamed if ch.choices for t in ch.choices[0].delta.tool_calls
                  or []]
        assert [t.function.name for t in deltas] == ["get_weather"]
        assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == \
            "tool_calls"
        # tool_choice none reaches the upstream: it parses nothing
        declined = ask(agent, USER, tools=[WEATHER], tool_choice="none").choices[0]
        assert declined.finish_reason == "stop" and declined.message.tool_calls is None
        spans = llm_spans(rid)
        assert len(spans) == 3
        a = spans[0].attributes
        assert a["gen_ai.completion.0.tool_calls.0.id"] == reply.message.tool_calls[0].id
        assert len(a[c.LLM_RESPONSE_IDS]) == 4 and a[c.LLM_FINISH] == "tool_calls"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_bad_tools_body_is_400_over_http(tool_gateway, keyed):
    _, base = tool_gateway
    _, key, *_ = keyed
    answer = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": "scripted", "messages": USER, "tools": "get_weather"})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "tools"


@pytest.mark.slow
def test_a_later_turn_starts_with_the_ids_generated_not_their_retokenization(
        tmp_path, keyed, transactional_db):
    """The model writes "a", "b" as two tokens; the tokenizer reads the text "ab" back as one
    token. The next turn's prompt still starts with the two generated ids (spliced in)."""
    tok = scripted_tokenizer("ab")
    assert tok("ab", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("ab")]
    path = scripted(tmp_path, tok, ["<|assistant|>", "a", "b", "<eos>"])
    gateway = build_gateway(models=[f"scripted={path}"])
    server = ServerThread(gateway.app()).start()
    try:
        project, key, *_ = keyed
        rid, aid = started_attempt(project)
        agent = client(f"http://127.0.0.1:{server.port}", key, rid, aid)
        first = ask(agent, USER).choices[0].message
        assert first.content == "ab"
        ask(agent, [*USER, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": "and tomorrow?"}])
        one, two = (s.attributes for s in llm_spans(rid))
        assert tok.convert_ids_to_tokens(one[c.LLM_RESPONSE_IDS]) == ["a", "b", "<eos>"]
        assert two[c.LLM_RETOKENIZED] is False
        assert two[c.LLM_PROMPT_IDS][:len(one[c.LLM_PROMPT_IDS]) + 3] == (
            one[c.LLM_PROMPT_IDS] + one[c.LLM_RESPONSE_IDS])
        assert tok.decode(two[c.LLM_PROMPT_IDS]).endswith(
            "<|assistant|>ab<eos><|user|>and tomorrow?<|assistant|>")
    finally:
        server.stop()


@pytest.mark.slow
def test_a_call_written_its_own_way_is_rendered_back_as_written(tmp_path, keyed,
                                                               transactional_db):
    """The model writes its call compactly and adds a remark after it; the client gets the
    canonical call and sends it back; the next prompt holds the text as generated."""
    compact = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    tok = scripted_tokenizer(compact, " ok")
    path = scripted(tmp_path, tok, ["<|assistant|>", "<tool_call>", compact, "</tool_call>",
                                    " ok", "<eos>"])
    gateway = build_gateway(models=[f"scripted={path}"])
    server = ServerThread(gateway.app()).start()
    try:
        project, key, *_ = keyed
        rid, aid = started_attempt(project)
        agent = client(f"http://127.0.0.1:{server.port}", key, rid, aid)
        first = ask(agent, USER, tools=[WEATHER]).choices[0].message
        (call,) = first.tool_calls
        assert call.function.arguments == ARGS  # canonical for the client
        history = [*USER, first.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        ask(agent, history, tools=[WEATHER])
        changed = [*USER, {**first.model_dump(exclude_none=True), "tool_calls": [
            {**call.model_dump(), "function": {"name": "get_weather",
                                               "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        ask(agent, changed, tools=[WEATHER])
        one, two, three = (s.attributes for s in llm_spans(rid))
        assert two[c.LLM_RETOKENIZED] is False
        assert f"<|assistant|><tool_call>{compact}</tool_call> ok<eos>" in tok.decode(
            two[c.LLM_PROMPT_IDS])
        # a history the client changed renders as sent (and does not chain)
        assert three[c.LLM_RETOKENIZED] is True
        assert '"arguments": {"city": "Rome"}' in tok.decode(three[c.LLM_PROMPT_IDS])
    finally:
        server.stop()
