"""python -m engine.bench: decode speed next to the bound the memory system allows.

    python -m engine.bench cpu-decode [--preset mid] [--tokens 32]

Prints tokens/s, the bytes each token touches, the DRAM bandwidth measured in the same run,
the bound (bandwidth / bytes per token) and achieved/bound.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

PRESETS = {
    # a mid-size MoE that does not fit in CPU caches: 8 layers, 32 experts top-4, bf16
    "mid": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 32000,
        "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
        "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "eos_token_id": 258,
    },
    "small": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 4096,
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "eos_token_id": 258,
    },
}


@njit(parallel=True, cache=True)
def _read_sum(a):
    n = a.shape[0]
    chunks = 64
    part = np.zeros(chunks, dtype=np.float64)
    step = (n + chunks - 1) // chunks
    for c in prange(chunks):
        s = 0.0
        for i in range(c * step, min(n, (c + 1) * step)):
            s += a[i]
        part[c] = s
    return part.sum()


def dram_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of a parallel read over a buffer far larger than the caches (best of repeats)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    _read_sum(a[:1024])
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        _read_sum(a)
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def decode_bytes_per_token(m) -> int:
    """Weight bytes one decode token reads: dense side, the routed experts, the lm_head row set."""
    c = m.config
    dense = sum(np.asarray(w).nbytes for n, w in m._dense.items() if "embed_tokens" not in n)
    if c.tie_embeddings:
        dense += np.asarray(m._dense["model.embed_tokens.weight"]).nbytes
    ck = m.checkpoint
    from engine.names import expert_names
    per_expert = sum(ck.info(n).nbytes for n in expert_names(c.family, c.moe_layers[0], 0))
    return int(dense + len(c.moe_layers) * c.top_k * per_expert)


def synth_dir(preset: str) -> Path:
    from engine.demo import build_random_model, cache_dir
    d = cache_dir() / f"synth-{preset}-bf16"
    if not (d / "config.json").is_file():
        print(f"building synthetic model {preset} in {d} ...", file=sys.stderr)
        build_random_model(d, PRESETS[preset], bf16=True)
    return d


def cpu_decode(preset: str = "mid", tokens: int = 32) -> dict:
    import engine
    m = engine.load(synth_dir(preset), device="cpu")
    m.generate([1, 2, 3, 4], max_new_tokens=4)  # compile kernels
    res = m.generate([1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=tokens, temperature=0)
    bpt = decode_bytes_per_token(m)
    bw = dram_read_bandwidth()
    tok_s = res.stats["decode_tok_s"]
    bound = bw * 1e9 / bpt
    return {"preset": preset, "decode_tok_s": tok_s, "prefill_tok_s": res.stats["prefill_tok_s"],
            "bytes_per_token": bpt, "dram_read_GBps": bw, "bound_tok_s": bound,
            "achieved_over_bound": tok_s / bound, "machine": platform.processor() or platform.machine(),
            "cores": __import__("os").cpu_count()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench")
    p.add_argument("what", choices=["cpu-decode"])
    p.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args(argv)
    r = cpu_decode(a.preset, a.tokens)
    print(json.dumps(r, indent=1))
    print(f"decode {r['decode_tok_s']:.2f} tok/s | {r['bytes_per_token'] / 1e6:.1f} MB/token | "
          f"DRAM {r['dram_read_GBps']:.1f} GB/s -> bound {r['bound_tok_s']:.1f} tok/s | "
          f"achieved/bound {r['achieved_over_bound']:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
