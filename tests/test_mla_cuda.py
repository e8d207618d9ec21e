"""The MLA kernels (kernels_numba/gpu_mla.py) against the numpy oracles in
kernels_numba/reference.py, on fresh random inputs with outputs poisoned first.

- CPU-only CI: test_simulator() runs this file as a script with NUMBA_ENABLE_CUDASIM=1 at tiny
  shapes (heads not a multiple of the tile, token counts not a multiple of the absorb kernels'
  tile, several pieces and several key steps a piece, float32 and bf16 caches and weights), and
  DeepSeek-V2's group-limited softmax routing.
- A GPU (marker gpu): the same checks at DeepSeek-V2-Lite's and V3's shapes.
Run directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_mla_cuda.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from numba import cuda  # noqa: E402

from kernels_numba import reference as ref  # noqa: E402
from kernels_numba.gpu_util import SIM  # noqa: E402


def _close(got, exp, tol, what):
    got, exp = np.asarray(got, np.float64), np.asarray(exp, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (poison left?)"
    err = np.abs(got - exp).max() / max(np.abs(exp).max(), 1e-30)
    assert err <= tol, f"{what}: max error {err:.3g} of max |ref| exceeds {tol}"
    return err


def _bf16(a):
    from loader.quant import f32_to_bf16
    return f32_to_bf16(np.asarray(a, dtype=np.float32))


def check_prep(rng, t, hq, nope, r, c_dim, s_max):
    """q's rotary part into the latent query; the normed latent and the rotated key into the
    cache rows of the tokens' positions, no other row touched."""
    from kernels_numba import gpu_mla as gml
    stream = cuda.stream()
    d = c_dim + r
    q = rng.standard_normal((t, hq, nope + r)).astype(np.float32)
    kv = rng.standard_normal((t, d)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(c_dim)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)
    pos = rng.choice(s_max, t, replace=False).astype(np.int32)
    scaling = 1.2
    want_q = ref.rope(q[:, :, nope:], pos, inv_freq, scaling)
    want_row = np.concatenate([ref.rmsnorm(kv[:, :c_dim], nw, 1e-6),
                               ref.rope(kv[:, None, c_dim:], pos, inv_freq, scaling)[:, 0]], axis=1)
    for bf in (False, True):
        cache = cuda.to_device(np.full((s_max, 1, d), 0xFFFF, np.uint16) if bf
                               else np.full((s_max, 1, d), np.nan, np.float32))
        q_lat = cuda.to_device(np.full((t, hq, d), np.nan, np.float32))
        gml.prep(cuda.to_device(q), cuda.to_device(kv), cuda.to_device(nw), 1e-6,
                 cuda.to_device(pos), cuda.to_device(inv_freq), scaling, q_lat, cache, stream)
        stream.synchronize()
        got_q = q_lat.copy_to_host()
        _close(got_q[:, :, c_dim:], want_q, 1e-5, "prep q rope")
        assert np.isnan(got_q[:, :, :c_dim]).all(), "prep wrote the latent part of the query"
        ch = cache.copy_to_host()
        rows = ref.bf16_to_f32(ch[pos, 0]) if bf else ch[pos, 0]
        _close(rows, want_row, 1e-2 if bf else 1e-5, f"prep cache rows bf16={bf}")
        rest = np.setdiff1d(np.arange(s_max), pos)
        assert (ch[rest] == 0xFFFF).all() if bf else np.isnan(ch[rest]).all(), \
            "prep wrote cache rows outside the positions"


def check_absorb(rng, t, hq, nope, v_dim, c_dim, r):
    from kernels_numba import gpu_mla as gml
    stream = cuda.stream()
    kv_b = (rng.standard_normal((hq * (nope + v_dim), c_dim)) * 0.1).astype(np.float32)
    q = rng.standard_normal((t, hq, nope + r)).astype(np.float32)
    a = rng.standard_normal((t, hq, c_dim)).astype(np.float32)
    for w, t in ((kv_b, t), (_bf16(kv_b), t), (kv_b, 1), (_bf16(kv_b), 1)):   # t = 1: decode kernels
        q, a = q[:t], a[:t]
        dw = cuda.to_device(w)
        q_lat = cuda.to_device(np.full((t, hq, c_dim + r), np.nan, np.float32))
        gml.absorb_q(cuda.to_device(q), dw, q_lat, stream)
        out = cuda.to_device(np.full((t, hq, v_dim), np.nan, np.float32))
        gml.absorb_o(cuda.to_device(a), dw, out, stream)
        stream.synchronize()
        got = q_lat.copy_to_host()
        _close(got[:, :, :c_dim], ref.mla_absorb_q(q[:, :, :nope], w), 1e-5, f"absorb_q {w.dtype} t={t}")
        assert np.isnan(got[:, :, c_dim:]).all(), "absorb_q wrote the rotary part"
        _close(out.copy_to_host(), ref.mla_absorb_o(a, w, v_dim), 1e-5, f"absorb_o {w.dtype} t={t}")


def check_attention(rng, hq, c_dim, r, s_max, split, t_prefill, gh):
    """Decode at the first, a middle and the last position, and a causal prefill, against the
    oracle's multi-query attention over the rows (values: their first C entries)."""
    from kernels_numba import gpu_attention as ga
    from kernels_numba import gpu_mla as gml
    stream = cuda.stream()
    d = c_dim + r
    scale = 0.3
    for bf in (False, True):
        rows = rng.standard_normal((s_max, 1, d)).astype(np.float32)
        if bf:
            bits = _bf16(rows)
            rows, dc = ref.bf16_to_f32(bits), cuda.to_device(bits)
        else:
            dc = cuda.to_device(rows)
        for t, positions in ((1, (0, s_max // 2, s_max - 1)), (t_prefill, (None,))):
            parts = ga.alloc_partials(t, hq, d, s_max, split)
            for p0 in positions:
                qp = (np.arange(t, dtype=np.int32) + s_max - t) if p0 is None else np.array([p0], np.int32)
                q = rng.standard_normal((t, hq, d)).astype(np.float32)
                want = ref.attention(q, rows, rows, qp, scale)[:, :, :c_dim]
                for variant in ("tile",) if bf else gml.ATT_VARIANTS:   # staged: float32 caches
                    out = cuda.to_device(np.full((t, hq, c_dim), np.nan, np.float32))
                    gml.attention(cuda.to_device(q), dc, cuda.to_device(qp), scale, out, parts,
                                  stream, split=split, gh=gh, variant=variant)
                    stream.synchronize()
                    _close(out.copy_to_host(), want, 1e-5,
                           f"MLA attention {variant} bf16={bf} t={t} pos={qp[-1]}")


def check_router_group_softmax(rng, t, e, k, n_group, topk_group):
    """DeepSeek-V2's group-limited softmax routing (gs.router_sigmoid_topk softmax=True) against
    the oracle: the same ids, weights times the scale, every pick inside the kept groups; the slot
    table path the same."""
    from kernels_numba import gpu_sampling as gs
    stream = cuda.stream()
    logits = (rng.standard_normal((t, e)) * 2).astype(np.float32)
    slot_of = rng.permutation(e).astype(np.int32)
    eids, ew = ref.router_group_softmax_topk(logits, k, n_group, topk_group, 16.0)
    dl = cuda.to_device(logits)
    ids, w = cuda.to_device(np.full((t, k), -1, np.int32)), cuda.to_device(np.full((t, k), np.nan, np.float32))
    gs.router_sigmoid_topk(dl, None, n_group, topk_group, False, 16.0, ids, w, stream, softmax=True)
    ids2, w2 = cuda.to_device(np.full((t, k), -1, np.int32)), cuda.to_device(np.full((t, k), np.nan, np.float32))
    sl = cuda.to_device(np.full((t, k), -1, np.int32))
    gs.router_sigmoid_topk(dl, None, n_group, topk_group, False, 16.0, ids2, w2, stream,
                           slots=(cuda.to_device(slot_of), sl), softmax=True)
    stream.synchronize()
    ih = ids.copy_to_host()
    assert np.array_equal(ih, eids), f"group softmax ids {ih} != {eids}"
    _close(w.copy_to_host(), ew, 1e-5, "group softmax weights")
    assert np.array_equal(ids2.copy_to_host(), ih) and np.array_equal(w2.copy_to_host(), w.copy_to_host())
    assert np.array_equal(sl.copy_to_host(), slot_of[ih]), "group softmax slots"
    assert all(len(set(row // (e // n_group))) <= topk_group for row in ih), "picks outside the kept groups"


def check_router_softmax_pairs(rng, t, e, k, n_group, topk_group):
    """Mistral 4's routing (gs.router_sigmoid_topk softmax=True, no bias, pair_groups: a group
    scores its two best) against the oracle (reference.router_sigmoid_topk's softmax form with a
    zero bias), renormalized or not; the slot table path the same."""
    from kernels_numba import gpu_sampling as gs
    stream = cuda.stream()
    logits = (rng.standard_normal((t, e)) * 2).astype(np.float32)
    slot_of = rng.permutation(e).astype(np.int32)
    dl = cuda.to_device(logits)
    for norm, scale in ((True, 1.5), (False, 1.0)):
        what = f"softmax pairs T={t} E={e} K={k} groups={topk_group}/{n_group} norm={norm}"
        eids, ew = ref.router_sigmoid_topk(logits, np.zeros(e), k, n_group, topk_group, norm, scale, softmax=True)
        ids, w = cuda.to_device(np.full((t, k), -1, np.int32)), cuda.to_device(np.full((t, k), np.nan, np.float32))
        gs.router_sigmoid_topk(dl, None, n_group, topk_group, norm, scale, ids, w, stream, softmax=True,
                               pair_groups=True)
        ids2, w2 = cuda.to_device(np.full((t, k), -1, np.int32)), cuda.to_device(np.full((t, k), np.nan, np.float32))
        sl = cuda.to_device(np.full((t, k), -1, np.int32))
        gs.router_sigmoid_topk(dl, None, n_group, topk_group, norm, scale, ids2, w2, stream,
                               slots=(cuda.to_device(slot_of), sl), softmax=True, pair_groups=True)
        stream.synchronize()
        ih = ids.copy_to_host()
        assert np.array_equal(ih, eids), f"{what}: ids {ih} != {eids}"
        _close(w.copy_to_host(), ew, 1e-5, what + " weights")
        assert np.array_equal(ids2.copy_to_host(), ih) and np.array_equal(w2.copy_to_host(), w.copy_to_host())
        assert np.array_equal(sl.copy_to_host(), slot_of[ih]), what + ": slots"


def check_query_scale(rng, t, nh, d, period, beta):
    """Mistral 4's queries by position (gm.query_temperature, shift 0) against the oracle, over
    positions across several periods."""
    from kernels_numba import gpu_misc as gm
    q = rng.standard_normal((t, nh, d)).astype(np.float32)
    pos = np.sort(rng.choice(8 * period, size=t, replace=False)).astype(np.int32)
    dq = cuda.to_device(q)
    gm.query_temperature(dq, cuda.to_device(pos), period, beta, cuda.stream(), shift=0.0)
    cuda.synchronize()
    _close(dq.copy_to_host(), ref.query_temperature(q, pos, period, beta, shift=0.0), 1e-6, "query scale")


def check_fused_rows(rng) -> None:
    """q_a | kv_a (and q | k | v) stacked for one launch; blocks that disagree in dtype or row
    width are refused in one line naming the layer and both tensors."""
    from engine.gpu import fused_rows
    a, b = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    f = fused_rows([("q_a", a), ("kv_a", b)], 4)
    assert f.flags.c_contiguous and np.array_equal(f, np.concatenate([a, b]))
    for bad in (b.astype(np.float16), rng.standard_normal((2, 9)).astype(np.float32)):
        with pytest.raises(ValueError, match=r"layer 4: kv_a .* cannot be fused with q_a"):
            fused_rows([("q_a", a), ("kv_a", bad)], 4)


def run_sim_checks() -> None:
    rng = np.random.default_rng()
    check_prep(rng, t=3, hq=3, nope=6, r=4, c_dim=40, s_max=9)   # C over a block: a strided norm
    check_absorb(rng, t=3, hq=3, nope=5, v_dim=6, c_dim=36, r=4)  # C past one block of columns
    # 3 heads in tiles of 2; 11 rows in pieces of 2+ keys, steps of 4 keys (SIM's KC; the
    # staged kernel's KS: 2)
    check_attention(rng, hq=3, c_dim=12, r=4, s_max=11, split=2, t_prefill=3, gh=2)
    check_router_group_softmax(rng, t=24, e=40, k=4, n_group=8, topk_group=3)   # two a lane
    check_router_softmax_pairs(rng, t=24, e=40, k=4, n_group=8, topk_group=3)
    check_query_scale(rng, t=6, nh=3, d=12, period=4, beta=0.1)
    check_fused_rows(rng)
    print("SIM MLA CHECKS PASSED", flush=True)


def test_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, __file__], env=env, cwd=str(ROOT), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "SIM MLA CHECKS PASSED" in r.stdout, r.stdout + r.stderr


_HAVE_GPU = (not SIM) and cuda.is_available()
gpu = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("hq,nope,v_dim", [(16, 128, 128), (128, 128, 128)])   # V2-Lite, V3
def test_mla_kernels_gpu(hq, nope, v_dim):
    rng = np.random.default_rng()
    check_prep(rng, t=5, hq=hq, nope=nope, r=64, c_dim=512, s_max=64)
    check_absorb(rng, t=7, hq=hq, nope=nope, v_dim=v_dim, c_dim=512, r=64)
    check_attention(rng, hq=hq, c_dim=512, r=64, s_max=4096, split=32, t_prefill=37, gh=8)
    check_router_group_softmax(rng, t=5, e=160, k=6, n_group=8, topk_group=3)   # DeepSeek-V2's
    check_router_softmax_pairs(rng, t=5, e=128, k=4, n_group=1, topk_group=1)   # Mistral Small 4's
    check_router_softmax_pairs(rng, t=5, e=128, k=4, n_group=8, topk_group=3)
    check_query_scale(rng, t=7, nh=hq, d=576, period=8192, beta=0.1)


if __name__ == "__main__":
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    run_sim_checks()
