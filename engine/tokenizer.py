"""Tokenizer (tokenizers' tokenizer.json, or a tiktoken.model converted at load) and chat template
(jinja2), as transformers renders it."""
from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
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


# Kimi's tiktoken pattern (tokenization_kimi.py). HF tokenizers' Oniguruma takes it unchanged:
# it has the same `&&` class intersection and \p{Han} as tiktoken's fancy-regex
# (tests/test_tiktoken.py compares the two).
KIMI_PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED_SPECIAL = 256
# the tokens Kimi's tokenizer skips when decoding (with bos / eos / unk / pad) where its
# tokenizer_config.json lists none; its other reserved tokens (the tool-call markers) stay in text
KIMI_SKIPPED = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:   # control bytes and space: moved past 255
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def read_tiktoken(model_file: Path) -> dict[bytes, int]:
    """tiktoken.model: one `<base64 of the token's bytes> <rank>` a line; ranks are the ids."""
    ranks: dict[bytes, int] = {}
    with open(model_file, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                tok, rank = base64.b64decode(tok, validate=True), int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{model_file}:{n}: expected '<base64> <rank>', got "
                                 f"{line[:60]!r}") from None
            if tok in ranks:
                raise ValueError(f"{model_file}:{n}: token listed twice (ranks {ranks[tok]} "
                                 f"and {rank})")
            ranks[tok] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{model_file}: ranks are not the ids 0..{len(ranks) - 1}, each once")
    return ranks


def tiktoken_to_tokenizers(model_file: Path, tokenizer_config: dict) -> _HFTokenizer:
    """A tiktoken BPE (Kimi-K2's, Kimi-Linear's) as an equivalent byte-level tokenizers BPE."""
    ranks = read_tiktoken(model_file)
    b2u = str.maketrans({chr(b): c for b, c in _bytes_to_unicode().items()})

    def uni(b: bytes) -> str:   # latin-1: byte b -> chr(b), then the byte-level alphabet
        return b.decode("latin-1").translate(b2u)

    # tiktoken merges the adjacent pair whose concatenation has the lowest rank: every split of
    # a token into two tokens is a merge, ranked by the token's rank (ties: the pieces' ranks)
    merges = sorted((r, ranks[t[:i]], ranks[t[i:]], i, t) for t, r in ranks.items()
                    for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks)
    bpe = models.BPE(vocab={uni(t): r for t, r in ranks.items()},
                     merges=[(uni(t[:i]), uni(t[i:])) for *_, i, t in merges],
                     ignore_merges=True)   # tiktoken takes a pre-token that is a token whole
    tk = _HFTokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    n = len(ranks)
    named = tokenizer_config.get("added_tokens_decoder") or {}
    names = [(named.get(str(i)) or {}).get("content") or f"<|reserved_token_{i}|>"
             for i in range(n, n + NUM_RESERVED_SPECIAL + 2)]
    listed = (tokenizer_config.get("additional_special_tokens")
              or tokenizer_config.get("extra_special_tokens") or KIMI_SKIPPED)
    if isinstance(listed, dict):   # transformers v5 may name them: {name: token}
        listed = list(listed.values())
    skipped = {t.get("content") if isinstance(t, dict) else t for t in listed}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = tokenizer_config.get(key)
        skipped.add(v.get("content") if isinstance(v, dict) else v)
    # added in id order, each takes the next id: n, n+1, ...; all are matched whole in text
    # (tiktoken's allowed_special="all"), only the skipped ones are special to decode
    tk.add_tokens([AddedToken(t, special=t in skipped, normalized=False) for t in names])
    for i, t in enumerate(names, n):
        if tk.token_to_id(t) != i:
            raise ValueError(f"{model_file}: special token {t!r} would get id "
                             f"{tk.token_to_id(t)}, not {i} (a duplicate name?)")
    return tk


class Tokenizer:
    def __init__(self, path: Path | _HFTokenizer, tokenizer_config: dict,
                 template_source: str | None):
        # a tokenizer.json's path, or a tokenizer already built (a converted tiktoken.model)
        self.tk = path if isinstance(path, _HFTokenizer) else _HFTokenizer.from_file(str(path))
        self.config = tokenizer_config
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = tokenizer_config.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            special[key] = v
        self.bos_token = special.get("bos_token")
        self.add_bos = bool(tokenizer_config.get("add_bos_token", False)) and self.bos_token is not None
        self.special = special
        self.chat_template = ChatTemplate(template_source, special) if template_source else None

    def default_template(self, source: str) -> None:
        """A family's built-in chat template, taken where the folder ships none."""
        if self.chat_template is None:
            self.chat_template = ChatTemplate(source, self.special)

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
    """tokenizer_json: the folder's tokenizer.json, or its tiktoken.model where it has none."""
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
    if Path(tokenizer_json).name == "tiktoken.model":
        return Tokenizer(tiktoken_to_tokenizers(tokenizer_json, tcfg), tcfg, tpl)
    return Tokenizer(tokenizer_json, tcfg, tpl)
