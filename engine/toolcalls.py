"""Tool calls in a chat reply, for the OpenAI API's message.tool_calls (engine.serve).

The chat templates of Qwen2.5, Qwen3 and Qwen3-Next (the Hermes style) ask the model to write
each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> in its reply; Qwen3.5's and
Qwen3-Coder's as <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
</tool_call>; GLM-4.5 / 4.6 / 4.7's as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE
</arg_value>...</tool_call>; MiniMax-M2's as <minimax:tool_call><invoke name="NAME"><parameter
name="KEY">VALUE</parameter>...</invoke>...</minimax:tool_call> (several calls a block); Kimi-K2's
as <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>
{...}<|tool_call_end|>...<|tool_calls_section_end|> (added tokens that decoding keeps; the call's
id is the model's own, which its template writes back). When a
request gives tools and the model's template writes one of these tags (call_format), the server
turns each such block into tool calls; the text around the blocks stays the message's content.
A block that parses as none of them, or that the reply leaves open, stays text. Reasoning
(<think>...</think>, which may mention the tag) passes through untouched.
"""
from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# reply format -> (open, close) tags of its call blocks
TAGS = {"tool_calls": (OPEN, CLOSE), "minimax": ("<minimax:tool_call>", "</minimax:tool_call>"),
        "kimi": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")}
THINK, UNTHINK = "<think>", "</think>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# a value ends at its </parameter>, or (a model that left the tag out) at the next parameter or
# the end of the function's body
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)",
                        re.S)
# GLM: the name, then key / value pairs
_GLM_NAME = re.compile(r"[^\s<>{}]+")
_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
# MiniMax-M2: invokes, each with its parameters
_INVOKE = re.compile(r'\s*<invoke name="([^"\n]+)">(.*?)</invoke>', re.S)
_MM_PARAM = re.compile(r'\s*<parameter name="([^"\n]+)">\n?(.*?)\n?</parameter>', re.S)
# Kimi-K2: an id (functions.NAME:N), then the arguments' JSON
_KIMI_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*([^<\s]+)\s*<\|tool_call_argument_begin\|>"
                        r"(.*?)<\|tool_call_end\|>", re.S)
_KIMI_ID = re.compile(r"(?:functions\.)?([^\s:]+)(?::\d+)?")


def call_format(chat_template: str | None) -> str | None:
    """The reply format ("tool_calls", "minimax" or "kimi", TAGS) whose call blocks the chat
    template writes, or None where it writes none of them."""
    for kind in ("kimi", "minimax", "tool_calls"):   # no tag holds another: order is free
        if chat_template and TAGS[kind][0] in chat_template:
            return kind
    return None


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


def _typed(types: dict, name: str, key: str, value: str):
    """A value written as text: the text, or JSON where that parses and its schema declares
    types none of which is string (a zip code "12345" stays text where a string is allowed;
    undeclared parameters stay text)."""
    if "string" not in (types.get(name, {}).get(key) or {"string"}):
        try:
            return _strict_json(value)
        except ValueError:
            pass
    return value


def _args(types: dict, name: str, pairs) -> dict:
    """The (key, value text) pairs of a call to name -> its arguments, each value _typed."""
    return {k.strip(): _typed(types, name, k.strip(), v) for k, v in pairs}


def _xml_call(body: str, types: dict) -> tuple[str, dict] | None:
    """<function=NAME><parameter=K>V</parameter>...</function> -> (NAME, {K: V})."""
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name = m.group(1).strip()
    return name, _args(types, name, _PARAMETER.findall(m.group(2)))


def _pairs(pattern: re.Pattern, text: str) -> list | None:
    """Every match of pattern in text, back to back up to trailing white space, or None."""
    out, at = [], 0
    for m in pattern.finditer(text):
        if m.start() != at:
            return None
        out.append(m.groups())
        at = m.end()
    return out if text[at:].strip() == "" else None


def _glm_call(body: str, types: dict) -> tuple[str, dict] | None:
    """NAME<arg_key>K</arg_key><arg_value>V</arg_value>... -> (NAME, {K: V}); a name alone
    is a call only to a tool the request gave."""
    i = body.find("<arg_key>")
    name = (body if i < 0 else body[:i]).strip()
    pairs = [] if i < 0 else _pairs(_GLM_ARG, body[i:])
    if not _GLM_NAME.fullmatch(name) or pairs is None or (i < 0 and name not in types):
        return None
    return name, _args(types, name, pairs)


def _as_call(name: str, args, call_id: str | None = None) -> dict | None:
    """An OpenAI tool call (arguments the text of a JSON object), or None: the client parses
    arguments as an object, so NaN / Infinity, null or a bare string there are no call."""
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
    return {"id": call_id or "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": text}}


def parse_call(body: str, types: dict | None = None) -> dict | None:
    """One <tool_call> block (JSON, Qwen's XML or GLM's keys and values) -> an OpenAI tool
    call, or None where the block is not a call. types: the request's param_types()."""
    types = types or {}
    try:
        obj = _strict_json(body)
    except ValueError:
        xml = _xml_call(body, types) or _glm_call(body, types)
        return None if xml is None else _as_call(*xml)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _as_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse_invokes(body: str, types: dict | None = None) -> list[dict] | None:
    """One <minimax:tool_call> block -> its calls, or None where any invoke is not one."""
    types = types or {}
    invokes = _pairs(_INVOKE, body)
    if not invokes:
        return None
    calls = []
    for name, inner in invokes:
        name, params = name.strip(), _pairs(_MM_PARAM, inner)
        call = None if params is None else _as_call(name, _args(types, name, params))
        if call is None:
            return None
        calls.append(call)
    return calls


def parse_kimi(body: str, types: dict | None = None) -> list[dict] | None:
    """One Kimi-K2 tool-calls section -> its calls (ids kept), or None where any is not one."""
    found = _pairs(_KIMI_CALL, body)
    if not found:
        return None
    calls = []
    for call_id, args in found:
        m = _KIMI_ID.fullmatch(call_id)
        call = None if m is None else _as_call(m.group(1), args.strip(), call_id)
        if call is None:
            return None
        calls.append(call)
    return calls


def _tool_call_block(body: str, types: dict) -> list[dict] | None:
    call = parse_call(body.strip(), types)
    return None if call is None else [call]


# reply format -> the parser of one of its blocks: its calls, or None (the block stays text)
BLOCKS = {"tool_calls": _tool_call_block, "minimax": parse_invokes, "kimi": parse_kimi}
# other spellings of a format's tags: some Kimi-K2 checkpoints write the singular section marker
ALIASES = {"kimi": (("<|tool_call_section_begin|>", TAGS["kimi"][0]),
                    ("<|tool_call_section_end|>", TAGS["kimi"][1]))}


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

    def __init__(self, types: dict | None = None, thinking: bool = False, kind: str = "tool_calls"):
        self.buf, self.inside, self.calls = "", False, 0
        self.types, self.thinking = types or {}, thinking
        self.open, self.close = TAGS[kind]
        self.kind = kind
        self.opens = (self.open, *(alt for alt, _ in ALIASES.get(kind, ())))   # held back whole
        self.parse_block = BLOCKS[kind]
        self.begun = thinking   # past the reply's start: a later <think> is just text

    def push(self, piece: str) -> list[tuple[str, object]]:
        self.buf += piece
        for alt, tag in ALIASES.get(self.kind, ()):
            self.buf = self.buf.replace(alt, tag)
        out: list[tuple[str, object]] = []

        def text(t: str) -> None:
            if t:
                out.append(("text", t))
        while True:
            if self.thinking:   # reasoning, tags and all, until </think>
                j = self.buf.find(UNTHINK)
                # Kimi-K2 opens its calls without closing its reasoning: the section ends it
                c = self.buf.find(self.open) if self.kind == "kimi" else -1
                if 0 <= c and (j < 0 or c < j):
                    text(self.buf[:c])
                    self.buf, self.thinking = self.buf[c:], False
                    continue
                if j < 0:
                    ends = (UNTHINK, *self.opens) if self.kind == "kimi" else (UNTHINK,)
                    cut = len(self.buf) - _held(self.buf, ends)
                    text(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return out
                text(self.buf[:j + len(UNTHINK)])
                self.buf, self.thinking = self.buf[j + len(UNTHINK):], False
            elif not self.inside:
                i = self.buf.find(self.open)
                k = -1 if self.begun else self.buf.find(THINK)
                if k >= 0 and self.buf[:k].strip() == "" and (i < 0 or k < i):
                    text(self.buf[:k + len(THINK)])
                    self.buf, self.thinking, self.begun = self.buf[k + len(THINK):], True, True
                    continue
                if i < 0:
                    tags = self.opens if self.begun else (*self.opens, THINK)
                    cut = len(self.buf) - _held(self.buf, tags)
                    if not self.begun and self.buf[:cut].strip():
                        self.begun = True   # text first: no <think> can open reasoning now
                        continue
                    text(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return out
                text(self.buf[:i])
                self.buf, self.inside, self.begun = self.buf[i + len(self.open):], True, True
            else:
                j = self.buf.find(self.close)
                if j < 0:
                    return out
                body, self.buf, self.inside = self.buf[:j], self.buf[j + len(self.close):], False
                calls = self.parse_block(body, self.types)
                if calls is None:
                    out.append(("text", self.open + body + self.close))
                for call in calls or ():
                    self.calls += 1
                    out.append(("call", call))

    def flush(self) -> list[tuple[str, object]]:
        """What is held when the reply ends: an open block goes out as text."""
        text = (self.open if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return [("text", text)] if text else []


def reply_parser(kind: str, types: dict | None = None, thinking: bool = False):
    """The parser of a reply format: "tool_calls", "minimax" or "kimi" (the blocks above, TAGS; types:
    param_types(), thinking: the reply starts inside <think>) or "harmony" / "harmony-text"
    (gpt-oss's channels, engine/harmony.py). Both turn text pieces into ("text" | "reasoning" |
    "call") events."""
    if kind in ("harmony", "harmony-text"):   # -text: the request allows no tool calls
        from engine.harmony import HarmonyParser
        return HarmonyParser(calls=kind == "harmony")
    return ToolCallParser(types, thinking, kind)


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
