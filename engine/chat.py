"""python -m engine.chat: a multi-turn chat with the model in the terminal.

Each line read is a user message; the reply streams to stdout. The conversation goes through the
model's chat template every turn, and the engine resumes from the last turn's run state (its
prefix cache), so a turn prefills only what follows the ids already in the model: the history is
not computed again. Commands: /reset (forget the conversation), /exit (or end of input). A
summary line a turn (tokens/s, ids resumed) goes to stderr. Bad input exits with status 2.
"""
from __future__ import annotations

import argparse
import sys

from engine.cli import add_load_args, add_prefix_args, check_prefix_args, load_from_args
from engine.harmony import HarmonyParser, uses_harmony
from loader.checkpoint import CheckpointError


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m engine.chat", description=__doc__.splitlines()[0])
    add_load_args(p)
    p.add_argument("--system", default=None, help="a system message first in the conversation")
    p.add_argument("--max-new-tokens", type=int, default=512, help="a reply's length at most")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's generation_config.json, else 0.7)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--think", choices=("on", "off"), default=None,
                   help="chat_template_kwargs enable_thinking (Qwen3), where the template reads it")
    add_prefix_args(p)
    a = p.parse_args(argv)
    check_prefix_args(p, a)
    if a.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if (a.temperature is not None and a.temperature < 0) or \
            (a.top_p is not None and not 0 < a.top_p <= 1) or (a.top_k is not None and a.top_k < 0):
        p.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    return a


class Chat:
    """The conversation and its turns on one engine (prefix cache on)."""

    def __init__(self, m, system: str | None, params, template_kw: dict):
        self.m, self.params, self.kw = m, params, template_kw
        self.head = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []
        m.prefix_cache = True
        m.tokenizer.apply_chat_template(self.head + [{"role": "user", "content": "hi"}], True,
                                        None, **template_kw)   # no template: refuse before reading

    def prompt_ids(self, user: str) -> tuple[list, int]:
        """The ids of the conversation + user, and how many of the oldest exchanges (user
        message and reply; never the system message or the new one) must leave it for the
        prompt to leave room for min(max_new_tokens, 16) ids of reply."""
        m, drop = self.m, 0
        while True:
            msgs = self.head + self.turns[2 * drop:] + [{"role": "user", "content": user}]
            text = m.tokenizer.apply_chat_template(msgs, True, None, **self.kw)
            ids = m.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) + min(self.params.max_new_tokens, 16) <= m.max_context or \
                    2 * drop >= len(self.turns):
                return ids, drop
            drop += 1

    def say(self, user: str, out) -> dict:
        """One turn: the reply streams to out; returns the engine's stats (with "interrupted"
        when Ctrl-C stopped the reply: what came so far stays the turn's answer, and the state
        stays resumable). The oldest exchanges leave only once the turn has run. (The engine
        cuts max_new_tokens to the context's room and refuses a prompt that does not fit.)"""
        from engine.tokenizer import StreamDecoder
        ids, dropped = self.prompt_ids(user)
        stats: dict = {}
        # gpt-oss (harmony): its reasoning to stderr, its answer to out and into the history
        parser = HarmonyParser() if uses_harmony(self.m.tokenizer) else None
        dec, reply, answer = StreamDecoder(self.m.tokenizer, parser is None), [], []

        def show(piece: str) -> None:
            for kind, text in parser.push(piece) if parser else [("text", piece)]:
                if kind == "text":
                    answer.append(text)
                    out.write(text)
                elif kind == "reasoning":
                    sys.stderr.write(text)
            out.flush()

        stop = set(self.m.eos_ids)
        gen = self.m.stream(ids, self.params, stats)
        try:
            for tid in gen:
                if tid in stop:
                    break
                reply.append(tid)
                show(dec.push(tid))
        except KeyboardInterrupt:   # Ctrl-C stops the reply, not the chat
            gen.close()
            stats["interrupted"] = True
            if not reply:
                out.write("\n")
                out.flush()
                return stats   # nothing said: the turn did not happen
        show(dec.flush())
        for kind, text in parser.flush() if parser else []:
            if kind == "text":
                answer.append(text)
                out.write(text)
        out.write("\n")
        out.flush()
        content = "".join(answer) if parser else self.m.tokenizer.decode(reply)
        if dropped:
            print(f"(the conversation outgrew the {self.m.max_context}-token context: the "
                  f"{dropped} oldest exchange(s) left it)", file=sys.stderr)
        self.turns = self.turns[2 * dropped:] + [{"role": "user", "content": user},
                                                 {"role": "assistant", "content": content}]
        return stats

    def reset(self) -> None:
        self.turns = []


def main(argv=None, stdin=None, stdout=None) -> int:
    a = parse_args(argv)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    from engine.models.rope import ConfigError
    from engine.runtime import GenerationParams
    from engine.tokenizer import TemplateError
    errors = (CheckpointError, ConfigError, TemplateError, ValueError, RuntimeError, OSError)
    try:
        m = load_from_args(a)
        gen = m.generation_defaults
        params = GenerationParams(
            a.max_new_tokens,
            a.temperature if a.temperature is not None else float(gen.get("temperature", 0.7)),
            a.top_k if a.top_k is not None else int(gen.get("top_k", 0)),
            a.top_p if a.top_p is not None else float(gen.get("top_p", 1.0)), a.seed)
        kw = {} if a.think is None else {"enable_thinking": a.think == "on"}
        chat = Chat(m, a.system, params, kw)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tty = stdin.isatty()
    if tty:
        print(f"chatting with {m.dir.name} on {m.device} (context {m.max_context}); /reset, "
              "/exit", file=sys.stderr)
    while True:
        if tty:
            stdout.write(">>> ")
            stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:   # Ctrl-C at the prompt: leave, as end of input does
            stdout.write("\n")
            return 0
        if not line or line.strip() == "/exit":
            return 0
        user = line.rstrip("\n")
        if user.strip() == "/reset":
            chat.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not user.strip():
            continue
        try:
            s = chat.say(user, stdout)
        except errors as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        if s.get("interrupted") or "decode_tok_s" not in s:
            print("[interrupted]", file=sys.stderr)
            continue
        print(f"[{s['prefill_tokens']} prompt tokens, {s['prefill_cached_tokens']} resumed, "
              f"prefill {s['prefill_tok_s']:.1f} tok/s | {s['decode_tokens']} decoded at "
              f"{s['decode_tok_s']:.2f} tok/s]", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
