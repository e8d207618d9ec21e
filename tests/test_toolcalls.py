"""Tool calls: <tool_call> blocks in a reply -> the OpenAI API's message.tool_calls.

The parser on text cut at every place, and the server end to end (openai client, whole and
streamed) on an engine whose replies are scripted: a random model does not write tool calls,
and what is under test is the server's reading of them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.runtime import Engine, GenerationParams
from engine.serve import create_app
from engine.toolcalls import ToolCallParser, call_format, param_types, parse_call, split_reply
from test_serve import CONFIG, HELLO, NAME, ServerThread, build_random_qwen3_moe

CALL = {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}
REPLY = (f"Let me look.\n<tool_call>\n{json.dumps(CALL, ensure_ascii=False)}\n</tool_call>\n"
         f'<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
# Qwen's template: the tools in a system block that asks for <tool_call> tags
TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
            "Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
            "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
            "{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def events_of(text: str, cuts, types=None, kind="tool_calls") -> list:
    p = ToolCallParser(types, kind=kind)
    out, last = [], 0
    for c in list(cuts) + [len(text)]:
        out += p.push(text[last:c])
        last = c
    out += p.flush()
    merged = []   # adjacent text events joined: where the pieces were cut must not matter
    for k, v in out:
        if merged and k == "text" and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + v)
        else:
            merged.append((k, v))
    return merged


def test_parser_any_cut():
    whole = events_of(REPLY, [])
    assert [k for k, _ in whole] == ["text", "call", "text", "call"]
    assert whole[0][1] == "Let me look.\n" and whole[2][1] == "\n"
    assert json.loads(whole[1][1]["function"]["arguments"]) == CALL["arguments"]
    assert whole[1][1]["function"]["name"] == "get_weather" and whole[1][1]["type"] == "function"
    assert whole[3][1]["function"] == {"name": "get_time", "arguments": "{}"}
    strip = [(k, v if k == "text" else v["function"]) for k, v in whole]
    for cut in range(1, len(REPLY)):
        for second in (cut + 1, cut + 7):
            got = events_of(REPLY, [cut, min(second, len(REPLY))])
            assert [(k, v if k == "text" else v["function"]) for k, v in got] == strip, cut


@pytest.mark.parametrize("text", [
    "no calls at all, a < sign and <tool",                 # a held tail that never becomes a tag
    "<tool_call>{not json}</tool_call> after",             # a block that does not parse
    '<tool_call>{"arguments": {}}</tool_call>',            # no name
    'before <tool_call>{"name": "x", "arguments": {}',     # left open at the end
])
def test_what_is_not_a_call_stays_text(text):
    assert events_of(text, [len(text) // 2]) == [("text", text)]
    assert split_reply(text) == (text, "", [])


def test_qwen35_xml_calls_and_reasoning():
    """Qwen3.5 / Qwen3-Coder's <function=...><parameter=...> blocks, values typed by the tools'
    schemas (JSON where it parses, unless declared a string); a <tool_call> inside <think> is
    reasoning, not a call, and so is all of a reply whose prompt ended with <think>."""
    xml = ("<think>\nMaybe <tool_call> get_weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
           "<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
           "<parameter=zip>\n8001\n</parameter>\n</function>\n</tool_call>")
    types = param_types([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "zip": {"type": "string"}}}}}])
    for cut in range(1, len(xml)):
        p = ToolCallParser(types)
        ev = p.push(xml[:cut]) + p.push(xml[cut:]) + p.flush()
        text = "".join(v for k, v in ev if k == "text")
        calls = [v["function"] for k, v in ev if k == "call"]
        assert text == "<think>\nMaybe <tool_call> get_weather.\n</think>\n\n", cut
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [("get_weather", {"city": "Zürich", "days": 3, "zip": "8001"})], cut
    inside = "still thinking <tool_call>{\"name\": \"f\"}</tool_call></think>done"
    assert split_reply(inside, thinking=True) == (inside, "", [])
    assert split_reply(inside)[2][0]["function"]["name"] == "f"


WEATHER_TYPES = param_types([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}}}}},
                              {"type": "function", "function": {"name": "get_time"}}])
WANT = [("get_weather", {"city": "Zürich", "days": 3, "zip": "8001"}), ("get_time", {})]


def calls_at_any_cut(reply: str, kind: str) -> str:
    """The calls of reply, the same wherever the text is cut; returns the text around them."""
    texts = set()
    for cut in range(1, len(reply)):
        ev = events_of(reply, [cut], WEATHER_TYPES, kind)
        assert [(v["function"]["name"], json.loads(v["function"]["arguments"]))
                for k, v in ev if k == "call"] == WANT, cut
        texts.add("".join(v for k, v in ev if k == "text"))
    assert len(texts) == 1
    return texts.pop()


@pytest.mark.parametrize("sep", ["\n", ""])
def test_glm_calls(sep):
    """GLM-4.5 / 4.6's blocks (a line each) and GLM-4.7's (none): the name, then key / value
    pairs typed by the schema; a name alone is a call to a tool the request gave."""
    reply = (f"Sure.<tool_call>get_weather{sep}<arg_key>city</arg_key>{sep}<arg_value>Zürich"
             f"</arg_value>{sep}<arg_key>days</arg_key>{sep}<arg_value>3</arg_value>{sep}"
             f"<arg_key>zip</arg_key>{sep}<arg_value>8001</arg_value>{sep}</tool_call>{sep}"
             f"<tool_call>get_time{sep}</tool_call>")
    assert calls_at_any_cut(reply, "tool_calls") == "Sure." + sep


@pytest.mark.parametrize("body", [
    "lookup",                                                        # a name no tool has
    "get_weather <arg_key>city</arg_key>",                           # a key without its value
    "get_weather<arg_key>a</arg_key><arg_value>1</arg_value>junk",   # text after the pairs
    "get weather<arg_key>a</arg_key><arg_value>1</arg_value>",       # not a name
])
def test_what_is_no_glm_call(body):
    assert parse_call(body, WEATHER_TYPES) is None


def test_minimax_calls():
    """MiniMax-M2's <minimax:tool_call> block, several invokes in one, values typed by the
    schema; a <tool_call> tag is text there, and a block with a malformed invoke stays text."""
    reply = ('Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
             'Zürich</parameter>\n<parameter name="days">3</parameter>\n<parameter name="zip">'
             '8001</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n'
             '</minimax:tool_call>')
    assert calls_at_any_cut(reply, "minimax") == "Sure.\n"
    for bad in ('<minimax:tool_call><invoke name="f"><parameter name="a">1</invoke>'
                '</minimax:tool_call>',
                '<minimax:tool_call>text</minimax:tool_call>',
                '<tool_call>{"name": "f", "arguments": {}}</tool_call>'):
        assert events_of(bad, [5], WEATHER_TYPES, "minimax") == [("text", bad)]
    assert call_format("... <minimax:tool_call> ...") == "minimax"
    assert call_format("... <tool_call> ...") == "tool_calls"
    assert call_format("no calls") is None and call_format(None) is None


def test_kimi_calls():
    """Kimi-K2's section of calls (special-token markers), the model's ids kept, arguments as
    JSON; a section with a malformed call stays text."""
    reply = ("Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Zürich", "days": 3, "zip": "8001"}'
             "<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
             "{}<|tool_call_end|><|tool_calls_section_end|>")
    assert calls_at_any_cut(reply, "kimi") == "Sure."
    ids = [v["id"] for k, v in events_of(reply, [7], WEATHER_TYPES, "kimi") if k == "call"]
    assert ids == ["functions.get_weather:0", "functions.get_time:1"]
    for bad in ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                "<|tool_call_argument_begin|>{oops}<|tool_call_end|><|tool_calls_section_end|>",
                "<|tool_calls_section_begin|>text<|tool_calls_section_end|>"):
        assert events_of(bad, [5], WEATHER_TYPES, "kimi") == [("text", bad)]
    assert call_format("...<|tool_calls_section_begin|>...") == "kimi"
    # K2-Thinking: the section may follow reasoning that was never closed
    single = reply.replace("_calls_section", "_call_section")   # the singular markers
    assert calls_at_any_cut(single, "kimi") == "Sure."
    # (the reasoning passes through as text, as for the other formats)
    for start, thinking in (("<think>plan", False), ("plan", True)):
        content, _, calls = split_reply(start + reply[5:], "kimi", WEATHER_TYPES, thinking)
        assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
        assert content == start


def test_odd_schemas_and_values():
    """Tools whose schemas are not objects give no types (not a server error); an XML value that
    only Python's JSON reads (NaN) stays a string, so the arguments stay valid JSON."""
    from engine.toolcalls import param_types, parse_call
    assert param_types([{"function": {"name": "f", "parameters": "x"}},
                        {"function": {"name": "g", "parameters": {"properties": [1]}}}]) == \
        {"f": {}, "g": {}}
    call = parse_call("<function=f>\n<parameter=x>\nNaN\n</parameter>\n</function>")
    assert json.loads(call["function"]["arguments"]) == {"x": "NaN"}


def test_values_typed_by_what_the_schema_allows():
    """A value is JSON only where its schema allows no string: Optional[str] (a type list, or
    Pydantic's anyOf) keeps "12345" text, and so does a parameter the schema does not declare;
    a value whose </parameter> the model left out ends at the next parameter or the body."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "zip": {"type": ["string", "null"]}, "id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "n": {"type": "integer"}, "flag": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}}}]
    types = param_types(tools)
    assert types["f"] == {"zip": {"string", "null"}, "id": {"string", "null"}, "n": {"integer"},
                          "flag": {"boolean", "null"}}
    body = ("<function=f>\n<parameter=zip>\n12345\n</parameter>\n<parameter=id>\n007\n"
            "</parameter>\n<parameter=n>\n12\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n"
            "<parameter=extra>\n42\n</parameter>\n</function>")
    assert json.loads(parse_call(body, types)["function"]["arguments"]) == \
        {"zip": "12345", "id": "007", "n": 12, "flag": True, "extra": "42"}
    open_ended = "<function=f>\n<parameter=zip>\n8001\n<parameter=n>\n3\n</function>"
    assert json.loads(parse_call(open_ended, types)["function"]["arguments"]) == \
        {"zip": "8001", "n": 3}


@pytest.mark.parametrize("args", ['{"x": NaN}', "null", '"hello"', "[1, 2]", '"{\\"a\\": Infinity}"'])
def test_arguments_that_are_no_json_object_leave_the_block_text(args):
    text = '<tool_call>{"name": "f", "arguments": ' + args + '}</tool_call>'
    assert split_reply(text) == (text, "", [])


def test_think_opens_reasoning_only_at_the_reply_start():
    """A <think> the answer mentions is text: the call after it is still read."""
    reply = 'Use the <think> tag. <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, _, calls = split_reply(reply)
    assert content == "Use the <think> tag." and [c["function"]["name"] for c in calls] == ["f"]
    for cut in range(1, len(reply)):
        assert [k for k, _ in events_of(reply, [cut])].count("call") == 1, cut
    lead = '\n<think>a <tool_call>{"name": "f", "arguments": {}}</tool_call></think>ok'
    assert split_reply(lead) == (lead, "", [])


def test_split_reply():
    content, _, calls = split_reply(REPLY)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2
    assert split_reply('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[0] is None


class ScriptedEngine(Engine):
    """The engine, its replies replaced by the ids of `reply` (then the stop the real EOS gives)."""
    reply = REPLY

    def stream(self, prompt_ids, params, stats=None):
        ids = self.tokenizer.encode(self.reply)
        n = min(len(ids), params.max_new_tokens)
        real = GenerationParams(n, params.temperature, params.top_k, params.top_p, params.seed, ())
        for tid, _ in zip(ids[:n], super().stream(prompt_ids, real, stats)):
            yield tid
        if stats is not None and n == len(ids):
            stats["finish_reason"] = "stop"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = build_random_qwen3_moe(tmp_path_factory.mktemp("tools") / "m",
                               dict(CONFIG, max_position_embeddings=2048))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = ServerThread(create_app(ScriptedEngine(d, device="cpu"), NAME))
    yield s
    s.stop()


def test_server_returns_tool_calls(srv):
    c = srv.client()
    r = c.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, max_tokens=400)
    m = r.choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content == "Let me look."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls] == \
        [("get_weather", CALL["arguments"]), ("get_time", {})]
    # streamed: the same calls, as deltas with their index, and the same content
    text, calls, finish = "", {}, None
    for ch in c.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, max_tokens=400,
                                        stream=True):
        d = ch.choices[0].delta
        text += d.content or ""
        for t in d.tool_calls or []:
            calls[t.index] = (t.id, t.function.name, json.loads(t.function.arguments))
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and text.strip() == "Let me look."
    assert [v[1:] for _, v in sorted(calls.items())] == [("get_weather", CALL["arguments"]),
                                                         ("get_time", {})]
    assert all(v[0].startswith("call_") for v in calls.values())
    # the next turn: the assistant's calls and the tool's answer go back through the template
    turn = HELLO + [m.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": m.message.tool_calls[0].id, "content": "21 C"}]
    r2 = c.chat.completions.create(model=NAME, messages=turn, tools=TOOLS, max_tokens=400)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_tool_choice_and_history_arguments(srv):
    """tool_choice none: blocks stay text; a value the API does not define is refused; the
    history's arguments (a JSON string in the API) reach the template as an object (Qwen3.5's
    template iterates it, Qwen2.5's prints it through tojson), as the client's string where
    that fails (DeepSeek's concatenate it)."""
    c = srv.client()
    r = c.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, tool_choice="none",
                                  max_tokens=400)
    assert r.choices[0].message.content == REPLY and r.choices[0].finish_reason == "stop"
    import openai
    with pytest.raises(openai.BadRequestError, match="'tool_choice' must be"):
        c.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, tool_choice="always",
                                  max_tokens=4)
    r = c.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, max_tokens=400,
                                  extra_body={"tool_choice": None})   # null: as if left out
    assert r.choices[0].finish_reason == "tool_calls"
    from engine.serve import _call_for_template, _render
    from engine.tokenizer import ChatTemplate
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert _call_for_template(call)["function"]["arguments"] == {"city": "Paris"}
    assert _call_for_template({**call, "function": {"name": "f", "arguments": "not json"}}) == \
        {**call, "function": {"name": "f", "arguments": "not json"}}
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [call]}]

    class Tok:   # a tokenizer holding just a template
        def __init__(self, source):
            self.chat_template = ChatTemplate(source, {})

        def apply_chat_template(self, m, add, tools, **kw):
            return self.chat_template.render(m, add, tools, **kw)
    # DeepSeek's templates concatenate the string; Qwen3.5's iterate the object's items;
    # Qwen2.5's print it through tojson (a string there would be encoded twice)
    concat = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
              "{{ '<call>' + c.function.name + ':' + c.function.arguments }}{% endfor %}{% endfor %}")
    items = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in "
             "c.function.arguments|items %}<{{ k }}={{ v }}>{% endfor %}{% endfor %}{% endfor %}")
    tojson = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
              "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    assert _render(Tok(concat), history, True, None, {}) == '<call>get_weather:{"city": "Paris"}'
    assert _render(Tok(items), history, True, None, {}) == "<city=Paris>"
    assert _render(Tok(tojson), history, True, None, {}) == '{"city": "Paris"}'
    odd = [history[0], {**history[1], "tool_calls": [
        {**call, "function": {"name": "f", "arguments": "not json"}}]}]   # left as it came
    assert _render(Tok(concat), odd, True, None, {}) == "<call>f:not json"


def test_without_tools_or_cut_short_the_text_is_content(srv):
    c = srv.client()
    r = c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=400)   # no tools
    assert r.choices[0].message.content == REPLY and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    n = len(REPLY.encode()) - 5   # the second block left open: the first is a call, the rest text
    r = c.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, max_tokens=n)
    m = r.choices[0]
    assert m.finish_reason == "length" and [t.function.name for t in m.message.tool_calls] == ["get_weather"]
    assert m.message.content.startswith("Let me look.") and "<tool_call>" in m.message.content
    assert np.all([t.id.startswith("call_") for t in m.message.tool_calls])
