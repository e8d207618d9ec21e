"""CUDA kernels of DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5; the math:
engine/models/deepseek_v32.py): its key a position cached, each query's scores over its causal
prefix, and the index_topk positions the query reads. The attention over the picked latent rows
is gpu_mla.attention(sel=...).

Legend: T = tokens, Hi = indexer heads, Di = index_head_dim (a multiple of 4), R = rotary dims
(rotate-half order: the decoder permutes GLM-5's interleaved pairs at upload), S_max = cache
rows, K = index_topk. pos int32 [T] in device memory; every grid depends on T and S_max only,
so one captured graph serves every decode step.

    index_prep:   grid T * (Hi + 1): blocks h < Hi rotate q[t, h]'s first R dims in place;
                  block Hi writes ik[pos[t]] = rope(layernorm(k[t]) * w + b).
    index_scores: grid (cdiv(S_max, SC_THREADS), T): a thread a position j <= pos[t] (its key
                  read 4 values a step, the Hi x Di query in shared memory, Hi sums in
                  registers) -> out[t, j] = sum_h wt[t, h] w_scale relu(q_scale q[t, h] . ik[j]).
                  Rows with pos[t] < K (every position picked) exit at once; so do blocks past
                  pos[t].
    index_select: grid T, SEL_THREADS: the K-th highest score of the row by a radix select over
                  order-preserving uint32 keys (four passes of a 256-bin histogram), then the
                  picks written ascending: each thread counts its own run of positions (above,
                  equal), one block scan gives each run its place; the scores above the K-th
                  and, of those equal to it, the earliest positions (as
                  deepseek_v32.top_positions). A row with at most K positions picks them all.
                  vpos[t] = picks - 1: the query position gpu_mla.attention(sel=...) takes.
"""
from __future__ import annotations

import math

from numba import cuda, float32, float64, int32, int64

from .gpu_util import SIM, WARP, block_sum, cdiv, float_as_uint, lds4, pdl_kernel, pdl_trigger, pdl_wait

PREP_THREADS = 32 if SIM else 128
PREP_WARPS = PREP_THREADS // WARP
SC_THREADS = 32 if SIM else 128      # index_scores: positions a block
SEL_THREADS = 32 if SIM else 512     # index_select: threads a row
_SIGN = 0x80000000
_M32 = 0xFFFFFFFF


@cuda.jit(device=True, inline=True)
def _rot(p, f, scaling):
    ang = float64(p) * float64(f)
    return float32(math.cos(ang) * scaling), float32(math.sin(ang) * scaling)


@pdl_kernel
@cuda.jit
def _index_prep(q, k, norm_w, norm_b, eps, pos, inv_freq, scaling, ik):
    """q float32 [T, Hi, Di] rotated in place; k float32 [T, Di] (wk's output) -> ik [S_max, Di]
    row pos[t]."""
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(PREP_THREADS, float32)
    wred = cuda.shared.array(PREP_WARPS, float32)
    T, Hi, D = q.shape
    r2 = inv_freq.shape[0]
    b = cuda.blockIdx.x
    t = b // (Hi + 1)
    h = b - t * (Hi + 1)
    tid = cuda.threadIdx.x
    p = pos[t]
    if h < Hi:
        for f in range(tid, r2, PREP_THREADS):
            co, si = _rot(p, inv_freq[f], scaling)
            x1 = q[t, h, f]
            x2 = q[t, h, f + r2]
            q[t, h, f] = x1 * co - x2 * si
            q[t, h, f + r2] = x2 * co + x1 * si
        return
    s = float32(0.0)
    for i in range(tid, D, PREP_THREADS):
        s += k[t, i]
    mean = block_sum(s, red, wred) / float32(D)
    s = float32(0.0)
    for i in range(tid, D, PREP_THREADS):
        x = k[t, i] - mean
        s += x * x
    inv = float32(1.0) / float32(math.sqrt(block_sum(s, red, wred) / float32(D) + eps))
    for i in range(2 * r2 + tid, D, PREP_THREADS):
        ik[p, i] = (k[t, i] - mean) * inv * norm_w[i] + norm_b[i]
    for f in range(tid, r2, PREP_THREADS):
        co, si = _rot(p, inv_freq[f], scaling)
        x1 = (k[t, f] - mean) * inv * norm_w[f] + norm_b[f]
        x2 = (k[t, f + r2] - mean) * inv * norm_w[f + r2] + norm_b[f + r2]
        ik[p, f] = x1 * co - x2 * si
        ik[p, f + r2] = x2 * co + x1 * si


def index_prep(q, k, norm_w, norm_b, eps, pos, inv_freq, scaling, ik, stream):
    """The indexer's queries q [T, Hi, Di] rotated in place and its keys k [T, Di] normed,
    rotated and stored in ik [S_max, Di] at rows pos [T]."""
    t, hi, d = q.shape
    if k.shape != (t, d) or ik.shape[1] != d or 2 * inv_freq.shape[0] > d:
        raise ValueError(f"index_prep: q {q.shape}, k {k.shape}, ik {ik.shape}, "
                         f"{2 * inv_freq.shape[0]} rotary dims")
    _index_prep[t * (hi + 1), PREP_THREADS, stream](q, k, norm_w, norm_b, float32(eps), pos,
                                                    inv_freq, float64(scaling), ik)


def _make_scores(HI, D):
    QD = HI * D

    @cuda.jit
    def scores(q, wt, keys, pos, q_scale, w_scale, topk, out):
        """q float32 [T, HI, D], wt float32 [T, HI], keys float32 [S_max, D] -> out float32
        [T, >= S_max] at j <= pos[t] (rows with pos[t] < topk not written)."""
        if SIM:
            qs = cuda.shared.array(QD, float32)
        else:
            qs = cuda.shared.array(QD, float32, alignment=16)
        ws = cuda.shared.array(HI, float32)
        pdl_wait()
        pdl_trigger()
        t = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        j0 = cuda.blockIdx.x * SC_THREADS
        p = pos[t]
        if p < topk or j0 > p:                       # (uniform over the block)
            return
        for i in range(tid, QD, SC_THREADS):
            h = i // D
            qs[i] = q[t, h, i - h * D]
        for h in range(tid, HI, SC_THREADS):
            ws[h] = wt[t, h] * w_scale
        cuda.syncthreads()
        j = j0 + tid
        if j > p:
            return
        acc = cuda.local.array(HI, float32)
        for h in range(HI):
            acc[h] = float32(0.0)
        for d in range(0, D, 4):
            k0 = keys[j, d]
            k1 = keys[j, d + 1]
            k2 = keys[j, d + 2]
            k3 = keys[j, d + 3]
            for h in range(HI):
                x0, x1, x2, x3 = lds4(qs, h * D + d)
                acc[h] += x0 * k0 + x1 * k1 + x2 * k2 + x3 * k3
        s = float32(0.0)
        for h in range(HI):
            s += ws[h] * max(acc[h] * q_scale, float32(0.0))
        out[t, j] = s
    return scores


_SCORES = {}


def index_scores(q, wt, keys, pos, q_scale, w_scale, topk, out, stream):
    """out [T, >= S_max]: query t's indexer score of each position j <= pos[t], where pos[t] >=
    topk (below it every position is picked and the row is left as it was)."""
    t, hi, d = q.shape
    s_max = keys.shape[0]
    if d % 4 or keys.shape[1] != d or wt.shape != (t, hi) or out.shape[0] != t or out.shape[1] < s_max:
        raise ValueError(f"index_scores: q {q.shape} (Di a multiple of 4), wt {wt.shape}, keys "
                         f"{keys.shape}, out {out.shape}")
    key = (hi, d)
    if key not in _SCORES:
        _SCORES[key] = pdl_kernel(_make_scores(hi, d))
    _SCORES[key][(cdiv(s_max, SC_THREADS), t), SC_THREADS, stream](
        q, wt, keys, pos, float32(q_scale), float32(w_scale), int32(topk), out)


@cuda.jit(device=True, inline=True)
def _order_key(f):
    """float32 -> int64 in [0, 2^32) ordered as the floats (-0 as 0: the CPU compares them equal)."""
    if f == float32(0.0):
        f = float32(0.0)
    u = int64(float_as_uint(f))
    return u ^ _M32 if u >= _SIGN else u | _SIGN


@pdl_kernel
@cuda.jit
def _index_select(scores, pos, topk, sel, vpos):
    """scores float32 [T, >= pos[t] + 1] -> sel int32 [T, >= topk] (the picks, ascending),
    vpos int32 [T] (picks - 1)."""
    hist = cuda.shared.array(256, int32)
    scan = cuda.shared.array(SEL_THREADS, int64)
    pick = cuda.shared.array(2, int64)
    pdl_wait()
    pdl_trigger()
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = pos[t] + 1
    if n <= topk:
        for i in range(tid, n, SEL_THREADS):
            sel[t, i] = i
        if tid == 0:
            vpos[t] = n - 1
        return
    # the topk-th highest key, 8 bits a pass: prefix / mask the bits fixed so far, need its
    # rank among the keys that share them
    prefix = int64(0)
    mask = int64(0)
    need = int64(topk)
    for r in range(4):
        shift = 24 - 8 * r
        for i in range(tid, 256, SEL_THREADS):
            hist[i] = 0
        cuda.syncthreads()
        for j in range(tid, n, SEL_THREADS):
            u = _order_key(scores[t, j])
            if (u & mask) == prefix:
                cuda.atomic.add(hist, (u >> shift) & 255, 1)
        cuda.syncthreads()
        if tid == 0:
            cum = int64(0)
            b = 255
            while cum + hist[b] < need:
                cum += hist[b]
                b -= 1
            pick[0] = b
            pick[1] = need - cum
        cuda.syncthreads()
        prefix |= pick[0] << shift
        mask |= int64(255) << shift
        need = pick[1]                       # of the keys equal to prefix: the first need
    seg = (n + SEL_THREADS - 1) // SEL_THREADS
    a = min(tid * seg, n)
    z = min(a + seg, n)
    gt = int64(0)
    eq = int64(0)
    for j in range(a, z):
        u = _order_key(scores[t, j])
        if u > prefix:
            gt += 1
        elif u == prefix:
            eq += 1
    v = gt + (eq << 32)
    scan[tid] = v
    cuda.syncthreads()
    off = 1
    while off < SEL_THREADS:                 # inclusive scan (Hillis-Steele)
        x = scan[tid - off] if tid >= off else int64(0)
        cuda.syncthreads()
        scan[tid] += x
        cuda.syncthreads()
        off *= 2
    ex = scan[tid] - v
    ng = ex & _M32                           # above the threshold before this run
    ne = ex >> 32                            # equal to it before this run
    for j in range(a, z):
        u = _order_key(scores[t, j])
        if u > prefix:
            sel[t, ng + min(ne, need)] = j
            ng += 1
        elif u == prefix:
            if ne < need:
                sel[t, ng + ne] = j
            ne += 1
    if tid == 0:
        vpos[t] = topk - 1


def index_select(scores, pos, topk, sel, vpos, stream):
    """Each query's picked positions into sel [T, >= topk] (ascending) and their count - 1 into
    vpos [T]: every position while there are at most topk, else the topk highest scores."""
    t = pos.shape[0]
    if scores.shape[0] != t or sel.shape[0] != t or sel.shape[1] < topk or vpos.shape != (t,):
        raise ValueError(f"index_select: scores {scores.shape}, pos {pos.shape}, sel {sel.shape}, "
                         f"vpos {vpos.shape}, topk {topk}")
    _index_select[t, SEL_THREADS, stream](scores, pos, int32(topk), sel, vpos)
