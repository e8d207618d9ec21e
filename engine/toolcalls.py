"""Tool calls in a chat reply, for the OpenAI API's message.tool_calls (engine.serve).

The chat templates of Qwen2.5, Qwen3 and Qwen3-Next (the Hermes style) ask the model to write
each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> in its reply; Qwen3.5's and
Qwen3-Coder's as <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
</tool_call>. When a request gives tools and the model's template writes that tag, the server
turns each such block into a tool call; the text around the blocks stays the message's content.
A block that parses as neither, or that the reply leaves open, stays text. Reasoning
(<think>...</think>, which may mention the tag) passes through untouched.
"""
from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK, UNTHINK = "<think>", "</think>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# a value ends at its </parameter>, or (a model that left the tag out) at the next parameter or
# the end of the function's body
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)",
                        re.S)


def template_writes_calls(chat_template: str | None) -> bool:
    return bool(chat_template) and OPEN in chat_template


def _schema_types(schema) -> set:
    """The JSON types a parameter's schema allows ("type" a name or a list, or anyOf / oneOf
    members: Pydantic writes Optional[str] as anyOf string / null); empty when it says none."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    out = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} \
        if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            out |= _schema_types(sub) or {"string"}   # a member without a type may be text
    return out


def param_types(tools) -> dict:
    """{function name: {parameter: the set of JSON types its schema allows}} of a request's
    tools."""
    out = {}
    for t in tools or ():
        f = t.get("function") if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            params = f.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[f["name"]] = ({k: _schema_types(v) for k, v in props.items()}
                              if isinstance(props, dict) else {})
    return out


def _strict_json(text: str):
    """json.loads without NaN / Infinity (not JSON: arguments must stay valid JSON)."""
    def refuse(name):
        raise ValueError(name)
    return json.loads(text, parse_constant=refuse)


def _xml_call(body: str, types: dict) -> tuple[str, dict] | None:
    """<function=NAME><parameter=K>V</parameter>...</function> -> (NAME, {K: V}); a value is
    the text, or JSON where that parses and its schema declares types none of which is string
    (a zip code "12345" stays text where a string is allowed; undeclared parameters stay text)."""
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name, args = m.group(1).strip(), {}
    for key, value in _PARAMETER.findall(m.group(2)):
        key = key.strip()
        allowed = types.get(name, {}).get(key) or {"string"}
        if "string" not in allowed:
            try:
                value = _strict_json(value)
            except ValueError:
                pass
        args[key] = value
    return name, args


def parse_call(body: str, types: dict | None = None) -> dict | None:
    """One block -> an OpenAI tool call (arguments the text of a JSON object), or None where
    the block is not a call: the client parses arguments as an object, so NaN / Infinity,
    null or a bare string there leave the block as text. types: the request's param_types()."""
    try:
        obj = _strict_json(body)
    except ValueError:
        xml = _xml_call(body, types or {})
        if xml is None:
            return None
        obj = {"name": xml[0], "arguments": xml[1]}
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _strict_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:   # an XML value of 1e999: Infinity, not JSON
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": text}}


def _held(text: str, tags) -> int:
    """The length of the longest tail of text that could begin one of tags (held back: the
    next piece decides)."""
    for k in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-k:]) for t in tags):
            return k
    return 0


class ToolCallParser:
    """Reply text in pieces -> events in order: ("text", str) and ("call", tool call dict).
    thinking: the reply starts inside <think> (the prompt ended with it)."""

    def __init__(self, types: dict | None = None, thinking: bool = False):
        self.buf, self.inside, self.calls = "", False, 0
        self.types, self.thinking = types or {}, thinking
        self.begun = thinking   # past the reply's start: a later <think> is just text

    def push(self, piece: str) -> list[tuple[str, object]]:
        self.buf += piece
        out: list[tuple[str, object]] = []

        def text(t: str) -> None:
            if t:
                out.append(("text", t))
        while True:
            if self.thinking:   # reasoning, tags and all, until </think>
                j = self.buf.find(UNTHINK)
                if j < 0:
                    cut = len(self.buf) - _held(self.buf, (UNTHINK,))
                    text(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return out
                text(self.buf[:j + len(UNTHINK)])
                self.buf, self.thinking = self.buf[j + len(UNTHINK):], False
            elif not self.inside:
                i = self.buf.find(OPEN)
                k = -1 if self.begun else self.buf.find(THINK)
                if k >= 0 and self.buf[:k].strip() == "" and (i < 0 or k < i):
                    text(self.buf[:k + len(THINK)])
                    self.buf, self.thinking, self.begun = self.buf[k + len(THINK):], True, True
                    continue
                if i < 0:
                    tags = (OPEN,) if self.begun else (OPEN, THINK)
                    cut = len(self.buf) - _held(self.buf, tags)
                    if not self.begun and self.buf[:cut].strip():
                        self.begun = True   # text first: no <think> can open reasoning now
                        continue
                    text(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return out
                text(self.buf[:i])
                self.buf, self.inside, self.begun = self.buf[i + len(OPEN):], True, True
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    return out
                body, self.buf, self.inside = self.buf[:j], self.buf[j + len(CLOSE):], False
                call = parse_call(body.strip(), self.types)
                if call is None:
                    out.append(("text", OPEN + body + CLOSE))
                else:
                    self.calls += 1
                    out.append(("call", call))

    def flush(self) -> list[tuple[str, object]]:
        """What is held when the reply ends: an open block goes out as text."""
        text = (OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return [("text", text)] if text else []


def reply_parser(kind: str, types: dict | None = None, thinking: bool = False):
    """The parser of a reply format: "tool_calls" (the blocks above; types: param_types(),
    thinking: the reply starts inside <think>) or "harmony" / "harmony-text" (gpt-oss's channels,
    engine/harmony.py). Both turn text pieces into ("text" | "reasoning" | "call") events."""
    if kind in ("harmony", "harmony-text"):   # -text: the request allows no tool calls
        from engine.harmony import HarmonyParser
        return HarmonyParser(calls=kind == "harmony")
    return ToolCallParser(types, thinking)


def split_reply(text: str, kind: str = "tool_calls", types: dict | None = None,
                thinking: bool = False) -> tuple[str | None, str, list[dict]]:
    """A whole reply -> (content, reasoning, tool calls): content None when the reply is calls
    and whitespace only."""
    p = reply_parser(kind, types, thinking)
    events = p.push(text) + p.flush()
    calls = [v for k, v in events if k == "call"]
    content = "".join(v for k, v in events if k == "text")
    if calls:
        content = content.strip() or None
    return content, "".join(v for k, v in events if k == "reasoning"), calls
