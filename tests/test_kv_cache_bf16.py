"""The bfloat16 KV cache (engine kv_cache="bf16", --kv-cache bf16): K and V rounded to nearest
even as they are stored; on cuda the cache holds the bf16 bits (half the VRAM), the CPU backend
rounds the same way in its float32 cache, so the two backends agree token for token.
- CPU: the rounding against an oracle that picks the nearer bf16 neighbour; the engine's cache
  against the float32 engine's cache rounded; logits near the float32 cache's.
- CI also runs this file as a script under NUMBA_ENABLE_CUDASIM=1 (test_simulator): the store
  kernels (kv_store, qk_norm_rope's fused store, both variants) bit for bit, and the eager cuda
  decoder with a bf16 cache against the CPU backend with one.
- A GPU (marker gpu): cuda = CPU backend, graph replay = eager, streamed and resident, on a
  plain-attention family (kv_store), a per-head-norm one (qk_norm_rope) and a hybrid.
Run the simulator checks directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_kv_cache_bf16.py DIR
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":   # run as a script from anywhere
    for p in (ROOT, ROOT / "tests"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))

from conftest import (build_hf_model, check_graph_replay_equals_eager,  # noqa: E402
                      eager_decoder_matches_cpu, rel_err)

TINY = dict(vocab_size=24, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, moe_intermediate_size=8, intermediate_size=8, num_experts=4,
            num_experts_per_tok=2, num_hidden_layers=2)


def edge_values(rng) -> np.ndarray:
    """Random magnitudes over the float32 range, exact ties, infinities, NaN, zeros."""
    x = (rng.standard_normal(50000) * 10.0 ** rng.integers(-35, 35, 50000)).astype(np.float32)
    ties = ((rng.integers(0, 1 << 15, 2000).astype(np.uint32) << 16) | 0x8000).view(np.float32)
    return np.concatenate([x, ties, -ties, np.array([np.nan, np.inf, -np.inf, 0.0, -0.0,
                                                     3.4e38], np.float32)])


def test_round_bf16_matches_oracle():
    from kernels_numba import reference as ref
    from kernels_numba.cpu import round_bf16
    from loader.quant import bf16_to_f32, f32_to_bf16
    x = edge_values(np.random.default_rng())
    got = round_bf16(x)
    assert np.array_equal(got, ref.round_bf16(x), equal_nan=True)
    assert np.array_equal(got, bf16_to_f32(f32_to_bf16(x)), equal_nan=True)


def test_cpu_bf16_cache_is_the_f32_cache_rounded(tmp_path):
    import engine
    from kernels_numba import reference as ref
    # every expert chosen: the logits are then a continuous function of the cache; with top-2 of
    # 4 the rounding now and then flips a routing choice (~1 run in 100) and the logits jump
    build_hf_model(tmp_path, "qwen3_moe", num_experts_per_tok=4)
    ids = np.random.default_rng().integers(0, 300, 10)
    runs = {}
    for kind in ("f32", "bf16"):
        m = engine.load(tmp_path, device="cpu", kv_cache=kind)
        st = m.model.new_state(len(ids))
        runs[kind] = (np.asarray(m.model.forward(ids, st, all_logits=True)), st)
    (l32, s32), (l16, s16) = runs["f32"], runs["bf16"]
    # layer 0 sees the same input either way: its rows are the float32 ones rounded
    assert np.array_equal(s16.k[0], ref.round_bf16(s32.k[0]))
    assert np.array_equal(s16.v[0], ref.round_bf16(s32.v[0]))
    assert not (np.asarray(s16.k).view(np.uint32) & 0xFFFF).any()
    assert not np.array_equal(s16.k[0], s32.k[0])      # (the rounding did something)
    assert rel_err(l16, l32) < 2e-2


def test_kv_cache_kind_is_checked(tmp_path):
    import engine
    build_hf_model(tmp_path, "qwen3_moe")
    with pytest.raises(ValueError, match="kv_cache 'fp16'"):
        engine.load(tmp_path, device="cpu", kv_cache="fp16")


def test_simulator(tmp_path):
    # bf16 weights, as the cuda backend builds bf16 expert blocks from a checkpoint
    build_hf_model(tmp_path, "qwen3_moe", dtype="bfloat16", **TINY)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=900, cwd=str(ROOT))
    assert r.returncode == 0 and "SIM BF16 CACHE PASSED" in r.stdout, r.stdout + r.stderr


def check_kv_store(rng, t, hkv, d, s_max):
    """gm.kv_store into a poisoned bf16 cache: the rows at the positions hold k, v rounded."""
    from numba import cuda

    from kernels_numba import gpu_misc as gm
    from loader.quant import f32_to_bf16_ref
    k, v = (rng.standard_normal((t, hkv, d)).astype(np.float32) for _ in range(2))
    pos = rng.permutation(s_max)[:t].astype(np.int32)
    kc, vc = (cuda.to_device(np.full((s_max, hkv, d), 0xFFFF, np.uint16)) for _ in range(2))
    s = cuda.stream()
    gm.kv_store(cuda.to_device(k), cuda.to_device(v), kc, vc, cuda.to_device(pos), s)
    s.synchronize()
    kh, vh = kc.copy_to_host(), vc.copy_to_host()
    assert np.array_equal(kh[pos], f32_to_bf16_ref(k)) and np.array_equal(vh[pos], f32_to_bf16_ref(v))
    rest = np.setdiff1d(np.arange(s_max), pos)
    assert (kh[rest] == 0xFFFF).all() and (vh[rest] == 0xFFFF).all()


# ---- real GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_cuda_bf16_cache_matches_cpu(tmp_path, family, resident):
    """Graph replay = eager = the CPU backend, each with a bf16 cache; the cuda cache holds
    bf16 bits and the plan reserves half the float32 cache's bytes."""
    import engine
    from engine.pack import pack
    n = {"num_local_experts": 8} if family == "mixtral" else {"num_experts": 8}
    build_hf_model(tmp_path / "src", family, num_experts_per_tok=2, num_hidden_layers=3,
                   hidden_size=64, **n)
    pack(tmp_path / "src", tmp_path / "p", "nvfp4", progress=False)
    prompt = np.random.default_rng().integers(0, 300, 20).tolist()
    check_graph_replay_equals_eager(tmp_path / "p", prompt, resident, kv_cache="bf16")
    plans = {k: engine.load(tmp_path / "p", device="cuda", kv_cache=k) for k in ("f32", "bf16")}
    assert plans["bf16"].plan.kv_bytes * 2 == plans["f32"].plan.kv_bytes
    assert plans["bf16"].gpu.new_state(8).k[0].dtype == np.uint16
    if resident:
        # logits near the float32 cache's, on a model that chooses every expert: with top-2 the
        # rounding can flip a routing choice and the logits jump (test_cpu_bf16_cache_...)
        build_hf_model(tmp_path / "all", family, num_experts_per_tok=8, num_hidden_layers=3,
                       hidden_size=64, **n)
        pack(tmp_path / "all", tmp_path / "pa", "nvfp4", progress=False)
        l16, l32 = (engine.load(tmp_path / "pa", device="cuda", kv_cache=k).logits(prompt)
                    for k in ("bf16", "f32"))
        assert rel_err(l16, l32) < 2e-2


@pytest.mark.gpu
def test_cuda_bf16_cache_hybrid(tmp_path):
    """The hybrid's gated attention layers store through qk_norm_rope: cuda = CPU backend."""
    import engine
    from test_hybrid import build
    build(tmp_path, "qwen3_next", dtype="bfloat16")
    prompt = np.random.default_rng().integers(0, 200, 12).tolist()
    g = engine.load(tmp_path, device="cuda", kv_cache="bf16")
    c = engine.load(tmp_path, device="cpu", kv_cache="bf16")
    assert g.generate(prompt, max_new_tokens=24).output_ids == \
        c.generate(prompt, max_new_tokens=24).output_ids


if __name__ == "__main__":
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    from test_cuda_kernels import check_qk_norm_rope
    rng = np.random.default_rng()
    check_kv_store(rng, 3, 2, 8, 7)
    for variant in ("base", "v2"):
        check_qk_norm_rope(rng, t=3, hq=4, hkv=2, d=16, r=8, store=True, variant=variant, bf16=True)
    print("store kernels ok", flush=True)
    eager_decoder_matches_cpu(Path(sys.argv[1]), kv_cache="bf16")
    print("SIM BF16 CACHE PASSED", flush=True)
