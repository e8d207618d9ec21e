"""CUDA grouped-query attention over a KV cache, split over the sequence (flash-decoding).

Legend: T = queries, Hq / Hkv = query / key-value heads, G = Hq / Hkv (a GQA group),
D = head dim (<= 256), S_max = cache rows, P = splits (num_splits), n = keys a query sees.
Cache: k, v float32 or uint16 (bf16 bits) [S_max, Hkv, D]; row j holds position j.
q_pos int32 [T] in device memory: query t sees keys j <= q_pos[t] (and q_pos[t] - j < window
when window > 0; with window < 0, chunked attention: keys of its chunk of -window positions,
j >= q_pos[t] - q_pos[t] % -window). Decode is T = 1 with q_pos = the position; prefill
(causal) is T > 1. The grid depends on S_max only, so one captured graph serves every decode
step; the work is cut where the keys are: query t's n keys go in pieces of max(split,
cdiv(n, P)), so at any position every active block has about the same share and the rest exit
at once.

    partial: grid (T * Hkv, P), ATT_WARPS warps: a block takes the G query heads of one kv head
             over one piece, so each K / V row is read once for the whole group. A warp scores
             KB keys at a time (lanes over D, 8-byte loads, all 2 * KB rows in flight), online
             softmax per head in fp32, warps merged in shared memory
             -> pm, pl float32 [T*Hq, P] (max, sum), pacc float32 [T*Hq, P, D]. K / V loads are
             double-buffered (the next KB keys are in flight while the current ones are scored).
             Fused (the default where G * P <= FAC_FLOATS): the last block of a (query, kv head)
             to finish (a ticket from a float atomic in pm's extra column P, reset to 0 by that
             block, so graph replays start clean) merges the G heads' pieces -> out: ONE launch.
    combine: (unfused) grid T * Hq, COMB_THREADS: merges the pieces that were used -> out

Decode variants (T = 1; attention(variant=...), module default DECODE_VARIANT; prefill always
takes the path above):
    "base": the partial + combine kernels above.
    "v2":   partial2, grid (Hkv, P2) with P2 = decode_splits() (about V2_WAVES blocks an SM,
            from S_max and the SM count only): lanes over D in chunks of 4 values (16-byte
            fp32 / 8-byte bf16 loads, a warp reads a whole row per load), KB keys a step with
            the next step's rows in flight (two register buffers, no copies). The G * KB
            partial dot products of a step are summed over the warp by a transpose reduction
            (each shuffle halves the values a lane holds: 31 shuffles for 32 sums, not 160), so
            lane L ends with the score of one (head, key); it takes that exp2 itself (one MUFU
            a lane, not G * KB) and the probabilities reach the other lanes through shared
            memory. Scores are in log2 units (q is scaled by scale * log2 e). Then combine2:
            grid T * Hq, C2_THREADS; the pieces' rows are loaded before their maxima are
            reduced, so the two reads overlap.
    "v2f":  partial2 with the merge in the last block of each (query, kv head) to finish: one
            launch. The old fused merge (3.5x slower than two launches) has each thread of the
            last block do G * D / threads outputs one after another, each over the pieces four
            loads at a time: about 128 dependent L2 round trips at 64 pieces, and every thread
            fences. Here the last block (V2F_WARPS warps; about one wave of pieces, so fewer to
            merge) keeps F_U rows of 16 bytes in flight a thread, and only thread 0 fences and
            takes the ticket (a float atomic on pm[:, P], reset by the last block).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .gpu_util import (FULL_MASK, M32, NEG_INF, SIM, WARP, aligned, block_max, block_sum, cdiv,
                        globaltimer, int_as_float, ld1cg, ld2o, ld2ocg, ld4cg, ld4o, ld4ocg,
                        lds4, pdl_kernel, pdl_trigger, pdl_wait, st4, warp_max, warp_sum,
                        warp_sync)

ATT_WARPS = 2 if SIM else 4   # partial: warps a block
KB = 2                        # partial: keys a warp scores at once (H200 sweep: 2 beats 4, 8)
FUSED = False                 # True: merge the pieces in the partial kernel's last block (one
                              # launch); H200 sweep: 67 us against 19 us for two launches at 4k
FAC_FLOATS = 1024             # fused merge: shared floats a factor table holds (G * P, 4 KB)
MAX_D = 256
SPLIT = 32                    # fewest keys a block takes (default)
MAX_SPLITS = 4 if SIM else 128  # P for decode: Hkv * P blocks cover the GPU several times
SMEM_FLOATS = 8192            # partial: shared floats for the warp merge (32 KB)
COMB_THREADS = 32 if SIM else 256
COMB_PG = COMB_THREADS // WARP  # combine: pieces read in parallel (one warp each)
_S16 = np.uint32(16)
_XFFFF = np.uint32(0xFFFF)
_XFFFF0000 = np.uint32(0xFFFF0000)


@cuda.jit(device=True, inline=True)
def _chunk_f32(w, v, o):
    """8 bytes of the cache -> v[o], v[o + 1] (two float32)."""
    v[o] = int_as_float(uint32(w & M32))
    v[o + 1] = int_as_float(uint32(w >> 32))


@cuda.jit(device=True, inline=True)
def _chunk_bf16(w, v, o):
    """8 bytes of the cache -> v[o .. o + 3] (four bfloat16)."""
    lo = uint32(w & M32)
    hi = uint32(w >> 32)
    v[o] = int_as_float((lo & _XFFFF) << _S16)
    v[o + 1] = int_as_float(lo & _XFFFF0000)
    v[o + 2] = int_as_float((hi & _XFFFF) << _S16)
    v[o + 3] = int_as_float(hi & _XFFFF0000)


@cuda.jit(device=True, inline=True)
def _piece(q_pos, t, window, split, P):
    """(first key, keys n, keys a piece) of query t."""
    pos = q_pos[t]
    lo = 0
    if window > 0:
        lo = max(0, pos - window + 1)
    elif window < 0:   # chunked (Llama 4): from the start of the query's chunk
        lo = pos - pos % -window
    n = pos + 1 - lo
    return lo, n, max(split, (n + P - 1) // P)


def _make_partial(cw, chunk, G, NCL, KB, NW, FUSED):
    """cw values per 8-byte chunk (2 fp32 / 4 bf16); NCL chunks per lane cover the head dim."""
    DP = NCL * WARP * cw          # padded head dim
    CL = NCL * cw                 # head-dim values per lane
    GC = G * CL                   # (array sizes must be plain constants for numba)
    KN = KB * NCL
    KC = KB * CL
    KG = KB * G
    NT = NW * WARP
    FP = FAC_FLOATS // G if FUSED else 1   # pieces the fused merge holds factors for

    @pdl_kernel
    @cuda.jit
    def partial(q, k64, v64, q_pos, scale, window, split, pm, pl, pacc, out):
        """q float32 [T, Hq, D]; k64, v64 uint64 [S_max, Hkv, D / cw]; out [T, Hq, D] (FUSED).

        K / V rows are double-buffered: a warp issues the loads of its next KB keys before it
        scores the current ones. FUSED: each block that did a piece takes a ticket (float atomic
        on pm[t * Hq + h0, P]); the block that takes the last one merges the pieces of the G
        heads into out and resets the ticket to 0 (so a captured graph can replay it)."""
        pdl_wait()
        pdl_trigger()
        fac = cuda.shared.array((G, FP), float32)
        fl = cuda.shared.array((G, FP), float32)
        gmx = cuda.shared.array(G, float32)
        tick = cuda.shared.array(1, float32)
        red = cuda.shared.array(NT, float32)
        wm = cuda.shared.array((NW, G), float32)
        wl = cuda.shared.array((NW, G), float32)
        wf = cuda.shared.array((NW, G), float32)
        wacc = cuda.shared.array((NW, G, DP), float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        T, Hq, D = q.shape
        Hkv = k64.shape[1]
        nch = k64.shape[2]
        P = pm.shape[1] - 1            # the last column holds the fused merge's tickets
        row = cuda.blockIdx.x
        p = cuda.blockIdx.y
        t = row // Hkv
        kvh = row - t * Hkv
        lo, n, piece = _piece(q_pos, t, window, split, P)
        start = lo + p * piece
        if start >= lo + n:            # an unused piece (uniform over the block)
            return
        end = min(lo + n, start + piece)
        h0 = kvh * G
        qv = cuda.local.array(GC, float32)
        acc = cuda.local.array(GC, float32)
        m = cuda.local.array(G, float32)
        l = cuda.local.array(G, float32)
        for g in range(G):
            m[g] = NEG_INF
            l[g] = float32(0.0)
            for i in range(NCL):
                c = i * WARP + lane
                cc = min(c, nch - 1)
                for e in range(cw):
                    v = q[t, h0 + g, cc * cw + e] * scale
                    qv[g * CL + i * cw + e] = v if c < nch else float32(0.0)
                    acc[g * CL + i * cw + e] = float32(0.0)
        kw = cuda.local.array(KN, uint64)
        vw = cuda.local.array(KN, uint64)
        kn = cuda.local.array(KN, uint64)
        vn = cuda.local.array(KN, uint64)
        kd = cuda.local.array(cw, float32)
        vd = cuda.local.array(KC, float32)
        sc = cuda.local.array(KG, float32)
        niter = (end - start + NW * KB - 1) // (NW * KB)   # uniform over the block
        for u in range(KB):                                # the first KB keys
            jj = min(start + warp * KB + u, end - 1)
            for i in range(NCL):
                cc = min(i * WARP + lane, nch - 1)
                kn[u * NCL + i] = k64[jj, kvh, cc]
                vn[u * NCL + i] = v64[jj, kvh, cc]
        for it in range(niter):
            jb = start + (it * NW + warp) * KB
            for x in range(KN):
                kw[x] = kn[x]
                vw[x] = vn[x]
            if it + 1 < niter:                             # the next KB keys, in flight now
                for u in range(KB):
                    jj = min(jb + NW * KB + u, end - 1)
                    for i in range(NCL):
                        cc = min(i * WARP + lane, nch - 1)
                        kn[u * NCL + i] = k64[jj, kvh, cc]
                        vn[u * NCL + i] = v64[jj, kvh, cc]
            for x in range(KB * G):
                sc[x] = float32(0.0)
            for u in range(KB):
                for i in range(NCL):
                    chunk(kw[u * NCL + i], kd, 0)
                    for g in range(G):
                        s = float32(0.0)
                        for e in range(cw):
                            s += qv[g * CL + i * cw + e] * kd[e]
                        sc[u * G + g] += s
            for x in range(KB * G):
                sc[x] = warp_sum(sc[x], red)
            for u in range(KB):
                if jb + u >= end:
                    for g in range(G):
                        sc[u * G + g] = NEG_INF
                for i in range(NCL):
                    chunk(vw[u * NCL + i], vd, u * CL + i * cw)
            for g in range(G):
                mn = m[g]
                for u in range(KB):
                    mn = max(mn, sc[u * G + g])
                if mn > NEG_INF:                           # uniform over the warp
                    corr = math.exp(m[g] - mn)
                    lg = l[g] * corr
                    for x in range(CL):
                        acc[g * CL + x] *= corr
                    for u in range(KB):
                        ev = math.exp(sc[u * G + g] - mn)
                        lg += ev
                        for x in range(CL):
                            acc[g * CL + x] += ev * vd[u * CL + x]
                    l[g] = lg
                    m[g] = mn
        if lane == 0:
            for g in range(G):
                wm[warp, g] = m[g]
                wl[warp, g] = l[g]
        for g in range(G):
            for i in range(NCL):
                for e in range(cw):
                    wacc[warp, g, (i * WARP + lane) * cw + e] = acc[g * CL + i * cw + e]
        cuda.syncthreads()
        nt = cuda.blockDim.x
        for x in range(tid, NW * G, nt):                  # merge factors of the warps
            w = x // G
            g = x - w * G
            mt = wm[0, g]
            for o in range(1, NW):
                mt = max(mt, wm[o, g])
            wf[w, g] = math.exp(wm[w, g] - mt) if wm[w, g] > NEG_INF else float32(0.0)
        cuda.syncthreads()
        for x in range(tid, G * D, nt):
            g = x // D
            d = x - g * D
            a = float32(0.0)
            for w in range(NW):
                a += wacc[w, g, d] * wf[w, g]
            hr = t * Hq + h0 + g
            pacc[hr, p, d] = a
            if d == 0:
                mt = wm[0, g]
                lt = float32(0.0)
                for w in range(NW):
                    mt = max(mt, wm[w, g])
                    lt += wl[w, g] * wf[w, g]
                pm[hr, p] = mt
                pl[hr, p] = lt
        if FUSED:
            cuda.threadfence()
            cuda.syncthreads()
            r0 = t * Hq + h0
            if tid == 0:
                tick[0] = cuda.atomic.add(pm, (r0, P), float32(1.0))
            cuda.syncthreads()
            nu = (n + piece - 1) // piece
            if tick[0] != float32(nu - 1):                 # not the last block (uniform)
                return
            if tid == 0:
                pm[r0, P] = float32(0.0)
            for x in range(tid, G * nu, nt):              # piece maxima and sums -> shared
                g = x // nu
                pp = x - g * nu
                fac[g, pp] = pm[r0 + g, pp]
                fl[g, pp] = pl[r0 + g, pp]
            cuda.syncthreads()
            for g in range(tid, G, nt):
                mt = fac[g, 0]
                for pp in range(1, nu):
                    mt = max(mt, fac[g, pp])
                gmx[g] = mt
            cuda.syncthreads()
            for x in range(tid, G * nu, nt):
                g = x // nu
                pp = x - g * nu
                fac[g, pp] = math.exp(fac[g, pp] - gmx[g])
            cuda.syncthreads()
            for g in range(tid, G, nt):
                lt = float32(0.0)
                for pp in range(nu):
                    lt += fac[g, pp] * fl[g, pp]
                gmx[g] = float32(1.0) / lt
            cuda.syncthreads()
            for x in range(tid, G * D, nt):               # four pieces in flight a thread
                g = x // D
                d = x - g * D
                hr = r0 + g
                a0 = float32(0.0)
                a1 = float32(0.0)
                a2 = float32(0.0)
                a3 = float32(0.0)
                for pp in range(0, nu, 4):
                    p1 = min(pp + 1, nu - 1)
                    p2 = min(pp + 2, nu - 1)
                    p3 = min(pp + 3, nu - 1)
                    a0 += fac[g, pp] * pacc[hr, pp, d]
                    v1 = pacc[hr, p1, d]
                    v2 = pacc[hr, p2, d]
                    v3 = pacc[hr, p3, d]
                    if pp + 1 < nu:
                        a1 += fac[g, p1] * v1
                    if pp + 2 < nu:
                        a2 += fac[g, p2] * v2
                    if pp + 3 < nu:
                        a3 += fac[g, p3] * v3
                out[t, h0 + g, d] = ((a0 + a1) + (a2 + a3)) * gmx[g]
    return partial


_PARTIAL = {}


def fusable(g: int, p: int) -> bool:
    """Whether the fused merge holds the factors of p pieces of a g-head group."""
    return g * p <= FAC_FLOATS


def partial_kernel(kind: str, g: int, d: int, kb: int = KB, warps: int = ATT_WARPS,
                   fused: bool = False):
    """(kernel, warps) for a cache kind ("f32" / "bf16"), group size g and head dim d; fused:
    the variant that merges the pieces itself (see fusable())."""
    cw = 4 if kind == "bf16" else 2
    ncl = cdiv(cdiv(d, cw), WARP)
    dp = ncl * WARP * cw
    nw = max(1, min(warps, SMEM_FLOATS // (g * dp)))
    key = (kind, g, ncl, kb, nw, bool(fused))
    if key not in _PARTIAL:
        chunk = _chunk_bf16 if kind == "bf16" else _chunk_f32
        _PARTIAL[key] = _make_partial(cw, chunk, g, ncl, kb, nw, bool(fused))
    return _PARTIAL[key], nw


def _make_combine(DL):
    DW = DL * WARP
    @pdl_kernel
    @cuda.jit
    def combine(q_pos, window, split, pm, pl, pacc, out):
        """Merge the used pieces of one (query, head): out [T, Hq, D]; grid T * Hq, COMB_THREADS.

        Warp w reads pieces w, w + COMB_PG, ... (lanes over D, DL values each, two pieces in
        flight); the COMB_PG partial sums meet in shared memory."""
        pdl_wait()
        pdl_trigger()
        red = cuda.shared.array(COMB_THREADS, float32)
        wred = cuda.shared.array(COMB_PG, float32)
        fac = cuda.shared.array(MAX_SPLITS, float32)
        sacc = cuda.shared.array((COMB_PG, DW), float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        pg = tid // WARP
        row = cuda.blockIdx.x
        T, Hq, D = out.shape
        t = row // Hq
        h = row - t * Hq
        P = pm.shape[1] - 1
        lo, n, piece = _piece(q_pos, t, window, split, P)
        nu = (n + piece - 1) // piece
        mloc = NEG_INF
        for p in range(tid, nu, COMB_THREADS):
            mloc = max(mloc, pm[row, p])
        mt = block_max(mloc, red, wred)
        lloc = float32(0.0)
        for p in range(tid, nu, COMB_THREADS):
            f = math.exp(pm[row, p] - mt)
            fac[p] = f
            lloc += f * pl[row, p]
        lt = block_sum(lloc, red, wred)               # its barriers publish fac[]
        a = cuda.local.array(DL, float32)
        b = cuda.local.array(DL, float32)
        for i in range(DL):
            a[i] = float32(0.0)
            b[i] = float32(0.0)
        for p in range(pg, nu, 2 * COMB_PG):
            p2 = min(p + COMB_PG, nu - 1)
            f1 = fac[p]
            f2 = fac[p2] if p + COMB_PG < nu else float32(0.0)
            for i in range(DL):
                d = min(i * WARP + lane, D - 1)
                a[i] += f1 * pacc[row, p, d]
                b[i] += f2 * pacc[row, p2, d]
        for i in range(DL):
            sacc[pg, i * WARP + lane] = a[i] + b[i]
        cuda.syncthreads()
        inv = float32(1.0) / lt
        for d in range(tid, D, COMB_THREADS):
            s = float32(0.0)
            for o in range(COMB_PG):
                s += sacc[o, d]
            out[t, h, d] = s * inv
    return combine


_COMBINE = {dl: _make_combine(dl) for dl in (MAX_D // WARP // 2, MAX_D // WARP)}


def combine(q_pos, window, split, partials, out, stream):
    """Merge the pieces in partials (pm, pl, pacc as the partial kernels leave them; pacc's
    rows at least D wide) into out [T, Hq, D], any D (MLA's latent too: gpu_mla)."""
    t, hq, d = out.shape
    dl = cdiv(d, WARP)
    if dl not in _COMBINE:
        _COMBINE[dl] = _make_combine(dl)
    pm, pl, pacc = partials
    _COMBINE[dl][t * hq, COMB_THREADS, stream](q_pos, int32(window), int32(split), pm, pl, pacc, out)


# ---- decode v2 / v2f (T = 1) -----------------------------------------------------------------

VARIANTS = ("base", "v2", "v2f")
DECODE_VARIANT = "v2f"        # T = 1 path when attention() is not told (H200 sweep, docs/PERF.md)
V2_KB = 4                     # keys a warp scores a step (a power of 2, GP * KB <= 32)
V2_WARPS = 2 if SIM else 4
V2F_WARPS = 2 if SIM else 8   # the fused merge's block: more threads, more rows in flight
V2_WAVES = 2                  # v2: P2 aims at this many blocks an SM
V2F_WAVES = 1                 # v2f: fewer pieces, so the last block has less to merge
C2_THREADS = 32 if SIM else 128   # combine2: a block per (query, head)
C2_U = 4 if SIM else 16       # combine2: pieces a warp keeps in flight (64 pieces: one round)
F_U = 4 if SIM else 16        # v2f merge: pieces a thread keeps in flight
F_MAX = 4 if SIM else 36      # v2f merge: at most this many (merge_unroll())
LOG2E = 1.4426950408889634
_SMS = []                     # the device's SM count, read once

if SIM:
    @cuda.jit(device=True)
    def _shfl_xor(v, off, red):
        """v of lane ^ off: every thread of the block must call. red float32 [3 * threads]: two
        exchange buffers used in turn (one barrier a call: a thread writes a buffer again only
        after the next call's barrier, which every reader of this call has passed) and each
        thread's call count. gpu_util's reductions use red[:threads] between barriers."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        c = red[2 * nt + tid]
        red[2 * nt + tid] = c + float32(1.0)
        base = nt if c % 2 else 0
        red[base + tid] = v
        cuda.syncthreads()
        return red[base + (tid ^ off)]
else:
    @cuda.jit(device=True, inline=True)
    def _shfl_xor(v, off, red):
        return cuda.shfl_xor_sync(FULL_MASK, v, off)


def _make_get(l4, l2):
    """(f32, bf16) cache-chunk getters over the 16-byte / 8-byte loads l4 / l2:
    f32: chunk c (4 values, 16 bytes) of row (j, h) of an fp32 cache -> buf[o:o + 4];
    bf16: chunk c (4 bf16, 8 bytes) of row (j, h) of a bf16 cache viewed as uint32 -> buf[o:o + 2]."""
    @cuda.jit(device=True, inline=True)
    def get_f32(a, j, h, c, buf, o):
        x0, x1, x2, x3 = l4(a, j, h, 4 * c)
        buf[o] = x0
        buf[o + 1] = x1
        buf[o + 2] = x2
        buf[o + 3] = x3

    @cuda.jit(device=True, inline=True)
    def get_bf16(a, j, h, c, buf, o):
        x0, x1 = l2(a, j, h, 2 * c)
        buf[o] = x0
        buf[o + 1] = x1
    return get_f32, get_bf16


def _flat(ld):
    """ld(a, off) at a flat 32-bit offset as _make_get's load: (a, row offset, unused, k)."""
    @cuda.jit(device=True, inline=True)
    def at(a, off, _h, k):
        return ld(a, uint32(off) + uint32(k))
    return at


# with j = the row's flat 32-bit offset into the cache (h unused); _c: through L2 and kept
# after pdl_wait, for rows the launch before may have written
_geto_f32, _geto_bf16 = _make_get(_flat(ld4o), _flat(ld2o))
_geto_f32_c, _geto_bf16_c = _make_get(_flat(ld4ocg), _flat(ld2ocg))


@cuda.jit(device=True, inline=True)
def _dec_f32(buf, o, v, vo):
    for e in range(4):
        v[vo + e] = buf[o + e]


@cuda.jit(device=True, inline=True)
def _dec_bf16(buf, o, v, vo):
    lo = uint32(buf[o])
    hi = uint32(buf[o + 1])
    v[vo] = int_as_float((lo & _XFFFF) << _S16)
    v[vo + 1] = int_as_float(lo & _XFFFF0000)
    v[vo + 2] = int_as_float((hi & _XFFFF) << _S16)
    v[vo + 3] = int_as_float(hi & _XFFFF0000)


NSTAMP = 8                    # partial2 TRACE: timestamps a block


def _make_partial2(BF, G, NCL, KB, NW, FUSED, TRACE=False, FU=F_U):
    """BF: bf16 cache (else fp32); G heads a kv head; NCL chunks of 4 values a lane cover D; KB
    keys a warp step (GP * KB <= 32); NW warps; FUSED: v2f (merge in the last block). TRACE
    (timeline tools only): thread 0 of block b stores the low 32 bits of %globaltimer at its
    NSTAMP phases (entry, after the PDL wait, the first step, the loop, the partials stored, the
    ticket, then in the last block the merge factors and the end) as flat floats b * NSTAMP + k
    of pacc[:, P - 1, :], a piece no decode with P2 < P uses. K / V rows are read at 32-bit
    offsets from the cache's start (no 64-bit index arithmetic); the warps' merge and the
    last block's merge with 16-byte shared / global stores and no integer division (each thread
    computes its head's warp factors itself: one barrier, not two), the last block's first FU
    pieces and pm / pl loaded together before its factors (one L2 round trip for all, not
    three or more); the same sums in the same order as without."""
    GP = 1 << (G - 1).bit_length()     # G padded to a power of 2
    N = GP * KB                        # partial dot products a lane holds before the reduction
    LN = N.bit_length() - 1
    SH = 5 - LN                        # after it lane L holds the sum number L >> SH
    LKB = KB.bit_length() - 1
    C4 = NCL * 4                       # head-dim values a lane
    GC = G * C4
    KC4 = KB * C4
    CWD = 2 if BF else 4               # words a chunk in the register buffers
    BW = KB * NCL * CWD
    BT = uint32 if BF else float32
    NT = NW * WARP
    DP = NCL * WARP * 4                # padded head dim
    RED = 3 * NT if SIM else 1
    FP = MAX_SPLITS if FUSED else 1
    FU4 = FU * 4
    CH = NCL * WARP                    # 4-value chunks a head, padded
    PU = cdiv(MAX_SPLITS, WARP)        # pieces a lane reads for the merge factors
    W1 = NW * G * DP
    NG = N + GP                        # (array sizes must be plain constants for numba)
    get = _geto_bf16 if BF else _geto_f32
    get_c = _geto_bf16_c if BF else _geto_f32_c
    dec = _dec_bf16 if BF else _dec_f32

    @cuda.jit(device=True, inline=True)
    def stamp(pacc, b, k):
        f = b * NSTAMP + k
        dd = pacc.shape[2]
        r = f // dd
        pacc[r, pacc.shape[1] - 1, f - r * dd] = int_as_float(uint32(globaltimer() & M32))

    def make_load(g):
        @cuda.jit(device=True, inline=True)
        def load(kc, vc, kvh, j0, end, lane, nch, kb_, vb_):
            """K and V rows of keys j0 .. j0 + KB - 1 (clamped to end - 1) -> registers
            (at 32-bit offsets from the cache's start)."""
            rw = uint32(kc.shape[1]) * uint32(kc.shape[2])
            hw = uint32(kvh) * uint32(kc.shape[2])
            for u in range(KB):
                jj = min(j0 + u, end - 1)
                for i in range(NCL):
                    c = min(i * WARP + lane, nch - 1)
                    o = uint32(jj) * rw + hw
                    g(kc, o, 0, c, kb_, (u * NCL + i) * CWD)
                    g(vc, o, 0, c, vb_, (u * NCL + i) * CWD)
        return load

    load = make_load(get)
    # coherent, after pdl_wait, for a step that holds the row the launch before stored (a
    # non-coherent load is only for data no launch in flight writes)
    load_c = make_load(get_c)

    @cuda.jit(device=True, inline=True)
    def step(kb_, vb_, jb, end, par, m, l, qv, acc, sp, red, lane, warp):
        """Score keys jb .. jb + KB - 1 for the G heads, update (m, l) of this lane's (head,
        key slot) and acc [G, C4]; sp[warp, par]: this step's probabilities and corrections."""
        s = cuda.local.array(N, float32)
        kd = cuda.local.array(4, float32)
        for x in range(N):
            s[x] = float32(0.0)
        for u in range(KB):
            for i in range(NCL):
                dec(kb_, (u * NCL + i) * CWD, kd, 0)
                for g in range(G):
                    a = s[g * KB + u]
                    for e in range(4):
                        a += qv[g * C4 + i * 4 + e] * kd[e]
                    s[g * KB + u] = a
        for b in range(LN):            # transpose reduction: keep the half picked by the lane bit
            off = 16 >> b
            half = N >> (b + 1)
            up = (lane & off) != 0
            for x in range(half):
                lo_ = s[x]
                hi_ = s[x + half]
                s[x] = (hi_ if up else lo_) + _shfl_xor(lo_ if up else hi_, off, red)
        sc = s[0]
        for b in range(LN, 5):         # lanes that hold the same sum (N < 32)
            sc += _shfl_xor(sc, 16 >> b, red)
        idx = lane >> SH
        g = idx >> LKB
        if jb + (idx & (KB - 1)) >= end or g >= G:
            sc = NEG_INF
        mx = max(m, sc)
        for b in range(LKB + SH):      # max over the head's KB << SH lanes
            mx = max(mx, _shfl_xor(mx, 1 << b, red))
        p = math.exp2(sc - mx) if sc > NEG_INF else float32(0.0)
        corr = math.exp2(m - mx) if m > NEG_INF else float32(0.0)
        sp[warp, par, idx] = p
        sp[warp, par, N + g] = corr
        warp_sync()
        for g2 in range(G):
            cg = sp[warp, par, N + g2]
            for x in range(C4):
                acc[g2 * C4 + x] *= cg
        vd = cuda.local.array(KC4, float32)
        for u in range(KB):
            for i in range(NCL):
                dec(vb_, (u * NCL + i) * CWD, vd, u * C4 + i * 4)
        for g2 in range(G):
            for u in range(KB):
                pg = sp[warp, par, g2 * KB + u]
                for x in range(C4):
                    acc[g2 * C4 + x] += pg * vd[u * C4 + x]
        return mx, l * corr + p

    @cuda.jit(device=True, inline=True)
    def merge_warps(acc, wm, wl, wacc1, pm, pl, pacc, h0, p, nch, tid, lane, warp):
        """The NW warps' (m, l, acc) of the block -> pm, pl, pacc of piece p."""
        for g2 in range(G):
            for i in range(NCL):
                o = g2 * C4 + i * 4
                st4(wacc1, ((warp * G + g2) * CH + i * WARP + lane) * 4, acc[o], acc[o + 1],
                    acc[o + 2], acc[o + 3])
        cuda.syncthreads()
        for x in range(tid, G * CH, NT):             # (head, chunk of 4 values)
            g2 = x // CH
            c = x - g2 * CH
            if c < nch:
                mt = wm[0, g2]
                for w in range(1, NW):
                    mt = max(mt, wm[w, g2])
                a0 = float32(0.0)
                a1 = float32(0.0)
                a2 = float32(0.0)
                a3 = float32(0.0)
                lt = float32(0.0)
                for w in range(NW):
                    mw = wm[w, g2]
                    f = math.exp2(mw - mt) if mw > NEG_INF else float32(0.0)
                    v0, v1, v2, v3 = lds4(wacc1, ((w * G + g2) * CH + c) * 4)
                    a0 += v0 * f
                    a1 += v1 * f
                    a2 += v2 * f
                    a3 += v3 * f
                    lt += wl[w, g2] * f
                st4(pacc, (h0 + g2, p, 4 * c), a0, a1, a2, a3)
                if c == 0:
                    pm[h0 + g2, p] = mt
                    pl[h0 + g2, p] = lt

    @cuda.jit(device=True, inline=True)
    def merge_pieces(q_pos, window, split, P, pm, pl, pacc, out, h0, fac, linv, tk, red, nch,
                     tid, lane, warp, blk):
        """The ticket; the last block of the kv head merges its pieces -> out."""
        # as cooperative groups' grid sync: the barrier orders the block's writes before
        # thread 0's fence (fences are cumulative), so one thread fences, not all
        cuda.syncthreads()
        if tid == 0:
            cuda.threadfence()
            tk[0] = cuda.atomic.add(pm, (h0, pm.shape[1] - 1), float32(1.0))
            cuda.threadfence()
            if TRACE:
                stamp(pacc, blk, 5)
        cuda.syncthreads()
        _, n, piece = _piece(q_pos, 0, window, split, P)
        nu = (n + piece - 1) // piece
        if tk[0] != float32(nu - 1):                  # not the last block (uniform)
            return
        if tid == 0:
            pm[h0, pm.shape[1] - 1] = float32(0.0)
        wb = cuda.local.array(FU4, float32)
        # this thread's first (head, chunk): its first FU pieces in flight during the factors
        g2 = min(tid // CH, G - 1)
        c = min(tid - (tid // CH) * CH, nch - 1)
        for u in range(FU):
            x0, x1, x2, x3 = ld4cg(pacc, h0 + g2, min(u, nu - 1), 4 * c)
            wb[4 * u] = x0
            wb[4 * u + 1] = x1
            wb[4 * u + 2] = x2
            wb[4 * u + 3] = x3
        mv = cuda.local.array(PU, float32)
        lv = cuda.local.array(PU, float32)
        for g0 in range(0, G, NW):                    # warp: head g0 + warp, lanes: pieces
            gw = g0 + warp
            gg = min(gw, G - 1)
            for u in range(PU):
                pp = min(lane + u * WARP, nu - 1)
                mv[u] = ld1cg(pm, h0 + gg, pp)[0]
                lv[u] = ld1cg(pl, h0 + gg, pp)[0]
            mloc = NEG_INF
            for u in range(PU):
                if lane + u * WARP < nu:
                    mloc = max(mloc, mv[u])
            mt = warp_max(mloc, red)
            lloc = float32(0.0)
            for u in range(PU):
                pp = lane + u * WARP
                if pp < nu:
                    f = math.exp2(mv[u] - mt)
                    if gw < G:
                        fac[gw, pp] = f
                    lloc += f * lv[u]
            lt = warp_sum(lloc, red)
            if lane == 0 and gw < G:
                linv[gw] = float32(1.0) / lt
        cuda.syncthreads()
        if TRACE and tid == 0:
            stamp(pacc, blk, 6)
        for x in range(tid, G * CH, NT):              # (head, chunk): FU pieces in flight
            g2 = x // CH
            c = x - g2 * CH
            gg = min(g2, G - 1)
            cc = min(c, nch - 1)
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            for p0 in range(0, nu, FU):
                if p0 > 0 or x != tid:
                    for u in range(FU):
                        x0, x1, x2, x3 = ld4cg(pacc, h0 + gg, min(p0 + u, nu - 1), 4 * cc)
                        wb[4 * u] = x0
                        wb[4 * u + 1] = x1
                        wb[4 * u + 2] = x2
                        wb[4 * u + 3] = x3
                for u in range(FU):
                    f = fac[gg, min(p0 + u, nu - 1)] if p0 + u < nu else float32(0.0)
                    a0 += f * wb[4 * u]
                    a1 += f * wb[4 * u + 1]
                    a2 += f * wb[4 * u + 2]
                    a3 += f * wb[4 * u + 3]
            if c < nch:
                li = linv[gg]
                st4(out, (0, h0 + g2, 4 * c), a0 * li, a1 * li, a2 * li, a3 * li)
        if TRACE and tid == 0:
            stamp(pacc, blk, 7)

    @cuda.jit
    def partial2(q, kc, vc, q_pos, scale2, window, split, pm, pl, pacc, out):
        """q float32 [1, Hq, D]; kc, vc [S_max, Hkv, D] float32 (or [S_max, Hkv, D / 2] uint32:
        bf16 pairs); grid (Hkv, P2): block (kvh, p) takes piece p of the keys for the G heads
        of kv head kvh -> pm, pl [Hq, P2 of P], pacc [Hq, P2 of P, D] (log2 units); FUSED: the
        last block merges them -> out [1, Hq, D]."""
        red = cuda.shared.array(RED, float32)
        if SIM:
            red[2 * NT + cuda.threadIdx.x] = float32(0.0)   # _shfl_xor's call count
        sp = cuda.shared.array((NW, 2, NG), float32)
        wm = cuda.shared.array((NW, G), float32)
        wl = cuda.shared.array((NW, G), float32)
        if SIM:
            wacc1 = cuda.shared.array(W1, float32)
        else:
            wacc1 = cuda.shared.array(W1, float32, alignment=16)
        fac = cuda.shared.array((G, FP), float32)
        linv = cuda.shared.array(G, float32)
        tk = cuda.shared.array(1, float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        D = q.shape[2]
        nch = D // 4
        kvh = cuda.blockIdx.x
        p = cuda.blockIdx.y
        P = cuda.gridDim.y
        if TRACE and tid == 0:
            stamp(pacc, kvh * P + p, 0)
        # PDL: the positions and every cache row but the newest (the launch just before, qk_norm
        # _rope, stores that one) are read before the wait; the newest row after it
        lo, n, piece = _piece(q_pos, 0, window, split, P)
        start = lo + p * piece
        if start >= lo + n:            # an unused piece (uniform over the block)
            return
        end = min(lo + n, start + piece)
        newest = lo + n - 1
        h0 = kvh * G
        ka = cuda.local.array(BW, BT)
        va = cuda.local.array(BW, BT)
        kb2 = cuda.local.array(BW, BT)
        vb2 = cuda.local.array(BW, BT)
        stride = NW * KB
        j0 = start + warp * KB
        early = n > 1                  # rows up to newest - 1 exist (uniform)
        if early:                      # steps 0 and 1 in flight before q is read
            load(kc, vc, kvh, j0, newest, lane, nch, ka, va)
            load(kc, vc, kvh, j0 + stride, newest, lane, nch, kb2, vb2)
        pdl_wait()
        pdl_trigger()
        if TRACE and tid == 0:
            stamp(pacc, kvh * P + p, 1)
        if not early or (j0 <= newest and newest < min(end, j0 + KB)):
            load_c(kc, vc, kvh, j0, end, lane, nch, ka, va)
        if not early or (j0 + stride <= newest and newest < min(end, j0 + stride + KB)):
            load_c(kc, vc, kvh, j0 + stride, end, lane, nch, kb2, vb2)
        qv = cuda.local.array(GC, float32)
        acc = cuda.local.array(GC, float32)
        for g in range(G):
            for i in range(NCL):
                c = i * WARP + lane
                x0, x1, x2, x3 = ld4cg(q, 0, h0 + g, 4 * min(c, nch - 1))   # the launch before's
                f = scale2 if c < nch else float32(0.0)
                qv[g * C4 + i * 4] = x0 * f
                qv[g * C4 + i * 4 + 1] = x1 * f
                qv[g * C4 + i * 4 + 2] = x2 * f
                qv[g * C4 + i * 4 + 3] = x3 * f
                for e in range(4):
                    acc[g * C4 + i * 4 + e] = float32(0.0)
        m = NEG_INF
        l = float32(0.0)
        niter = (end - start + stride - 1) // stride     # uniform over the block
        for it in range(0, niter, 2):
            jb = j0 + it * stride
            m, l = step(ka, va, jb, end, 0, m, l, qv, acc, sp, red, lane, warp)
            if TRACE and tid == 0 and it == 0:
                stamp(pacc, kvh * P + p, 2)
            if it + 2 < niter:
                load(kc, vc, kvh, jb + 2 * stride, end, lane, nch, ka, va)
            if it + 1 < niter:
                m, l = step(kb2, vb2, jb + stride, end, 1, m, l, qv, acc, sp, red, lane, warp)
                if it + 3 < niter:
                    load(kc, vc, kvh, jb + 3 * stride, end, lane, nch, kb2, vb2)
        if TRACE and tid == 0:
            stamp(pacc, kvh * P + p, 3)
        for b in range(LKB):           # l over the head's key slots
            l += _shfl_xor(l, (1 << SH) << b, red)
        g = (lane >> SH) >> LKB
        if (lane & ((KB << SH) - 1)) == 0 and g < G:
            wm[warp, g] = m
            wl[warp, g] = l
        merge_warps(acc, wm, wl, wacc1, pm, pl, pacc, h0, p, nch, tid, lane, warp)
        if TRACE and tid == 0:
            stamp(pacc, kvh * P + p, 4)
        if FUSED:
            merge_pieces(q_pos, window, split, P, pm, pl, pacc, out, h0, fac, linv, tk,
                         red, nch, tid, lane, warp, kvh * P + p)
    return partial2


def _make_combine2(NCL):
    NT = C2_THREADS
    NWC = NT // WARP
    U = C2_U
    C4 = NCL * 4
    UC4 = U * C4
    DP = NCL * WARP * 4
    RED = NT if SIM else 1

    @cuda.jit(device=True, inline=True)
    def fetch(pacc, row, b0, nu, w, lane, nch, buf):
        """Pieces b0 + u * NWC + w (u < U, clamped) of the row, this lane's chunks -> buf."""
        for u in range(U):
            pp = min(b0 + u * NWC + w, nu - 1)
            for i in range(NCL):
                c = min(i * WARP + lane, nch - 1)
                x0, x1, x2, x3 = ld4cg(pacc, row, pp, 4 * c)
                o = u * C4 + i * 4
                buf[o] = x0
                buf[o + 1] = x1
                buf[o + 2] = x2
                buf[o + 3] = x3

    @cuda.jit(device=True, inline=True)
    def add(fac, b0, nu, w, buf, acc):
        for u in range(U):
            pp = b0 + u * NWC + w
            f = fac[min(pp, nu - 1)] if pp < nu else float32(0.0)
            for x in range(C4):
                acc[x] += f * buf[u * C4 + x]

    @pdl_kernel
    @cuda.jit
    def combine2(q_pos, window, split, P, pm, pl, pacc, out):
        """Merge the used pieces (log2 units) of one head: out [1, Hq, D]; grid Hq, C2_THREADS.
        Warp w takes pieces w, w + NWC, ... (lanes over D, U pieces in flight); the first U
        are in flight while the pieces' maxima are reduced."""
        pdl_wait()
        pdl_trigger()
        red = cuda.shared.array(RED, float32)
        wred = cuda.shared.array(NWC, float32)
        fac = cuda.shared.array(MAX_SPLITS, float32)
        sacc = cuda.shared.array((NWC, DP), float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        w = tid // WARP
        row = cuda.blockIdx.x
        D = out.shape[2]
        nch = D // 4
        lo, n, piece = _piece(q_pos, 0, window, split, P)
        nu = (n + piece - 1) // piece
        buf = cuda.local.array(UC4, float32)
        acc = cuda.local.array(C4, float32)
        for x in range(C4):
            acc[x] = float32(0.0)
        fetch(pacc, row, 0, nu, w, lane, nch, buf)
        mloc = NEG_INF
        for pp in range(tid, nu, NT):
            mloc = max(mloc, pm[row, pp])
        mt = block_max(mloc, red, wred)
        lloc = float32(0.0)
        for pp in range(tid, nu, NT):
            f = math.exp2(pm[row, pp] - mt)
            fac[pp] = f
            lloc += f * pl[row, pp]
        lt = block_sum(lloc, red, wred)               # its barriers publish fac[]
        add(fac, 0, nu, w, buf, acc)
        for b0 in range(NWC * U, nu, NWC * U):
            fetch(pacc, row, b0, nu, w, lane, nch, buf)
            add(fac, b0, nu, w, buf, acc)
        for i in range(NCL):
            for e in range(4):
                sacc[w, (i * WARP + lane) * 4 + e] = acc[i * 4 + e]
        cuda.syncthreads()
        inv = float32(1.0) / lt
        for d in range(tid, D, NT):
            s = float32(0.0)
            for o in range(NWC):
                s += sacc[o, d]
            out[0, row, d] = s * inv
    return combine2


SINK_RED = WARP if SIM else 1


@pdl_kernel
@cuda.jit
def sinks_kernel(q_pos, window, split, P, unit, pm, pl, sinks, out):
    """Attention sinks (gpt-oss: a logit a head that joins the softmax's denominator, with no
    value row) on the merged out [T, Hq, D]: out *= L / (L + e^(sink - M)) with M, L the
    softmax's max and sum over the used pieces of pm, pl [T * Hq, >= P] (P the pieces the
    launch ran with); unit = log2 e where the pieces hold scores in log2 units (v2 / v2f),
    1 where natural. Grid T * Hq, one warp."""
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(SINK_RED, float32)
    lane = cuda.threadIdx.x
    row = cuda.blockIdx.x
    hq = out.shape[1]
    t = row // hq
    h = row - t * hq
    _, n, piece = _piece(q_pos, t, window, split, P)
    nu = (n + piece - 1) // piece
    m = NEG_INF
    for p in range(lane, nu, WARP):
        m = max(m, pm[row, p])
    m = warp_max(m, red)
    s = sinks[h] * unit
    m2 = max(m, s)
    inv = float32(1.0) / unit           # back to natural units for exp
    lsum = float32(0.0)
    for p in range(lane, nu, WARP):
        lsum += pl[row, p] * math.exp((pm[row, p] - m2) * inv)
    lsum = warp_sum(lsum, red)
    f = lsum / (lsum + math.exp((s - m2) * inv))
    for d in range(lane, out.shape[2], WARP):
        out[t, h, d] *= f


_PARTIAL2 = {}
_COMBINE2 = {}


def _sm_count() -> int:
    if not _SMS:
        _SMS.append(2 if SIM else int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _SMS[0]


def decode_splits(s_max: int, hkv: int, fused: bool = False, split: int = SPLIT) -> int:
    """P2: pieces a kv head for the v2 / v2f decode, from S_max and the SM count only (so one
    captured graph serves every position): about V2_WAVES (v2) / V2F_WAVES (v2f) blocks an SM,
    at most MAX_SPLITS (attention() also caps it by the partials' P)."""
    waves = V2F_WAVES if fused else V2_WAVES
    return max(1, min(cdiv(waves * _sm_count(), hkv), cdiv(s_max, split), MAX_SPLITS))


def v2_pieces(s_max: int, hkv: int, p_alloc: int, fused: bool, split: int = SPLIT,
              splits=None) -> int:
    """The P2 a v2 / v2f decode launches: splits (default decode_splits()), at most the
    partials' p_alloc."""
    p2 = decode_splits(s_max, hkv, fused, split) if splits is None else splits
    return max(1, min(p2, p_alloc))


def merge_unroll(p2: int) -> int:
    """Pieces a thread of the v2f last block keeps in flight for P2 pieces: all of them
    in one round up to F_MAX, else the fewest equal rounds."""
    return cdiv(p2, cdiv(p2, F_MAX))


def partial2_kernel(kind: str, g: int, d: int, kb: int, warps: int, fused: bool,
                    trace: bool = False, p2: int = 1):
    """(kernel, warps, kb) of the v2 partial for a cache kind ("f32" / "bf16"), group size g
    (<= 32) and head dim d (a multiple of 4); kb is lowered to a power of 2 with GP * kb <= 32.
    trace: the TRACE build (_make_partial2); p2: the pieces it runs with (the v2f merge's
    unroll)."""
    gp = 1 << (g - 1).bit_length()
    kb = max(1, min(1 << (max(1, kb).bit_length() - 1), WARP // gp))
    ncl = cdiv(d // 4, WARP)
    dp = ncl * WARP * 4
    nw = max(1, min(warps, SMEM_FLOATS // (g * dp)))
    fu = merge_unroll(p2) if fused else F_U
    key = (kind, g, ncl, kb, nw, bool(fused), bool(trace), fu)
    if key not in _PARTIAL2:
        _PARTIAL2[key] = pdl_kernel(_make_partial2(kind == "bf16", g, ncl, kb, nw, bool(fused),
                                                   bool(trace), fu))
    return _PARTIAL2[key], nw, kb


def _combine2_kernel(d: int):
    ncl = cdiv(d // 4, WARP)
    if ncl not in _COMBINE2:
        _COMBINE2[ncl] = _make_combine2(ncl)
    return _COMBINE2[ncl]


def _decode_v2(q, kc, vc, q_pos, scale, out, partials, stream, window, split, kb, warps,
               fused, splits):
    """The v2 / v2f decode (see the module doc): the pieces it ran with, 0 where it does not
    apply (the caller takes the base path)."""
    t, hq, d = q.shape
    hkv = kc.shape[1]
    g = hq // hkv
    pm, pl, pacc = partials
    kind = "bf16" if kc.dtype == np.uint16 else "f32"
    if (t != 1 or d % 4 or g > WARP or not aligned(16, q, pacc)
            or not aligned(8 if kind == "bf16" else 16, kc, vc)):
        return 0
    p2 = v2_pieces(kc.shape[0], hkv, pm.shape[1] - 1, fused, split, splits)
    ncl = cdiv(d // 4, WARP)
    kb = (V2_KB if ncl == 1 else 2) if kb is None else kb
    warps = (V2F_WARPS if fused else V2_WARPS) if warps is None else warps
    kern, nw, _ = partial2_kernel(kind, g, d, kb, warps, fused, p2=p2)
    if kind == "bf16":
        kv = (kc.view(np.uint32), vc.view(np.uint32))
    else:
        kv = (kc, vc)
    kern[(hkv, p2), nw * WARP, stream](q, kv[0], kv[1], q_pos, float32(scale * LOG2E),
                                        int32(window), int32(split), pm, pl, pacc, out)
    if not fused:
        _combine2_kernel(d)[hq, C2_THREADS, stream](q_pos, int32(window), int32(split),
                                                    int32(p2), pm, pl, pacc, out)
    return p2


def num_splits(s_max: int, split: int = SPLIT, t: int = 1) -> int:
    """P: pieces per (query, kv head) that alloc_partials() makes room for. Decode (t = 1) gets
    up to MAX_SPLITS; a prefill chunk of t queries fills the GPU with t times fewer."""
    return max(1, min(cdiv(s_max, split), MAX_SPLITS // t))


def alloc_partials(t: int, hq: int, d: int, s_max: int, split: int = SPLIT):
    """Device scratch for attention(): (pm [T*Hq, P + 1], pl [T*Hq, P], pacc [T*Hq, P, D]);
    allocate once. Any P works with any cache length: pieces grow to cover the keys. pm's last
    column holds the fused merge's tickets: zeroed here, left at zero by every launch."""
    p = num_splits(s_max, split, t)
    return (cuda.to_device(np.zeros((t * hq, p + 1), np.float32)),
            cuda.device_array((t * hq, p), np.float32),
            cuda.device_array((t * hq, p, d), np.float32))


def attention(q, kc, vc, q_pos, scale, out, partials, stream, window=0, split=SPLIT, kb=None,
              warps=None, fused=None, variant=None, splits=None, sinks=None):
    """q float32 [T, Hq, D], caches [S_max, Hkv, D] -> out float32 [T, Hq, D].

    split: fewest keys a block takes; kb, warps: partial-kernel variants (default KB /
    ATT_WARPS for base, V2_KB / V2_WARPS / V2F_WARPS for v2 / v2f); fused (base only): merge
    the pieces in the partial kernel (one launch; default FUSED where fusable()) or in a
    separate combine kernel. variant: the decode (T = 1) path, one of VARIANTS (default
    DECODE_VARIANT; v2 / v2f need D % 4 == 0, G <= 32 and rows of q, the caches and the
    partials aligned to their 4-value chunks, else base runs); splits: v2 / v2f pieces a kv
    head (default decode_splits()); sinks: float32 [Hq] in device memory, a logit a head that
    joins the softmax's denominator (gpt-oss), applied by sinks_kernel after the merge.
    Returns the path that ran: "base", "v2" or "v2f"."""
    variant = DECODE_VARIANT if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"unknown attention variant {variant!r} (one of {VARIANTS})")
    t, hq, d = q.shape
    hkv = kc.shape[1]
    if d > MAX_D:
        raise ValueError(f"head dim {d} exceeds MAX_D={MAX_D}")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    kind = "bf16" if kc.dtype == np.uint16 else "f32"
    if d % (4 if kind == "bf16" else 2):
        raise ValueError(f"head dim {d} is not a multiple of {4 if kind == 'bf16' else 2}")
    pm, pl, pacc = partials
    p = pm.shape[1] - 1
    if p > MAX_SPLITS or pm.shape[0] < t * hq or pl.shape[1] != p:
        raise ValueError(f"partials {pm.shape} do not fit {t} queries x {hq} heads "
                         f"(at most {MAX_SPLITS} splits; allocate with alloc_partials())")
    p2 = 0 if variant == "base" else _decode_v2(q, kc, vc, q_pos, scale, out, partials, stream,
                                                window, split, kb, warps, variant == "v2f",
                                                splits)
    if p2:
        if sinks is not None:
            sinks_kernel[t * hq, WARP, stream](q_pos, int32(window), int32(split), int32(p2),
                                               float32(LOG2E), pm, pl, sinks, out)
        return variant
    kb = KB if kb is None else kb
    warps = ATT_WARPS if warps is None else warps
    g = hq // hkv
    fused = (FUSED if fused is None else fused) and fusable(g, p)
    kern, nw = partial_kernel(kind, g, d, kb, warps, fused)
    kern[(t * hkv, p), nw * WARP, stream](q, kc.view(np.uint64), vc.view(np.uint64), q_pos,
                                          float32(scale), int32(window), int32(split),
                                          pm, pl, pacc, out)
    if not fused:
        comb = _COMBINE[MAX_D // WARP // 2 if d <= MAX_D // 2 else MAX_D // WARP]
        comb[t * hq, COMB_THREADS, stream](q_pos, int32(window), int32(split), pm, pl, pacc, out)
    if sinks is not None:
        sinks_kernel[t * hq, WARP, stream](q_pos, int32(window), int32(split), int32(p),
                                           float32(1.0), pm, pl, sinks, out)
    return "base"
