"""gpt-oss replies in the harmony format -> reasoning, content and tool calls (engine.serve).

gpt-oss writes its reply as messages on channels, each
    <|channel|>NAME[ to=functions.TOOL][ <|constrain|>json]<|message|>TEXT<|end|> (or <|return|>,
    <|call|>), the next one after <|start|>assistant.
The analysis channel is its reasoning (message.reasoning_content), final and commentary are
what it says (content), and a message addressed to=functions.TOOL (in its header or after
<|start|>assistant, as the chat template writes past calls) that ends with <|call|> is a call
of that tool with TEXT as its JSON arguments. The markers are special tokens: the reply is
decoded with them kept, and other special tokens are dropped (<|endoftext|> ends a message).
Text before any marker is content once it is clearly not a message's header.
"""
from __future__ import annotations

import re
import uuid

MARKS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
         "<|constrain|>", "<|endoftext|>")
ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")
_TO = re.compile(r"to=functions\.([\w.\-]+)")
_SPECIAL = re.compile(r"<\|[\w.]+\|>")          # a special token's text
_SPECIAL_START = re.compile(r"<\|[\w.]*\|?\Z")  # ... still arriving
HEADER_MAX = 256   # text before any marker longer than this is content, not a header


def uses_harmony(tokenizer) -> bool:
    """A tokenizer with the harmony markers as tokens (gpt-oss's)."""
    return all(tokenizer.token_to_id(m) is not None for m in ("<|channel|>", "<|message|>", "<|end|>"))


class HarmonyParser:
    """Reply text in pieces -> events in order: ("reasoning", str), ("text", str) and ("call",
    tool call dict). calls: False where the request allows none (tool_choice "none"): an
    addressed message is then text."""

    def __init__(self, calls: bool = True):
        self.allow_calls = calls
        self.started = False    # a <|start|> came after the last message's end: role text follows
        self.buf = ""
        self.role = ""          # text after <|start|> (or the reply's start) until <|channel|>
        self.state = "start"    # start | body (a message's text) | header (after <|channel|>) | between
        self.kind = "text"      # what the current body is: reasoning, text, or a call's arguments
        self.header = ""
        self.to_text = ""       # the role's text of the current message (may name its recipient)
        self.tool = None        # the function a commentary message is addressed to
        self.args = ""
        self.calls = 0

    def push(self, piece: str) -> list[tuple[str, object]]:
        self.buf += piece
        out: list[tuple[str, object]] = []
        while True:
            i = self.buf.find("<|")
            if i < 0:   # a last "<" may begin a marker: held for the next piece
                cut = len(self.buf) - self.buf.endswith("<")
                self._text(self.buf[:cut], out)
                self.buf = self.buf[cut:]
                return out
            mark = next((m for m in MARKS if self.buf.startswith(m, i)), None)
            if mark is None:
                if _SPECIAL_START.match(self.buf, i):   # a token still arriving
                    self._text(self.buf[:i], out)
                    self.buf = self.buf[i:]
                    return out
                other = _SPECIAL.match(self.buf, i)
                self._text(self.buf[:i] if other else self.buf[:i + 2], out)
                self.buf = self.buf[other.end() if other else i + 2:]   # another special: dropped
                continue
            self._text(self.buf[:i], out)
            self.buf = self.buf[i + len(mark):]
            self._mark(mark, out)

    def flush(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self._text(self.buf, out)
        self.buf = ""
        if self.role and self._stray():   # no marker came, or text after an end: content
            out.append(("text", self.role))
            self.role = ""
        if self.kind == "args" and self.args:   # a call the reply did not finish: its text
            out.append(("text", self.args))
            self.args = ""
        return out

    def _stray(self) -> bool:
        """Whether the role text gathered now is content: before any marker, or between a
        message's end and the next <|start|> (no header can follow it)."""
        return self.state == "start" or self.state == "between" and not self.started

    def _text(self, text: str, out: list) -> None:
        if not text:
            return
        if self.state in ("start", "between"):
            self.role += text
            if self.state == "start" and len(self.role) > HEADER_MAX:   # plainly not a header
                self.state, text, self.role = "body", self.role, ""
            else:
                return
        if self.state == "header":
            self.header += text
        elif self.state == "body":
            if self.kind == "args":
                self.args += text
            elif out and out[-1][0] == self.kind:
                out[-1] = (self.kind, out[-1][1] + text)
            else:
                out.append((self.kind, text))

    def _mark(self, mark: str, out: list) -> None:
        if mark == "<|channel|>":   # the role's text may name the recipient: part of the header
            self.state, self.header, self.to_text, self.role = "header", "", self.role, ""
        elif mark == "<|message|>":
            channel = self.header.split(maxsplit=1)[0] if self.header.split() else ""
            to = _TO.search(self.to_text + " " + self.header + " " + self.role)
            self.tool = to.group(1) if to and self.allow_calls else None
            self.kind = ("args" if self.tool else "reasoning" if channel == "analysis" else "text")
            self.state, self.args = "body", ""
        elif mark == "<|constrain|>":
            if self.state == "header":
                self.header += " "
        elif mark in ENDS or mark == "<|start|>":
            if self.role and self._stray():   # text before any header, or after an end
                out.append(("text", self.role))
            if self.kind == "args" and self.state == "body":
                if mark == "<|call|>":
                    self.calls += 1
                    out.append(("call", {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                         "function": {"name": self.tool,
                                                      "arguments": self.args.strip()}}))
                elif self.args:
                    out.append(("text", self.args))
                self.args = ""
            self.state, self.kind, self.tool, self.role, self.to_text = "between", "text", None, "", ""
            self.header, self.started = "", mark == "<|start|>"
