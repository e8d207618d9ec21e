"""The embedded demo model: a small qwen3_moe with RANDOM weights, built deterministically on first
use into the user cache dir. It proves the install works; its text is noise."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

DEMO_NAME = "demo-random-qwen3moe-v1"
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
    dst = cache_dir() / DEMO_NAME
    print("demo model: small qwen3_moe with RANDOM weights: the install works, the text is noise "
          "(pass --model DIR for a real checkpoint)", file=sys.stderr)
    if not (dst / "config.json").is_file():
        print(f"building it once in {dst} ...", file=sys.stderr)
        build_random_model(dst, DEMO_CONFIG)
    return dst

# renamed; kept for callers written against the first name
build_random_qwen3_moe = build_random_model
