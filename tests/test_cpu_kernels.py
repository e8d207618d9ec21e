"""Every CPU kernel against its numpy oracle, on fresh random inputs, outputs poisoned first."""
from __future__ import annotations

import numpy as np
import pytest

from kernels_numba import cpu, reference as ref

rng = np.random.default_rng()


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def poisoned(shape):
    return np.full(shape, np.nan, dtype=np.float32)


def bf16_bits(a):
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("n,k", [(1, 1), (37, 53), (256, 384)])
def test_matvec_f32_and_bf16(n, k):
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal(k).astype(np.float32)
    out = poisoned(n)
    cpu.matvec_f32(w, x, out)
    assert rel(out, ref.linear(x[None], w)[0]) < 1e-5
    wb = bf16_bits(w)
    out = poisoned(n)
    cpu.matvec_bf16(wb, x, out)
    assert rel(out, ref.linear(x[None], wb)[0]) < 1e-5


@pytest.mark.parametrize("n", [29, 30, 31, 32])   # rows go four at a time: every tail
def test_gemm_bf16(n):
    w = bf16_bits(rng.standard_normal((n, 40)))
    x = rng.standard_normal((7, 40)).astype(np.float32)
    out = poisoned((7, n))
    cpu.gemm_bf16(x, w, out)
    assert rel(out, ref.linear(x, w)) < 1e-5


def test_rmsnorm_rows():
    x = rng.standard_normal((9, 48)).astype(np.float32) * 3
    w = rng.standard_normal(48).astype(np.float32)
    out = poisoned(x.shape)
    cpu.rmsnorm_rows(x, w, 1e-6, out)
    assert rel(out, ref.rmsnorm(x, w, 1e-6)) < 1e-5


def test_layernorm():
    x = rng.standard_normal((9, 48)).astype(np.float32) * 3 + 1
    w = rng.standard_normal(48).astype(np.float32)
    b = rng.standard_normal(48).astype(np.float32)
    ops = cpu.CpuOps()
    assert rel(ops.layernorm(x, w, 1e-5), ref.layernorm(x, w, 1e-5)) < 1e-5
    assert rel(ops.layernorm(x, w, 1e-5, b), ref.layernorm(x, w, 1e-5) + b) < 1e-5


@pytest.mark.parametrize("d,rot", [(16, 16), (32, 8), (64, 48)])
def test_rope_full_and_partial(d, rot):
    x = rng.standard_normal((5, 3, d)).astype(np.float32)
    pos = rng.integers(0, 500, 5).astype(np.int32)
    inv = (1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    want = ref.rope(x, pos, inv, 1.25)
    got = x.copy()
    cpu.rope_inplace(got, pos, inv, 1.25)
    assert rel(got, want) < 1e-5
    assert np.array_equal(got[..., rot:], x[..., rot:])


@pytest.mark.parametrize("hq,hkv,window,sinks", [(4, 4, 0, False), (8, 2, 0, False),
                                                 (4, 1, 3, False), (4, 4, 0, True),
                                                 (8, 2, 5, True), (4, 1, 1, True)])
def test_attention_gqa(hq, hkv, window, sinks):
    """sinks: gpt-oss's attention sinks, a per-head logit in the softmax denominator only."""
    s, d, t = 19, 16, 4
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    kc = rng.standard_normal((s, hkv, d)).astype(np.float32)
    vc = rng.standard_normal((s, hkv, d)).astype(np.float32)
    sk = (rng.standard_normal(hq) * 2).astype(np.float32) if sinks else None
    pos = np.array([0, 6, 7, 18] if sinks else [3, 9, 10, 18], dtype=np.int32)
    out = poisoned(q.shape)
    cpu.attention_gqa(q, kc, vc, pos, np.float32(d ** -0.5), window,
                      np.zeros(0, np.float32) if sk is None else sk, out)
    want = ref.attention(q, kc, vc, pos, d ** -0.5, window, sk)
    assert rel(out, want) < 1e-5
    if sinks:
        assert rel(want, ref.attention(q, kc, vc, pos, d ** -0.5, window)) > 1e-2   # they matter
        got = cpu.CpuOps().attention(q, kc, vc, pos, d ** -0.5, window, sk)
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("limit,alpha", [(7.0, 1.702), (0.8, 1.702), (1.5, 0.9)])
def test_expert_clamped(limit, alpha):
    """gpt-oss's expert (clamped SwiGLU with biases) on dense weights, f32 and bf16."""
    h, i = 40, 24
    x = rng.standard_normal((5, h)).astype(np.float32)
    g, u = (rng.standard_normal((i, h)).astype(np.float32) * 0.5 for _ in range(2))
    dn = rng.standard_normal((h, i)).astype(np.float32)
    gb, ub = (rng.standard_normal(i).astype(np.float32) for _ in range(2))
    db = rng.standard_normal(h).astype(np.float32)
    ops = cpu.CpuOps()
    want = ref.gpt_oss_expert(x, g, u, dn, gb, ub, db, alpha, limit)
    assert rel(ops.expert_clamped(x, (g, u, dn), (gb, ub, db), alpha, limit), want) < 1e-5
    wb = tuple(bf16_bits(a) for a in (g, u, dn))
    want = ref.gpt_oss_expert(x, *(ref.bf16_to_f32(a) for a in wb), gb, ub, db, alpha, limit)
    assert rel(ops.expert_clamped(x[:1], wb, (gb, ub, db), alpha, limit), want[:1]) < 1e-5
    assert rel(ops.expert_clamped(x, wb, (gb, ub, db), alpha, limit), want) < 1e-5


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("h,i", [(40, 24), (41, 19), (64, 32)])
def test_expert_block_swiglu_and_clamped(fmt, t, h, i):
    """An expert read from its arena block (each format; one token takes the direct path, more
    the decoded-row path): SwiGLU, gpt-oss's clamped form with biases, DeepSeek-V4's and
    Step-3.5's clamped SwiGLU (also on dense weights), against the oracles
    on the block's decoded weights. H = 40 pads NVFP4 rows, 41 / 19 leave a lone last value."""
    from loader.layout import ExpertLayout
    from loader.quant import decode_expert_block, encode_expert_block
    limit, alpha = 1.2, 1.702
    lay = ExpertLayout.build(fmt, h, i)
    w = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in ((i, h), (i, h), (h, i))]
    block = encode_expert_block(fmt, lay, *w)
    dg, du, dd = decode_expert_block(block, lay)
    x = rng.standard_normal((t, h)).astype(np.float32)
    gb, ub = (rng.standard_normal(i).astype(np.float32) for _ in range(2))
    db = rng.standard_normal(h).astype(np.float32)
    ops = cpu.CpuOps()
    weights = (fmt, block, lay.as_array())
    assert rel(ops.expert(x, weights), ref.swiglu_expert(x, dg, du, dd)) < 1e-5
    want = ref.gpt_oss_expert(x, dg, du, dd, gb, ub, db, alpha, limit)
    assert rel(ops.expert_clamped(x, weights, (gb, ub, db), alpha, limit), want) < 1e-5
    # the clamps bite and the biases count: the plain activation is far from it
    assert rel(ref.gpt_oss_expert(x, dg, du, dd, gb, ub, db, alpha, 1e9), want) > 1e-2
    want = ref.limited_expert(x, dg, du, dd, limit)   # DeepSeek-V4's clamps, no biases
    assert rel(ops.expert_limited(x, weights, limit), want) < 1e-5
    assert rel(ops.expert_limited(x, (dg, du, dd), limit), want) < 1e-5
    assert rel(ref.swiglu_expert(x, dg, du, dd), want) > 1e-2
    want = ref.limited_expert(x, dg, du, dd, limit, after=True)   # Step-3.5's: the SiLU clamped
    assert rel(ops.expert_limited(x, weights, limit, after=True), want) < 1e-5
    assert rel(ops.expert_limited(x, (dg, du, dd), limit, after=True), want) < 1e-5
    assert rel(ref.limited_expert(x, dg, du, dd, limit), want) > 1e-2


@pytest.mark.parametrize("e,k,norm", [(8, 1, False), (8, 2, True), (16, 16, False), (5, 3, True), (16, 4, 2)])
def test_router_topk(e, k, norm):
    logits = rng.standard_normal((6, e)).astype(np.float32) * 2
    ids = np.full((6, k), -1, np.int32)
    w = poisoned((6, k))
    cpu.router_topk(logits, k, norm, ids, w)
    rid, rw = ref.router_topk(logits, k, norm)
    assert np.array_equal(ids, rid)
    assert rel(w, rw) < 1e-5


@pytest.mark.parametrize("e,k,groups,top_groups,norm,scale", [
    (8, 2, 1, 1, True, 1.0), (16, 3, 4, 2, True, 2.5), (12, 4, 3, 3, False, 1.0),
    (32, 8, 8, 4, True, 1.5), (6, 6, 2, 2, False, 0.5), (8, 3, 8, 4, True, 1.0)])
def test_router_sigmoid_topk(e, k, groups, top_groups, norm, scale):
    logits = rng.standard_normal((7, e)).astype(np.float32) * 2
    bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
    ids = np.full((7, k), -1, np.int32)
    w = poisoned((7, k))
    cpu.router_sigmoid_topk(logits, bias, k, groups, top_groups, norm, scale, ids, w)
    rid, rw = ref.router_sigmoid_topk(logits, bias, k, groups, top_groups, norm, scale)
    assert np.array_equal(ids, rid)
    assert rel(w, rw) < 1e-5
    if top_groups < groups:   # every pick inside the chosen groups
        assert all(len(set(row // (e // groups))) <= top_groups for row in ids)


@pytest.mark.parametrize("e,k,norm", [(8, 2, True), (64, 6, True), (12, 4, False)])
def test_router_softmax_bias_topk(e, k, norm):
    """ERNIE-4.5's routing (softmax scores chosen on score + bias): a bias the size of the
    probabilities' spread, so it changes picks."""
    logits = rng.standard_normal((7, e)).astype(np.float32) * 2
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
    ids = np.full((7, k), -1, np.int32)
    w = poisoned((7, k))
    cpu.router_sigmoid_topk(logits, bias, k, 1, 1, norm, 1.0, ids, w, True)
    rid, rw = ref.router_softmax_bias_topk(logits, bias, k, norm)
    assert np.array_equal(ids, rid)
    assert rel(w, rw) < 1e-5
    plain, _ = ref.router_softmax_bias_topk(logits, np.zeros(e, np.float32), k, norm)
    assert not np.array_equal(rid, plain)   # the bias moved some pick


@pytest.mark.parametrize("e,k,groups,top_groups,norm,scale", [
    (16, 3, 4, 2, True, 1.0), (12, 4, 3, 2, False, 2.0), (32, 4, 8, 3, True, 1.5)])
def test_router_softmax_groups(e, k, groups, top_groups, norm, scale):
    """Mistral 4's routing (softmax scores, no bias, DeepSeek-V3's groups: the two best summed):
    the kernel's softmax form with a zero bias against the oracle's; the groups change picks."""
    logits = rng.standard_normal((9, e)).astype(np.float32) * 2
    zero = np.zeros(e, np.float32)
    ids = np.full((9, k), -1, np.int32)
    w = poisoned((9, k))
    cpu.router_sigmoid_topk(logits, zero, k, groups, top_groups, norm, scale, ids, w, True)
    rid, rw = ref.router_sigmoid_topk(logits, zero, k, groups, top_groups, norm, scale, softmax=True)
    assert np.array_equal(ids, rid)
    assert rel(w, rw) < 1e-5
    assert all(len(set(row // (e // groups))) <= top_groups for row in ids)
    free, _ = ref.router_sigmoid_topk(logits, zero, k, 1, 1, norm, scale, softmax=True)
    assert not np.array_equal(rid, free)   # some token's best experts lay outside its groups


def test_weight_vectors_widened():
    """bf16 bits: vectors (1-D or one row, [1, N]) become float32 of the same values; matrices
    ([N, 1] included) stay bits for the bf16 kernels."""
    rng = np.random.default_rng()
    f = rng.standard_normal((1, 7)).astype(np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    want = (bits.astype(np.uint32) << 16).view(np.float32)
    ops = cpu.CpuOps()
    for a, w in ((bits, want), (bits[0], want[0])):
        got = ops.weight(a)
        assert got.dtype == np.float32 and got.shape == a.shape and np.array_equal(got, w)
    for a in (bits.T, np.tile(bits, (3, 1))):
        got = ops.weight(a)
        assert got.dtype == np.uint16 and np.array_equal(got, a)


def test_expert_dense_weights():
    h, i = 40, 24
    x = rng.standard_normal((3, h)).astype(np.float32)
    g, u = (rng.standard_normal((i, h)).astype(np.float32) for _ in range(2))
    dn = rng.standard_normal((h, i)).astype(np.float32)
    got = cpu.CpuOps().expert(x, (g, u, dn))
    assert rel(got, ref.swiglu_expert(x, g, u, dn)) < 1e-5


def test_sampling_greedy_and_distribution():
    v = 50
    logits = rng.standard_normal(v).astype(np.float32) * 2
    assert cpu.sample_logits(logits, 0.0, 0, 1.0, 0.5) == int(np.argmax(logits))
    for temp, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5)]:
        probs = ref.sample_probs(logits, temp, top_k, top_p)
        order = np.argsort(-probs, kind="stable")
        ps = probs[order]
        for u in rng.random(20):
            if top_k == 0 and top_p == 1.0:   # nothing cut: inverse CDF in vocabulary order
                want = min(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"), v - 1)
            else:   # inverse CDF in probability order: the engine draws exactly this id
                want = order[min(np.searchsorted(np.cumsum(ps), u * ps.sum(), side="right"), v - 1)]
            assert cpu.sample_logits(logits, temp, top_k, top_p, u) == want
        assert (probs > 0).sum() <= (top_k or v)


def test_seeded_generation_reproduces(tiny_qwen):
    import engine
    m = engine.load(tiny_qwen, device="cpu")
    a = m.generate([1, 2, 3], max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7).output_ids
    b = m.generate([1, 2, 3], max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7).output_ids
    c = m.generate([1, 2, 3], max_new_tokens=12, temperature=0.9, top_p=0.9, seed=8).output_ids
    assert a == b and a != c
