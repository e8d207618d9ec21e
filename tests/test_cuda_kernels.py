"""CUDA kernels (kernels_numba/gpu_*.py) against the numpy oracles in kernels_numba/reference.py.

Two ways in:
- CPU-only CI: test_simulator() runs this file as a script in a subprocess with
  NUMBA_ENABLE_CUDASIM=1 (the variable must be set before numba.cuda is imported, and the rest
  of the pytest process imports numba normally), at tiny shapes.
- A GPU: the tests marked `gpu` run the same checks at real model shapes (skipped without one).
Every check draws fresh random inputs, poisons outputs with NaN first, and compares within
1e-5 of the output's largest magnitude (fp32 accumulation; oracles run on the same decoded
weights). Run the simulator checks directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_cuda_kernels.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from numba import cuda  # noqa: E402

from kernels_numba import reference as ref  # noqa: E402
from kernels_numba.gpu_util import SIM  # noqa: E402

TOL = 1e-5


def _close(got, exp, tol=TOL, what=""):
    got = np.asarray(got, dtype=np.float64)
    exp = np.asarray(exp, dtype=np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (poison left?)"
    scale = max(np.abs(exp).max(), 1e-30)
    err = np.abs(got - exp).max() / scale
    assert err <= tol, f"{what}: max error {err:.3g} of max |ref| exceeds {tol}"
    return err


def _nan(shape, dtype=np.float32):
    return cuda.to_device(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype=dtype))


def _bf16(a):
    from loader.quant import f32_to_bf16
    return f32_to_bf16(np.asarray(a, dtype=np.float32))


# ---- checks (shared by the simulator run and the GPU tests) ----------------------------------

def make_bank(fmt, h, i, slots, rng, scale=0.05):
    """A device slot bank of `slots` random experts; returns (bank, layout, decoded weights)."""
    from loader.layout import ExpertLayout
    from loader.quant import decode_expert_block, encode_expert_block
    lay = ExpertLayout.build(fmt, h, i)
    blocks, ws = [], []
    for _ in range(slots):
        g = (rng.standard_normal((i, h)) * scale).astype(np.float32)
        u = (rng.standard_normal((i, h)) * scale).astype(np.float32)
        d = (rng.standard_normal((h, i)) * scale).astype(np.float32)
        b = encode_expert_block(fmt, lay, g, u, d)
        blocks.append(b)
        ws.append(decode_expert_block(b, lay))
    return cuda.to_device(np.stack(blocks)), lay, ws


def check_experts(fmt, h, i, k, slots, rng, bank=None, variant="", accumulate=True):
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    if bank is None:
        bank = make_bank(fmt, h, i, slots, rng)
    dbank, lay, ws = bank
    lh = lay.as_array()
    ge.check_layout(fmt, lh, k)
    views = ge.bank_views(dbank)
    sl = rng.choice(len(ws), size=k, replace=False).astype(np.int32)
    w = rng.random(k).astype(np.float32)
    x = rng.standard_normal(h).astype(np.float32)
    act = _nan((k, i))
    out = _nan(h)
    ge.expert_mlp(fmt, views, cuda.to_device(lh), lh, cuda.to_device(sl), cuda.to_device(w),
                  cuda.to_device(x), act, out, stream, variant=variant)
    stream.synchronize()
    exp = ref.moe(x[None], sl[None], w[None], ws)[0]
    e1 = _close(out.copy_to_host(), exp, what=f"expert_mlp {fmt} {variant}")
    if not accumulate:
        return e1
    base = rng.standard_normal(h).astype(np.float32)          # accumulate into out
    out2 = cuda.to_device(base)
    ge.expert_mlp(fmt, views, cuda.to_device(lh), lh, cuda.to_device(sl), cuda.to_device(w),
                  cuda.to_device(x), act, out2, stream, accumulate=True, variant=variant)
    stream.synchronize()
    _close(out2.copy_to_host(), exp + base, what=f"expert_mlp {fmt} {variant} accumulate")
    return e1


def _oss_bias(rng, n_exp, h, i):
    """gpt-oss expert biases [E, 2I + H] (gate | up | down), some far past the clamp (7)."""
    b = (rng.standard_normal((n_exp, 2 * i + h)) * 3.0).astype(np.float32)
    b[:, 0], b[:, 1], b[:, i], b[:, i + 1] = 20.0, -20.0, 20.0, -20.0
    return b


def _oss_moe(x, ids, slot_of, wts, ws, bias, h, i, alpha=1.702, limit=7.0):
    """The oracle: token t's experts ids[t] (weights ws[slot_of[e]], biases bias[e])."""
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for kk in range(ids.shape[1]):
            e = int(ids[t, kk])
            b = bias[e]
            out[t] += float(wts[t, kk]) * ref.gpt_oss_expert(
                x[t:t + 1], *ws[slot_of[e]], b[:i], b[i:2 * i], b[2 * i:], alpha, limit)[0]
    return out.astype(np.float32)


def check_experts_clamped(fmt, h, i, k, n_exp, rng, variant=""):
    """gpt-oss's experts for one token (expert_mlp_clamped) against reference.gpt_oss_expert:
    biases by expert id, weights by slot (a permutation apart), accumulating into out."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_bank(fmt, h, i, n_exp, rng)
    lh = lay.as_array()
    views = ge.bank_views(dbank)
    slot_of = rng.permutation(n_exp).astype(np.int32)
    bias = _oss_bias(rng, n_exp, h, i)
    ids = rng.choice(n_exp, size=k, replace=False).astype(np.int32)
    w = rng.random(k).astype(np.float32)
    x = (rng.standard_normal(h) * 3.0).astype(np.float32)
    base = rng.standard_normal(h).astype(np.float32)
    out = cuda.to_device(base)
    ge.expert_mlp_clamped(fmt, views, cuda.to_device(lh), lh, cuda.to_device(slot_of[ids]),
                          cuda.to_device(ids), cuda.to_device(w), cuda.to_device(x),
                          _nan((2 * k, i)), out, cuda.to_device(bias), 1.702, 7.0, stream,
                          accumulate=True, variant=variant)
    stream.synchronize()
    exp = _oss_moe(x[None], ids[None], slot_of, w[None], ws, bias, h, i)[0]
    return _close(out.copy_to_host(), exp + base, what=f"expert_mlp_clamped {fmt} {variant}")


def check_grouped_clamped(fmt, h, i, k, t, n_exp, rng):
    """gpt-oss's experts over t tokens, tiled grouped kernels in two batches of groups (as the
    engine runs them), then the combine and the down biases."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_bank(fmt, h, i, n_exp, rng)
    lh, dl = lay.as_array(), cuda.to_device(lay.as_array())
    views = ge.bank_views(dbank)
    slot_of = rng.permutation(n_exp).astype(np.int32)
    bias = _oss_bias(rng, n_exp, h, i)
    ids, wts = ref.router_topk(rng.standard_normal((t, n_exp)).astype(np.float32), k, True)
    ids = ids.astype(np.int32)
    gslot, gstart, order, aw, pos = ge.group_assignments(ids, wts, lambda e: slot_of[e])
    experts = np.unique(ids)
    aid = np.repeat(experts, np.diff(gstart)).astype(np.int32)
    x = (rng.standard_normal((t, h)) * 3.0).astype(np.float32)
    a = t * k
    act, y = _nan((2 * a, i)), _nan((a, h))
    base = rng.standard_normal((t, h)).astype(np.float32)
    out = cuda.to_device(base)
    d = {n: cuda.to_device(v) for n, v in (("gslot", gslot), ("gstart", gstart), ("order", order),
                                            ("aw", aw), ("aid", aid), ("bias", bias))}
    half = len(experts) // 2
    for g0, g1 in ((0, half), (half, len(experts))):
        ge.grouped_gate_up_down(fmt, views, dl, lh, d["gslot"][g0:g1], d["gstart"][g0:g1 + 1],
                                d["order"], d["aw"], cuda.to_device(x), act, y, stream,
                                clamp=lambda a, s, lo=int(gstart[g0]), hi=int(gstart[g1]):
                                ge.clamped_swiglu(a, d["aid"], d["bias"], 1.702, 7.0, s, lo, hi))
    ge.combine(y, cuda.to_device(pos), out, stream, accumulate=True)
    ge.expert_bias_add(out, cuda.to_device(ids), cuda.to_device(wts.astype(np.float32)),
                       d["bias"], stream)
    stream.synchronize()
    exp = _oss_moe(x, ids, slot_of, wts, ws, bias, h, i)
    return _close(out.copy_to_host(), exp + base, what=f"grouped clamped {fmt}")


# the clamped SwiGLUs without biases: Step-3.5's (the SiLU clamped after), MiniMax-M3's
# (gpt-oss's form)
LIMITED_FORMS = (dict(after=True), dict(alpha=1.702))


def _limited_moe(x, ids, slot_of, wts, ws, limit, form):
    """The oracle of the clamped experts (reference.limited_expert in form)."""
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for kk in range(ids.shape[1]):
            out[t] += float(wts[t, kk]) * ref.limited_expert(x[t:t + 1], *ws[slot_of[int(ids[t, kk])]],
                                                             limit, **form)[0]
    return out.astype(np.float32)


def _biting_limit(x, ids, slot_of, ws):
    """A clamp that cuts about half of the routed experts' up sums and SiLU'd gate sums."""
    vals = []
    for e in np.unique(ids):
        g, u, _ = (np.asarray(w, np.float64) for w in ws[slot_of[int(e)]])
        gs, us = x.astype(np.float64) @ g.T, x.astype(np.float64) @ u.T
        vals += [np.abs(us).ravel(), (gs / (1 + np.exp(-gs))).ravel()]
    return float(np.median(np.concatenate(vals)))


def check_experts_limited(fmt, h, i, k, n_exp, rng, variant="", form=LIMITED_FORMS[0]):
    """Clamped experts without biases for one token (expert_mlp_limited: RAW gate_up,
    limited_swiglu, down) against reference.limited_expert, accumulating into out."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_bank(fmt, h, i, n_exp, rng)
    lh = lay.as_array()
    slot_of = rng.permutation(n_exp).astype(np.int32)
    ids = rng.choice(n_exp, size=k, replace=False).astype(np.int32)
    w = rng.random(k).astype(np.float32)
    x = (rng.standard_normal(h) * 3.0).astype(np.float32)
    limit = _biting_limit(x[None], ids, slot_of, ws)
    base = rng.standard_normal(h).astype(np.float32)
    out = cuda.to_device(base)
    ge.expert_mlp_limited(fmt, ge.bank_views(dbank), cuda.to_device(lh), lh, cuda.to_device(slot_of[ids]),
                          cuda.to_device(w), cuda.to_device(x), _nan((2 * k, i)), out, limit, stream,
                          accumulate=True, variant=variant, **form)
    stream.synchronize()
    exp = _limited_moe(x[None], ids[None], slot_of, w[None], ws, limit, form)[0]
    return _close(out.copy_to_host(), exp + base, what=f"expert_mlp_limited {fmt} {variant} {form}")


def check_grouped_limited(fmt, h, i, k, t, n_exp, rng, form=LIMITED_FORMS[0]):
    """Clamped experts without biases over t tokens: tiled grouped kernels in two batches of groups,
    limited_swiglu between them, then the combine."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_bank(fmt, h, i, n_exp, rng)
    lh, dl = lay.as_array(), cuda.to_device(lay.as_array())
    slot_of = rng.permutation(n_exp).astype(np.int32)
    ids, wts = ref.router_topk(rng.standard_normal((t, n_exp)).astype(np.float32), k, True)
    ids = ids.astype(np.int32)
    gslot, gstart, order, aw, pos = ge.group_assignments(ids, wts, lambda e: slot_of[e])
    x = (rng.standard_normal((t, h)) * 3.0).astype(np.float32)
    limit = _biting_limit(x, ids, slot_of, ws)
    a = t * k
    act, y = _nan((2 * a, i)), _nan((a, h))
    d = {n: cuda.to_device(v) for n, v in (("gslot", gslot), ("gstart", gstart), ("order", order),
                                            ("aw", aw))}
    half = len(np.unique(ids)) // 2
    for g0, g1 in ((0, half), (half, len(np.unique(ids)))):
        ge.grouped_gate_up_down(fmt, ge.bank_views(dbank), dl, lh, d["gslot"][g0:g1], d["gstart"][g0:g1 + 1],
                                d["order"], d["aw"], cuda.to_device(x), act, y, stream,
                                clamp=lambda a, s, lo=int(gstart[g0]), hi=int(gstart[g1]):
                                ge.limited_swiglu(a, limit, s, lo, hi, **form))
    out = cuda.to_device(np.zeros((t, h), np.float32))
    ge.combine(y, cuda.to_device(pos), out, stream)
    stream.synchronize()
    return _close(out.copy_to_host(), _limited_moe(x, ids, slot_of, wts, ws, limit, form),
                  what=f"grouped limited {fmt} {form}")


def _scaled_moe(x, ids, slot_of, wts, ws):
    """The oracle of Llama 4's experts: each expert on its input times the routing weight."""
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for kk in range(ids.shape[1]):
            out[t] += ref.swiglu_expert(x[t:t + 1] * wts[t, kk], *ws[slot_of[int(ids[t, kk])]])[0]
    return out.astype(np.float32)


def check_experts_scaled(fmt, h, i, k, n_exp, rng, variant=""):
    """Llama 4's experts for one token (expert_mlp_scaled: RAW gate_up, scaled_swiglu, down by
    ones) against the reference on the scaled input, accumulating into out."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_bank(fmt, h, i, n_exp, rng)
    lh = lay.as_array()
    slot_of = rng.permutation(n_exp).astype(np.int32)
    ids = rng.choice(n_exp, size=k, replace=False).astype(np.int32)
    w = (rng.random(k) * 2.0 + 0.1).astype(np.float32)   # scales that bend the SiLU
    x = (rng.standard_normal(h) * 3.0).astype(np.float32)
    base = rng.standard_normal(h).astype(np.float32)
    out = cuda.to_device(base)
    ge.expert_mlp_scaled(fmt, ge.bank_views(dbank), cuda.to_device(lh), lh, cuda.to_device(slot_of[ids]),
                         cuda.to_device(w), cuda.to_device(np.ones(k, np.float32)), cuda.to_device(x),
                         _nan((2 * k, i)), out, stream, accumulate=True, variant=variant)
    stream.synchronize()
    exp = _scaled_moe(x[None], ids[None], slot_of, w[None], ws)[0]
    return _close(out.copy_to_host(), exp + base, what=f"expert_mlp_scaled {fmt} {variant}")


def check_grouped_scaled(fmt, h, i, k, t, n_exp, rng):
    """Llama 4's experts over t tokens: tiled grouped kernels in two batches of groups, the
    assignments' weights scaling the RAW sums (scaled_swiglu), down by ones, then the combine."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_bank(fmt, h, i, n_exp, rng)
    lh, dl = lay.as_array(), cuda.to_device(lay.as_array())
    slot_of = rng.permutation(n_exp).astype(np.int32)
    ids = np.argsort(-rng.standard_normal((t, n_exp)), axis=-1)[:, :k].astype(np.int32)
    wts = (rng.random((t, k)) * 2.0 + 0.1).astype(np.float32)
    gslot, gstart, order, aw, pos = ge.group_assignments(ids, wts, lambda e: slot_of[e])
    x = (rng.standard_normal((t, h)) * 3.0).astype(np.float32)
    a = t * k
    act, y = _nan((2 * a, i)), _nan((a, h))
    d = {n: cuda.to_device(v) for n, v in (("gslot", gslot), ("gstart", gstart), ("order", order),
                                            ("aw", aw), ("ones", np.ones(a, np.float32)))}
    half = len(np.unique(ids)) // 2
    for g0, g1 in ((0, half), (half, len(np.unique(ids)))):
        ge.grouped_gate_up_down(fmt, ge.bank_views(dbank), dl, lh, d["gslot"][g0:g1], d["gstart"][g0:g1 + 1],
                                d["order"], d["ones"], cuda.to_device(x), act, y, stream,
                                clamp=lambda a, s, lo=int(gstart[g0]), hi=int(gstart[g1]):
                                ge.scaled_swiglu(a, d["aw"], s, lo, hi))
    out = cuda.to_device(np.zeros((t, h), np.float32))
    ge.combine(y, cuda.to_device(pos), out, stream)
    stream.synchronize()
    return _close(out.copy_to_host(), _scaled_moe(x, ids, slot_of, wts, ws), what=f"grouped scaled {fmt}")


def check_query_temperature(rng, t=5, nh=3, d=8):
    from kernels_numba import gpu_misc as gm
    q = rng.standard_normal((t, nh, d)).astype(np.float32)
    pos = np.sort(rng.choice(40, size=t, replace=False)).astype(np.int32)
    dq = cuda.to_device(q)
    gm.query_temperature(dq, cuda.to_device(pos), 4.0, 0.3, cuda.stream())
    cuda.synchronize()
    _close(dq.copy_to_host(), ref.query_temperature(q, pos, 4.0, 0.3), what="query temperature")


def check_scale(rng, n=37):
    from kernels_numba import gpu_misc as gm
    x = rng.standard_normal(n).astype(np.float32)
    dx = cuda.to_device(x)
    gm.scale(dx, 5.5, cuda.stream())
    cuda.synchronize()
    _close(dx.copy_to_host(), x * np.float32(5.5), tol=0, what="scale")


def check_head_prefix(rng, t=3, nh=4, d=12, dv=8):
    from kernels_numba import gpu_misc as gm
    a = rng.standard_normal((t, nh, d)).astype(np.float32)
    out = _nan((t, nh * dv))
    gm.head_prefix(cuda.to_device(a), dv, 0.707, out, cuda.stream())
    cuda.synchronize()
    _close(out.copy_to_host(), ref.head_prefix(a, dv, 0.707), what="head prefix")


def check_silu_mul_limited(rng, n=37):
    """gm.silu_mul with a limit, both clamp placements and gpt-oss's form, against
    limited_expert's activation."""
    from kernels_numba import gpu_misc as gm
    g, u = (rng.standard_normal(n) * 3.0).astype(np.float32), (rng.standard_normal(n) * 3.0).astype(np.float32)
    for after in (False, True):
        out = _nan((n,))
        gm.silu_mul(cuda.to_device(g), cuda.to_device(u), out, cuda.stream(), 1.5, after=after)
        cuda.synchronize()
        g64, u64 = g.astype(np.float64), np.clip(u.astype(np.float64), -1.5, 1.5)
        if after:
            exp = np.minimum(g64 / (1 + np.exp(-g64)), 1.5) * u64
        else:
            gm64 = np.minimum(g64, 1.5)
            exp = gm64 / (1 + np.exp(-gm64)) * u64
        _close(out.copy_to_host(), exp.astype(np.float32), what=f"silu_mul limited after={after}")
    out = _nan((n,))
    gm.silu_mul(cuda.to_device(g), cuda.to_device(u), out, cuda.stream(), 1.5, alpha=1.702)
    cuda.synchronize()
    gm64 = np.minimum(g.astype(np.float64), 1.5)
    exp = (np.clip(u.astype(np.float64), -1.5, 1.5) + 1) * gm64 / (1 + np.exp(-1.702 * gm64))
    _close(out.copy_to_host(), exp.astype(np.float32), what="silu_mul limited alpha")


def check_experts_grouped(fmt, h, i, k, t, n_exp, rng, variant=""):
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_bank(fmt, h, i, n_exp, rng)
    lh = lay.as_array()
    views = ge.bank_views(dbank)
    logits = rng.standard_normal((t, n_exp)).astype(np.float32)
    ids, wts = ref.router_topk(logits, k, True)
    gslot, gstart, order, aw, pos = ge.group_assignments(ids, wts, lambda e: e)
    x = rng.standard_normal((t, h)).astype(np.float32)
    a = t * k
    act, y, out = _nan((a, i)), _nan((a, h)), _nan((t, h))
    ge.expert_mlp_grouped(fmt, views, cuda.to_device(lh), lh, cuda.to_device(gslot),
                          cuda.to_device(gstart), cuda.to_device(order), cuda.to_device(aw),
                          cuda.to_device(pos), cuda.to_device(x), act, y, out, stream,
                          variant=variant)
    stream.synchronize()
    return _close(out.copy_to_host(), ref.moe(x, ids, wts, ws), what=f"grouped {fmt} {variant}")


def _grouped_routing(t, k, n_exp, rng):
    """ids int32 [T, K], weights float32 [T, K] with the group shapes the tiled kernels must
    survive: expert 0 takes every token (more than one token tile when T > GT_BT, the last one
    partial), expert 1 exactly one token, the rest drawn at random (distinct within a token)."""
    assert n_exp >= k + 2 and t >= 2
    ids = np.empty((t, k), np.int32)
    for tt in range(t):
        rest = 2 + rng.permutation(n_exp - 2)
        ids[tt] = np.concatenate([[0], [1] if tt == 1 else rest[:1], rest[1:k - 1]])[:k]
    w = rng.random((t, k)).astype(np.float32) + np.float32(0.1)
    return ids, (w / w.sum(1, keepdims=True)).astype(np.float32)


def check_grouped_parts(fmt, h, i, k, t, n_exp, rng, variant, bank=None, batches=2):
    """grouped_gate_up_down alone, act and y against the oracle assignment by assignment:
    experts in shuffled bank slots, the groups launched in `batches` slices (absolute gstart
    offsets, as the engine's prefill batches do), act / y poisoned first; then combine."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = bank or make_bank(fmt, h, i, n_exp + 2, rng)
    lh = lay.as_array()
    views = ge.bank_views(dbank)
    slot_of = rng.permutation(len(ws))[:n_exp]
    ids, wts = _grouped_routing(t, k, n_exp, rng)
    gslot, gstart, order, aw, pos = ge.group_assignments(ids, wts, lambda e: slot_of[e])
    x = rng.standard_normal((t, h)).astype(np.float32)
    a = t * k
    act, y, out = _nan((a, i)), _nan((a, h)), _nan((t, h))
    dlay, dgs, dst = cuda.to_device(lh), cuda.to_device(gslot), cuda.to_device(gstart)
    dord, daw, dx = cuda.to_device(order), cuda.to_device(aw), cuda.to_device(x)
    cuts = np.linspace(0, len(gslot), batches + 1).astype(int)
    for g0, g1 in zip(cuts[:-1], cuts[1:]):
        ge.grouped_gate_up_down(fmt, views, dlay, lh, dgs[g0:g1], dst[g0:g1 + 1], dord, daw, dx,
                                act, y, stream, variant=variant)
    ge.combine(y, cuda.to_device(pos), out, stream)
    stream.synchronize()
    eact = np.empty((a, i))
    ey = np.empty((a, h))
    x64 = x.astype(np.float64)
    for g, s in enumerate(gslot):
        gw, uw, dw = (m.astype(np.float64) for m in ws[s])
        sl = slice(gstart[g], gstart[g + 1])
        xa = x64[order[sl]]
        eact[sl] = ref.silu(xa @ gw.T) * (xa @ uw.T)
        ey[sl] = aw[sl, None] * (eact[sl] @ dw.T)
    what = f"grouped {variant} {fmt} H={h} I={i} T={t} K={k}"
    e1 = _close(act.copy_to_host(), eact, what=what + " act")
    e2 = _close(y.copy_to_host(), ey, what=what + " y")
    e3 = _close(out.copy_to_host(), ref.moe(x, ids, wts, [ws[s] for s in slot_of]),
                what=what + " out")
    return max(e1, e2, e3)


def check_dense(rng, t, n, k, gemm_t, configs=(None,)):
    """configs: linear (R, KS, U) variants to check besides the default (None)."""
    from kernels_numba import gpu_dense as gd
    stream = cuda.stream()
    errs = []
    for kind in ("f32", "bf16"):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if kind == "bf16":
            w = _bf16(w)
        dw = cuda.to_device(w)
        for cfg in configs:
            for tt in (1, t) if cfg else (1, t, gd.LIN_TT_MAX + 1):
                x = rng.standard_normal((tt, k)).astype(np.float32)
                y = _nan((tt, n))
                gd.linear(dw, cuda.to_device(x), y, stream, config=cfg)
                stream.synchronize()
                errs.append(_close(y.copy_to_host(), ref.linear(x, w),
                                   what=f"linear {kind} T={tt} config={cfg}"))
                y0 = rng.standard_normal((tt, n)).astype(np.float32)   # accumulate: y += x @ w^T
                y = cuda.to_device(y0)
                gd.linear(dw, cuda.to_device(x), y, stream, config=cfg, accumulate=True)
                stream.synchronize()
                errs.append(_close(y.copy_to_host(), y0 + ref.linear(x, w),
                                   what=f"linear {kind} T={tt} config={cfg} accumulate"))
        x = rng.standard_normal((gemm_t, k)).astype(np.float32)
        y = _nan((gemm_t, n))
        gd.gemm(dw, cuda.to_device(x), y, stream)
        stream.synchronize()
        errs.append(_close(y.copy_to_host(), ref.linear(x, w), what=f"gemm {kind}"))
    return max(errs)


def check_linear16(rng, n, k, ts, configs, misaligned=False):
    """linear's 16-byte path: for each weight kind and T in ts, one of configs (gd.Wide, in
    turn), plain and accumulating in turn, against the oracle. Where the path does not apply
    (K not a multiple of 8 bf16 / 4 fp32 values; misaligned: x starting 8 bytes past a 16-byte
    boundary, GPU only) a Wide config raises and linear() takes the 8-byte path."""
    from kernels_numba import gpu_dense as gd
    stream = cuda.stream()
    errs = [0.0]
    turn = 0
    for kind in ("f32", "bf16"):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if kind == "bf16":
            w = _bf16(w)
        dw = cuda.to_device(w)
        fits = k % (8 if kind == "bf16" else 4) == 0 and not misaligned
        for t in ts:
            cfg = configs[turn % len(configs)]
            acc = turn % 2 == 1
            turn += 1
            what = f"linear16 {kind} N={n} K={k} T={t} config={cfg} accumulate={acc}"
            x = rng.standard_normal((t, k)).astype(np.float32)
            if misaligned:
                buf = cuda.to_device(np.concatenate([np.zeros(2, np.float32), x.reshape(-1)]))
                dx = buf[2:].reshape(t, k)
            else:
                dx = cuda.to_device(x)
            y0 = rng.standard_normal((t, n)).astype(np.float32)
            if not fits:
                with pytest.raises(ValueError, match="16-byte path"):
                    gd.linear(dw, dx, _nan((t, n)), stream, config=cfg)
                assert not isinstance(gd.linear_choice(dw, dx), gd.Wide), what
                cfg = None
            y = cuda.to_device(y0) if acc else _nan((t, n))
            gd.linear(dw, dx, y, stream, config=cfg, accumulate=acc)
            stream.synchronize()
            errs.append(_close(y.copy_to_host(), ref.linear(x, w) + (y0 if acc else 0),
                               what=what))
    return max(errs)


def check_norm_rope_embed(rng, t, nh, d, r, hidden, vocab):
    from kernels_numba import gpu_dense as gd
    stream = cuda.stream()
    x = rng.standard_normal((t, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    y = _nan((t, hidden))
    gd.rmsnorm(cuda.to_device(x), cuda.to_device(w), 1e-6, y, stream)
    stream.synchronize()
    _close(y.copy_to_host(), ref.rmsnorm(x, w, 1e-6), what="rmsnorm")
    for n in (hidden, 20):   # LayerNorm (no bias) of a block a row, of a warp a row; an offset
        xo = np.ascontiguousarray(x[:, :n] + np.float32(3.0))   # that its mean removes
        y = _nan((t, n))
        gd.layernorm(cuda.to_device(xo), cuda.to_device(w[:n]), 1e-5, y, stream)
        stream.synchronize()
        _close(y.copy_to_host(), ref.layernorm(xo, w[:n], 1e-5), what=f"layernorm {n}")
    qh = rng.standard_normal((t, nh, d)).astype(np.float32)       # per-head norm, (1 + w)
    wh = rng.standard_normal(d).astype(np.float32) * 0.1
    dq = cuda.to_device(qh.reshape(t * nh, d))
    gd.rmsnorm(dq, cuda.to_device(wh), 1e-6, dq, stream, w_offset=1.0)
    stream.synchronize()
    _close(dq.copy_to_host().reshape(t, nh, d), ref.rmsnorm(qh, wh + 1.0, 1e-6), what="head norm")
    pos = rng.integers(0, 40000, size=t).astype(np.int32)
    inv_freq = (1.0 / (1e6 ** (np.arange(0, r, 2) / r))).astype(np.float32)
    dx = cuda.to_device(qh)
    gd.rope(dx, cuda.to_device(pos), cuda.to_device(inv_freq), stream)
    stream.synchronize()
    _close(dx.copy_to_host(), ref.rope(qh, pos, inv_freq), what=f"rope R={r}")
    for kind in ("f32", "bf16"):
        table = rng.standard_normal((vocab, hidden)).astype(np.float32)
        if kind == "bf16":
            table = _bf16(table)
        ids = rng.integers(0, vocab, size=t).astype(np.int32)
        out = _nan((t, hidden))
        gd.embed(cuda.to_device(ids), cuda.to_device(table), out, stream)
        stream.synchronize()
        exp = ref.bf16_to_f32(table[ids]) if kind == "bf16" else table[ids]
        _close(out.copy_to_host(), exp, tol=0, what=f"embed {kind}")
    a = rng.standard_normal(hidden).astype(np.float32)
    b = rng.standard_normal(hidden).astype(np.float32)
    o = _nan(hidden)
    gd.add(cuda.to_device(a), cuda.to_device(b), o, stream)
    stream.synchronize()
    _close(o.copy_to_host(), a + b, tol=0, what="add")


def check_qk_norm_rope(rng, t, hq, hkv, d, r, w_offset=0.0, scaling=1.0, store=False,
                       variant=None, max_pos=40000, bf16=False):
    """gd.qk_norm_rope (one launch) against rmsnorm then rope of the reference, q and k; with
    store, also the fused kv_store: k and v at their rows of a poisoned cache, the rest left.
    variant: one of gd.QKR_VARIANTS (None: the default); positions below max_pos (store: the
    cache rows, t + 5 of them). bf16: a cache of bf16 bits, which must hold the k the kernel
    wrote and v rounded to nearest even, bit for bit."""
    from kernels_numba import gpu_dense as gd
    stream = cuda.stream()
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    wq = (rng.standard_normal(d) * 0.1).astype(np.float32)
    wk = (rng.standard_normal(d) * 0.1).astype(np.float32)
    s_max = t + 5
    pos = (rng.permutation(s_max)[:t] if store
           else rng.integers(0, max_pos, size=t)).astype(np.int32)
    inv_freq = (1.0 / (1e6 ** (np.arange(0, r, 2) / r))).astype(np.float32)
    dq, dk = cuda.to_device(q), cuda.to_device(k)
    if bf16:   # poisoned with a NaN pattern
        kc, vc = (cuda.to_device(np.full((s_max, hkv, d), 0xFFFF, np.uint16)) for _ in range(2))
    else:
        kc, vc = _nan((s_max, hkv, d)), _nan((s_max, hkv, d))
    gd.qk_norm_rope(dq, dk, cuda.to_device(wq), cuda.to_device(wk), 1e-6, cuda.to_device(pos),
                    cuda.to_device(inv_freq), scaling, stream, w_offset=w_offset,
                    cache=(cuda.to_device(v), kc, vc) if store else None, variant=variant)
    stream.synchronize()
    errs = []
    what = (f"{variant or gd.QKR_VARIANT} T={t} Hq={hq} Hkv={hkv} D={d} R={r} "
            f"offset={w_offset} store={store} bf16={bf16}")
    for got, x, w, name in ((dq, q, wq, "q"), (dk, k, wk, "k")):
        exp = ref.rope(ref.rmsnorm(x, w + np.float32(w_offset), 1e-6), pos, inv_freq, scaling)
        errs.append(_close(got.copy_to_host(), exp, what=f"qk_norm_rope {name} {what}"))
        if store and name == "k" and bf16:
            from loader.quant import f32_to_bf16_ref
            kch, vch = kc.copy_to_host(), vc.copy_to_host()
            assert np.array_equal(kch[pos], f32_to_bf16_ref(got.copy_to_host())), \
                f"qk_norm_rope k cache {what}"
            assert np.array_equal(vch[pos], f32_to_bf16_ref(v)), f"qk_norm_rope v cache {what}"
            rest = np.setdiff1d(np.arange(s_max), pos)
            assert (kch[rest] == 0xFFFF).all() and (vch[rest] == 0xFFFF).all(), \
                f"qk_norm_rope wrote cache rows outside positions ({what})"
        elif store and name == "k":
            kch, vch = kc.copy_to_host(), vc.copy_to_host()
            errs.append(_close(kch[pos], exp, what=f"qk_norm_rope k cache {what}"))
            assert np.array_equal(vch[pos], v), f"qk_norm_rope v cache {what}"
            rest = np.setdiff1d(np.arange(s_max), pos)
            assert np.isnan(kch[rest]).all() and np.isnan(vch[rest]).all(), \
                f"qk_norm_rope wrote cache rows outside positions ({what})"
    return max(errs)


def check_attention(rng, s_max, hq, hkv, d, split, t_prefill, window, variant=None,
                    kinds=("f32", "bf16"), sinks=False):
    """variant: attention() keyword overrides (kb, warps) for the partial kernel; sinks: with
    gpt-oss's attention sinks (a logit a head, some above every score, some far below)."""
    from kernels_numba import gpu_attention as ga
    stream = cuda.stream()
    errs = []
    var = dict(variant or {})
    sk = None
    if sinks:
        sk = (rng.standard_normal(hq) * 3.0).astype(np.float32)
        sk[0], sk[-1] = 40.0, -40.0
        var["sinks"] = cuda.to_device(sk)
    for kind in kinds:
        k = rng.standard_normal((s_max, hkv, d)).astype(np.float32)
        v = rng.standard_normal((s_max, hkv, d)).astype(np.float32)
        if kind == "bf16":
            kb, vb = _bf16(k), _bf16(v)
            k, v = ref.bf16_to_f32(kb), ref.bf16_to_f32(vb)
            dk, dv = cuda.to_device(kb), cuda.to_device(vb)
        else:
            dk, dv = cuda.to_device(k), cuda.to_device(v)
        scale = d ** -0.5
        parts = ga.alloc_partials(1, hq, d, s_max, split)
        for pos, win in ((0, 0), (s_max // 3, 0), (s_max - 1, 0), (s_max - 1, window)):
            q = rng.standard_normal((1, hq, d)).astype(np.float32)   # decode: one grid for all
            qp = np.array([pos], np.int32)
            out = _nan((1, hq, d))
            ga.attention(cuda.to_device(q), dk, dv, cuda.to_device(qp), scale, out, parts, stream,
                         window=win, split=split, **var)
            stream.synchronize()
            errs.append(_close(out.copy_to_host(), ref.attention(q, k, v, qp, scale, win, sk),
                               what=f"decode attention {kind} pos={pos} window={win} {var}"))
        q = rng.standard_normal((t_prefill, hq, d)).astype(np.float32)
        qp = np.arange(t_prefill, dtype=np.int32)
        parts = ga.alloc_partials(t_prefill, hq, d, s_max, split)
        for win in (0, window):
            out = _nan((t_prefill, hq, d))
            ga.attention(cuda.to_device(q), dk, dv, cuda.to_device(qp), scale, out, parts, stream,
                         window=win, split=split, **var)
            stream.synchronize()
            errs.append(_close(out.copy_to_host(), ref.attention(q, k, v, qp, scale, win, sk),
                               what=f"prefill attention {kind} window={win} {var}"))
    return max(errs)


def check_router_topk(rng, t, e, k):
    """gs.router_topk, every variant, against the oracle: random logits, logits on a few levels
    (ties: the lower index first), and (v2) rows with fewer finite logits than K (the -inf ones
    in index order, ids distinct); the variants' weights equal bit for bit (same sums in the
    same order); the slot table path gives the same ids and weights and slot_of[ids]. NaN
    logits (one row all NaN): ids in range (v2: distinct)."""
    from kernels_numba import gpu_sampling as gs
    stream = cuda.stream()
    slot_of = rng.permutation(3 * e)[:e].astype(np.int32)
    dso = cuda.to_device(slot_of)
    lv = rng.standard_normal((t, e)).astype(np.float32)
    few = np.full((t, e), -np.inf, np.float32)           # k // 2 finite logits a row
    for row in few:
        row[rng.choice(e, size=k // 2, replace=False)] = rng.standard_normal(k // 2)
    cases = [("random", lv, gs.ROUTER_VARIANTS),
             ("ties", rng.integers(-2, 3, size=(t, e)).astype(np.float32), gs.ROUTER_VARIANTS),
             ("-inf", few, ("v2",) if k <= 32 else ())]   # base repeats ids there
    for name, logits, variants in cases:
        if not variants:
            continue
        dl = cuda.to_device(logits)
        for norm in (True, False, 2):   # 2: the weights over their 2-norm (DBRX)
            eids, ew = ref.router_topk(logits, k, norm)
            got_w = {}
            for variant in variants:
                what = f"router_topk {variant} {name} T={t} E={e} K={k} norm={norm}"
                ids, w = _nan((t, k), np.int32), _nan((t, k))
                gs.router_topk(dl, norm, ids, w, stream, variant=variant)
                ids2, w2, sl = _nan((t, k), np.int32), _nan((t, k)), _nan((t, k), np.int32)
                gs.router_topk(dl, norm, ids2, w2, stream, slots=(dso, sl), variant=variant)
                stream.synchronize()
                ih, wh = ids.copy_to_host(), w.copy_to_host()
                assert np.array_equal(ih, eids), f"{what}: ids {ih} != {eids}"
                _close(wh, ew, what=what + " weights")
                assert np.array_equal(ids2.copy_to_host(), ih), what + ": ids (slots)"
                assert np.array_equal(w2.copy_to_host(), wh), what + ": weights (slots)"
                assert np.array_equal(sl.copy_to_host(), slot_of[ih]), what + ": slots"
                got_w[variant] = wh
            assert all(np.array_equal(a, got_w[variants[0]]) for a in got_w.values()), \
                f"router_topk {name}: the variants' weights differ"
    bad = rng.standard_normal((t, e)).astype(np.float32)
    bad[:, rng.choice(e, size=max(1, e // 8), replace=False)] = np.nan
    bad[0] = np.nan                                       # a row of NaN: still K ids
    for variant in gs.ROUTER_VARIANTS:
        ids, w = _nan((t, k), np.int32), _nan((t, k))
        gs.router_topk(cuda.to_device(bad), True, ids, w, stream, variant=variant)
        stream.synchronize()
        ih = ids.copy_to_host()
        assert ((ih >= 0) & (ih < e)).all(), f"router_topk {variant} NaN logits: ids {ih}"
        if variant == "v2" and k <= 32:
            assert all(len(set(row)) == k for row in ih), f"router_topk v2 NaN: repeats {ih}"


def check_router_sigmoid(rng, t, e, k, n_group, topk_group):
    """gs.router_sigmoid_topk against the oracle (DeepSeek-V3 / GLM-4.5 routing): random logits
    and selection bias, renormalized or not, scaled; the slot table path gives the same ids and
    weights and slot_of[ids]; every pick inside the kept groups."""
    from kernels_numba import gpu_sampling as gs
    stream = cuda.stream()
    slot_of = rng.permutation(2 * e)[:e].astype(np.int32)
    dso = cuda.to_device(slot_of)
    logits = (rng.standard_normal((t, e)) * 2).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
    dl, db = cuda.to_device(logits), cuda.to_device(bias)
    for norm, scale in ((True, 2.5), (False, 1.0)):
        what = f"router_sigmoid T={t} E={e} K={k} groups={topk_group}/{n_group} norm={norm}"
        eids, ew = ref.router_sigmoid_topk(logits, bias, k, n_group, topk_group, norm, scale)
        ids, w = _nan((t, k), np.int32), _nan((t, k))
        gs.router_sigmoid_topk(dl, db, n_group, topk_group, norm, scale, ids, w, stream)
        ids2, w2, sl = _nan((t, k), np.int32), _nan((t, k)), _nan((t, k), np.int32)
        gs.router_sigmoid_topk(dl, db, n_group, topk_group, norm, scale, ids2, w2, stream,
                               slots=(dso, sl))
        stream.synchronize()
        ih = ids.copy_to_host()
        assert np.array_equal(ih, eids), f"{what}: ids {ih} != {eids}"
        _close(w.copy_to_host(), ew, what=what + " weights")
        assert np.array_equal(ids2.copy_to_host(), ih), what + ": ids (slots)"
        assert np.array_equal(w2.copy_to_host(), w.copy_to_host()), what + ": weights (slots)"
        assert np.array_equal(sl.copy_to_host(), slot_of[ih]), what + ": slots"
        assert all(len(set(row // (e // n_group))) <= topk_group for row in ih), what + ": groups"
    if n_group == 1:   # ERNIE-4.5: softmax scores chosen with the bias
        for norm in (True, False):
            what = f"router softmax+bias T={t} E={e} K={k} norm={norm}"
            eids, ew = ref.router_softmax_bias_topk(logits, bias * 0.1, k, norm)
            ids, w, sl = _nan((t, k), np.int32), _nan((t, k)), _nan((t, k), np.int32)
            gs.router_sigmoid_topk(dl, cuda.to_device(bias * 0.1), 1, 1, norm, 1.0, ids, w, stream,
                                   slots=(dso, sl), softmax=True)
            stream.synchronize()
            ih = ids.copy_to_host()
            assert np.array_equal(ih, eids), f"{what}: ids {ih} != {eids}"
            _close(w.copy_to_host(), ew, what=what + " weights")
            assert np.array_equal(sl.copy_to_host(), slot_of[ih]), what + ": slots"
    with pytest.raises(ValueError, match="router_sigmoid_topk"):
        gs.router_sigmoid_topk(dl, db, n_group, topk_group, True, 1.0,
                               _nan((t, e + 1), np.int32), _nan((t, e + 1)), stream)


def check_router_sparsemixer(rng, t, e):
    """gs.router_sparsemixer against the oracle (Phi-3.5-MoE): fresh logits with near ties and
    all-negative rows, two jitter widths; the slot table path the same ids and weights."""
    from kernels_numba import gpu_sampling as gs
    stream = cuda.stream()
    slot_of = rng.permutation(2 * e)[:e].astype(np.int32)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[: t // 3] -= 4.0
    logits[t // 3: 2 * t // 3, 1] = logits[t // 3: 2 * t // 3, 0] + 1e-3
    dl = cuda.to_device(logits)
    for eps in (0.01, 0.4):
        what = f"router_sparsemixer T={t} E={e} eps={eps}"
        eids, ew = ref.router_sparsemixer(logits, eps)
        ids, w = _nan((t, 2), np.int32), _nan((t, 2))
        gs.router_sparsemixer(dl, eps, ids, w, stream)
        ids2, w2, sl = _nan((t, 2), np.int32), _nan((t, 2)), _nan((t, 2), np.int32)
        gs.router_sparsemixer(dl, eps, ids2, w2, stream, slots=(cuda.to_device(slot_of), sl))
        stream.synchronize()
        ih = ids.copy_to_host()
        assert np.array_equal(ih, eids), f"{what}: ids {ih} != {eids}"
        _close(w.copy_to_host(), ew, what=what + " weights")
        assert np.array_equal(ids2.copy_to_host(), ih) and np.array_equal(w2.copy_to_host(), w.copy_to_host())
        assert np.array_equal(sl.copy_to_host(), slot_of[ih]), what + ": slots"
    with pytest.raises(ValueError, match="router_sparsemixer"):
        gs.router_sparsemixer(dl, 0.01, _nan((t, 3), np.int32), _nan((t, 3)), stream)


def check_router_sampling(rng, t, e, k, vocab):
    from kernels_numba import gpu_sampling as gs
    stream = cuda.stream()
    logits = rng.standard_normal((t, e)).astype(np.float32)
    for norm in (True, False):
        ids, w = _nan((t, k), np.int32), _nan((t, k))
        gs.router_topk(cuda.to_device(logits), norm, ids, w, stream)
        stream.synchronize()
        eids, ew = ref.router_topk(logits, k, norm)
        assert np.array_equal(ids.copy_to_host(), eids), "router ids"
        _close(w.copy_to_host(), ew, what=f"router weights norm={norm}")
    lg = (rng.standard_normal(vocab) * 3).astype(np.float32)
    dl = cuda.to_device(lg)
    tok = _nan(1, np.int32)
    gs.argmax(dl, tok, stream)
    stream.synchronize()
    assert int(tok.copy_to_host()[0]) == int(np.argmax(lg)), "argmax"
    probs = cuda.device_array(vocab, np.float32)
    from kernels_numba.cpu import sample_logits
    settings = ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8), (0.9, 40, 0.9),
                (1.0, vocab + 5, 1.0))   # the last cuts nothing but draws in probability order
    for temp, top_k, top_p in settings:
        for u in (0.03, 0.41, 0.77, 0.98):
            if near_cdf_step(lg, temp, top_k, top_p, u):
                continue
            tok = _nan(1, np.int32)
            gs.sample(dl, cuda.to_device(np.array([temp, top_k, top_p], np.float32)),
                      cuda.to_device(np.array([u], np.float32)), probs, tok, stream)
            stream.synchronize()
            want = ref.sample_token(lg, temp, top_k, top_p, u)
            got = int(tok.copy_to_host()[0])
            assert got == want, f"sample T={temp} k={top_k} p={top_p} u={u}: {got} != {want}"
            # the engine's CPU sampler: the host path of the same decode step
            assert sample_logits(lg, temp, top_k, top_p, u) == want, "cpu sampler"


def near_cdf_step(logits, temp, top_k, top_p, u, tol=1e-4) -> bool:
    """Whether u lands within float rounding (fp32 on the device) of a step of the CDF the
    engine draws from, or the cut keeps a near tie: there device and host may pick apart."""
    if temp <= 0:
        top2 = np.sort(logits)[-2:]
        return top2[1] - top2[0] < tol
    p = ref.sample_probs(logits, temp, top_k, top_p)
    if not (top_k <= 0 and top_p >= 1.0):
        p = p[np.argsort(-p, kind="stable")]
    c = np.cumsum(p)
    if np.min(np.abs(c - u * c[-1])) < tol:
        return True
    if top_k <= 0 and top_p >= 1.0:
        return False
    q = np.sort(ref.sample_probs(logits, temp, 0, 1.0))[::-1]   # every token, most likely first
    if 0 < top_k < len(q) and q[top_k - 1] - q[top_k] < tol * q[0]:
        return True   # a near tie at the top-k threshold
    qk = q[:top_k] / q[:top_k].sum() if top_k > 0 else q
    return top_p < 1.0 and np.min(np.abs(np.cumsum(qk) - top_p)) < tol   # ... at the top-p one


# ---- simulator (CI) -------------------------------------------------------------------------

def run_sim_checks(part: str = "ab") -> None:
    """Tiny shapes; run only under NUMBA_ENABLE_CUDASIM=1. part: "a" (the per-token expert
    kernels but the copy-engine ones, the grouped ones), "b" (the rest), "ab" both; two
    processes run the halves side by side (test_simulator)."""
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    t0 = time.time()
    if "a" in part:
        _sim_checks_a(rng, t0)
    if "b" in part:
        _sim_checks_b(rng, t0)
    print(f"SIM CHECKS PASSED {part}", flush=True)


def _sim_checks_a(rng, t0) -> None:
    # default (flat) kernels at shapes that are not multiples of the block's rows (H 40 pads to
    # 48 for NVFP4); then the other decodes and the legacy staged kernels, smaller
    for fmt in ("nvfp4", "fp8", "bf16"):
        check_experts(fmt, 40, 24, 3, 4, rng)
        print(f"ok experts {fmt} {time.time() - t0:.0f}s", flush=True)
    # pipelined kernels (3 blocks over 8 items: the prefetch loop runs) with the other decodes
    for v in ("parith-g2j1-d2j2", "pmix-g1j2-d1j1", "qpair-g2j1-d2j2", "qbpair-g1j2-d1j1",
              "qtab-g1j1-d2j1", "qarith-g2j2-d1j2", "lut-g2-d2", "legacy", "arith"):
        check_experts("nvfp4", 32, 16, 2, 3, rng, variant=v, accumulate=v == "legacy")
        print(f"ok experts nvfp4 {v} {time.time() - t0:.0f}s", flush=True)
    # tensor-core kernels: H pads to one 128-column step, 3 experts' down steps over 2 warps
    # of 2 steps (one masked); the mma itself runs as a numpy emulation here. "-c" (the
    # default's scale placement) with accumulate, the f16-scaled A without
    check_experts("nvfp4", 120, 128, 3, 4, rng, variant="mma-g1-d2-c")
    check_experts("nvfp4", 120, 128, 3, 4, rng, variant="mma-g1-d2-a1", accumulate=False)
    # the lean kernels (H = Hs, I = Is): one step a warp; two, the second warp's down steps
    # in the second expert
    check_experts("nvfp4", 128, 128, 3, 4, rng, variant="mma-g1-d1-p4-c-l")
    check_experts("nvfp4", 256, 256, 2, 3, rng, variant="mma-g2-d2-p5-c-l", accumulate=False)
    print(f"ok experts nvfp4 mma {time.time() - t0:.0f}s", flush=True)
    for fmt in ("nvfp4", "bf16"):
        check_experts_grouped(fmt, 32, 16, 2, 3, 4, rng, variant="legacy")
        print(f"ok grouped legacy {fmt} {time.time() - t0:.0f}s", flush=True)
    # tiled grouped kernels (tiles of GT_BR = 8 weight rows x GT_BT = 8 tokens x GT_BK = 16 here):
    # 19 tokens in one group (3 token tiles, the last partial), a one-token group, two launches
    # over slices of the groups; H and I not multiples of the row tiles (nvfp4) or of GT_BK (fp8,
    # bf16); then the default path end to end
    for fmt, h, i in (("nvfp4", 44, 22), ("fp8", 40, 24), ("bf16", 36, 20)):
        check_grouped_parts(fmt, h, i, 3, 19, 6, rng, "tiled")
        print(f"ok grouped tiled {fmt} {time.time() - t0:.0f}s", flush=True)
    check_experts_grouped("fp8", 32, 16, 2, 5, 4, rng)
    print(f"ok grouped default {time.time() - t0:.0f}s", flush=True)
    # gpt-oss: RAW gate_up, clamped SwiGLU with biases, down biases; decode in each format's
    # RAW variant (and a flat one for nvfp4), prefill in the tiled kernels
    for fmt, h, i in (("nvfp4", 44, 22), ("fp8", 40, 24), ("bf16", 36, 20)):
        check_experts_clamped(fmt, h, i, 3, 5, rng)
        check_grouped_clamped(fmt, h, i, 2, 7, 5, rng)
    check_experts_clamped("nvfp4", 40, 24, 3, 5, rng, variant="tab-g2j1-d2j1")
    print(f"ok experts clamped {time.time() - t0:.0f}s", flush=True)
    # Step-3.5 / MiniMax-M3: the same RAW sums, clamped without biases (a form a format: the
    # activation reads the sums whatever decoded them)
    for (fmt, h, i), form in zip((("nvfp4", 44, 22), ("bf16", 36, 20)), LIMITED_FORMS):
        check_experts_limited(fmt, h, i, 3, 5, rng, form=form)
        check_grouped_limited(fmt, h, i, 2, 7, 5, rng, form=form)
    check_silu_mul_limited(rng)
    print(f"ok experts limited {time.time() - t0:.0f}s", flush=True)
    # Llama 4: the same RAW sums, scaled by the routing weights before the SwiGLU
    check_experts_scaled("nvfp4", 44, 22, 2, 5, rng)
    check_grouped_scaled("bf16", 36, 20, 2, 7, 5, rng)
    check_query_temperature(rng)
    check_head_prefix(rng)
    check_scale(rng)
    print(f"ok experts scaled {time.time() - t0:.0f}s", flush=True)


def _sim_checks_b(rng, t0) -> None:
    # the copy-engine kernels (copies run synchronously here): 3 experts' 48 tiles over the
    # simulator's 2 blocks, one step a warp; then two steps a warp, down's crossing an expert
    check_experts("nvfp4", 128, 128, 3, 4, rng, variant="tma-g1-d1")
    check_experts("nvfp4", 256, 256, 2, 3, rng, variant="tma-g2-d2", accumulate=False)
    check_experts("nvfp4", 256, 256, 2, 3, rng, variant="tma-g2-d2-w", accumulate=False)
    print(f"ok experts nvfp4 tma {time.time() - t0:.0f}s", flush=True)
    from kernels_numba.gpu_dense import Wide
    check_dense(rng, t=5, n=6, k=40, gemm_t=3,
                configs=(None, (2, 2, 2), (4, 1, 3), Wide(1, 2, 1), Wide(2, 1, 2)))
    print(f"ok dense {time.time() - t0:.0f}s", flush=True)
    # the 16-byte path, T = 1..8 and two passes (9): K = 256, chunks a multiple of the shapes'
    # 32 * KS * U (no clamped loads), x staged in shared memory at T = 1 only (LIN16_XS_BYTES
    # is 1024 here); K = 40: clamped loads, x staged up to a token tile of 4; K = 36: bf16 takes
    # the 8-byte path
    shapes16 = (Wide(1, 1, 1), Wide(2, 2, 1), Wide(1, 1, 2), Wide(4, 1, 1))
    check_linear16(rng, n=5, k=256, ts=(1, 2, 3, 8, 9), configs=shapes16)
    check_linear16(rng, n=6, k=40, ts=range(1, 10), configs=shapes16)
    check_linear16(rng, n=3, k=36, ts=(1, 2, 8), configs=shapes16)
    print(f"ok linear 16-byte {time.time() - t0:.0f}s", flush=True)
    check_norm_rope_embed(rng, t=2, nh=2, d=16, r=8, hidden=40, vocab=11)
    print(f"ok norm/rope/embed {time.time() - t0:.0f}s", flush=True)
    for variant in ("base", "v2"):
        check_qk_norm_rope(rng, t=2, hq=3, hkv=2, d=16, r=16, variant=variant)
        check_qk_norm_rope(rng, t=1, hq=2, hkv=1, d=40, r=8, w_offset=1.0, scaling=0.9,
                           variant=variant)
        check_qk_norm_rope(rng, t=3, hq=4, hkv=2, d=16, r=8, store=True, variant=variant)
    # v2 (one warp a head): rotary pairs over two chunks of a lane and dims past R over two
    # (D 136, R 80), R/2 not a multiple of 32 (R 24 of 72), positions up to 1e6, store at T > 1
    check_qk_norm_rope(rng, t=2, hq=2, hkv=1, d=136, r=80, max_pos=1_000_000)
    check_qk_norm_rope(rng, t=1, hq=3, hkv=1, d=72, r=24, w_offset=1.0, scaling=1.1,
                       store=True)
    check_qk_norm_rope(rng, t=4, hq=1, hkv=1, d=32, r=32, store=True)
    print(f"ok qk_norm_rope {time.time() - t0:.0f}s", flush=True)
    check_attention(rng, s_max=20, hq=2, hkv=1, d=8, split=8, t_prefill=5, window=3)
    check_attention(rng, s_max=13, hq=4, hkv=2, d=12, split=2, t_prefill=3, window=4,
                    variant=dict(kb=4, warps=1))      # splits capped: pieces > split
    check_attention(rng, s_max=10, hq=2, hkv=1, d=8, split=2, t_prefill=3, window=4,
                    variant=dict(fused=False), kinds=("bf16",))   # separate combine kernel
    check_attention(rng, s_max=9, hq=2, hkv=2, d=72, split=4, t_prefill=2, window=3,
                    kinds=("f32",))                   # head dim over 2 chunks a lane
    # gpt-oss's sinks: v2f decode (log2 units), base decode and the prefill (natural units)
    check_attention(rng, s_max=20, hq=4, hkv=2, d=8, split=4, t_prefill=5, window=3,
                    sinks=True)
    check_attention(rng, s_max=20, hq=4, hkv=2, d=8, split=4, t_prefill=5, window=3,
                    variant=dict(variant="base"), kinds=("f32",), sinks=True)
    print(f"ok attention {time.time() - t0:.0f}s", flush=True)
    check_router_topk(rng, t=2, e=10, k=3)            # one logit a lane, most lanes none
    check_router_topk(rng, t=1, e=40, k=8)            # lanes of one and two logits
    check_router_topk(rng, t=2, e=130, k=6)           # E > 128: five a lane, the last partial
    check_router_sampling(rng, t=2, e=10, k=3, vocab=50)
    check_router_sigmoid(rng, t=2, e=16, k=3, n_group=4, topk_group=2)
    check_router_sigmoid(rng, t=1, e=40, k=6, n_group=1, topk_group=1)   # two keys a lane
    check_router_sigmoid(rng, t=2, e=8, k=3, n_group=8, topk_group=4)    # one expert a group
    check_router_sparsemixer(rng, t=6, e=16)                                  # Phi-3.5-MoE
    print(f"ok router/sampling {time.time() - t0:.0f}s", flush=True)


@pytest.mark.timeout(2400)     # ~750 s on a loaded 2-core machine (2026-12-01), over the 900 default
def test_simulator():
    """The simulator checks in two processes side by side (pytest itself waits on one core)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    procs = {part: subprocess.Popen([sys.executable, __file__, part], env=env, cwd=str(ROOT),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for part in ("a", "b")}
    try:
        outs = {part: p.communicate(timeout=2300)[0] for part, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    for part, p in procs.items():
        assert p.returncode == 0 and f"SIM CHECKS PASSED {part}" in outs[part], outs[part]


# ---- real GPU, real shapes ------------------------------------------------------------------

_HAVE_GPU = (not SIM) and cuda.is_available()
gpu = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU")

SHAPES = [(2048, 768, 8), (2048, 512, 10), (2560, 640, 10)]   # (H, I, K): Qwen3-30B-A3B, -Next, -
FORMATS = ["nvfp4", "fp8", "bf16"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("h,i,k", SHAPES)
def test_experts_gpu(fmt, h, i, k):
    """The default (variant "") and every other variant the engine can run (live_variants);
    the timed-only SWEEP variants are checked by tools/sweep_experts.py when it times them (all
    of them here compiled for 224 s a session)."""
    rng = np.random.default_rng(1)
    bank = make_bank(fmt, h, i, k + 4, rng)
    from kernels_numba.gpu_experts import live_variants
    check_experts(fmt, h, i, k, k + 4, rng, bank=bank)
    for v in live_variants(fmt)[1:]:
        check_experts(fmt, h, i, k, k + 4, rng, bank=bank, variant=v)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_clamped_gpu(fmt):
    """gpt-oss-20b's experts (2880 x 2880, top-4 of 32): decode in the format's RAW variant,
    prefill in the tiled kernels (256 tokens), against reference.gpt_oss_expert."""
    rng = np.random.default_rng()
    check_experts_clamped(fmt, 2880, 2880, 4, 32, rng)
    check_grouped_clamped(fmt, 2880, 2880, 4, 256, 32, rng)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_limited_gpu(fmt):
    """Step-3.5-Flash's experts (4096 x 1280, top-8 of 288) clamped, in Step's form and
    MiniMax-M3's: decode in the format's RAW variant, prefill in the tiled kernels (256 tokens),
    against reference.limited_expert."""
    rng = np.random.default_rng()
    for form in LIMITED_FORMS:
        check_experts_limited(fmt, 4096, 1280, 8, 32, rng, form=form)
        check_grouped_limited(fmt, 4096, 1280, 8, 256, 32, rng, form=form)
    check_silu_mul_limited(rng, 5000)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_scaled_gpu(fmt):
    """Llama-4-Scout's experts (5120 x 8192, top-1 of 16; a top-2 case) with the routing weight
    on the input: decode in the format's RAW variant, prefill in the tiled kernels (256 tokens)."""
    rng = np.random.default_rng()
    for k in (1, 2):
        check_experts_scaled(fmt, 5120, 8192, k, 16, rng)
    check_grouped_scaled(fmt, 5120, 8192, 1, 256, 16, rng)
    check_query_temperature(rng, 7, 40, 128)
    check_head_prefix(rng, 7, 64, 192, 128)
    check_scale(rng, 100_000)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("h,i,k", SHAPES)
@pytest.mark.parametrize("hint", [3, 4, 5])
def test_experts_lean_gpu(h, i, k, hint):
    """The lean NVFP4 kernels ("-l") with each weight-load hint, against the oracle; both
    halves run lean at every shape (2560 x 640's down has 50 steps: 5 a warp there)."""
    from kernels_numba import gpu_experts as ge
    from kernels_numba import gpu_experts_mma as gm
    rng = np.random.default_rng(8)
    bank = make_bank("nvfp4", h, i, k + 4, rng)
    v = f"mma-g4-d4-p{hint}-c-l"
    cfg, lh = ge.parse_variant("nvfp4", v), bank[1].as_array()
    assert gm.lean_steps(cfg, lh, k, "gate_up") == 4
    assert gm.lean_steps(cfg, lh, k, "down") == (5 if h == 2560 else 4)
    check_experts("nvfp4", h, i, k, k + 4, rng, bank=bank, variant=v)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("h,i,k", SHAPES)
@pytest.mark.parametrize("v", ["tma-g1-d2", "tma-g1-d3-w"])
def test_experts_tma_gpu(h, i, k, v):
    """The copy-engine NVFP4 kernels ("tma") against the oracle at the real shapes: a copy a row
    (padded pitch) and a copy a tile (-w), down at 2 / 3 steps a warp (the nearest count that
    divides K * Is / 128 where that does not)."""
    from kernels_numba import gpu_experts as ge
    from kernels_numba import gpu_experts_tma as gt
    rng = np.random.default_rng(9)
    bank = make_bank("nvfp4", h, i, k + 4, rng)
    got = gt.steps(bank[1].as_array(), k, ge.parse_variant("nvfp4", v))
    assert got is not None and got[0] == 1, got     # the tma kernels run, not their fallback
    check_experts("nvfp4", h, i, k, k + 4, rng, bank=bank, variant=v)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_grouped_gpu(fmt):
    check_experts_grouped(fmt, 2048, 768, 8, 37, 16, np.random.default_rng(2))
    check_experts_grouped(fmt, 2048, 768, 8, 37, 16, np.random.default_rng(2), variant="legacy")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("h,i,k,t,n_exp", [(2048, 768, 8, 300, 16), (2560, 640, 10, 150, 24),
                                           (2000, 744, 8, 97, 12)])
def test_grouped_parts_gpu(fmt, h, i, k, t, n_exp):
    """Both grouped kernel pairs at real shapes (the last: H, I not multiples of the tiles); the
    legacy pair refuses, by name, shapes whose staged x exceeds its shared memory (bf16 at
    H = 2560: 51,200 bytes)."""
    from kernels_numba import gpu_experts as ge
    rng = np.random.default_rng(8)
    bank = make_bank(fmt, h, i, n_exp + 2, rng)
    check_grouped_parts(fmt, h, i, k, t, n_exp, rng, "tiled", bank=bank, batches=3)
    lay_h = bank[1].as_array()
    cw = ge.CHUNK[fmt]
    staged = max(ge.gate_up_shared_bytes(fmt, lay_h, ge.TT),
                 ge.TT * (int(lay_h[9]) // cw) * (cw + 1) * 4)
    if staged > ge.SHARED_LIMIT:
        with pytest.raises(ValueError, match="legacy grouped .* use the tiled variant"):
            check_grouped_parts(fmt, h, i, k, t, n_exp, rng, "legacy", bank=bank, batches=3)
    else:
        check_grouped_parts(fmt, h, i, k, t, n_exp, rng, "legacy", bank=bank, batches=3)


@pytest.mark.gpu
@gpu
def test_dense_gpu():
    from kernels_numba.gpu_dense import Wide
    check_dense(np.random.default_rng(3), t=7, n=4096, k=2048, gemm_t=77,
                configs=(None, (4, 1, 2), (2, 2, 4), (1, 8, 2), Wide(1, 1, 8), Wide(4, 1, 2),
                         Wide(1, 8, 1)))
    check_dense(np.random.default_rng(3), t=3, n=128, k=2048, gemm_t=9)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (151936, 2048), (128, 2048),
                                 (100, 1000), (64, 1004)])
def test_linear16_gpu(n, k):
    """The 16-byte path at Qwen3-30B-A3B's shapes (qkv, o, LM head, router), K = 1000 (chunks
    not a multiple of a warp's), K = 1004 (bf16: the 8-byte path), T = 1..9, the default and
    other launch shapes; then x misaligned for it (the 8-byte path)."""
    from kernels_numba import gpu_dense as gd
    rng = np.random.default_rng(13)
    shapes = [gd.linear16_config(n, k, 1), gd.Wide(1, 1, 4), gd.Wide(2, 2, 4, 256, 0),
              gd.Wide(1, 4, 2, 128, 8), gd.Wide(2, 1, 4, 512, 2)]
    assert check_linear16(rng, n, k, ts=range(1, 10), configs=shapes) <= TOL
    check_linear16(rng, n, k, ts=(1, 3), configs=shapes, misaligned=True)


@pytest.mark.gpu
@gpu
def test_norm_rope_embed_gpu():
    rng = np.random.default_rng(4)
    check_norm_rope_embed(rng, t=7, nh=32, d=128, r=128, hidden=2048, vocab=1000)
    check_norm_rope_embed(rng, t=3, nh=16, d=256, r=64, hidden=2048, vocab=1000)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["base", "v2"])
def test_qk_norm_rope_gpu(variant):
    rng = np.random.default_rng(7)
    check_qk_norm_rope(rng, t=1, hq=32, hkv=4, d=128, r=128, variant=variant)
    check_qk_norm_rope(rng, t=7, hq=16, hkv=2, d=256, r=64, w_offset=1.0, variant=variant)
    check_qk_norm_rope(rng, t=40, hq=32, hkv=4, d=128, r=128, scaling=1.2, variant=variant)
    check_qk_norm_rope(rng, t=1, hq=32, hkv=4, d=128, r=128, store=True, variant=variant)
    check_qk_norm_rope(rng, t=9, hq=16, hkv=2, d=256, r=64, w_offset=1.0, store=True,
                       variant=variant)
    check_qk_norm_rope(rng, t=5, hq=32, hkv=4, d=128, r=128, max_pos=1_000_000,
                       variant=variant)
    check_qk_norm_rope(rng, t=3, hq=8, hkv=2, d=80, r=40, store=True, variant=variant)


@pytest.mark.gpu
@gpu
def test_attention_gpu():
    check_attention(np.random.default_rng(5), s_max=3000, hq=32, hkv=4, d=128, split=256,
                    t_prefill=40, window=16)
    check_attention(np.random.default_rng(5), s_max=40960, hq=32, hkv=4, d=128, split=32,
                    t_prefill=9, window=4096, kinds=("f32",))
    check_attention(np.random.default_rng(5), s_max=4096, hq=16, hkv=2, d=256, split=32,
                    t_prefill=9, window=0, variant=dict(kb=2))
    check_attention(np.random.default_rng(5), s_max=4096, hq=32, hkv=4, d=128, split=32,
                    t_prefill=9, window=0, variant=dict(fused=False, kb=4))


@pytest.mark.gpu
@gpu
def test_router_sampling_gpu():
    check_router_sampling(np.random.default_rng(6), t=4, e=512, k=10, vocab=151936)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (3, 128, 8), (4, 512, 10), (2, 1024, 8),
                                   (2, 60, 4), (1, 100, 40)])
def test_router_topk_gpu(t, e, k):
    """Qwen3-30B-A3B's router at decode and prefill, 512 and 1024 experts, E not a multiple of
    32, K > 32 (v2 runs base)."""
    check_router_topk(np.random.default_rng(13), t, e, k)


@pytest.mark.gpu
@gpu
def test_router_sparsemixer_gpu():
    """Phi-3.5-MoE's router (16 experts) at decode and over a prefill chunk."""
    check_router_sparsemixer(np.random.default_rng(15), 1, 16)
    check_router_sparsemixer(np.random.default_rng(16), 96, 16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t,e,k,n_group,topk_group", [(1, 128, 8, 1, 1), (3, 160, 8, 1, 1),
                                                      (2, 256, 8, 8, 4), (1, 64, 6, 32, 3)])
def test_router_sigmoid_gpu(t, e, k, n_group, topk_group):
    """GLM-4.5-Air's and GLM-4.5's routers (128, 160 experts), DeepSeek-V3's (256 in 8 groups,
    4 kept), 32 groups of two; one group: ERNIE-4.5's softmax scores chosen with a bias too."""
    check_router_sigmoid(np.random.default_rng(14), t, e, k, n_group, topk_group)


if __name__ == "__main__":
    if not SIM:
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    run_sim_checks(sys.argv[1] if len(sys.argv) > 1 else "ab")
