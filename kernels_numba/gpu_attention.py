"""CUDA grouped-query attention over a KV cache, split over the sequence (flash-decoding).

Legend: T = queries, Hq / Hkv = query / key-value heads, G = Hq / Hkv (a GQA group),
D = head dim (<= 256), S_max = cache rows, P = splits (num_splits), n = keys a query sees.
Cache: k, v float32 or uint16 (bf16 bits) [S_max, Hkv, D]; row j holds position j.
q_pos int32 [T] in device memory: query t sees keys j <= q_pos[t] (and q_pos[t] - j < window
when window > 0). Decode is T = 1 with q_pos = the position; prefill (causal) is T > 1. The
grid depends on S_max only, so one captured graph serves every decode step; the work is cut
where the keys are: query t's n keys go in pieces of max(split, cdiv(n, P)), so at any
position every active block has about the same share and the rest exit at once.

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
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .gpu_util import M32, NEG_INF, SIM, WARP, block_max, block_sum, cdiv, int_as_float, warp_sum

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

    @cuda.jit
    def partial(q, k64, v64, q_pos, scale, window, split, pm, pl, pacc, out):
        """q float32 [T, Hq, D]; k64, v64 uint64 [S_max, Hkv, D / cw]; out [T, Hq, D] (FUSED).

        K / V rows are double-buffered: a warp issues the loads of its next KB keys before it
        scores the current ones. FUSED: each block that did a piece takes a ticket (float atomic
        on pm[t * Hq + h0, P]); the block that takes the last one merges the pieces of the G
        heads into out and resets the ticket to 0 (so a captured graph can replay it)."""
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
    @cuda.jit
    def combine(q_pos, window, split, pm, pl, pacc, out):
        """Merge the used pieces of one (query, head): out [T, Hq, D]; grid T * Hq, COMB_THREADS.

        Warp w reads pieces w, w + COMB_PG, ... (lanes over D, DL values each, two pieces in
        flight); the COMB_PG partial sums meet in shared memory."""
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


def attention(q, kc, vc, q_pos, scale, out, partials, stream, window=0, split=SPLIT, kb=KB,
              warps=ATT_WARPS, fused=None):
    """q float32 [T, Hq, D], caches [S_max, Hkv, D] -> out float32 [T, Hq, D].

    split: fewest keys a block takes; kb, warps: partial-kernel variants; fused: merge the
    pieces in the partial kernel (one launch; default FUSED where fusable()) or in a separate
    combine kernel (benchmark sweeps)."""
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
    g = hq // hkv
    fused = (FUSED if fused is None else fused) and fusable(g, p)
    kern, nw = partial_kernel(kind, g, d, kb, warps, fused)
    kern[(t * hkv, p), nw * WARP, stream](q, kc.view(np.uint64), vc.view(np.uint64), q_pos,
                                          float32(scale), int32(window), int32(split),
                                          pm, pl, pacc, out)
    if fused:
        return
    comb = _COMBINE[MAX_D // WARP // 2 if d <= MAX_D // 2 else MAX_D // WARP]
    comb[t * hq, COMB_THREADS, stream](q_pos, int32(window), int32(split), pm, pl, pacc, out)
