"""python -m engine.bench: decode speed next to the bound the memory system allows.

    python -m engine.bench cpu-decode [--preset mid] [--tokens 32] [--experts nvfp4] [--prompt-len N]

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

from engine.runtime import KV_CACHE_KINDS

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


CPU_EXPERTS = ("checkpoint", "bf16", "fp8", "nvfp4")   # cpu-decode --experts: as built, or packed


def synth_dir(preset: str, experts: str = "checkpoint") -> Path:
    """The preset's random bf16 checkpoint (built once in the cache folder), or that checkpoint
    packed with its experts in an arena of the format named (packed once too)."""
    from engine.demo import build_random_model, cache_dir
    d = cache_dir() / f"synth-{preset}-bf16"
    if not (d / "config.json").is_file():
        print(f"building synthetic model {preset} in {d} ...", file=sys.stderr)
        build_random_model(d, PRESETS[preset], bf16=True)
    if experts == "checkpoint":
        return d
    from engine.pack import MANIFEST, pack
    packed = cache_dir() / f"synth-{preset}-packed-{experts}"
    if not (packed / MANIFEST).is_file():
        print(f"packing {d} into {packed} ({experts} experts) ...", file=sys.stderr)
        pack(d, packed, experts, force=True, progress=False)
    return packed


def cpu_decode(preset: str = "mid", tokens: int = 32, experts: str = "checkpoint",
               prompt_len: int = 8) -> dict:
    import engine
    m = engine.load(synth_dir(preset, experts), device="cpu")
    m.generate([1, 2, 3, 4], max_new_tokens=4)  # compile kernels
    m.generate(list(range(1, 18)), max_new_tokens=1)  # and the many-token expert path
    prompt = np.random.default_rng(0).integers(1, PRESETS[preset]["vocab_size"], prompt_len)
    res = m.generate(prompt.tolist(), max_new_tokens=tokens, temperature=0)
    pt = res.stats["decode_per_token"]
    bpt = pt["weight_bytes"] + pt["state_bytes"]   # the weights and the KV rows a token reads
    bw = dram_read_bandwidth()
    tok_s = res.stats["decode_tok_s"]
    bound = bw * 1e9 / bpt
    return {"preset": preset, "experts": experts, "prompt_len": prompt_len,
            "decode_tok_s": tok_s, "prefill_tok_s": res.stats["prefill_tok_s"],
            "bytes_per_token": bpt, "dram_read_GBps": bw, "bound_tok_s": bound,
            "achieved_over_bound": tok_s / bound, "machine": platform.processor() or platform.machine(),
            "cores": __import__("os").cpu_count()}


def drop_page_cache(path) -> None:
    """Evict a file from the page cache so the next reads come from the disk."""
    import os
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_gbps(path, nbytes: int = 2 << 30, block: int = 8 << 20) -> float:
    """Sequential O_DIRECT read of the file's first nbytes, page cache dropped first."""
    import mmap
    import os
    drop_page_cache(path)
    buf = mmap.mmap(-1, block)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    n = min(nbytes, os.fstat(fd).st_size) // block * block
    t = time.perf_counter()
    off = 0
    while off < n:
        off += os.preadv(fd, [buf], off)
    dt = time.perf_counter() - t
    os.close(fd)
    return n / dt / 1e9


def uniform_router(n_experts: int, top_k: int, seed: int = 0):
    """Routing drawn uniformly at random (no locality: the caches' worst case). Random-weight
    models route nearly every token to the same experts, which would hide the streaming."""
    rng = np.random.default_rng(seed)

    def route(layer, ids):
        return np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(ids.shape[0])]
                        ).astype(np.int32)
    return route


def fill_ram_cache(m) -> int:
    """Read experts into the engine's RAM cache, layer by layer, up to each layer's share of it;
    returns how many blocks are resident afterwards."""
    cache = m.experts.cache
    share = cache.n_slots // max(len(m.config.moe_layers), 1)
    for layer in m.config.moe_layers:
        ids = list(range(min(m.config.n_experts, share)))
        for i in range(0, len(ids), 32):
            cache.get_many(layer, ids[i:i + 32])
    return len(cache.resident())


def gpu_stream(model: str, vram_gb: float, ram_gbs, tokens: int, prompt_len: int, out_json=None,
               resident_vram_gb: float | None = None, route: str = "model", profile: bool = False,
               speculate: bool = False, warm_ram: bool = False, kv_cache: str = "f32") -> list:
    """Decode and prefill tokens/s on the cuda backend under each RAM budget, page cache dropped
    before each run, with the bound from bandwidths measured in this run."""
    import engine
    from engine.bandwidth import bound, h2d_gbps, hbm_gbps
    arena = str(Path(model) / "experts.arena")
    bw = {"disk": disk_read_gbps(arena), "h2d": h2d_gbps(), "hbm": hbm_gbps()}
    print(f"measured: disk {bw['disk']:.2f} GB/s, pinned H2D {bw['h2d']:.1f} GB/s, "
          f"HBM {bw['hbm']:.0f} GB/s", file=sys.stderr)
    rng = np.random.default_rng(0)
    rows = []
    runs = [(vram_gb, r) for r in ram_gbs]
    if resident_vram_gb:
        runs.append((resident_vram_gb, max(ram_gbs)))
    for vram, ram in runs:
        drop_page_cache(arena)
        t = time.perf_counter()
        m = engine.load(model, device="cuda", vram_gb=vram, ram_gb=ram, max_context=prompt_len + tokens + 8,
                        speculate=speculate, kv_cache=kv_cache)
        load_s = time.perf_counter() - t
        # compile every kernel and capture the graphs outside the timed run (numba compiles on
        # first launch); then the page cache is dropped again for a cold prefill
        m.generate(rng.integers(0, m.config.vocab_size, 16).tolist(), max_new_tokens=3,
                   temperature=1.0, seed=1)
        drop_page_cache(arena)
        if warm_ram:   # experts already in host RAM, as a peer that mmaps a cached model has them
            fill_ram_cache(m)
        prompt = rng.integers(0, m.config.vocab_size, prompt_len).tolist()
        if route == "uniform":   # (prefill and the per-layer path on the host, a streamed
            # token graph on the device: the same distribution, no locality either way)
            m.gpu.route_override = uniform_router(m.config.n_experts, m.config.top_k)
            m.gpu.device_route = "uniform"
            m.gpu.speculate = False
        # sampled, not greedy: a random-weight model repeats one token under greedy decoding,
        # which would route every step to the same experts
        if profile:   # where the decode thread's time goes (Python side)
            import cProfile
            import io
            import pstats
            pr = cProfile.Profile()
            pr.enable()
        res = m.generate(prompt, max_new_tokens=tokens, temperature=1.0, seed=0)
        if profile:
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
            print(buf.getvalue(), file=sys.stderr)
        s = res.stats
        pt = s["decode_per_token"]
        # HBM: the weights and the sequence state (KV cache rows) a token reads
        per = {"disk": pt["disk_bytes"], "h2d": pt["h2d_bytes"],
               "hbm": pt["weight_bytes"] + pt["state_bytes"]}
        b = bound(per, bw)
        row = {"vram_gb": vram, "ram_gb": ram, "speculate": m.gpu.speculate, "warm_ram": warm_ram,
               "kv_cache": kv_cache,
               "all_resident": m.plan.all_resident, "route": route,
               "hot_experts": m.plan.hot_slots, "total_experts": m.plan.total_experts,
               "load_s": load_s, "prefill_tokens": s["prefill_tokens"], "prefill_tok_s": s["prefill_tok_s"],
               "decode_tokens": s["decode_tokens"], "decode_tok_s": s["decode_tok_s"],
               "per_token_bytes": per, "bandwidth_GBps": bw, "bound_tok_s": b,
               "achieved_over_bound": s["decode_tok_s"] / b, "vram": s.get("vram"),
               "ram_cache": {k: s["experts"].get(k) for k in ("hit_rate", "hits", "misses", "evictions",
                                                              "bytes_read", "read_gbps")},
               "wait_host_s_per_token": pt["wait_host_s"], "wait_h2d_s_per_token": pt["wait_h2d_s"],
               "compute_s_per_token": pt["compute_s"], "issue_s_per_token": pt["issue_s"],
               "graph_nodes": sum(g.nodes for g in (m.gpu._graphs or {}).values()),
               "programmatic_edges": sum(g.programmatic for g in (m.gpu._graphs or {}).values())}
        rows.append(row)
        print(f"[{route} routing] vram {vram:g} GB ram {ram:g} GB: prefill {row['prefill_tok_s']:.0f} tok/s, decode "
              f"{row['decode_tok_s']:.1f} tok/s | per token disk {per['disk'] / 1e6:.1f} MB, H2D "
              f"{per['h2d'] / 1e6:.1f} MB, weights {pt['weight_bytes'] / 1e6:.0f} MB + state "
              f"{pt['state_bytes'] / 1e6:.0f} MB | bound {b:.1f} tok/s | "
              f"achieved/bound {row['achieved_over_bound']:.2f} | ms per token: compute "
              f"{1e3 * pt['compute_s']:.1f}, H2D wait {1e3 * pt['wait_h2d_s']:.1f}, host tier "
              f"{1e3 * pt['wait_host_s']:.1f}; the decode thread issuing copies "
              f"{1e3 * pt['issue_s']:.1f} | graphs: {row['graph_nodes']} nodes, "
              f"{row['programmatic_edges']} programmatic edges", file=sys.stderr)
        if out_json:
            Path(out_json).write_text(json.dumps(rows, indent=1))
        m.experts.close()
        del m
        import gc
        gc.collect()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench")
    p.add_argument("what", choices=["cpu-decode", "gpu-stream"])
    p.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--model", help="gpu-stream: a packed folder (engine.synth makes one)")
    p.add_argument("--vram-gb", type=float, default=8.0)
    p.add_argument("--ram-gb", type=float, nargs="+", default=[4.0, 8.0, 32.0])
    p.add_argument("--resident-vram-gb", type=float, default=None,
                   help="also run with this VRAM budget (all experts resident: the compute ceiling)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt length (gpu-stream default 2048, cpu-decode 8)")
    p.add_argument("--experts", choices=CPU_EXPERTS, default="checkpoint",
                   help="cpu-decode: the preset's bf16 checkpoint as it is, or packed into an "
                        "arena of this format (packed once, kept in the cache folder)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--route", choices=("model", "uniform"), default="model",
                   help="uniform: replace the model's routing by uniform random draws (forces streaming)")
    p.add_argument("--speculate", action="store_true", help="speculative copies on (engine --speculate)")
    p.add_argument("--warm-ram", action="store_true",
                   help="fill the RAM cache with experts before the timed prefill (warm, not cold)")
    p.add_argument("--kv-cache", choices=KV_CACHE_KINDS, default="f32", help="engine --kv-cache")
    p.add_argument("--profile", action="store_true",
                   help="print where the decode thread spends its time (cProfile, top 25)")
    a = p.parse_args(argv)
    if a.what == "gpu-stream":
        gpu_stream(a.model, a.vram_gb, a.ram_gb, a.tokens, a.prompt_len or 2048, a.out,
                   a.resident_vram_gb,
                   a.route, a.profile, a.speculate, a.warm_ram, a.kv_cache)
        return 0
    r = cpu_decode(a.preset, a.tokens, a.experts, a.prompt_len or 8)
    print(json.dumps(r, indent=1))
    print(f"prefill {r['prefill_tok_s']:.1f} tok/s ({r['prompt_len']} ids) | "
          f"decode {r['decode_tok_s']:.2f} tok/s | {r['bytes_per_token'] / 1e6:.1f} MB/token | "
          f"DRAM {r['dram_read_GBps']:.1f} GB/s -> bound {r['bound_tok_s']:.1f} tok/s | "
          f"achieved/bound {r['achieved_over_bound']:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
