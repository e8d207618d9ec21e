"""gpt-oss's harmony replies -> reasoning_content, content and tool_calls (engine/harmony.py).

The parser on text cut at every place, and the server end to end on an engine whose replies are
scripted (a random model writes no harmony) under a tokenizer that has the harmony markers as
special tokens, as gpt-oss's does."""
from __future__ import annotations

import json

import pytest

from engine.demo import byte_level_tokenizer
from engine.harmony import MARKS, HarmonyParser
from engine.serve import create_app
from engine.toolcalls import split_reply
from test_serve import CONFIG, HELLO, NAME, ServerThread, build_random_qwen3_moe
from test_toolcalls import TOOLS, ScriptedEngine

ANSWER = ("<|channel|>analysis<|message|>The user says hi. Reply briefly.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hi! <|x is not a marker.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')


def events_of(text: str, cuts) -> list:
    p = HarmonyParser()
    out, last = [], 0
    for c in list(cuts) + [len(text)]:
        out += p.push(text[last:c])
        last = c
    out += p.flush()
    merged = []
    for k, v in out:
        if merged and k != "call" and merged[-1][0] == k:
            merged[-1] = (k, merged[-1][1] + v)
        else:
            merged.append((k, v if k != "call" else v["function"]))
    return merged


@pytest.mark.parametrize("text,want", [
    (ANSWER, [("reasoning", "The user says hi. Reply briefly."), ("text", "Hi! <|x is not a marker.")]),
    (CALL, [("reasoning", "Need the weather."),
            ("call", {"name": "get_weather", "arguments": '{"city": "Paris"}'})]),
    ("plain text, no markers", [("text", "plain text, no markers")]),
    # the recipient after <|start|>assistant, as the chat template writes past calls; another
    # special token dropped, <|endoftext|> ending a message
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant to=functions.get_weather"
     '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
     [("reasoning", "Think."), ("call", {"name": "get_weather", "arguments": '{"city": "Paris"}'})]),
    (" to=functions.f<|channel|>commentary<|message|>{}<|call|>",
     [("call", {"name": "f", "arguments": "{}"})]),
    ("<|channel|>final<|message|>Hi<|im_end|> there<|endoftext|>", [("text", "Hi there")]),
    ("Hello there<|return|>", [("text", "Hello there")]),   # no header at all: content
    # a call the reply does not finish (cut by max_tokens): its arguments come back as text
    (CALL[:-len("<|call|>")], [("reasoning", "Need the weather."), ("text", '{"city": "Paris"}')]),
])
def test_parser_any_cut(text, want):
    assert events_of(text, []) == want
    for cut in range(1, len(text)):
        assert events_of(text, [cut, min(cut + 3, len(text))]) == want, cut


def test_split_reply():
    assert split_reply(ANSWER, "harmony")[:2] == ("Hi! <|x is not a marker.",
                                                  "The user says hi. Reply briefly.")
    content, reasoning, calls = split_reply(CALL, "harmony")
    assert content is None and reasoning == "Need the weather."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = build_random_qwen3_moe(tmp_path_factory.mktemp("harmony") / "m",
                               dict(CONFIG, max_position_embeddings=2048, vocab_size=272))
    byte_level_tokenizer(("<|pad|>", "<|bos|>", "<|endoftext|>") + MARKS).save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
                            "<|end|>{% endfor %}<|start|>assistant")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = ServerThread(create_app(ScriptedEngine(d, device="cpu"), NAME))
    yield s
    s.stop()


def test_terminal_chat_shows_the_answer(srv, capsys):
    """engine.chat on a harmony model: the reasoning on stderr, the answer on stdout and, alone,
    in the history the next turn's prompt is made from."""
    import io

    from engine.chat import Chat
    from engine.runtime import GenerationParams
    eng = srv.app.state.server.engine
    eng.reply = ANSWER
    chat, out = Chat(eng, None, GenerationParams(300), {}), io.StringIO()
    chat.say("hi", out)
    assert out.getvalue() == "Hi! <|x is not a marker.\n"
    assert "The user says hi. Reply briefly." in capsys.readouterr().err
    assert chat.turns[-1] == {"role": "assistant", "content": "Hi! <|x is not a marker."}


def test_server_splits_the_channels(srv):
    c = srv.client()
    eng = srv.app.state.server.engine
    eng.reply = ANSWER
    r = c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=300)
    m = r.choices[0]
    assert (m.message.content, m.finish_reason) == ("Hi! <|x is not a marker.", "stop")
    assert m.message.model_extra["reasoning_content"] == "The user says hi. Reply briefly."
    text, reasoning = "", ""
    for ch in c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=300, stream=True):
        d = ch.choices[0].delta
        text += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
    assert (text, reasoning) == ("Hi! <|x is not a marker.", "The user says hi. Reply briefly.")

    eng.reply = CALL
    r = c.chat.completions.create(model=NAME, messages=HELLO, tools=TOOLS, max_tokens=300)
    m = r.choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]


def test_no_calls_allowed_text_after_an_end_and_fresh_headers():
    """tool_choice none: a message addressed to a function stays text; text after an end marker
    with no header after it is content, not lost; a header does not carry over to the next
    message (a bare <|start|>assistant<|message|> is neither the last channel nor its tool)."""
    call = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Paris"}<|call|>')
    content, _, calls = split_reply(call, "harmony")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    content, _, calls = split_reply(call, "harmony-text")
    assert calls == [] and content == '{"city": "Paris"}'
    assert split_reply("<|channel|>final<|message|>Hi<|end|>Trailing text", "harmony")[0] == \
        "HiTrailing text"
    assert split_reply("<|channel|>final<|message|>Hi<|end|><|start|>assistant", "harmony")[0] == "Hi"
    two = ("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|message|>plain<|return|>")
    content, reasoning, _ = split_reply(two, "harmony")
    assert (content, reasoning) == ("plain", "hmm")
    after_call = (call + '<|start|>assistant<|message|>{"x": 1}<|call|>')
    assert [c["function"]["name"] for c in split_reply(after_call, "harmony")[2]] == ["get_weather"]
