"""CUDA grouped-query attention over a KV cache, split over the sequence (flash-decoding).

Legend: T = queries, Hq / Hkv = query / key-value heads, D = head dim (<= 256),
S_max = cache rows, P = splits = cdiv(S_max, split).
Cache: k, v float32 or uint16 (bf16 bits) [S_max, Hkv, D]; row j holds position j.
q_pos int32 [T] in device memory: query t sees keys j <= q_pos[t] (and q_pos[t] - j < window
when window > 0). Decode is T = 1 with q_pos = the position; prefill (causal) is T > 1. The
grid depends on S_max only, so one captured graph serves every decode step.

    partial: grid (T * Hq, P): a block scores keys [p*split, (p+1)*split), one warp a key at a
             time, online softmax per warp, warps merged in shared memory
             -> pm, pl float32 [T*Hq, P], pacc float32 [T*Hq, P, D]
    combine: grid T * Hq, D threads -> out float32 [T, Hq, D]
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from .gpu_util import NEG_INF, SIM, WARP, cdiv, int_as_float, warp_sum

ATT_THREADS = 64 if SIM else 128
ATT_WARPS = ATT_THREADS // 32
MAX_D = 256
DL = MAX_D // WARP            # head-dim values per lane, at most
SPLIT = 64                    # keys per block (default): many short blocks hide latency
KB = 4                        # keys a warp scores at once
_S16 = np.uint32(16)


@cuda.jit(device=True, inline=True)
def _ld_f32(c, j, h, d):
    return c[j, h, d]


@cuda.jit(device=True, inline=True)
def _ld_bf16(c, j, h, d):
    return int_as_float(uint32(c[j, h, d]) << _S16)


def _make_partial(ld, DL):
    KBDL = KB * DL

    @cuda.jit
    def partial(q, kc, vc, q_pos, scale, window, split, pm, pl, pacc):
        red = cuda.shared.array(ATT_THREADS, float32)
        wm = cuda.shared.array(ATT_WARPS, float32)
        wl = cuda.shared.array(ATT_WARPS, float32)
        wacc = cuda.shared.array((ATT_WARPS, MAX_D), float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        nw = cuda.blockDim.x // WARP
        T, Hq, D = q.shape
        Hkv = kc.shape[1]
        row = cuda.blockIdx.x
        p = cuda.blockIdx.y
        t = row // Hq
        h = row - t * Hq
        kvh = h // (Hq // Hkv)
        pos = q_pos[t]
        end = min(pos + 1, (p + 1) * split)
        start = p * split
        if window > 0:
            start = max(start, pos - window + 1)
        qv = cuda.local.array(DL, float32)
        acc = cuda.local.array(DL, float32)
        for i in range(DL):
            d = lane + i * WARP
            qv[i] = q[t, h, d] * scale if d < D else float32(0.0)
            acc[i] = float32(0.0)
        m = NEG_INF
        l = float32(0.0)
        sc = cuda.local.array(KB, float32)
        vv = cuda.local.array(KBDL, float32)   # V rows of the KB keys, loaded with K
        for j0 in range(start, end, nw * KB):  # uniform trip count over the block
            jb = j0 + warp * KB                # this warp's KB keys: independent dots, so
            for u in range(KB):                # their loads and shuffles overlap
                jj = min(jb + u, end - 1)
                s = float32(0.0)
                for i in range(DL):
                    d = lane + i * WARP
                    if d < D:
                        s += qv[i] * ld(kc, jj, kvh, d)
                        vv[u * DL + i] = ld(vc, jj, kvh, d)
                sc[u] = s
            for u in range(KB):
                sc[u] = warp_sum(sc[u], red)
            mn = m
            for u in range(KB):
                if jb + u < end:
                    mn = max(mn, sc[u])
            if mn > NEG_INF:
                corr = math.exp(m - mn)
                l = l * corr
                for i in range(DL):
                    acc[i] = acc[i] * corr
                for u in range(KB):
                    if jb + u < end:
                        e = math.exp(sc[u] - mn)
                        l += e
                        for i in range(DL):
                            acc[i] += e * vv[u * DL + i]
                m = mn
        if lane == 0:
            wm[warp] = m
            wl[warp] = l
        for i in range(DL):
            d = lane + i * WARP
            if d < D:
                wacc[warp, d] = acc[i]
        cuda.syncthreads()
        mt = NEG_INF
        for w in range(nw):
            mt = max(mt, wm[w])
        if tid == 0:
            lt = float32(0.0)
            if mt > NEG_INF:
                for w in range(nw):
                    lt += wl[w] * math.exp(wm[w] - mt)
            pm[row, p] = mt
            pl[row, p] = lt
        for d in range(tid, D, cuda.blockDim.x):
            a = float32(0.0)
            if mt > NEG_INF:
                for w in range(nw):
                    a += wacc[w, d] * math.exp(wm[w] - mt)
            pacc[row, p, d] = a
    return partial


_PARTIAL = {(dt, dl): _make_partial(ld, dl) for dt, ld in (("f32", _ld_f32), ("bf16", _ld_bf16))
            for dl in (DL // 2, DL)}    # head dims <= 128 and <= 256
_partial_f32 = _PARTIAL["f32", DL]
_partial_bf16 = _PARTIAL["bf16", DL]


@cuda.jit
def _combine(pm, pl, pacc, out):
    """Merge the P splits of one (query, head): out [T, Hq, D]; grid T * Hq, threads >= D."""
    row = cuda.blockIdx.x
    T, Hq, D = out.shape
    t = row // Hq
    h = row - t * Hq
    P = pm.shape[1]
    mt = NEG_INF
    for p in range(P):
        mt = max(mt, pm[row, p])
    lt = float32(0.0)
    for p in range(P):
        if pm[row, p] > NEG_INF:
            lt += pl[row, p] * math.exp(pm[row, p] - mt)
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        a = float32(0.0)
        for p in range(P):
            if pm[row, p] > NEG_INF:
                a += pacc[row, p, d] * math.exp(pm[row, p] - mt)
        out[t, h, d] = a / lt


def num_splits(s_max: int, split: int = SPLIT) -> int:
    return cdiv(s_max, split)


def alloc_partials(t: int, hq: int, d: int, s_max: int, split: int = SPLIT):
    """Device scratch for attention(): (pm, pl [T*Hq, P], pacc [T*Hq, P, D]); allocate once."""
    p = num_splits(s_max, split)
    return (cuda.device_array((t * hq, p), np.float32), cuda.device_array((t * hq, p), np.float32),
            cuda.device_array((t * hq, p, d), np.float32))


def attention(q, kc, vc, q_pos, scale, out, partials, stream, window=0, split=SPLIT):
    """q float32 [T, Hq, D], caches [S_max, Hkv, D] -> out float32 [T, Hq, D]."""
    t, hq, d = q.shape
    if d > MAX_D:
        raise ValueError(f"head dim {d} exceeds MAX_D={MAX_D}")
    if hq % kc.shape[1]:
        raise ValueError(f"{hq} query heads are not a multiple of {kc.shape[1]} kv heads")
    pm, pl, pacc = partials
    p = pm.shape[1]
    if p * split < kc.shape[0]:
        raise ValueError("partials were allocated for a smaller cache or a larger split")
    kern = _PARTIAL["bf16" if kc.dtype == np.uint16 else "f32", DL // 2 if d <= MAX_D // 2 else DL]
    kern[(t * hq, p), ATT_THREADS, stream](q, kc, vc, q_pos, float32(scale), int32(window),
                                          int32(split), pm, pl, pacc)
    _combine[t * hq, min(max(d, WARP), 256), stream](pm, pl, pacc, out)
