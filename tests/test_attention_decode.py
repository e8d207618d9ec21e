"""Decode attention (T = 1) variants of kernels_numba/gpu_attention.py against the numpy oracle.

Each run draws fresh random inputs and poisons the output (NaN) and the partials scratch (NaN,
the ticket column left at 0) first; the result must be within 1e-5 of max |ref|, and the
ticket column must be back at 0 after it (so a captured graph can replay it).
- Simulator (tiny shapes): NUMBA_ENABLE_CUDASIM=1 python -m pytest -q tests/test_attention_decode.py
  runs them in this process; a plain pytest run (CPU CI) runs the same file in a subprocess
  with the variable set (it must be set before numba.cuda is imported).
- A GPU (marker gpu): Qwen3-30B-A3B shapes (32 / 4 heads x 128, S_max 4096 and 32768) and
  Qwen3-Next's (16 / 2 x 256), and one captured graph replayed at several positions.
Legend: Hq / Hkv = query / kv heads, D = head dim, S = cache rows (S_max).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from kernels_numba import reference as ref
from kernels_numba.gpu_util import SIM

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
NEW = ("v2", "v2f")
_HAVE_GPU = (not SIM) and cuda.is_available()
sim_only = pytest.mark.skipif(not SIM, reason="run under NUMBA_ENABLE_CUDASIM=1 "
                                              "(test_simulator_subprocess does)")
gpu = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU")


def _bf16(a):
    from loader.quant import f32_to_bf16
    return f32_to_bf16(np.asarray(a, dtype=np.float32))


def _cache(rng, kind, s, hkv, d):
    """(host k, host v as the oracle sees them, device k, device v) [S, Hkv, D]."""
    k = rng.standard_normal((s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((s, hkv, d)).astype(np.float32)
    if kind == "bf16":
        kb, vb = _bf16(k), _bf16(v)
        return ref.bf16_to_f32(kb), ref.bf16_to_f32(vb), cuda.to_device(kb), cuda.to_device(vb)
    return k, v, cuda.to_device(k), cuda.to_device(v)


def _poison_partials(parts):
    pm, pl, pacc = parts
    h = np.full(pm.shape, np.nan, np.float32)
    h[:, -1] = 0.0                                  # the fused merge's ticket column
    pm.copy_to_device(h)
    pl.copy_to_device(np.full(pl.shape, np.nan, np.float32))
    pacc.copy_to_device(np.full(pacc.shape, np.nan, np.float32))


def _check(got, exp, what):
    got = np.asarray(got, np.float64)
    exp = np.asarray(exp, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (poison left?)"
    err = np.abs(got - exp).max() / max(np.abs(exp).max(), 1e-30)
    assert err <= TOL, f"{what}: max error {err:.3g} of max |ref| exceeds {TOL}"
    return err


def check_decode(rng, kind, s_max, hq, hkv, d, split, cases, t_alloc=1, ran=None, sinks=None,
                 **var):
    """Decode at each (pos, window) of cases through attention(**var) against the oracle; the
    partials come from alloc_partials(t_alloc, ...) (the engine slices its rows for T = 1);
    ran: the path attention() must report (default: the variant asked for); sinks: float32
    [Hq] attention sinks (gpt-oss), or None."""
    from kernels_numba import gpu_attention as ga
    stream = cuda.stream()
    k, v, dk, dv = _cache(rng, kind, s_max, hkv, d)
    full = ga.alloc_partials(t_alloc, hq, d, s_max, split)
    parts = tuple(a[:hq] for a in full)
    scale = d ** -0.5
    errs = []
    for pos, win in cases:
        q = rng.standard_normal((1, hq, d)).astype(np.float32)
        qp = np.array([pos], np.int32)
        out = cuda.to_device(np.full((1, hq, d), np.nan, np.float32))
        _poison_partials(full)
        path = ga.attention(cuda.to_device(q), dk, dv, cuda.to_device(qp), scale, out, parts,
                            stream, window=win, split=split,
                            sinks=None if sinks is None else cuda.to_device(sinks), **var)
        stream.synchronize()
        what = f"decode {kind} S={s_max} {hq}/{hkv}x{d} pos={pos} window={win} {var}"
        assert path == (ran or var.get("variant", ga.DECODE_VARIANT)), f"{what}: ran {path}"
        errs.append(_check(out.copy_to_host(), ref.attention(q, k, v, qp, scale, win, sinks),
                           what))
        assert not full[0].copy_to_host()[:, -1].any(), f"{what}: ticket column not reset"
    return max(errs)


# ---- simulator: tiny shapes -----------------------------------------------------------------

# first, mid, last position; a window; chunks (Llama 4: window -C), the last a chunk's first
S_CASES = ((0, 0), (13, 0), (31, 0), (31, 5), (13, -6), (30, -5))


@sim_only
@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("variant", NEW)
def test_sim_decode(variant, kind):
    """Hq 4 / Hkv 2 x 32, S 32: pieces of 4+ keys, the default splits (few in the simulator)."""
    check_decode(np.random.default_rng(1), kind, 32, 4, 2, 32, 4, S_CASES, variant=variant)


def _sinks(rng, hq):
    """gpt-oss-like sinks, one above every score and one far below."""
    s = (rng.standard_normal(hq) * 3.0).astype(np.float32)
    s[0], s[-1] = 40.0, -40.0
    return s


@sim_only
@pytest.mark.parametrize("variant", NEW + ("base",))
def test_sim_decode_sinks(variant):
    """Attention sinks after each path (log2 units for v2 / v2f, natural for base)."""
    rng = np.random.default_rng()
    check_decode(rng, "f32", 32, 4, 2, 32, 4, S_CASES, variant=variant, sinks=_sinks(rng, 4))


@sim_only
@pytest.mark.parametrize("variant", NEW)
def test_sim_decode_splits(variant):
    """Explicit splits: 3 pieces (uneven; the tail pieces unused at small positions), and more
    than the partials hold (capped at their 4)."""
    rng = np.random.default_rng(2)
    for splits in (3, 9):
        check_decode(rng, "f32", 48, 4, 2, 32, 4, ((5, 0), (47, 20)), variant=variant,
                     splits=splits)


@sim_only
@pytest.mark.parametrize("variant", NEW)
def test_sim_decode_group8(variant):
    """G = 8 (the real models' group): 32 sums a step, the full transpose reduction."""
    check_decode(np.random.default_rng(3), "f32", 40, 8, 1, 8, 4, ((0, 0), (39, 0), (39, 7)),
                 variant=variant)
    check_decode(np.random.default_rng(4), "bf16", 40, 8, 1, 8, 4, ((22, 0),), variant=variant,
                 kb=2)


@sim_only
@pytest.mark.parametrize("variant", NEW)
def test_sim_decode_shapes(variant):
    """G = 1 with D = 36 (lanes past the head dim), kb = 1, one warp; D = 136 (two chunks a
    lane); partials of a 3-token allocation, sliced as the engine does."""
    rng = np.random.default_rng(5)
    check_decode(rng, "bf16", 24, 2, 2, 36, 4, ((0, 0), (23, 0), (23, 6)), variant=variant,
                 kb=1, warps=1)
    check_decode(rng, "f32", 20, 2, 1, 136, 8, ((19, 0),), variant=variant)
    check_decode(rng, "f32", 48, 4, 2, 16, 8, ((47, 0),), t_alloc=3, variant=variant)


@sim_only
def test_sim_fallbacks_and_prefill():
    """D % 4 != 0 takes the base path; prefill (T > 1) ignores the decode variant; an unknown
    variant is refused by name."""
    from kernels_numba import gpu_attention as ga
    rng = np.random.default_rng(6)
    check_decode(rng, "f32", 16, 2, 1, 10, 4, ((15, 0),), ran="base", variant="v2f")
    k, v, dk, dv = _cache(rng, "f32", 12, 1, 8)
    t = 3
    q = rng.standard_normal((t, 2, 8)).astype(np.float32)
    qp = np.arange(4, 4 + t, dtype=np.int32)
    stream = cuda.stream()
    for variant, window in zip(NEW, (3, -5)):   # (a chunk boundary at 5 among positions 4-6)
        out = cuda.to_device(np.full((t, 2, 8), np.nan, np.float32))
        assert ga.attention(cuda.to_device(q), dk, dv, cuda.to_device(qp), 0.3, out,
                            ga.alloc_partials(t, 2, 8, 12, 4), stream, window=window, split=4,
                            variant=variant) == "base"
        stream.synchronize()
        _check(out.copy_to_host(), ref.attention(q, k, v, qp, 0.3, window),
               f"prefill {variant} window={window}")
    with pytest.raises(ValueError, match="unknown attention variant 'v3'"):
        ga.attention(cuda.to_device(q[:1]), dk, dv, cuda.to_device(qp[:1]), 0.3, out,
                     ga.alloc_partials(1, 2, 8, 12, 4), stream, variant="v3")


@pytest.mark.skipif(SIM or _HAVE_GPU, reason="the simulator tests run in this process")
def test_simulator_subprocess():
    """CPU CI: this file's simulator tests, with NUMBA_ENABLE_CUDASIM=1 set before numba loads."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(Path(__file__)), "-k", "sim_"], env=env, capture_output=True,
                       text=True, timeout=900, cwd=str(ROOT))
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


# ---- real GPU, real shapes ------------------------------------------------------------------

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("variant", NEW)
def test_decode_gpu(variant, kind):
    """Qwen3-30B-A3B: 32 / 4 heads x 128, S 4096; and S 32768 (fp32). Llama 4's chunks of 8192
    (window -8192) at S 32768: a chunk's first position, its last, one inside."""
    rng = np.random.default_rng(7)
    check_decode(rng, kind, 4096, 32, 4, 128, 32,
                 ((0, 0), (1, 0), (255, 0), (2047, 0), (4095, 0), (4095, 1024)), variant=variant)
    if kind == "f32":
        check_decode(rng, kind, 32768, 32, 4, 128, 32, ((32767, 0), (20000, 4096), (16384, -8192),
                                                         (16383, -8192), (30000, -8192)),
                     variant=variant)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("variant", NEW + ("base",))
def test_decode_sinks_gpu(variant, kind):
    """gpt-oss-120b's attention (64 / 8 heads x 64, sinks, 128-key sliding window layers) at
    S 4096, and Qwen3-30B-A3B's shapes with sinks."""
    rng = np.random.default_rng()
    check_decode(rng, kind, 4096, 64, 8, 64, 32, ((0, 0), (127, 128), (2047, 0), (4095, 128),
                                                   (4095, 0)), variant=variant,
                 sinks=_sinks(rng, 64))
    check_decode(rng, kind, 4096, 32, 4, 128, 32, ((300, 0), (4095, 0)), variant=variant,
                 sinks=_sinks(rng, 32))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", NEW)
def test_decode_gpu_knobs(variant):
    """The sweep's knobs (kb, warps, splits) and Qwen3-Next's 16 / 2 heads x 256."""
    rng = np.random.default_rng(8)
    cases = ((0, 0), (2047, 0), (4095, 512))
    for var in (dict(kb=1), dict(kb=2), dict(warps=2), dict(warps=8), dict(splits=17),
                dict(splits=128)):
        check_decode(rng, "f32", 4096, 32, 4, 128, 32, cases, variant=variant, **var)
    for kind in ("f32", "bf16"):
        check_decode(rng, kind, 4096, 16, 2, 256, 32, cases, variant=variant)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", NEW)
def test_decode_graph_replay_gpu(variant):
    """One graph captured at one position serves every position (q_pos in device memory), and
    the fused merge's ticket is left at 0 by each replay."""
    from engine.graphs import capture_fn
    from kernels_numba import gpu_attention as ga
    rng = np.random.default_rng(9)
    s_max, hq, hkv, d = 4096, 32, 4, 128
    k, v, dk, dv = _cache(rng, "f32", s_max, hkv, d)
    parts = ga.alloc_partials(1, hq, d, s_max)
    q = cuda.device_array((1, hq, d), np.float32)
    qp = cuda.to_device(np.array([7], np.int32))
    out = cuda.device_array((1, hq, d), np.float32)
    stream = cuda.stream()

    def step(st):
        ga.attention(q, dk, dv, qp, d ** -0.5, out, parts, st, variant=variant)
    g = capture_fn(step, stream)
    for pos in (0, 100, 2047, 4000, 4095, 31):
        qh = rng.standard_normal((1, hq, d)).astype(np.float32)
        q.copy_to_device(qh, stream=stream)
        qp.copy_to_device(np.array([pos], np.int32), stream=stream)
        out.copy_to_device(np.full((1, hq, d), np.nan, np.float32), stream=stream)
        g.launch(stream)
        stream.synchronize()
        _check(out.copy_to_host(), ref.attention(qh, k, v, np.array([pos]), d ** -0.5),
               f"graph replay {variant} pos={pos}")
        assert not parts[0].copy_to_host()[:, -1].any(), "ticket column not reset"
    g.destroy()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", NEW)
@pytest.mark.parametrize("window", [0, 100])
def test_decode_after_store_programmatic_gpu(variant, window):
    """The decode step's order in one graph with programmatic edges: the cache store of the
    new key / value, then attention, which reads every older row before its PDL wait and the
    new one after it. Replayed at positions whose new row falls in different pieces and warps
    (and with a sliding window); the result must use the row just stored."""
    from engine.graphs import capture_fn, pdl_enabled
    from kernels_numba import gpu_attention as ga
    from kernels_numba import gpu_misc as gm
    rng = np.random.default_rng(10)
    s_max, hq, hkv, d = 4096, 32, 4, 128
    k, v, dk, dv = _cache(rng, "f32", s_max, hkv, d)
    parts = ga.alloc_partials(1, hq, d, s_max)
    q = cuda.device_array((1, hq, d), np.float32)
    kn = cuda.to_device(np.zeros((1, hkv, d), np.float32))
    vn = cuda.to_device(np.zeros((1, hkv, d), np.float32))
    # capture_fn's warm-up runs the store for real: at the last row, which the replay at
    # position s_max - 1 writes before it reads it (as the engine's warm-up does)
    qp = cuda.to_device(np.array([s_max - 1], np.int32))
    out = cuda.device_array((1, hq, d), np.float32)
    stream = cuda.stream()
    paths = []

    def step(st):
        gm.kv_store(kn, vn, dk, dv, qp, st)
        paths.append(ga.attention(q, dk, dv, qp, d ** -0.5, out, parts, st, window=window,
                                  variant=variant))
    g = capture_fn(step, stream)
    assert set(paths) == {variant}
    assert g.programmatic == (g.nodes - 1 if pdl_enabled() else 0)   # a chain of kernels
    for pos in (0, 1, 62, 63, 64, 2047, 2066, 4095):
        qh = rng.standard_normal((1, hq, d)).astype(np.float32)
        knh = rng.standard_normal((1, hkv, d)).astype(np.float32)
        vnh = rng.standard_normal((1, hkv, d)).astype(np.float32)
        for dev, host in ((q, qh), (kn, knh), (vn, vnh)):
            dev.copy_to_device(host, stream=stream)
        qp.copy_to_device(np.array([pos], np.int32), stream=stream)
        out.copy_to_device(np.full((1, hq, d), np.nan, np.float32), stream=stream)
        g.launch(stream)
        stream.synchronize()
        k[pos], v[pos] = knh[0], vnh[0]
        _check(out.copy_to_host(),
               ref.attention(qh, k, v, np.array([pos]), d ** -0.5, window),
               f"store + attention {variant} window={window} pos={pos}")
    g.destroy()
