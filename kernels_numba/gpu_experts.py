"""CUDA expert MLP kernels: SwiGLU experts read straight from expert blocks in a device slot bank.

Legend: H = hidden, I = expert intermediate, Hs / Is = stored columns of gate-up / down
(H, I padded to 16 for NVFP4), K = routed experts of a token, S = slots in the bank,
B = block bytes, T = tokens, A = (token, expert) assignments, G = expert groups.

Weights live in a slot bank, uint8 [S, B], one expert block (loader/layout.py) per slot. The
kernels read it through three views of the same memory (`bank_views`): uint64 [S, B/8] for the
quantized values (8 bytes a thread a load: one NVFP4 scale group, 8 FP8 or 4 bf16 values),
uint8 [S, B] for NVFP4 scales, float32 [S, B/4] for the header's global scales and FP8 row scales.
The layout arrives as int64 [10] from ExpertLayout.as_array().

Decode (one token, graph friendly): `slots` int32 [K] and `weights` float32 [K] are device
arrays, so one captured launch pair serves any routing; only their contents change.
    gate_up: grid (cdiv(I, 2 * warps), K): a warp owns two rows of gate and up of one expert,
             lanes split the row in 8-byte chunks, x staged in shared memory (padded so lanes
             read distinct banks), warp-shuffle reduction -> act [K, I] = silu(g) * u
    down:    grid (cdiv(H, 2 * warps)): a warp owns two output rows over all K experts
             (chunks of every expert's row flattened over the lanes), so out [H] needs no
             atomics: out = (out if accumulate) + sum_k w_k * down_k @ act_k
Prefill (grouped): assignments sorted by expert, one pass over each expert's weights for all
its tokens, in tiles of TT tokens: gate_up -> act [A, I]; down -> y [A, H] (weighted);
combine -> out [T, H] = sum over a token's K assignments (no atomics).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .gpu_util import (E2M1_TABLE, E4M3_TABLE, M32, SIM, WARP, cdiv, int_as_float, silu,
                       warp_sum)

FORMAT_CODE = {"bf16": 0, "fp8": 1, "nvfp4": 2}
CHUNK = {"bf16": 4, "fp8": 8, "nvfp4": 16}   # values in one 8-byte load
THREADS = 64 if SIM else 256                 # threads per block (2 warps under the simulator)
ROWS_PER_WARP = 2
TT = 2 if SIM else 4                         # grouped kernels: tokens per tile
ACC_GU = 4 * TT                              # grouped gate_up accumulators per lane
ACC_DN = 2 * TT
MAX_K = 64                                   # routed experts per token, at most
SHARED_LIMIT = 48 * 1024                     # static + dynamic shared bytes without opt-in
# per-format default, from the H200 sweep in docs/PERF-cuda.md: NVFP4 decode is ALU/LDS-heavy
# and lost 10-15 % with more loads in flight; fp8 / bf16 gained (bf16 27 %)
UNROLL_FOR = {"nvfp4": 1, "fp8": 4, "bf16": 4}
STAGE = 8                                    # staging x / act into shared: loads in flight
TWO_POW_120 = float32(2.0 ** 120)


# ---- per-format decode of one 8-byte chunk into v[0:CW] (before scales) -----------------------

# uint32 constants keep the nibble / byte extraction in 32-bit instructions (numba widens
# mixed-type integer ops to 64 bits)
_S4, _S8, _S12, _S16 = np.uint32(4), np.uint32(8), np.uint32(12), np.uint32(16)
_S20, _S24, _S28 = np.uint32(20), np.uint32(24), np.uint32(28)
_F15, _F255, _X80, _X7F = np.uint32(15), np.uint32(255), np.uint32(0x80), np.uint32(0x7F)
_XFFFF, _XFFFF0000 = np.uint32(0xFFFF), np.uint32(0xFFFF0000)


@cuda.jit(device=True, inline=True)
def _dec_nvfp4(w, tab, v):
    lo = uint32(w & M32)
    hi = uint32(w >> 32)
    v[0] = tab[lo & _F15]
    v[1] = tab[(lo >> _S4) & _F15]
    v[2] = tab[(lo >> _S8) & _F15]
    v[3] = tab[(lo >> _S12) & _F15]
    v[4] = tab[(lo >> _S16) & _F15]
    v[5] = tab[(lo >> _S20) & _F15]
    v[6] = tab[(lo >> _S24) & _F15]
    v[7] = tab[lo >> _S28]
    v[8] = tab[hi & _F15]
    v[9] = tab[(hi >> _S4) & _F15]
    v[10] = tab[(hi >> _S8) & _F15]
    v[11] = tab[(hi >> _S12) & _F15]
    v[12] = tab[(hi >> _S16) & _F15]
    v[13] = tab[(hi >> _S20) & _F15]
    v[14] = tab[(hi >> _S24) & _F15]
    v[15] = tab[hi >> _S28]


_X80000000, _X01C00000 = np.uint32(0x80000000), np.uint32(0x01C00000)
_S2, _S6, _S10, _S14, _S18, _S22 = (np.uint32(2), np.uint32(6), np.uint32(10), np.uint32(14),
                                    np.uint32(18), np.uint32(22))
TWO_POW_126 = float32(2.0 ** 126)


@cuda.jit(device=True, inline=True)
def _e2m1x(sign, mag):
    return int_as_float((sign & _X80000000) | (mag & _X01C00000)) * TWO_POW_126


@cuda.jit(device=True, inline=True)
def _e2m1_word(w, v, o):
    """8 E2M1 nibbles of w -> v[o:o+8], arithmetically: sign to bit 31, the 3 magnitude bits
    to bits 24..22 make float32 2^-126 * value (e = 0 lands on a subnormal, exact), times 2^126."""
    v[o + 0] = _e2m1x(w << _S28, w << _S22)
    v[o + 1] = _e2m1x(w << _S24, w << _S18)
    v[o + 2] = _e2m1x(w << _S20, w << _S14)
    v[o + 3] = _e2m1x(w << _S16, w << _S10)
    v[o + 4] = _e2m1x(w << _S12, w << _S6)
    v[o + 5] = _e2m1x(w << _S8, w << _S2)
    v[o + 6] = _e2m1x(w << _S4, w >> _S2)
    v[o + 7] = _e2m1x(w, w >> _S6)


@cuda.jit(device=True, inline=True)
def _dec_nvfp4_arith(w, tab, v):
    _e2m1_word(uint32(w & M32), v, 0)
    _e2m1_word(uint32(w >> 32), v, 8)


@cuda.jit(device=True, inline=True)
def _e4m3(b):
    """E4M3 byte (uint32) -> float32, arithmetically: exact, subnormals too (NaN codes not
    special: scales and weights never hold them)."""
    return int_as_float(((b & _X80) << _S24) | ((b & _X7F) << _S20)) * TWO_POW_120


@cuda.jit(device=True, inline=True)
def _dec_fp8(w, tab, v):
    lo = uint32(w & M32)
    hi = uint32(w >> 32)
    v[0] = _e4m3(lo & _F255)
    v[1] = _e4m3((lo >> _S8) & _F255)
    v[2] = _e4m3((lo >> _S16) & _F255)
    v[3] = _e4m3(lo >> _S24)
    v[4] = _e4m3(hi & _F255)
    v[5] = _e4m3((hi >> _S8) & _F255)
    v[6] = _e4m3((hi >> _S16) & _F255)
    v[7] = _e4m3(hi >> _S24)


@cuda.jit(device=True, inline=True)
def _dec_bf16(w, tab, v):
    lo = uint32(w & M32)
    hi = uint32(w >> 32)
    v[0] = int_as_float((lo & _XFFFF) << _S16)
    v[1] = int_as_float(lo & _XFFFF0000)
    v[2] = int_as_float((hi & _XFFFF) << _S16)
    v[3] = int_as_float(hi & _XFFFF0000)


@cuda.jit(device=True, inline=True)
def _cs_nvfp4(bank8, s8, slot, soff, r, nch, j):
    return s8[bank8[slot, soff + r * nch + j]]


@cuda.jit(device=True, inline=True)
def _cs_one(bank8, s8, slot, soff, r, nch, j):
    return float32(1.0)


@cuda.jit(device=True, inline=True)
def _rs_fp8(bankf, slot, soff, r):
    return bankf[slot, soff // 4 + r]


@cuda.jit(device=True, inline=True)
def _rs_one(bankf, slot, soff, r):
    return float32(1.0)


_PARTS = {
    "nvfp4": (_dec_nvfp4, _cs_nvfp4, _rs_one),
    "nvfp4-arith": (_dec_nvfp4_arith, _cs_nvfp4, _rs_one),   # same data, E2M1 decoded by ALU
    "fp8": (_dec_fp8, _cs_one, _rs_fp8),
    "bf16": (_dec_bf16, _cs_one, _rs_one),
}


def _make_kernels(fmt: str, min_blocks: int = 0, unroll: int = 0):
    """The four expert kernels of one format (or decode variant, e.g. "nvfp4-arith");
    min_blocks > 0 adds launch bounds (THREADS, min_blocks), capping registers so that many
    blocks fit on an SM."""
    CW = CHUNK[fmt.split("-")[0]]
    U = unroll or UNROLL_FOR[fmt.split("-")[0]]   # chunks a lane loads before it computes
    UQ4 = 4 * U
    UQ2 = 2 * U
    jit = cuda.jit(launch_bounds=(THREADS, min_blocks)) if min_blocks and not SIM else cuda.jit
    CP = CW + 1  # shared stride per chunk: lanes reading consecutive chunks hit distinct banks
    decode, chunk_scale, row_scale = _PARTS[fmt]

    @cuda.jit(device=True, inline=True)
    def tables(tab, s8):
        e2 = cuda.const.array_like(E2M1_TABLE)
        e4 = cuda.const.array_like(E4M3_TABLE)
        for i in range(cuda.threadIdx.x, 256, cuda.blockDim.x):
            s8[i] = e4[i]
        if cuda.threadIdx.x < 16:
            tab[cuda.threadIdx.x] = e2[cuda.threadIdx.x]

    @cuda.jit(device=True, inline=True)
    def dot(v, xs, base):
        acc = float32(0.0)
        for t in range(CW):
            acc += v[t] * xs[base + t]
        return acc

    @jit
    def gate_up(bank64, bank8, bankf, lay, slots, x, act):
        """x float32 [H] -> act float32 [K, I]; grid (cdiv(I, 2 * warps), K)."""
        xs = cuda.shared.array(0, float32)            # [Hs / CW * CP]
        tab = cuda.shared.array(16, float32)
        s8 = cuda.shared.array(256, float32)
        red = cuda.shared.array(THREADS, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        kk = cuda.blockIdx.y
        slot = slots[kk]
        H = lay[6]
        I = lay[7]
        Hs = lay[8]
        nch = Hs // CW
        tables(tab, s8)
        stv = cuda.local.array(STAGE, float32)
        for e0 in range(tid, Hs, nt * STAGE):        # stage x: STAGE loads in flight a thread
            for u in range(STAGE):
                e = e0 + u * nt
                stv[u] = x[min(e, H - 1)] if e < H else float32(0.0)
            for u in range(STAGE):
                e = e0 + u * nt
                if e < Hs:
                    c = e // CW
                    xs[c * CP + e - c * CW] = stv[u]
        cuda.syncthreads()
        lane = tid % WARP
        r0 = (cuda.blockIdx.x * (nt // WARP) + tid // WARP) * ROWS_PER_WARP
        ra = min(r0, I - 1)
        rb = min(r0 + 1, I - 1)
        ga = lay[0] // 8 + ra * nch
        gb = lay[0] // 8 + rb * nch
        ua = lay[2] // 8 + ra * nch
        ub = lay[2] // 8 + rb * nch
        v = cuda.local.array(CW, float32)
        xv = cuda.local.array(CW, float32)
        acc_ga = float32(0.0)
        acc_gb = float32(0.0)
        acc_ua = float32(0.0)
        acc_ub = float32(0.0)
        wq = cuda.local.array(UQ4, uint64)            # loads of U chunks x 4 rows, in flight
        sq = cuda.local.array(UQ4, float32)
        for jb in range(lane, nch, WARP * U):
            for u in range(U):                        # issue every load first ...
                jj = min(jb + u * WARP, nch - 1)
                wq[4 * u] = bank64[slot, ga + jj]
                wq[4 * u + 1] = bank64[slot, gb + jj]
                wq[4 * u + 2] = bank64[slot, ua + jj]
                wq[4 * u + 3] = bank64[slot, ub + jj]
                sq[4 * u] = chunk_scale(bank8, s8, slot, lay[1], ra, nch, jj)
                sq[4 * u + 1] = chunk_scale(bank8, s8, slot, lay[1], rb, nch, jj)
                sq[4 * u + 2] = chunk_scale(bank8, s8, slot, lay[3], ra, nch, jj)
                sq[4 * u + 3] = chunk_scale(bank8, s8, slot, lay[3], rb, nch, jj)
            for u in range(U):                        # ... then decode and multiply
                j = jb + u * WARP
                if j < nch:
                    base = j * CP
                    for t in range(CW):
                        xv[t] = xs[base + t]
                    decode(wq[4 * u], tab, v)
                    acc_ga += sq[4 * u] * dot(v, xv, 0)
                    decode(wq[4 * u + 1], tab, v)
                    acc_gb += sq[4 * u + 1] * dot(v, xv, 0)
                    decode(wq[4 * u + 2], tab, v)
                    acc_ua += sq[4 * u + 2] * dot(v, xv, 0)
                    decode(wq[4 * u + 3], tab, v)
                    acc_ub += sq[4 * u + 3] * dot(v, xv, 0)
        acc_ga = warp_sum(acc_ga, red)
        acc_gb = warp_sum(acc_gb, red)
        acc_ua = warp_sum(acc_ua, red)
        acc_ub = warp_sum(acc_ub, red)
        if lane == 0:
            gg = bankf[slot, 0]
            gu = bankf[slot, 1]
            if r0 < I:
                g = acc_ga * gg * row_scale(bankf, slot, lay[1], ra)
                u = acc_ua * gu * row_scale(bankf, slot, lay[3], ra)
                act[kk, r0] = silu(g) * u
            if r0 + 1 < I:
                g = acc_gb * gg * row_scale(bankf, slot, lay[1], rb)
                u = acc_ub * gu * row_scale(bankf, slot, lay[3], rb)
                act[kk, r0 + 1] = silu(g) * u

    @jit
    def down(bank64, bank8, bankf, lay, slots, weights, act, out, accumulate):
        """act float32 [K, I] -> out float32 [H] (+= when accumulate); grid cdiv(H, 2 * warps)."""
        As = cuda.shared.array(0, float32)            # [K * Is / CW * CP]
        tab = cuda.shared.array(16, float32)
        s8 = cuda.shared.array(256, float32)
        red = cuda.shared.array(THREADS, float32)
        sl = cuda.shared.array(MAX_K, int32)
        ks = cuda.shared.array(MAX_K, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        K = slots.shape[0]
        H = lay[6]
        I = lay[7]
        Is = lay[9]
        nch = Is // CW
        tables(tab, s8)
        if tid < K:
            s = slots[tid]
            sl[tid] = s
            ks[tid] = weights[tid] * bankf[s, 2]
        stv = cuda.local.array(STAGE, float32)
        for e0 in range(tid, K * Is, nt * STAGE):    # stage act: STAGE loads in flight a thread
            for u in range(STAGE):
                e = min(e0 + u * nt, K * Is - 1)
                k2 = e // Is
                i = e - k2 * Is
                stv[u] = act[k2, min(i, I - 1)] if i < I else float32(0.0)
            for u in range(STAGE):
                e = e0 + u * nt
                if e < K * Is:
                    k2 = e // Is
                    i = e - k2 * Is
                    c = k2 * nch + i // CW
                    As[c * CP + i % CW] = stv[u]
        cuda.syncthreads()
        lane = tid % WARP
        r0 = (cuda.blockIdx.x * (nt // WARP) + tid // WARP) * ROWS_PER_WARP
        ra = min(r0, H - 1)
        rb = min(r0 + 1, H - 1)
        dq = lay[4] // 8
        v = cuda.local.array(CW, float32)
        av = cuda.local.array(CW, float32)
        oa = float32(0.0)
        ob = float32(0.0)
        wq = cuda.local.array(UQ2, uint64)
        sq = cuda.local.array(UQ2, float32)
        total = K * nch
        for cb in range(lane, total, WARP * U):
            for u in range(U):                        # issue every load first ...
                cc = min(cb + u * WARP, total - 1)
                k2 = cc // nch
                j = cc - k2 * nch
                slot = sl[k2]
                wq[2 * u] = bank64[slot, dq + ra * nch + j]
                wq[2 * u + 1] = bank64[slot, dq + rb * nch + j]
                kw = ks[k2]
                sq[2 * u] = kw * chunk_scale(bank8, s8, slot, lay[5], ra, nch, j) * \
                    row_scale(bankf, slot, lay[5], ra)
                sq[2 * u + 1] = kw * chunk_scale(bank8, s8, slot, lay[5], rb, nch, j) * \
                    row_scale(bankf, slot, lay[5], rb)
            for u in range(U):                        # ... then decode and multiply
                c = cb + u * WARP
                if c < total:
                    base = c * CP
                    for t in range(CW):
                        av[t] = As[base + t]
                    decode(wq[2 * u], tab, v)
                    oa += sq[2 * u] * dot(v, av, 0)
                    decode(wq[2 * u + 1], tab, v)
                    ob += sq[2 * u + 1] * dot(v, av, 0)
        oa = warp_sum(oa, red)
        ob = warp_sum(ob, red)
        if lane == 0:
            if r0 < H:
                out[r0] = oa + (out[r0] if accumulate else float32(0.0))
            if r0 + 1 < H:
                out[r0 + 1] = ob + (out[r0 + 1] if accumulate else float32(0.0))

    @jit
    def grouped_gate_up(bank64, bank8, bankf, lay, gslot, gstart, order, x, act):
        """x float32 [T, H] -> act float32 [A, I] (row a = assignment a in expert order).

        gslot int32 [G]: slot of group g; gstart int32 [G + 1]: its assignments
        gstart[g]..gstart[g+1]-1; order int32 [A]: the token of each assignment.
        grid (cdiv(I, 2 * warps), G).
        """
        xs = cuda.shared.array(0, float32)            # [TT, Hs / CW * CP]
        tab = cuda.shared.array(16, float32)
        s8 = cuda.shared.array(256, float32)
        red = cuda.shared.array(THREADS, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        g = cuda.blockIdx.y
        slot = gslot[g]
        a0 = gstart[g]
        a1 = gstart[g + 1]
        H = lay[6]
        I = lay[7]
        Hs = lay[8]
        nch = Hs // CW
        row_len = nch * CP
        tables(tab, s8)
        lane = tid % WARP
        r0 = (cuda.blockIdx.x * (nt // WARP) + tid // WARP) * ROWS_PER_WARP
        ra = min(r0, I - 1)
        rb = min(r0 + 1, I - 1)
        ga = lay[0] // 8 + ra * nch
        gb = lay[0] // 8 + rb * nch
        ua = lay[2] // 8 + ra * nch
        ub = lay[2] // 8 + rb * nch
        gg = bankf[slot, 0]
        gu = bankf[slot, 1]
        v = cuda.local.array(CW, float32)
        acc = cuda.local.array(ACC_GU, float32)       # [gate a, gate b, up a, up b] x TT
        for t0 in range(a0, a1, TT):
            cuda.syncthreads()
            for e in range(tid, TT * Hs, nt):
                tt = e // Hs
                h = e - tt * Hs
                c = h // CW
                val = float32(0.0)
                if t0 + tt < a1 and h < H:
                    val = x[order[t0 + tt], h]
                xs[tt * row_len + c * CP + h - c * CW] = val
            cuda.syncthreads()
            for q in range(4 * TT):
                acc[q] = float32(0.0)
            for j in range(lane, nch, WARP):
                wga = bank64[slot, ga + j]
                wgb = bank64[slot, gb + j]
                wua = bank64[slot, ua + j]
                wub = bank64[slot, ub + j]
                sga = chunk_scale(bank8, s8, slot, lay[1], ra, nch, j)
                sgb = chunk_scale(bank8, s8, slot, lay[1], rb, nch, j)
                sua = chunk_scale(bank8, s8, slot, lay[3], ra, nch, j)
                sub = chunk_scale(bank8, s8, slot, lay[3], rb, nch, j)
                decode(wga, tab, v)
                for tt in range(TT):
                    acc[4 * tt] += sga * dot(v, xs, tt * row_len + j * CP)
                decode(wgb, tab, v)
                for tt in range(TT):
                    acc[4 * tt + 1] += sgb * dot(v, xs, tt * row_len + j * CP)
                decode(wua, tab, v)
                for tt in range(TT):
                    acc[4 * tt + 2] += sua * dot(v, xs, tt * row_len + j * CP)
                decode(wub, tab, v)
                for tt in range(TT):
                    acc[4 * tt + 3] += sub * dot(v, xs, tt * row_len + j * CP)
            for q in range(4 * TT):
                acc[q] = warp_sum(acc[q], red)
            if lane == 0:
                for tt in range(TT):
                    a = t0 + tt
                    if a < a1:
                        if r0 < I:
                            gv = acc[4 * tt] * gg * row_scale(bankf, slot, lay[1], ra)
                            uv = acc[4 * tt + 2] * gu * row_scale(bankf, slot, lay[3], ra)
                            act[a, r0] = silu(gv) * uv
                        if r0 + 1 < I:
                            gv = acc[4 * tt + 1] * gg * row_scale(bankf, slot, lay[1], rb)
                            uv = acc[4 * tt + 3] * gu * row_scale(bankf, slot, lay[3], rb)
                            act[a, r0 + 1] = silu(gv) * uv

    @jit
    def grouped_down(bank64, bank8, bankf, lay, gslot, gstart, wts, act, y):
        """act float32 [A, I] -> y float32 [A, H] = wts[a] * down @ act[a]; grid (cdiv(H, 2*warps), G)."""
        As = cuda.shared.array(0, float32)            # [TT, Is / CW * CP]
        tab = cuda.shared.array(16, float32)
        s8 = cuda.shared.array(256, float32)
        red = cuda.shared.array(THREADS, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        g = cuda.blockIdx.y
        slot = gslot[g]
        a0 = gstart[g]
        a1 = gstart[g + 1]
        H = lay[6]
        I = lay[7]
        Is = lay[9]
        nch = Is // CW
        row_len = nch * CP
        tables(tab, s8)
        lane = tid % WARP
        r0 = (cuda.blockIdx.x * (nt // WARP) + tid // WARP) * ROWS_PER_WARP
        ra = min(r0, H - 1)
        rb = min(r0 + 1, H - 1)
        da = lay[4] // 8 + ra * nch
        db = lay[4] // 8 + rb * nch
        gd = bankf[slot, 2]
        sra = gd * row_scale(bankf, slot, lay[5], ra)
        srb = gd * row_scale(bankf, slot, lay[5], rb)
        v = cuda.local.array(CW, float32)
        acc = cuda.local.array(ACC_DN, float32)
        for t0 in range(a0, a1, TT):
            cuda.syncthreads()
            for e in range(tid, TT * Is, nt):
                tt = e // Is
                i = e - tt * Is
                c = i // CW
                val = float32(0.0)
                if t0 + tt < a1 and i < I:
                    val = act[t0 + tt, i]
                As[tt * row_len + c * CP + i - c * CW] = val
            cuda.syncthreads()
            for q in range(2 * TT):
                acc[q] = float32(0.0)
            for j in range(lane, nch, WARP):
                wa = bank64[slot, da + j]
                wb = bank64[slot, db + j]
                sa = chunk_scale(bank8, s8, slot, lay[5], ra, nch, j)
                sb = chunk_scale(bank8, s8, slot, lay[5], rb, nch, j)
                decode(wa, tab, v)
                for tt in range(TT):
                    acc[2 * tt] += sa * dot(v, As, tt * row_len + j * CP)
                decode(wb, tab, v)
                for tt in range(TT):
                    acc[2 * tt + 1] += sb * dot(v, As, tt * row_len + j * CP)
            for q in range(2 * TT):
                acc[q] = warp_sum(acc[q], red)
            if lane == 0:
                for tt in range(TT):
                    a = t0 + tt
                    if a < a1:
                        if r0 < H:
                            y[a, r0] = wts[a] * sra * acc[2 * tt]
                        if r0 + 1 < H:
                            y[a, r0 + 1] = wts[a] * srb * acc[2 * tt + 1]

    return gate_up, down, grouped_gate_up, grouped_down


@cuda.jit
def combine_kernel(y, pos, out, accumulate):
    """y float32 [A, H], pos int32 [T, K] (row of y for each token's k-th expert) -> out [T, H]."""
    i = cuda.grid(1)
    T, H = out.shape
    if i < T * H:
        t = i // H
        h = i - t * H
        s = float32(0.0)
        for k in range(pos.shape[1]):
            s += y[pos[t, k], h]
        out[t, h] = s + (out[t, h] if accumulate else float32(0.0))


_KERNELS = {fmt: _make_kernels(fmt) for fmt in CHUNK}   # fmt -> the four kernels (compiled lazily)


def get_kernels(fmt: str, min_blocks: int = 0, unroll: int = 0):
    """(gate_up, down, grouped_gate_up, grouped_down) for fmt or a variant ("nvfp4-arith");
    built once per (variant, min_blocks, unroll); unroll 0 = the format's default."""
    key = fmt if (min_blocks, unroll) == (0, 0) else (fmt, min_blocks, unroll)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernels(fmt, min_blocks, unroll)
    return _KERNELS[key]


# ---- host side ---------------------------------------------------------------------------------

def bank_views(bank):
    """uint8 [S, B] device bank -> (uint64 [S, B/8], uint8 [S, B], float32 [S, B/4]) views."""
    if bank.shape[1] % 8:
        raise ValueError(f"slot bank row of {bank.shape[1]} bytes is not a multiple of 8")
    return bank.view(np.uint64), bank, bank.view(np.float32)


def check_layout(fmt: str, lay_host: np.ndarray, k: int) -> None:
    """Raise if these kernels cannot run a layout: chunk alignment and shared-memory room."""
    cw = CHUNK[fmt]
    h, i, hs, is_ = (int(v) for v in lay_host[6:10])
    if hs % cw or is_ % cw:
        raise ValueError(f"{fmt} expert kernels need H and I multiples of {cw}; got H={h}, I={i}")
    if any(int(o) % 8 for o in lay_host[:6]):
        raise ValueError("expert block sections must be 8-byte aligned")
    if k > MAX_K:
        raise ValueError(f"top-k {k} exceeds MAX_K={MAX_K}")
    if down_shared_bytes(fmt, lay_host, k) > SHARED_LIMIT - 2048:
        raise ValueError(f"{fmt} down kernel: K*I = {k}*{i} does not fit in shared memory")


def gate_up_shared_bytes(fmt: str, lay_host: np.ndarray, tokens: int = 1) -> int:
    cw = CHUNK[fmt]
    return int(tokens * (int(lay_host[8]) // cw) * (cw + 1) * 4)


def down_shared_bytes(fmt: str, lay_host: np.ndarray, k: int) -> int:
    cw = CHUNK[fmt]
    return int(k * (int(lay_host[9]) // cw) * (cw + 1) * 4)


def gate_up_grid(lay_host: np.ndarray, groups: int, threads: int = THREADS) -> tuple[int, int]:
    return cdiv(int(lay_host[7]), ROWS_PER_WARP * threads // WARP), groups


def down_grid(lay_host: np.ndarray, threads: int = THREADS) -> int:
    return cdiv(int(lay_host[6]), ROWS_PER_WARP * threads // WARP)


def expert_gate_up(fmt, views, lay, lay_host, slots, x, act, stream, variant="", min_blocks=0,
                   unroll=0, threads=THREADS):
    """x float32 [H] -> act float32 [K, I] for the K experts in slots int32 [K].
    threads: block size, a multiple of 32 up to THREADS (tuning)."""
    gate_up = get_kernels(fmt + ("-" + variant if variant else ""), min_blocks, unroll)[0]
    b64, b8, bf = views
    gate_up[gate_up_grid(lay_host, slots.shape[0], threads), threads, stream,
            gate_up_shared_bytes(fmt, lay_host)](b64, b8, bf, lay, slots, x, act)


def expert_down(fmt, views, lay, lay_host, slots, weights, act, out, stream, accumulate=False,
                variant="", min_blocks=0, unroll=0, threads=THREADS):
    """act float32 [K, I] -> out float32 [H] = (out if accumulate) + sum_k weights[k] * down_k."""
    down = get_kernels(fmt + ("-" + variant if variant else ""), min_blocks, unroll)[1]
    b64, b8, bf = views
    down[down_grid(lay_host, threads), threads, stream, down_shared_bytes(fmt, lay_host, slots.shape[0])](
        b64, b8, bf, lay, slots, weights, act, out, int32(1 if accumulate else 0))


def expert_mlp(fmt, views, lay, lay_host, slots, weights, x, act, out, stream, accumulate=False,
               variant="", min_blocks=0, unroll=0):
    """One token through its K routed experts: two launches, nothing allocated, no sync.

    views: bank_views(bank); lay int64 [10] device, lay_host its numpy copy (shapes only);
    slots int32 [K], weights float32 [K], x float32 [H], act float32 [K, I] scratch,
    out float32 [H]. Safe to capture in a CUDA graph: routing lives in slots / weights.
    variant "arith" decodes NVFP4 values with integer ops instead of a shared-memory table.
    """
    expert_gate_up(fmt, views, lay, lay_host, slots, x, act, stream, variant, min_blocks, unroll)
    expert_down(fmt, views, lay, lay_host, slots, weights, act, out, stream, accumulate,
                variant, min_blocks, unroll)


def group_assignments(ids: np.ndarray, weights: np.ndarray, slot_of):
    """Host prep for the grouped kernels.

    ids int [T, K] expert ids, weights float32 [T, K], slot_of(expert) -> bank slot.
    Returns numpy (gslot int32 [G], gstart int32 [G+1], order int32 [A], wts float32 [A],
    pos int32 [T, K]) with assignments sorted by expert.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    perm = np.argsort(flat, kind="stable")
    experts, counts = np.unique(flat[perm], return_counts=True)
    gstart = np.zeros(len(experts) + 1, dtype=np.int32)
    gstart[1:] = np.cumsum(counts)
    gslot = np.array([slot_of(int(e)) for e in experts], dtype=np.int32)
    order = (perm // k).astype(np.int32)
    wts = weights.reshape(-1)[perm].astype(np.float32)
    pos = np.empty(t * k, dtype=np.int32)
    pos[perm] = np.arange(t * k, dtype=np.int32)
    return gslot, gstart, order, wts, pos.reshape(t, k)


def grouped_gate_up_down(fmt, views, lay, lay_host, gslot, gstart, order, wts, x, act, y, stream):
    """The grouped gate_up and down kernels over groups gslot int32 [G] with offsets gstart
    int32 [G + 1] (absolute assignment indices, so a slice of the groups can run alone):
    x [T, H] -> act [A, I] -> y [A, H] = wts[a] * expert(x[order[a]]) for those assignments."""
    _, _, ggu, gdn = get_kernels(fmt)
    b64, b8, bf = views
    g = gslot.shape[0]
    ggu[gate_up_grid(lay_host, g), THREADS, stream, gate_up_shared_bytes(fmt, lay_host, TT)](
        b64, b8, bf, lay, gslot, gstart, order, x, act)
    cw = CHUNK[fmt]
    dsh = int(TT * (int(lay_host[9]) // cw) * (cw + 1) * 4)
    gdn[(down_grid(lay_host), g), THREADS, stream, dsh](b64, b8, bf, lay, gslot, gstart, wts, act, y)


def combine(y, pos, out, stream, accumulate=False):
    """out [T, H] = (out if accumulate) + sum_k y[pos[t, k]] (pos int32 [T, K])."""
    n = out.shape[0] * out.shape[1]
    combine_kernel[cdiv(n, 256), 256, stream](y, pos, out, int32(1 if accumulate else 0))


def expert_mlp_grouped(fmt, views, lay, lay_host, gslot, gstart, order, wts, pos, x, act, y,
                       out, stream, accumulate=False):
    """T tokens (prefill): x [T, H] -> out [T, H]; act [A, I], y [A, H] scratch (A = T*K)."""
    grouped_gate_up_down(fmt, views, lay, lay_host, gslot, gstart, order, wts, x, act, y, stream)
    combine(y, pos, out, stream, accumulate)
