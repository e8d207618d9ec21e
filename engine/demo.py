"""The embedded demo model, and random-weight models for tests and benchmarks.

The demo is a small qwen3_moe trained on the Python standard library's own source
(tools/train_demo.py; docs/demo-model.md), shipped packed (NVFP4 experts, bf16 dense) in
engine/data/demo/ so `python -m engine.generate` with no --model runs offline. Its continuation of
"def " looks like Python; it knows nothing else.

`build_random_model` writes a random-weight folder of any family from a config dict (DEMO_CONFIG
is a small qwen3_moe one, with the byte-level tokenizer's 259 ids); the text of those is noise."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

DEMO_NAME = "moe-stream-demo-stdlib-v1"       # the name engine.serve gives the shipped demo
DEMO_DIR = Path(__file__).parent / "data" / "demo"

# a small random qwen3_moe for build_random_model (tests, serve tests); not the shipped demo
DEMO_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 259, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "eos_token_id": 258, "bos_token_id": 257,
}


def byte_level_tokenizer(specials=("<|pad|>", "<|bos|>", "<|endoftext|>")):
    """A byte-level BPE tokenizer with no merges: ids 0..255 are bytes, then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    # the GPT-2 byte -> unicode map, so id b is byte b
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_char = {b: chr(c) for b, c in zip(bs, cs)}
    assert set(byte_char.values()) == set(alphabet)
    vocab = {byte_char[b]: b for b in range(256)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(specials))
    return tk


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-stream"


def build_random_model(dst: Path, config: dict, seed: int = 0, bf16: bool = False) -> Path:
    """Write a random-weight model folder of any family (config, safetensors, byte tokenizer).

    Needs only the runtime dependencies; written to a temporary name and renamed at the end.
    """
    from engine.models import family_of
    from loader.st_write import write_safetensors
    fam = family_of(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in {**fam.dense_spec, **fam.expert_spec}.items():
        if len(shape) == 1:
            a = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32))
        else:
            a = rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(shape[1]))
        tensors[name] = (a.view(np.uint32) >> 16).astype(np.uint16) if bf16 else a
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    write_safetensors(tmp / "model.safetensors", tensors, bf16=set(tensors) if bf16 else None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    byte_level_tokenizer().save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|endoftext|>", "add_bos_token": False}))
    if dst.exists():
        import shutil
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    return dst


def demo_model_dir() -> Path:
    """The shipped demo model folder (packed; inside the installed package, no download)."""
    if not (DEMO_DIR / "manifest.json").is_file():
        raise FileNotFoundError(f"the demo model is missing from {DEMO_DIR} (a broken install? "
                                "tools/train_demo.py rebuilds it); pass --model DIR")
    print("demo model: a 4-layer qwen3_moe (16 experts, NVFP4) trained for minutes on the Python "
          "standard library: it writes Python-like text, nothing more (pass --model DIR for a "
          "real checkpoint)", file=sys.stderr)
    return DEMO_DIR


# renamed; kept for callers written against the first name
build_random_qwen3_moe = build_random_model
