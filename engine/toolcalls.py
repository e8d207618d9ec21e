"""Tool calls in a chat reply, for the OpenAI API's message.tool_calls (engine.serve).

The chat templates of Qwen2.5, Qwen3, Qwen3-Next and Qwen3.5 (the Hermes style) ask the model to
write each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> in its reply. When a
request gives tools and the model's template writes that tag, the server turns each such block
into a tool call; the text around the blocks stays the message's content. A block whose JSON
does not parse as {"name": string, "arguments": ...}, or that the reply leaves open, stays text.
"""
from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_writes_calls(chat_template: str | None) -> bool:
    return bool(chat_template) and OPEN in chat_template


def parse_call(body: str) -> dict | None:
    """One block's JSON -> an OpenAI tool call (arguments as a JSON string), or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else
                         json.dumps(args, ensure_ascii=False)}}


def _open_prefix(text: str) -> int:
    """The length of the longest tail of text that could begin OPEN (held back: the next piece
    decides)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


class ToolCallParser:
    """Reply text in pieces -> events in order: ("text", str) and ("call", tool call dict)."""

    def __init__(self):
        self.buf, self.inside, self.calls = "", False, 0

    def push(self, piece: str) -> list[tuple[str, object]]:
        self.buf += piece
        out: list[tuple[str, object]] = []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    cut = len(self.buf) - _open_prefix(self.buf)
                    if cut:
                        out.append(("text", self.buf[:cut]))
                    self.buf = self.buf[cut:]
                    return out
                if i:
                    out.append(("text", self.buf[:i]))
                self.buf, self.inside = self.buf[i + len(OPEN):], True
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    return out
                body, self.buf, self.inside = self.buf[:j], self.buf[j + len(CLOSE):], False
                call = parse_call(body.strip())
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


def reply_parser(kind: str):
    """The parser of a reply format: "tool_calls" (the blocks above) or "harmony" (gpt-oss's
    channels, engine/harmony.py). Both turn text pieces into ("text" | "reasoning" | "call")
    events."""
    if kind == "harmony":
        from engine.harmony import HarmonyParser
        return HarmonyParser()
    return ToolCallParser()


def split_reply(text: str, kind: str = "tool_calls") -> tuple[str | None, str, list[dict]]:
    """A whole reply -> (content, reasoning, tool calls): content None when the reply is calls
    and whitespace only."""
    p = reply_parser(kind)
    events = p.push(text) + p.flush()
    calls = [v for k, v in events if k == "call"]
    content = "".join(v for k, v in events if k == "text")
    if calls:
        content = content.strip() or None
    return content, "".join(v for k, v in events if k == "reasoning"), calls
