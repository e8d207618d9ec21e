"""Tokenizer (tokenizers' tokenizer.json) and chat template (jinja2), as transformers renders it."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class TemplateError(ValueError):
    """The chat template is missing or failed to render."""


def _raise(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    """A jinja2 chat template with the environment transformers gives it."""

    def __init__(self, source: str, special: dict):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.source, self.special = source, special

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list | None = None, **kwargs) -> str:
        try:
            return self.template.render(messages=messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            # (a template's own code failing on what it was given, e.g. a message's field of a
            # type it does not expect)
            raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None


class Tokenizer:
    def __init__(self, path: Path, tokenizer_config: dict, template_source: str | None):
        self.tk = _HFTokenizer.from_file(str(path))
        self.config = tokenizer_config
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = tokenizer_config.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            special[key] = v
        self.bos_token = special.get("bos_token")
        self.add_bos = bool(tokenizer_config.get("add_bos_token", False)) and self.bos_token is not None
        self.chat_template = ChatTemplate(template_source, special) if template_source else None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, tok: str) -> int | None:
        return self.tk.token_to_id(tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            bid = self.tk.token_to_id(self.bos_token)
            if bid is not None and (not ids or ids[0] != bid):
                ids = [bid] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kw) -> str:
        if self.chat_template is None:
            raise TemplateError("this model has no chat template (no chat_template.jinja and no "
                                "chat_template in tokenizer_config.json)")
        return self.chat_template.render(messages, add_generation_prompt, tools, **kw)


class StreamDecoder:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8 sequences.

    Decodes a short window, not the whole list, each token (the whole list made a long reply
    quadratic): the text of ids[prefix:] minus the text of ids[prefix:read], the ids already
    shown, so a tokenizer that drops a leading space at the window's start drops it from both."""

    def __init__(self, tok: Tokenizer, skip_special: bool = True):
        self.tok, self.skip = tok, skip_special
        self.ids: list[int] = []
        self.prefix = 0   # window start: the last piece's first id
        self.read = 0     # ids before this are shown

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        shown = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""   # nothing new, or a character still incomplete
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]

    def flush(self) -> str:
        shown = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return text[len(shown):]


def load_tokenizer(model_dir: Path, tokenizer_json: Path) -> Tokenizer:
    tcfg = {}
    p = model_dir / "tokenizer_config.json"
    if p.is_file():
        tcfg = json.loads(p.read_text())
    tpl = None
    jp = model_dir / "chat_template.jinja"
    if jp.is_file():
        tpl = jp.read_text()
    elif isinstance(tcfg.get("chat_template"), str):
        tpl = tcfg["chat_template"]
    elif isinstance(tcfg.get("chat_template"), list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in tcfg["chat_template"]}
        tpl = named.get("default")
    elif (model_dir / "chat_template.json").is_file():   # an image-text model's processor template
        tpl = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
        tpl = tpl if isinstance(tpl, str) else None
    return Tokenizer(tokenizer_json, tcfg, tpl)
