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
               At T = 1 (STAGED) absorb_q1: grid (Hq, cdiv(C, 128)), 16 warps splitting the
               head's key rows, CPL columns a lane, every weight loaded before the PDL wait.
    attention: a partial kernel, grid (T * cdiv(Hq, G), P): a block takes G heads of one query
               over one piece of its keys (the pieces of gpu_attention's _piece) -> pm, pl,
               pacc (gpu_attention's partials); then gpu_attention's combine merges the pieces
               into out [T, Hq, C]. Two partial kernels:
               staged (float32 caches, STAGED_ATT): a warp a head, its scaled query in its lanes'
                 registers; KS rows a step copied into shared memory by cp.async, each lane's
                 16-byte granules dotted for all KS keys, one transposed warp reduction, the
                 online softmax in the warp; the values by head slices x 4-column granules.
               tile (bf16 caches): KC keys a step, scores with a warp a key (lanes over D), an
                 online softmax a head, then the values with a thread a value column for all G
                 heads, so each row is loaded once for the whole tile.
    absorb_o:  grid (cdiv(T, TT), cdiv(Hq V, AO_WARPS)): out[t, h, v] = sum_c a[t, h, c]
               kv_b[h (Nn + V) + Nn + v, c]; a warp a row of kv_b, lanes over c. At T = 1
               (STAGED) absorb_o1: a warp AO1_ROWS rows, its weights loaded before the wait.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32

from .gpu_attention import SPLIT, _piece, _shfl_xor, combine
from .gpu_util import (NEG_INF, SIM, WARP, aligned, bf16_at, block_sum, cdiv, cp_async4, cp_async_wait,
                       lds4, pdl_kernel, pdl_trigger, pdl_wait, putter, warp_sum)

PREP_THREADS = 32 if SIM else 128
PREP_WARPS = PREP_THREADS // WARP   # (shared array sizes must be plain constants)
AQ_THREADS = 32 if SIM else 128
AO_WARPS = 2 if SIM else 8
AO_THREADS = AO_WARPS * WARP
TT = 2 if SIM else 4            # tokens a block of the absorb kernels takes (prefill)
GH = 8                          # attention: heads a block (the tile shares every row load)
ATT_THREADS = 64 if SIM else 128
KC = 4 if SIM else 32           # attention: keys a step
# decode (T = 1) absorb kernels: every weight a thread reads is loaded, before the PDL wait, in
# one unrolled round (the tiled kernels above load one row a loop step: a dependent HBM trip each)
CPL = 4                         # consecutive kv_b columns a lane
AQ1_WARPS = 2 if SIM else 16    # absorb_q1: warps a block, splitting a head's key rows
AO1_WARPS = 2 if SIM else 8     # absorb_o1: warps a block
AO1_ROWS = 2                    # absorb_o1: value rows a warp
# staged attention: a block's G heads are its warps (the head's query in its lanes' registers);
# each step's KS rows go to shared memory in one round of cp.async copies
KS = 2 if SIM else 16           # keys a step (a power of 2, at most 32)
# heads a block (at most: even tiles) and fewest keys a block (pieces grow to fit the partials'
# P): the best sum over positions 530 and 4095 at GLM-4.7-Flash's shapes on the H100 (PERF.md,
# twenty-fourth session; gh 4 split 16: 17.7 + 51.9 us a layer, the tiled kernel 50.7 + 94.0)
STAGED_GH = 4
STAGED_SPLIT = 16
STAGED_GH_MAX = 8               # 10 warps of ~170 registers: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
STAGED_SMEM = 48 * 1024         # a step's rows (KS x D float32) in static shared memory
ATT_VARIANTS = ("staged", "tile")
# the absorb kernels at T = 1; False: the tiled ones at every T, kept to compare
# (tools/decode_ab.py --flag kernels_numba.gpu_mla.STAGED)
STAGED = True
# the staged attention where it applies (float32 caches); False: the tiled kernel
# (tools/decode_ab.py --flag kernels_numba.gpu_mla.STAGED_ATT)
STAGED_ATT = True


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
    t, hq, qd = q.shape
    c = kv_b.shape[1]
    if t == 1 and STAGED:
        nope = qd - (q_lat.shape[2] - c)
        _absorb1("q", kv_b.dtype == np.uint16, cdiv(nope, AQ1_WARPS))[
            (hq, cdiv(c, WARP * CPL)), AQ1_WARPS * WARP, stream](q, kv_b, q_lat)
        return
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
    if t == 1 and STAGED:
        _absorb1("o", kv_b.dtype == np.uint16, cdiv(kv_b.shape[1], WARP * CPL))[
            cdiv(hq * v, AO1_WARPS * AO1_ROWS), AO1_WARPS * WARP, stream](a, kv_b, int32(nope), out)
        return
    _ABSORB_O[kv_b.dtype == np.uint16][(cdiv(t, TT), cdiv(hq * v, AO_WARPS)), AO_THREADS, stream](
        a, kv_b, int32(nope), out)


def _make_absorb_q1(elem, RPW):
    """absorb_q at T = 1: grid (Hq, cdiv(C, WARP CPL)); warp w sums key rows w, w + AQ1_WARPS, ...
    (RPW of them) over CPL columns a lane, the warps' sums meet in shared memory."""
    CB = WARP * CPL
    NW = AQ1_WARPS
    NWV = RPW * CPL

    @cuda.jit
    def absorb_q1(q, kv_b, q_lat):
        red = cuda.shared.array((NW, CB), float32)
        _, Hq, QD = q.shape
        C = kv_b.shape[1]
        per = kv_b.shape[0] // Hq
        nope = QD - (q_lat.shape[2] - C)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        w = tid // WARP
        h = cuda.blockIdx.x
        c0 = cuda.blockIdx.y * CB + lane * CPL
        wv = cuda.local.array(NWV, float32)
        for i in range(RPW):            # the weights: constant, so read before the wait
            n = w + i * NW
            for k in range(CPL):
                wv[i * CPL + k] = elem(kv_b, h * per + n, c0 + k) if n < nope and c0 + k < C \
                    else float32(0.0)
        pdl_wait()
        pdl_trigger()
        acc = cuda.local.array(CPL, float32)
        for k in range(CPL):
            acc[k] = float32(0.0)
        for i in range(RPW):
            n = w + i * NW
            if n < nope:
                qv = q[0, h, n]
                for k in range(CPL):
                    acc[k] += qv * wv[i * CPL + k]
        for k in range(CPL):
            red[w, lane * CPL + k] = acc[k]
        cuda.syncthreads()
        if tid < CB:
            c = cuda.blockIdx.y * CB + tid
            s = float32(0.0)
            for j in range(NW):
                s += red[j, tid]
            if c < C:
                q_lat[0, h, c] = s
    return absorb_q1


def _make_absorb_o1(elem, NCH):
    """absorb_o at T = 1: a warp AO1_ROWS value rows of kv_b, a lane NCH chunks of CPL
    consecutive columns of each (all loaded before the wait), one warp sum a row."""
    NR = AO1_ROWS * NCH * CPL
    NT = AO1_WARPS * WARP

    @cuda.jit
    def absorb_o1(a, kv_b, nope, out):
        red = cuda.shared.array(NT, float32)   # the simulator's warp sums
        _, Hq, V = out.shape
        C = a.shape[2]
        per = kv_b.shape[0] // Hq
        tid = cuda.threadIdx.x
        lane = tid % WARP
        r0 = (cuda.blockIdx.x * AO1_WARPS + tid // WARP) * AO1_ROWS
        wv = cuda.local.array(NR, float32)
        for rr in range(AO1_ROWS):
            r = r0 + rr
            h = r // V
            ok = r < Hq * V
            for j in range(NCH):
                for k in range(CPL):
                    c = (j * WARP + lane) * CPL + k
                    wv[(rr * NCH + j) * CPL + k] = elem(kv_b, h * per + nope + r - h * V, c) \
                        if ok and c < C else float32(0.0)
        pdl_wait()
        pdl_trigger()
        for rr in range(AO1_ROWS):      # every lane of the block reaches each sum (the simulator)
            r = r0 + rr
            h = min(r // V, Hq - 1)
            s = float32(0.0)
            for j in range(NCH):
                for k in range(CPL):
                    c = (j * WARP + lane) * CPL + k
                    if c < C:
                        s += a[0, h, c] * wv[(rr * NCH + j) * CPL + k]
            s = warp_sum(s, red)
            if lane == 0 and r < Hq * V:
                out[0, r // V, r - (r // V) * V] = s
    return absorb_o1


_ABSORB1 = {}


def _absorb1(kind: str, bf: bool, n: int):
    key = (kind, bool(bf), n)
    if key not in _ABSORB1:
        make = _make_absorb_q1 if kind == "q" else _make_absorb_o1
        _ABSORB1[key] = pdl_kernel(make(_w_bf16 if bf else _w_f32, n))
    return _ABSORB1[key]


def _make_partial(row, G, D, CPT, SPARSE=False):
    """row: the cache loader (f32 / bf16); G heads a block; D the row width; CPT value columns a
    thread (ATT_THREADS * CPT >= C); SPARSE: key j of query t is row sel[t, j]."""
    NW = ATT_THREADS // WARP
    GC = G * CPT

    @cuda.jit
    def partial(q, cache, q_pos, sel, scale, window, split, cdim, pm, pl, pacc):
        """q float32 [T, Hq, D] (cache [S_max, 1, D]) -> the pieces of each (query, head): pm, pl
        float32 [T Hq, P (+1)] (max, sum of exp), pacc float32 [T Hq, P, >= C] (the unnormed
        value sums). sel int32 [T, > q_pos[t]] (SPARSE; else not read)."""
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
                    jr = sel[t, j] if SPARSE else j
                    for d in range(lane, D, WARP):
                        kv = row(cache, jr, d)
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
                jr = sel[t, j] if SPARSE else j
                for ci in range(CPT):
                    c = tid + ci * ATT_THREADS
                    if c < cdim:
                        v = row(cache, jr, c)
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


def partial_kernel(bf: bool, g: int, d: int, c: int, sparse: bool = False):
    cpt = cdiv(c, ATT_THREADS)
    key = (bool(bf), g, d, cpt, bool(sparse))
    if key not in _PARTIAL:
        _PARTIAL[key] = pdl_kernel(_make_partial(_row_bf16 if bf else _row_f32, g, d, cpt, bool(sparse)))
    return _PARTIAL[key]


def _value_split(G, C):
    """(HS, GPT, TPS, CPT4): the staged kernel's value phase splits its G heads into HS slices
    of GPT heads (HS the largest divisor of G that leaves each slice a thread a 4-column
    granule, where there are threads enough), a slice's TPS threads taking CPT4 granules each."""
    nt, grc = G * WARP, cdiv(C, 4)
    hs = max(d for d in range(1, G + 1) if G % d == 0 and d <= max(1, nt // grc))
    return hs, G // hs, nt // hs, cdiv(grc, nt // hs)


def _make_staged(G, D, C, SPARSE=False):
    """The staged partial kernel (float32 cache, D % 4 == 0): G warps, warp g scoring head h0 + g
    (its scaled query in its lanes' registers, 16-byte granules lane, lane + 32, ...); a step's
    KS rows go to shared memory by cp.async in one round (no registers held; rows past the
    piece repeat its last row, so every value read is finite and weighs 0), each lane sums its
    granules' dots for all KS keys (unrolled, 16-byte shared loads), one transposed warp
    reduction (KS - 1 + 5 - log2 KS shuffles) leaves key lane >> SH's score in the lane, the
    online softmax stays in the warp; then the values: head slices x 4-column granules
    (_value_split), each thread its heads' probabilities from shared memory. The first step's
    rows before q_pos[0] (no launch just before writes them) are requested before the PDL wait.
    SPARSE: key j of query t is row sel[t, j]; q_pos and sel come from the launch before (the
    indexer's), so nothing is read before the wait."""
    NT = G * WARP
    GR = D // 4                       # 16-byte granules a row
    QI = cdiv(GR, WARP)               # granules of the query a lane holds
    QV = QI * 4
    GRC = cdiv(C, 4)                  # granules of the values
    HS, GPT, TPS, CPT4 = _value_split(G, C)
    NA = GPT * CPT4 * 4
    KD = KS * D
    GK = G * KS
    LN = KS.bit_length() - 1          # log2 KS
    SH = 5 - LN                       # lane >> SH: the key whose score the lane ends with
    DUP = (1 << SH) - 1               # lanes holding the same key: the one with these bits 0
    RED = 3 * NT if SIM else 1        # the simulator's shuffles (gpu_attention._shfl_xor)

    @cuda.jit
    def staged(q, cache, q_pos, sel, scale, window, split, cdim, pm, pl, pacc):
        if SIM:                                      # (no alignment there)
            ks = cuda.shared.array(KD, float32)
        else:
            ks = cuda.shared.array(KD, float32, alignment=16)
        sp = cuda.shared.array(GK, float32)     # a step's probabilities, head-major
        fac = cuda.shared.array(G, float32)         # a step's correction, a head
        red = cuda.shared.array(RED, float32)
        if SPARSE:
            pdl_wait()
            pdl_trigger()
        T, Hq, _ = q.shape
        tid = cuda.threadIdx.x
        lane = tid % WARP
        g = tid // WARP
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
        if SIM:
            red[2 * NT + tid] = float32(0.0)
        fresh = 0 if SPARSE else q_pos[0]
        for e in range(tid, KS * GR, NT):
            kk = e // GR
            j = min(j0 + kk, j1 - 1)
            if j < fresh:
                k4 = (e - kk * GR) * 4
                cp_async4(ks, kk * D + k4, cache, j, 0, k4)
        if not SPARSE:
            pdl_wait()
            pdl_trigger()
        for e in range(tid, KS * GR, NT):
            kk = e // GR
            j = min(j0 + kk, j1 - 1)
            if j >= fresh:
                k4 = (e - kk * GR) * 4
                cp_async4(ks, kk * D + k4, cache, sel[t, j] if SPARSE else j, 0, k4)
        hv = h0 + g < Hq
        hg = min(h0 + g, Hq - 1)
        qv = cuda.local.array(QV, float32)
        for i in range(QI):
            gr = lane + i * WARP
            for e in range(4):
                qv[i * 4 + e] = q[t, hg, gr * 4 + e] * scale if gr < GR else float32(0.0)
        acc = cuda.local.array(NA, float32)
        for i in range(NA):
            acc[i] = float32(0.0)
        s = cuda.local.array(KS, float32)
        sl = tid % HS                                # value phase: head slice, first granule
        gi0 = tid // HS
        m = NEG_INF
        lsum = float32(0.0)
        for jb in range(j0, j1, KS):
            if jb > j0:
                cuda.syncthreads()                   # the last step's readers of ks are done
                for e in range(tid, KS * GR, NT):
                    kk = e // GR
                    j = min(jb + kk, j1 - 1)
                    k4 = (e - kk * GR) * 4
                    cp_async4(ks, kk * D + k4, cache, sel[t, j] if SPARSE else j, 0, k4)
            cp_async_wait()
            cuda.syncthreads()
            for kk in range(KS):
                a = float32(0.0)
                for i in range(QI):
                    gr = min(lane + i * WARP, GR - 1)   # (past GR the query is 0)
                    x0, x1, x2, x3 = lds4(ks, kk * D + gr * 4)
                    a += qv[i * 4] * x0 + qv[i * 4 + 1] * x1 + qv[i * 4 + 2] * x2 + qv[i * 4 + 3] * x3
                s[kk] = a
            for b in range(LN):                      # keep the half picked by the lane's bit
                off = 16 >> b
                half = KS >> (b + 1)
                up = (lane & off) != 0
                for x in range(half):
                    lo_ = s[x]
                    hi_ = s[x + half]
                    s[x] = (hi_ if up else lo_) + _shfl_xor(lo_ if up else hi_, off, red)
            sc = s[0]
            for b in range(LN, 5):                   # lanes that hold the same key
                sc += _shfl_xor(sc, 16 >> b, red)
            key = lane >> SH
            if jb + key >= j1:
                sc = NEG_INF
            mx = sc
            for b in range(5):
                mx = max(mx, _shfl_xor(mx, 1 << b, red))
            m_new = max(m, mx)
            f = math.exp(m - m_new)
            pe = math.exp(sc - m_new)
            ps = pe if (lane & DUP) == 0 else float32(0.0)
            for b in range(5):
                ps += _shfl_xor(ps, 1 << b, red)
            lsum = lsum * f + ps
            m = m_new
            if (lane & DUP) == 0:
                sp[g * KS + key] = pe
            if lane == 0:
                fac[g] = f
            cuda.syncthreads()
            for gg in range(GPT):
                ff = fac[sl * GPT + gg]
                for x in range(CPT4 * 4):
                    acc[gg * CPT4 * 4 + x] *= ff
            for kk in range(KS):
                for ci in range(CPT4):
                    gr = min(gi0 + ci * TPS, GRC - 1)   # (past GRC: not written out)
                    x0, x1, x2, x3 = lds4(ks, kk * D + gr * 4)
                    for gg in range(GPT):
                        pr = sp[(sl * GPT + gg) * KS + kk]
                        o = (gg * CPT4 + ci) * 4
                        acc[o] += pr * x0
                        acc[o + 1] += pr * x1
                        acc[o + 2] += pr * x2
                        acc[o + 3] += pr * x3
        r0 = t * Hq + h0
        if lane == 0 and hv:
            pm[r0 + g, p] = m
            pl[r0 + g, p] = lsum
        for gg in range(GPT):
            hh = sl * GPT + gg
            if h0 + hh < Hq:
                for ci in range(CPT4):
                    gr = gi0 + ci * TPS
                    if gr < GRC:
                        for e in range(4):
                            c = gr * 4 + e
                            if c < cdim:
                                pacc[r0 + hh, p, c] = acc[(gg * CPT4 + ci) * 4 + e]
    return staged


def staged_kernel(g: int, d: int, c: int, sparse: bool = False):
    key = ("staged", g, d, c, bool(sparse))
    if key not in _PARTIAL:
        _PARTIAL[key] = pdl_kernel(_make_staged(g, d, c, bool(sparse)))
    return _PARTIAL[key]


def attention(q_lat, cache, q_pos, scale, out, partials, stream, split=None, gh=None, variant=None,
              sel=None):
    """q_lat float32 [T, Hq, D], cache [S_max, 1, D] -> out float32 [T, Hq, C]: each head's
    softmax(scale q . row) over the rows j <= q_pos[t], times the rows' first C values; with sel
    int32 [T, > q_pos[t]] (DeepSeek Sparse Attention: gpu_dsa.index_select) over the rows
    sel[t, :q_pos[t] + 1] instead, in that order (sel[t, j] = j: the same sums as without).
    partials: gpu_attention.alloc_partials(T, Hq, >= C, S_max); gh: heads a block (at most);
    split: fewest keys a block; variant: "staged" (float32 caches) or "tile" (the first kernel:
    bf16 caches, and kept to compare); None: "staged" where it applies and STAGED_ATT is on.
    gh and split default to the variant's (STAGED_GH / STAGED_SPLIT, GH / SPLIT)."""
    t, hq, d = q_lat.shape
    c = out.shape[2]
    pm, pl, pacc = partials
    p = pl.shape[1]
    if cache.shape[1:] != (1, d) or out.shape[:2] != (t, hq) or c > d:
        raise ValueError(f"MLA attention: q {q_lat.shape}, cache {cache.shape}, out {out.shape} "
                         f"(expected a cache [S, 1, {d}] and out [{t}, {hq}, <= {d}])")
    if pm.shape[0] < t * hq or pacc.shape[2] < c:
        raise ValueError(f"partials {pacc.shape} do not fit {t} queries x {hq} heads x {c} values")
    bf = cache.dtype == np.uint16
    fits = d % 4 == 0 and KS * d * 4 <= STAGED_SMEM
    variant = variant or ("staged" if STAGED_ATT and not bf and fits and aligned(16, cache) else "tile")
    staged = variant == "staged"
    gh = gh or (STAGED_GH if staged else GH)
    split = split or (STAGED_SPLIT if staged else SPLIT)
    if staged:
        if bf or not fits or not aligned(16, cache) or gh > STAGED_GH_MAX:
            raise ValueError(f"MLA attention staged: a float32 cache of 16-byte rows of at most "
                             f"{STAGED_SMEM // (4 * KS)} values and at most {STAGED_GH_MAX} heads a "
                             f"block, not {cache.dtype} {cache.shape}, gh {gh}")
        g = cdiv(hq, cdiv(hq, max(1, gh)))          # even tiles of at most gh heads
        kern, threads = staged_kernel(g, d, c, sel is not None), g * WARP
    else:
        g = max(1, min(gh, hq))
        kern, threads = partial_kernel(bf, g, d, c, sel is not None), ATT_THREADS
    if sel is not None and (sel.ndim != 2 or sel.shape[0] != t):
        raise ValueError(f"MLA attention: sel {sel.shape} for {t} queries (expected [{t}, >= picks])")
    kern[(t * cdiv(hq, g), p), threads, stream](
        q_lat, cache, q_pos, q_pos.reshape(1, t) if sel is None else sel, float32(scale), int32(0),
        int32(split), int32(c), pm, pl, pacc)
    combine(q_pos, 0, split, partials, out, stream)
