"""CUDA kernels of multi-head latent attention (MLA, DeepSeek-V2 / V3) in its absorbed form (the
math: engine/models/deepseek_v3.py). A token's cache row is [c, k_pe]: its normed latent and its
rotated shared key, one row for all heads; each head's query is taken into the latent space
through the key half of kv_b (absorb_q), attends over the rows as multi-query attention whose
value is the row's first C values, and its output leaves through the value half (absorb_o).

Legend: T = tokens, Hq = heads, Nn = qk_nope dims, R = rotary dims (rotate-half order: the
decoder permutes the projections' rows once at upload), C = kv_lora_rank, D = C + R (a cache
row), V = v_head_dim, S_max = cache rows, P = pieces a query's keys are split into.
kv_b [Hq (Nn + V), C]: per head Nn key rows, then V value rows; float32 or uint16 (bf16 bits).
Cache [S_max, 1, D] float32 or uint16 (bf16 bits), row j holding position j.

    prep:      grid T * (Hq + 1): blocks h < Hq rotate q's rotary part into q_lat[:, h, C:];
               block Hq norms kv's latent and rotates its key into the cache row pos[t].
    absorb_q:  grid (cdiv(T, TT) * Hq, cdiv(C, AQ_THREADS)): q_lat[t, h, c] = sum_n q[t, h, n]
               kv_b[h (Nn + V) + n, c]; a thread a column c, TT tokens sharing each weight load.
    attention: the partial kernel, grid (T * cdiv(Hq, GH), P): a block takes GH heads of one
               query over one piece of its keys (the pieces of gpu_attention's _piece), KC keys a
               step: scores with a warp a key (lanes over D), an online softmax a head, then the
               values with a thread a value column for all GH heads, so each row is loaded once
               for the whole tile -> pm, pl, pacc (gpu_attention's partials); then gpu_attention's
               combine merges the pieces into out [T, Hq, C].
    absorb_o:  grid (cdiv(T, TT), cdiv(Hq V, AO_WARPS)): out[t, h, v] = sum_c a[t, h, c]
               kv_b[h (Nn + V) + Nn + v, c]; a warp a row of kv_b, lanes over c.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32

from .gpu_attention import SPLIT, _piece, combine
from .gpu_util import (NEG_INF, SIM, WARP, bf16_at, block_sum, cdiv, pdl_kernel, pdl_trigger, pdl_wait,
                       putter, warp_sum)

PREP_THREADS = 32 if SIM else 128
PREP_WARPS = PREP_THREADS // WARP   # (shared array sizes must be plain constants)
AQ_THREADS = 32 if SIM else 128
AO_WARPS = 2 if SIM else 8
AO_THREADS = AO_WARPS * WARP
TT = 2 if SIM else 4            # tokens a block of the absorb kernels takes (prefill)
GH = 8                          # attention: heads a block (the tile shares every row load)
ATT_THREADS = 64 if SIM else 128
KC = 4 if SIM else 32           # attention: keys a step


@cuda.jit(device=True, inline=True)
def _w_bf16(w, r, c):
    return bf16_at(w[r, c])


@cuda.jit(device=True, inline=True)
def _w_f32(w, r, c):
    return w[r, c]


@cuda.jit(device=True, inline=True)
def _row_bf16(a, j, d):
    return bf16_at(a[j, 0, d])


@cuda.jit(device=True, inline=True)
def _row_f32(a, j, d):
    return a[j, 0, d]


def _make_prep(BF):
    put = putter(BF)

    @cuda.jit
    def prep(q, kv, norm_w, eps, pos, inv_freq, scaling, q_lat, cache):
        """q float32 [T, Hq, Nn + R], kv float32 [T, D] -> q_lat[:, :, C:] = rope(q[:, :, Nn:]);
        cache[pos[t], 0] = [rmsnorm(kv[t, :C]) * norm_w, rope(kv[t, C:])]."""
        pdl_wait()
        pdl_trigger()
        red = cuda.shared.array(PREP_THREADS, float32)
        wred = cuda.shared.array(PREP_WARPS, float32)
        T, Hq, QD = q.shape
        D = kv.shape[1]
        r2 = inv_freq.shape[0]
        C = D - 2 * r2
        nope = QD - 2 * r2
        b = cuda.blockIdx.x
        t = b // (Hq + 1)
        h = b - t * (Hq + 1)
        tid = cuda.threadIdx.x
        p = pos[t]
        if h < Hq:
            for f in range(tid, r2, PREP_THREADS):
                ang = float64(p) * float64(inv_freq[f])
                co = float32(math.cos(ang) * scaling)
                si = float32(math.sin(ang) * scaling)
                x1 = q[t, h, nope + f]
                x2 = q[t, h, nope + f + r2]
                q_lat[t, h, C + f] = x1 * co - x2 * si
                q_lat[t, h, C + f + r2] = x2 * co + x1 * si
            return
        ss = float32(0.0)
        for i in range(tid, C, PREP_THREADS):
            v = kv[t, i]
            ss += v * v
        ss = block_sum(ss, red, wred)
        inv = float32(1.0) / math.sqrt(ss / float32(C) + eps)
        for i in range(tid, C, PREP_THREADS):
            put(cache, p, 0, i, kv[t, i] * inv * norm_w[i])
        for f in range(tid, r2, PREP_THREADS):
            ang = float64(p) * float64(inv_freq[f])
            co = float32(math.cos(ang) * scaling)
            si = float32(math.sin(ang) * scaling)
            x1 = kv[t, C + f]
            x2 = kv[t, C + f + r2]
            put(cache, p, 0, C + f, x1 * co - x2 * si)
            put(cache, p, 0, C + f + r2, x2 * co + x1 * si)
    return prep


_PREP = {bf: pdl_kernel(_make_prep(bf)) for bf in (False, True)}


def prep(q, kv, norm_w, eps, pos, inv_freq, scaling, q_lat, cache, stream):
    t, hq, _ = q.shape
    _PREP[cache.dtype == np.uint16][t * (hq + 1), PREP_THREADS, stream](
        q, kv, norm_w, float32(eps), pos, inv_freq, float64(scaling), q_lat, cache)


def _make_absorb_q(elem):
    @cuda.jit
    def absorb_q(q, kv_b, q_lat):
        """q float32 [T, Hq, Nn + R], kv_b [Hq (Nn + V), C] -> q_lat[:, :, :C] float32."""
        pdl_wait()
        pdl_trigger()
        T, Hq, QD = q.shape
        C = kv_b.shape[1]
        per = kv_b.shape[0] // Hq
        nope = QD - (q_lat.shape[2] - C)
        bx = cuda.blockIdx.x
        tb = bx // Hq
        h = bx - tb * Hq
        t0 = tb * TT
        c = cuda.blockIdx.y * AQ_THREADS + cuda.threadIdx.x
        if c >= C:
            return
        acc = cuda.local.array(TT, float32)
        for i in range(TT):
            acc[i] = float32(0.0)
        nt = min(TT, T - t0)
        for n in range(nope):
            w = elem(kv_b, h * per + n, c)
            for i in range(nt):
                acc[i] += q[t0 + i, h, n] * w
        for i in range(nt):
            q_lat[t0 + i, h, c] = acc[i]
    return absorb_q


_ABSORB_Q = {True: pdl_kernel(_make_absorb_q(_w_bf16)), False: pdl_kernel(_make_absorb_q(_w_f32))}


def absorb_q(q, kv_b, q_lat, stream):
    t, hq, _ = q.shape
    c = kv_b.shape[1]
    _ABSORB_Q[kv_b.dtype == np.uint16][(cdiv(t, TT) * hq, cdiv(c, AQ_THREADS)), AQ_THREADS, stream](
        q, kv_b, q_lat)


def _make_absorb_o(elem):
    @cuda.jit
    def absorb_o(a, kv_b, nope, out):
        """a float32 [T, Hq, C], kv_b [Hq (Nn + V), C] -> out float32 [T, Hq, V]."""
        pdl_wait()
        pdl_trigger()
        red = cuda.shared.array(AO_THREADS, float32)   # the simulator's warp sums
        T, Hq, V = out.shape
        C = a.shape[2]
        per = kv_b.shape[0] // Hq
        tid = cuda.threadIdx.x
        lane = tid % WARP
        r = cuda.blockIdx.y * AO_WARPS + tid // WARP    # (head, value row), uniform in the warp
        t0 = cuda.blockIdx.x * TT
        ok = r < Hq * V
        h = r // V
        v = r - h * V
        acc = cuda.local.array(TT, float32)
        for i in range(TT):
            acc[i] = float32(0.0)
        if ok:
            nt = min(TT, T - t0)
            for c in range(lane, C, WARP):
                w = elem(kv_b, h * per + nope + v, c)
                for i in range(nt):
                    acc[i] += a[t0 + i, h, c] * w
        for i in range(TT):    # every lane of the block reaches each sum (the simulator's rule)
            s = warp_sum(acc[i], red)
            if ok and lane == 0 and t0 + i < T:
                out[t0 + i, h, v] = s
    return absorb_o


_ABSORB_O = {True: pdl_kernel(_make_absorb_o(_w_bf16)), False: pdl_kernel(_make_absorb_o(_w_f32))}


def absorb_o(a, kv_b, out, stream):
    t, hq, v = out.shape
    nope = kv_b.shape[0] // hq - v
    _ABSORB_O[kv_b.dtype == np.uint16][(cdiv(t, TT), cdiv(hq * v, AO_WARPS)), AO_THREADS, stream](
        a, kv_b, int32(nope), out)


def _make_partial(row, G, D, CPT):
    """row: the cache loader (f32 / bf16); G heads a block; D the row width; CPT value columns a
    thread (ATT_THREADS * CPT >= C)."""
    NW = ATT_THREADS // WARP
    GC = G * CPT

    @cuda.jit
    def partial(q, cache, q_pos, scale, window, split, cdim, pm, pl, pacc):
        """q float32 [T, Hq, D] (cache [S_max, 1, D]) -> the pieces of each (query, head): pm, pl
        float32 [T Hq, P (+1)] (max, sum of exp), pacc float32 [T Hq, P, >= C] (the unnormed
        value sums)."""
        qs = cuda.shared.array((G, D), float32)
        sc = cuda.shared.array((G, KC), float32)        # a step's scores, then probabilities
        mrow = cuda.shared.array(G, float32)
        lrow = cuda.shared.array(G, float32)
        fac = cuda.shared.array(G, float32)
        red = cuda.shared.array(ATT_THREADS, float32)   # the simulator's warp sums
        pdl_wait()
        pdl_trigger()
        T, Hq, _ = q.shape
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        ht = (Hq + G - 1) // G
        t = cuda.blockIdx.x // ht
        h0 = (cuda.blockIdx.x - t * ht) * G
        p = cuda.blockIdx.y
        P = pl.shape[1]
        lo, n, piece = _piece(q_pos, t, window, split, P)
        j0 = lo + p * piece
        j1 = min(j0 + piece, lo + n)
        if j0 >= j1:
            return
        for i in range(tid, G * D, ATT_THREADS):
            g = i // D
            d = i - g * D
            qs[g, d] = q[t, h0 + g, d] * scale if h0 + g < Hq else float32(0.0)
        if tid < G:
            mrow[tid] = NEG_INF
            lrow[tid] = float32(0.0)
        acc = cuda.local.array(GC, float32)
        part = cuda.local.array(G, float32)
        for i in range(GC):
            acc[i] = float32(0.0)
        cuda.syncthreads()
        for jb in range(j0, j1, KC):
            for kk in range(warp, KC, NW):           # the same count in every warp
                j = jb + kk
                for g in range(G):
                    part[g] = float32(0.0)
                if j < j1:
                    for d in range(lane, D, WARP):
                        kv = row(cache, j, d)
                        for g in range(G):
                            part[g] += qs[g, d] * kv
                for g in range(G):
                    s = warp_sum(part[g], red)
                    if lane == 0:
                        sc[g, kk] = s if j < j1 else NEG_INF
            cuda.syncthreads()
            if tid < G:                              # the online softmax of head h0 + tid
                m_old = mrow[tid]
                mx = m_old
                for kk in range(KC):
                    mx = max(mx, sc[tid, kk])
                f = math.exp(m_old - mx)
                s = float32(0.0)
                for kk in range(KC):
                    e = math.exp(sc[tid, kk] - mx)
                    sc[tid, kk] = e
                    s += e
                lrow[tid] = lrow[tid] * f + s
                mrow[tid] = mx
                fac[tid] = f
            cuda.syncthreads()
            for g in range(G):
                f = fac[g]
                for ci in range(CPT):
                    acc[g * CPT + ci] *= f
            for kk in range(min(KC, j1 - jb)):
                j = jb + kk
                for ci in range(CPT):
                    c = tid + ci * ATT_THREADS
                    if c < cdim:
                        v = row(cache, j, c)
                        for g in range(G):
                            acc[g * CPT + ci] += sc[g, kk] * v
            cuda.syncthreads()                       # before the next step's scores
        r0 = t * Hq + h0
        if tid < G and h0 + tid < Hq:
            pm[r0 + tid, p] = mrow[tid]
            pl[r0 + tid, p] = lrow[tid]
        for g in range(G):
            if h0 + g < Hq:
                for ci in range(CPT):
                    c = tid + ci * ATT_THREADS
                    if c < cdim:
                        pacc[r0 + g, p, c] = acc[g * CPT + ci]
    return partial


_PARTIAL = {}


def partial_kernel(bf: bool, g: int, d: int, c: int):
    cpt = cdiv(c, ATT_THREADS)
    key = (bool(bf), g, d, cpt)
    if key not in _PARTIAL:
        _PARTIAL[key] = pdl_kernel(_make_partial(_row_bf16 if bf else _row_f32, g, d, cpt))
    return _PARTIAL[key]


def attention(q_lat, cache, q_pos, scale, out, partials, stream, split=SPLIT, gh=GH):
    """q_lat float32 [T, Hq, D], cache [S_max, 1, D] -> out float32 [T, Hq, C]: each head's
    softmax(scale q . row) over the rows j <= q_pos[t], times the rows' first C values.
    partials: gpu_attention.alloc_partials(T, Hq, >= C, S_max); gh: heads a block."""
    t, hq, d = q_lat.shape
    c = out.shape[2]
    pm, pl, pacc = partials
    p = pl.shape[1]
    if cache.shape[1:] != (1, d) or out.shape[:2] != (t, hq) or c > d:
        raise ValueError(f"MLA attention: q {q_lat.shape}, cache {cache.shape}, out {out.shape} "
                         f"(expected a cache [S, 1, {d}] and out [{t}, {hq}, <= {d}])")
    if pm.shape[0] < t * hq or pacc.shape[2] < c:
        raise ValueError(f"partials {pacc.shape} do not fit {t} queries x {hq} heads x {c} values")
    g = max(1, min(gh, hq))
    kern = partial_kernel(cache.dtype == np.uint16, g, d, c)
    kern[(t * cdiv(hq, g), p), ATT_THREADS, stream](q_lat, cache, q_pos, float32(scale), int32(0),
                                                   int32(split), int32(c), pm, pl, pacc)
    combine(q_pos, 0, split, partials, out, stream)
