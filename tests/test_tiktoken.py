"""Kimi's tiktoken.model, converted to a tokenizers BPE at load: the same ids as tiktoken itself."""
from __future__ import annotations

import base64
import json
import random
from collections import Counter

import pytest

from engine.tokenizer import NUM_RESERVED_SPECIAL, load_tokenizer, tiktoken_to_tokenizers
from loader.checkpoint import Checkpoint, CheckpointError

tiktoken = pytest.importorskip("tiktoken")
regex = pytest.importorskip("regex")   # tiktoken's own dependency; V1 has the `&&` intersection

# tokenization_kimi.py's pat_str, written out here (not engine's copy) for tiktoken's reference
PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
         6: "<|im_middle|>", 7: "<|tool_calls_section_begin|>"}   # offsets from N; the rest reserved

POOLS = [
    # English: capitals, contractions, mixed case
    ["The", "quick", "brown", "fox", "don't", "I'm", "WE'LL", "You're", "they've", "it's",
     "HELLO", "McDonald", "iPhone", "CamelCase", "she'd", "IT'S", "O'Neil", "ABCdef", "a", "I"],
    # Chinese, and Chinese punctuation
    ["你好", "世界", "中文分词", "模型推理", "我们", "的", "是", "。", "、", "「引号」", "（括号）"],
    # Japanese kana, with kanji beside
    ["ひらがな", "カタカナ", "こんにちは", "ありがとう", "です", "ます", "日本語", "ー", "ゃ", "ヴ"],
    # digits, other numerals
    ["0", "7", "42", "123", "2024", "31415926", "١٢٣", "½", "²", "Ⅻ"],
    # punctuation and symbols
    ["!", "?!", "...", "—", "(", ")", "{}", "#", "@", "$%", "'", '"', "'s", "->", "::", "\\"],
    # whitespace runs, newlines
    [" ", "  ", "    ", "\n", "\n\n", "\r\n", "\t", " \n ", "   \n", "\u3000", "\u00a0", "\x0b"],
    # emoji (multi-code-point too), accents, combining marks, title case, long s
    ["😀", "👍🏽", "🇯🇵", "👨‍👩‍👧", "❤️", "café", "naïve", "e\u0301", "ǅungla", "'ſ", "Straße",
     "ÉCOLE", "Ωmega", "привет", "ПРИВЕТ", "مرحبا", "שלום", "नमस्ते"],
]


def random_text(rng: random.Random, pieces: int, specials=()) -> str:
    out = []
    for _ in range(pieces):
        if specials and rng.random() < 0.05:
            out.append(rng.choice(specials))
        else:
            out.append(rng.choice(rng.choice(POOLS)))
        out.append(rng.choice(["", "", " ", " "]))
    return "".join(out)


def train_ranks(rng: random.Random, merges: int = 250) -> dict[bytes, int]:
    """A tiktoken-style table: the 256 bytes, greedy BPE merges over pre-tokens, then some
    whole pre-tokens added directly (often tokens that no merge path reaches: only tiktoken's
    whole-pre-token rule gives them)."""
    pat = regex.compile(PAT, regex.V1)
    text = "".join(random_text(rng, 3000))
    words = Counter(tuple(bytes([b]) for b in w.encode()) for w in pat.findall(text))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        merged = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    for w in rng.sample(sorted(set(pat.findall(text))), 60):
        ranks.setdefault(w.encode(), len(ranks))
    return ranks


def write_model(path, ranks):
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                            for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))


def kimi_config(n: int) -> dict:
    return {"bos_token": "[BOS]", "eos_token": "[EOS]", "add_bos_token": False,
            "added_tokens_decoder": {str(n + k): {"content": v, "special": True}
                                     for k, v in NAMED.items()}}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    seed = random.randrange(1 << 31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    ranks = train_ranks(rng)
    d = tmp_path_factory.mktemp("kimi")
    write_model(d / "tiktoken.model", ranks)
    n = len(ranks)
    cfg = kimi_config(n)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    specials = {NAMED.get(i - n, f"<|reserved_token_{i}|>"): i
                for i in range(n, n + NUM_RESERVED_SPECIAL + 2)}
    ref = tiktoken.Encoding("kimi-test", pat_str=PAT, mergeable_ranks=ranks,
                            special_tokens=specials)
    return d, ranks, specials, ref, rng, seed


def test_same_ids_as_tiktoken(table):
    d, ranks, specials, ref, rng, seed = table
    tk = tiktoken_to_tokenizers(d / "tiktoken.model",
                                json.loads((d / "tokenizer_config.json").read_text()))
    assert tk.get_vocab_size(with_added_tokens=True) == len(ranks) + NUM_RESERVED_SPECIAL + 2
    names = list(specials)
    some = [n for n in names if not n.startswith("<|reserved")] + rng.sample(names, 5)
    texts = [random_text(rng, rng.randint(1, 40), some) for _ in range(600)]
    texts += ["", " ", "  \n", "x" * 50, "你好" * 20, "1234567", " " * 17 + "a", "\n\n\n  \n"]
    merged_more = 0
    for t in texts:
        want = ref.encode(t, allowed_special="all")
        got = tk.encode(t, add_special_tokens=False).ids
        assert got == want, f"seed {seed}: {t!r}"
        assert tk.decode(got, skip_special_tokens=False) == t, f"seed {seed}: {t!r}"
        merged_more += len(want) < len(t.encode())
    assert merged_more > len(texts) // 2   # the table's merges are in use


def test_whole_pre_token(tmp_path):
    """A pre-token that is a token is taken whole, though no merge reaches it (tiktoken's rule)."""
    ranks = {**{bytes([b]): b for b in range(256)}, b"abc": 256}
    write_model(tmp_path / "tiktoken.model", ranks)
    tk = tiktoken_to_tokenizers(tmp_path / "tiktoken.model", {})
    ref = tiktoken.Encoding("whole", pat_str=PAT, mergeable_ranks=ranks, special_tokens={})
    for t in ("abc", "abcabc", " abc", "abc abc"):
        assert tk.encode(t).ids == ref.encode(t)
    assert tk.encode("abc abc").ids == [256, 32, 97, 98, 99]


def test_malformed_line_named(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    write_model(tmp_path / "tiktoken.model", ranks)
    lines = (tmp_path / "tiktoken.model").read_text().splitlines(keepends=True)
    k = random.randrange(len(lines))
    for bad in ("QUI= x\n", "not*base64 7\n", "QUI=\n"):
        (tmp_path / "tiktoken.model").write_text("".join(lines[:k] + [bad] + lines[k + 1:]))
        with pytest.raises(ValueError) as e:
            tiktoken_to_tokenizers(tmp_path / "tiktoken.model", {})
        msg = str(e.value)
        assert f"tiktoken.model:{k + 1}:" in msg and "\n" not in msg, msg


def test_folder_loads_through_checkpoint(table, tmp_path):
    """A folder with tiktoken.model and tokenizer_config.json only: the checkpoint hands the
    model file on; the engine's tokenizer encodes and decodes, specials included."""
    src, ranks, specials, ref, rng, seed = table
    for f in ("tiktoken.model", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    ck = Checkpoint.__new__(Checkpoint)   # the side-file lookup alone, no weights
    ck.dir = tmp_path
    tok = load_tokenizer(tmp_path, ck.tokenizer_path())
    n = len(ranks)
    for k, name in NAMED.items():
        assert tok.token_to_id(name) == n + k
    assert tok.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5
    text = "<|im_user|>user<|im_middle|>Hello, 世界! It's 2024 😀<|im_end|>" \
           "<|im_assistant|>assistant<|im_middle|>"
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all")
    assert [i for i in ids if i >= n] == [n + 3, n + 6, n + 2, n + 4, n + 6]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "userHello, 世界! It's 2024 😀assistant"
    # decoding skips the chat's markers, not the tool-call markers (the reply's parser reads them)
    call = tok.encode("<|tool_calls_section_begin|>x<|im_end|>")
    assert call[0] == n + 7 and tok.decode(call) == "<|tool_calls_section_begin|>x"
    (tmp_path / "tiktoken.model").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json.*tiktoken.model"):
        ck.tokenizer_path()


def test_engine_loads_kimi_tokenizer(table, tmp_path):
    """engine.load on a model folder whose tokenizer is tiktoken.model + tokenizer_config.json."""
    import engine
    from engine.demo import DEMO_CONFIG, build_random_model
    src, ranks, specials, ref, rng, seed = table
    cfg = dict(DEMO_CONFIG, vocab_size=1024, hidden_size=64, intermediate_size=128,
               moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=4)
    d = build_random_model(tmp_path / "m", cfg)
    (d / "tokenizer.json").unlink()
    for f in ("tiktoken.model", "tokenizer_config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    tok = engine.load(d, device="cpu").tokenizer
    text = "[BOS]<|im_user|>Hi 你好 123<|im_end|>"
    assert tok.encode(text) == ref.encode(text, allowed_special="all")
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
