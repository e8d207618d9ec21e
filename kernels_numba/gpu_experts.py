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
arrays, so one captured launch pair serves any routing; only their contents change. Kernel
families, chosen by `variant` (DEFAULT_VARIANT per format; see parse_variant): NVFP4's default,
the tensor-core "mma" kernels (gpu_experts_mma.py); the "q" and "p" pipelined and the "flat"
kernels (many small blocks, all loads of a thread in flight, see the sections below); the "lut"
kernels (gpu_experts_lut.py); and the legacy ones:
    gate_up: grid (cdiv(I, 2 * warps), K): a warp owns two rows of gate and up of one expert,
             lanes split the row in 8-byte chunks, x staged in shared memory (padded so lanes
             read distinct banks), warp-shuffle reduction -> act [K, I] = silu(g) * u
    down:    grid (cdiv(H, 2 * warps)): a warp owns two output rows over all K experts
             (chunks of every expert's row flattened over the lanes), so out [H] needs no
             atomics: out = (out if accumulate) + sum_k w_k * down_k @ act_k
Prefill (grouped): assignments sorted by expert, gate_up -> act [A, I]; down -> y [A, H]
(weighted); combine -> out [T, H] = sum over a token's K assignments (no atomics). Two kernel
pairs, chosen by GROUPED_VARIANT: "tiled" (GEMM-style blocks of GT_BR weight rows x GT_BT tokens
of one expert, each weight decoded once a token tile into shared memory; see its section) and
"legacy" (a warp a row pair, tiles of TT tokens, each weight decoded once every TT tokens).
gpt-oss (biased experts, clamped SwiGLU): the flat, pipelined, q and tiled gate_up kernels have
a RAW build that stores the gate and up sums; clamped_swiglu and expert_bias_add do the rest
(expert_mlp_clamped, grouped_gate_up_down(clamp=); see their section). Step-3.5's clamped
experts without biases take the same RAW sums through limited_swiglu (expert_mlp_limited).
Ungated experts (Nemotron-H's down(relu(up x)^2)) run the same RAW kernels over kernel_layout's
layout, whose gate sections are the up sections: the gate_up kernels compute the up sums twice
and relu2_up squares the second copy (expert_mlp_relu2): correct in every kernel family, at the
cost of reading each expert's up rows twice, where an up-only build would read them once.
"""
from __future__ import annotations

import math
import os
import re

import numpy as np
from numba import cuda, float32, int32, typeof, uint32, uint64

from .gpu_util import (E2M1_TABLE, E4M3_TABLE, FULL_MASK, M32, SIM, WARP, cdiv, float_as_uint,
                       int_as_float, pdl_kernel, pdl_trigger, pdl_wait, silu, warp_sum)

FORMAT_CODE = {"bf16": 0, "fp8": 1, "nvfp4": 2}
CHUNK = {"bf16": 4, "fp8": 8, "nvfp4": 16}   # values in one 8-byte load
THREADS = 64 if SIM else 256                 # threads per block (2 warps under the simulator)
ROWS_PER_WARP = 2
TT = 2 if SIM else 4                         # grouped kernels: tokens per tile
ACC_GU = 4 * TT                              # grouped gate_up accumulators per lane
ACC_DN = 2 * TT
MAX_K = 64                                   # routed experts per token, at most
SHARED_LIMIT = 48 * 1024                     # static + dynamic shared bytes without opt-in
SM_SHARED = 228 * 1024                       # shared bytes an SM (H200); 1 KB a block reserved
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


# ---- decode kernels, "flat" family: many small blocks, every load of a thread issued first ------
#
# gate_up: block (rows r0..r0+GR-1 of gate and up, expert k); grid (cdiv(I, GR), K). Its threads
#     split the Hs / CW chunks of those 2 * GR rows (GJ chunks a thread, all 2 * GR * GJ 8-byte
#     loads issued before any decode), hold their x chunks in registers (read through L1, no
#     staging), reduce the 2 * GR sums over the block -> act[k, r] = silu(g) * u.
# down: block (rows r0..r0+DR-1 of out); grid cdiv(H, DR). Its threads split the K * Is / CW
#     chunks of all K experts' rows (DJ a thread), read act through L1, reduce the DR sums over
#     the block: deterministic, no atomics, out written once (+= when accumulate).
# Decode "tab": E2M1 by a 16-entry shared table; "arith": by integer ops only, values left
# scaled by 2^-126 (E2M1) / 2^-120 (E4M3): x / act are pre-scaled by 2^64 in registers and the
# sums scaled back once, so no product falls into the subnormal range; "mix": low 32 bits of a
# chunk by table (holding values * 2^-126), high 32 bits by integer ops (splits the work between
# the shared-memory and integer pipes).
# Thread counts come from the shapes (threads = chunks / J, rounded up to a warp) and every
# thread runs the same number of loop trips, so barriers and the simulator's reductions are safe.

_X01C00000 = np.uint32(0x01C00000)
_X07F00000 = np.uint32(0x07F00000)
TWO_POW_64 = float32(2.0 ** 64)
RED = 256 if SIM else 1          # scratch of the simulator's warp reduction (unused on the GPU)
MAX_WARPS = 32


@cuda.jit(device=True, inline=True)
def _nib(w, a, b):
    """One E2M1 nibble of w as float32 value * 2^-126: sign bit moved to 31 by << a, the three
    magnitude bits to 24..22 by << b (exponent 0 = subnormal, exact)."""
    return int_as_float(((w << a) & _X80000000) | ((w << b) & _X01C00000))


@cuda.jit(device=True, inline=True)
def _e2m1_word_s(w, v, o):
    """8 nibbles of uint32 w -> v[o:o+8] = E2M1 * 2^-126."""
    v[o + 0] = _nib(w, _S28, _S22)
    v[o + 1] = _nib(w, _S24, _S18)
    v[o + 2] = _nib(w, _S20, _S14)
    v[o + 3] = _nib(w, _S16, _S10)
    v[o + 4] = _nib(w, _S12, _S6)
    v[o + 5] = _nib(w, _S8, _S2)
    v[o + 6] = int_as_float(((w << _S4) & _X80000000) | ((w >> _S2) & _X01C00000))
    v[o + 7] = int_as_float((w & _X80000000) | ((w >> _S6) & _X01C00000))


@cuda.jit(device=True, inline=True)
def _e2m1_word_tab(w, tab, v, o):
    v[o + 0] = tab[w & _F15]
    v[o + 1] = tab[(w >> _S4) & _F15]
    v[o + 2] = tab[(w >> _S8) & _F15]
    v[o + 3] = tab[(w >> _S12) & _F15]
    v[o + 4] = tab[(w >> _S16) & _F15]
    v[o + 5] = tab[(w >> _S20) & _F15]
    v[o + 6] = tab[(w >> _S24) & _F15]
    v[o + 7] = tab[w >> _S28]


@cuda.jit(device=True, inline=True)
def _fdec_nvfp4_tab(w, tab, v):
    _e2m1_word_tab(uint32(w & M32), tab, v, 0)
    _e2m1_word_tab(uint32(w >> 32), tab, v, 8)


@cuda.jit(device=True, inline=True)
def _fdec_nvfp4_arith(w, tab, v):
    _e2m1_word_s(uint32(w & M32), v, 0)
    _e2m1_word_s(uint32(w >> 32), v, 8)


@cuda.jit(device=True, inline=True)
def _fdec_nvfp4_mix(w, tab, v):
    _e2m1_word_tab(uint32(w & M32), tab, v, 0)     # tab holds E2M1 * 2^-126 here
    _e2m1_word_s(uint32(w >> 32), v, 8)


@cuda.jit(device=True, inline=True)
def _e4m3_s(w, a, b):
    """One E4M3 byte of uint32 w as float32 value * 2^-120 (sign << a to bit 31, the 7 other
    bits << b to 26..20)."""
    return int_as_float(((w << a) & _X80000000) | ((w << b) & _X07F00000))


@cuda.jit(device=True, inline=True)
def _e4m3_word_s(w, v, o):
    v[o + 0] = _e4m3_s(w, _S24, _S20)
    v[o + 1] = _e4m3_s(w, _S16, _S12)
    v[o + 2] = _e4m3_s(w, _S8, _S4)
    v[o + 3] = int_as_float((w & _X80000000) | ((w >> _S4) & _X07F00000))


@cuda.jit(device=True, inline=True)
def _fdec_fp8_arith(w, tab, v):
    _e4m3_word_s(uint32(w & M32), v, 0)
    _e4m3_word_s(uint32(w >> 32), v, 4)


@cuda.jit(device=True, inline=True)
def _fdec_bf16(w, tab, v):
    _dec_bf16(w, tab, v)


@cuda.jit(device=True, inline=True)
def _fcs_nvfp4(bank8, slot, soff, r, nch, j):
    return _e4m3(uint32(bank8[slot, soff + r * nch + j]))


@cuda.jit(device=True, inline=True)
def _fcs_one(bank8, slot, soff, r, nch, j):
    return float32(1.0)


# (format, decode) -> (chunk decoder, 2^k the decoded values are scaled down by, table scale)
_FLAT_DEC = {
    ("nvfp4", "tab"): (_fdec_nvfp4_tab, 0, 1.0),
    ("nvfp4", "arith"): (_fdec_nvfp4_arith, 126, 1.0),
    ("nvfp4", "mix"): (_fdec_nvfp4_mix, 126, 2.0 ** -126),
    ("fp8", "arith"): (_fdec_fp8_arith, 120, 1.0),
    ("bf16", "arith"): (_fdec_bf16, 0, 1.0),
}


@cuda.jit(device=True, inline=True)
def _act_swiglu(act, k, r, g, u):
    act[k, r] = silu(g) * u


@cuda.jit(device=True, inline=True)
def _act_raw(act, k, r, g, u):
    """The sums as they are, gate into row k, up into row A + k of act [2A, I] (gpt-oss's
    activation, with its biases, is clamped_swiglu's, a launch after)."""
    act[k, r] = g
    act[(act.shape[0] >> 1) + k, r] = u


def _act_store(raw: bool):
    return _act_raw if raw else _act_swiglu


def _make_reduce(NV: int):
    """Device function: sums of acc[0:NV] over each warp -> part[warp * NV + q], then a barrier.
    Called by every thread of the block."""
    LOG = NV.bit_length() - 1
    if SIM:
        @cuda.jit(device=True, inline=True)
        def reduce_block(acc, red, part):
            tid = cuda.threadIdx.x
            for q in range(NV):
                s = warp_sum(acc[q], red)
                if tid % WARP == 0:
                    part[(tid // WARP) * NV + q] = s
            cuda.syncthreads()
        return reduce_block

    PER = WARP // NV

    @cuda.jit(device=True, inline=True)
    def reduce_block(acc, red, part):
        """Transposed butterfly: NV - 1 + 5 - log2(NV) shuffles instead of 5 * NV; lane l ends
        with the warp's sum of value l // (32 / NV)."""
        tid = cuda.threadIdx.x
        lane = tid % WARP
        for st in range(LOG):
            off = 16 >> st
            half = NV >> (st + 1)
            up = (lane & off) != 0
            for i in range(half):
                a = acc[i]
                b = acc[i + half]
                keep = b if up else a
                send = a if up else b
                acc[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, off)
        s = acc[0]
        for st in range(LOG, 5):
            s += cuda.shfl_xor_sync(FULL_MASK, s, 16 >> st)
        if lane % PER == 0:
            part[(tid // WARP) * NV + lane // PER] = s
        cuda.syncthreads()
    return reduce_block


def _make_flat(fmt: str, dec: str, GR: int, GJ: int, DR: int, DJ: int, RAW: bool = False):
    """(gate_up, down) of the flat family for one format / decode / (rows, chunks) setting;
    RAW: gate_up stores the gate and up sums (_act_raw), not silu(gate) * up."""
    CW = CHUNK[fmt]
    act_store = _act_store(RAW)
    decode, shift, tab_scale = _FLAT_DEC[(fmt, dec)]
    XS = float32(2.0 ** 64) if shift else float32(1.0)       # pre-scale of x / act
    POST = float32(2.0 ** (shift - 64)) if shift else float32(1.0)
    TS = float32(tab_scale)
    USE_TAB = dec in ("tab", "mix")
    NG = 2 * GR
    # array sizes must be constants in the closure (numba does not fold products of them)
    PG, PD = MAX_WARPS * NG, MAX_WARPS * DR
    WG, WD = GJ * NG, DJ * DR
    XG, XD = GJ * CW, DJ * CW
    KJ = 2 * DJ
    chunk_scale = _fcs_nvfp4 if fmt == "nvfp4" else _fcs_one
    row_scale = _rs_fp8 if fmt == "fp8" else _rs_one
    for n in (NG, DR):
        if n & (n - 1) or n > WARP:
            raise ValueError(f"rows per block must be a power of two up to 16; got {n}")

    @cuda.jit(device=True, inline=True)
    def fill_tab(tab):
        if USE_TAB:
            e2 = cuda.const.array_like(E2M1_TABLE)
            if cuda.threadIdx.x < 16:
                tab[cuda.threadIdx.x] = e2[cuda.threadIdx.x] * TS
        cuda.syncthreads()

    reduce_g = _make_reduce(NG)
    reduce_d = _make_reduce(DR)

    @cuda.jit(device=True, inline=True)
    def dot(v, xv, base):
        d = float32(0.0)
        for t in range(CW):
            d += v[t] * xv[base + t]
        return d

    @pdl_kernel
    @cuda.jit
    def gate_up(bank64, bank8, bankf, lay, slots, x, act):
        """x float32 [H] -> act float32 [K, I]; grid (cdiv(I, GR), K), threads ~ nch / GJ."""
        pdl_wait()
        pdl_trigger()
        tab = cuda.shared.array(16, float32)
        red = cuda.shared.array(RED, float32)
        part = cuda.shared.array(PG, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        kk = cuda.blockIdx.y
        slot = slots[kk]
        H = lay[6]
        I = lay[7]
        nch = lay[8] // CW
        r0 = cuda.blockIdx.x * GR
        gq = lay[0] // 8
        uq = lay[2] // 8
        fill_tab(tab)
        acc = cuda.local.array(NG, float32)
        for q in range(NG):
            acc[q] = float32(0.0)
        wq = cuda.local.array(WG, uint64)
        sq = cuda.local.array(WG, float32)
        xv = cuda.local.array(XG, float32)
        v = cuda.local.array(CW, float32)
        for j0 in range(0, nch, nt * GJ):
            for u in range(GJ):                       # every weight load first ...
                j = min(j0 + tid + u * nt, nch - 1)
                for q in range(GR):
                    r = min(r0 + q, I - 1)
                    wq[u * NG + 2 * q] = bank64[slot, gq + r * nch + j]
                    wq[u * NG + 2 * q + 1] = bank64[slot, uq + r * nch + j]
                    sq[u * NG + 2 * q] = chunk_scale(bank8, slot, lay[1], r, nch, j)
                    sq[u * NG + 2 * q + 1] = chunk_scale(bank8, slot, lay[3], r, nch, j)
            for u in range(GJ):                       # ... then x (L1 hits after the first block)
                j = j0 + tid + u * nt
                for t in range(CW):
                    e = j * CW + t
                    xv[u * CW + t] = x[min(e, H - 1)] * (XS if e < H else float32(0.0))
            for u in range(GJ):
                if j0 + tid + u * nt < nch:
                    for q in range(NG):
                        decode(wq[u * NG + q], tab, v)
                        acc[q] += sq[u * NG + q] * dot(v, xv, u * CW)
        reduce_g(acc, red, part)
        if tid < GR:
            r = r0 + tid
            if r < I:
                g = float32(0.0)
                uu = float32(0.0)
                for w in range(nt // WARP):
                    g += part[w * NG + 2 * tid]
                    uu += part[w * NG + 2 * tid + 1]
                g *= POST * bankf[slot, 0] * row_scale(bankf, slot, lay[1], r)
                uu *= POST * bankf[slot, 1] * row_scale(bankf, slot, lay[3], r)
                act_store(act, kk, r, g, uu)

    @pdl_kernel
    @cuda.jit
    def down(bank64, bank8, bankf, lay, slots, weights, act, out, accumulate):
        """act float32 [K, I] -> out float32 [H] (+= when accumulate); grid cdiv(H, DR)."""
        pdl_wait()
        pdl_trigger()
        tab = cuda.shared.array(16, float32)
        red = cuda.shared.array(RED, float32)
        part = cuda.shared.array(PD, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        K = slots.shape[0]
        H = lay[6]
        I = lay[7]
        nch = lay[9] // CW
        total = K * nch
        r0 = cuda.blockIdx.x * DR
        dq = lay[4] // 8
        fill_tab(tab)
        acc = cuda.local.array(DR, float32)
        for q in range(DR):
            acc[q] = float32(0.0)
        wq = cuda.local.array(WD, uint64)
        sq = cuda.local.array(WD, float32)
        av = cuda.local.array(XD, float32)
        kj = cuda.local.array(KJ, int32)               # (expert, chunk) of each of the DJ chunks
        v = cuda.local.array(CW, float32)
        for c0 in range(0, total, nt * DJ):
            for u in range(DJ):                       # every weight load first ...
                c = min(c0 + tid + u * nt, total - 1)
                k2 = c // nch
                j = c - k2 * nch
                kj[2 * u] = k2
                kj[2 * u + 1] = j
                slot = slots[k2]
                kw = weights[k2] * bankf[slot, 2]
                for q in range(DR):
                    r = min(r0 + q, H - 1)
                    wq[u * DR + q] = bank64[slot, dq + r * nch + j]
                    sq[u * DR + q] = kw * chunk_scale(bank8, slot, lay[5], r, nch, j) * \
                        row_scale(bankf, slot, lay[5], r)
            for u in range(DJ):                       # ... then the activations
                k2 = kj[2 * u]
                j = kj[2 * u + 1]
                for t in range(CW):
                    i = j * CW + t
                    av[u * CW + t] = act[k2, min(i, I - 1)] * (XS if i < I else float32(0.0))
            for u in range(DJ):
                if c0 + tid + u * nt < total:
                    for q in range(DR):
                        decode(wq[u * DR + q], tab, v)
                        acc[q] += sq[u * DR + q] * dot(v, av, u * CW)
        reduce_d(acc, red, part)
        if tid < DR:
            r = r0 + tid
            if r < H:
                s = float32(0.0)
                for w in range(nt // WARP):
                    s += part[w * DR + tid]
                s *= POST
                out[r] = s + (out[r] if accumulate else float32(0.0))

    return gate_up, down


# ---- decode kernels, "pipelined" family (decode ptab / parith / pmix): persistent blocks --------
#
# Why (H200 sweep of the flat kernels): gate_up took 16-19 us for the 25 M weights of a 30B layer
# in all three formats (12.6, 25 and 50 MB), so it is bound by the work per weight and by its
# structure, not by bytes: every flat block loads once, then decodes, then exits, so an SM's
# blocks all wait on memory together and then all compute together (time = latency + compute,
# not max), 768 blocks over 132 SMs x 5 resident make 1.16 waves (a second, almost empty wave
# of the same length), and down (154 registers, 2 blocks an SM, 512 blocks = 2 waves) repeats
# the slot -> weight -> bank load chain and re-reads all of act (24 KB) in every block.
# Here a grid of (SMs x b) blocks walks over work items (gate_up: GR rows of one expert; down:
# DR output rows over all experts) with a register double buffer: the raw 8-byte chunks and
# scale bytes of item n + 1 are issued before item n is decoded, so each warp keeps
# GR * 2 * GJ * 8 (gate_up) / DR * DJ * 8 (down) bytes in flight while it computes (>= 30 KB an SM
# at 3 blocks of 128 threads). A thread owns fixed chunks of the row (one pass: threads * J
# covers the row, else the launcher uses the flat kernel), so its x chunk (gate_up) or its
# (expert, chunk) slot, routing weight and act values (down) are loaded once per kernel, not
# per item; b is chosen so the items spread evenly over the SMs (no second partial wave).
# Index math stays 32-bit; scale bytes are decoded only when used (not at prefetch).


def _make_pipe(fmt: str, dec: str, GR: int, GJ: int, DR: int, DJ: int, RAW: bool = False):
    """(gate_up, down) of the pipelined family; dec is the flat decode name ("tab", ...); RAW
    as _make_flat's."""
    CW = CHUNK[fmt]
    act_store = _act_store(RAW)
    decode, shift, tab_scale = _FLAT_DEC[(fmt, dec)]
    XS = float32(2.0 ** 64) if shift else float32(1.0)
    POST = float32(2.0 ** (shift - 64)) if shift else float32(1.0)
    TS = float32(tab_scale)
    USE_TAB = dec in ("tab", "mix")
    NVF = fmt == "nvfp4"
    FP8 = fmt == "fp8"
    NG = 2 * GR
    PG, PD = 2 * MAX_WARPS * NG, 2 * MAX_WARPS * DR     # double-buffered partial sums
    WG, WD = GJ * NG, DJ * DR
    XG, XD = GJ * CW, DJ * CW
    for n in (NG, DR):
        if n & (n - 1) or n > WARP:
            raise ValueError(f"rows per block must be a power of two up to 16; got {n}")

    @cuda.jit(device=True, inline=True)
    def fill_tab(tab):
        if USE_TAB:
            e2 = cuda.const.array_like(E2M1_TABLE)
            if cuda.threadIdx.x < 16:
                tab[cuda.threadIdx.x] = e2[cuda.threadIdx.x] * TS
        cuda.syncthreads()

    reduce_g = _make_reduce(NG)
    reduce_d = _make_reduce(DR)

    @cuda.jit(device=True, inline=True)
    def dot(v, xv, base):
        d = float32(0.0)
        for t in range(CW):
            d += v[t] * xv[base + t]
        return d

    @cuda.jit(device=True, inline=True)
    def cscale(raw):
        if NVF:
            return _e4m3(raw)
        return float32(1.0)

    @cuda.jit(device=True, inline=True)
    def load_gu(bank64, bank8, lay, slots, it, nrg, I, nch, wq, sb):
        k = it // nrg
        r0 = (it - k * nrg) * GR
        slot = slots[k]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        gq = lay[0] // 8
        uq = lay[2] // 8
        for u in range(GJ):
            j = min(tid + u * nt, nch - 1)
            for q in range(GR):
                r = min(r0 + q, I - 1)
                wq[u * NG + 2 * q] = bank64[slot, gq + r * nch + j]
                wq[u * NG + 2 * q + 1] = bank64[slot, uq + r * nch + j]
                if NVF:                               # raw bytes: decoded when used
                    sb[u * NG + 2 * q] = uint32(bank8[slot, lay[1] + r * nch + j])
                    sb[u * NG + 2 * q + 1] = uint32(bank8[slot, lay[3] + r * nch + j])

    @pdl_kernel
    @cuda.jit
    def gate_up(bank64, bank8, bankf, lay, slots, x, act):
        """x float32 [H] -> act float32 [K, I]; grid (blocks,), threads * GJ >= Hs / CW."""
        pdl_wait()
        pdl_trigger()
        tab = cuda.shared.array(16, float32)
        red = cuda.shared.array(RED, float32)
        part = cuda.shared.array(PG, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        K = slots.shape[0]
        H = int32(lay[6])
        I = int32(lay[7])
        nch = int32(lay[8] // CW)
        nrg = (I + int32(GR - 1)) // int32(GR)
        items = nrg * int32(K)
        fill_tab(tab)
        xv = cuda.local.array(XG, float32)           # this thread's x chunks, for every item
        for u in range(GJ):
            j = tid + u * nt
            for t in range(CW):
                e = j * CW + t
                xv[u * CW + t] = x[min(e, H - 1)] * (XS if e < H else float32(0.0))
        acc = cuda.local.array(NG, float32)
        wq = cuda.local.array(WG, uint64)            # in flight: the next item
        sb = cuda.local.array(WG, uint32)
        wc = cuda.local.array(WG, uint64)            # being decoded: this item
        sc = cuda.local.array(WG, uint32)
        v = cuda.local.array(CW, float32)
        it = int32(cuda.blockIdx.x)
        step = int32(cuda.gridDim.x)
        load_gu(bank64, bank8, lay, slots, min(it, items - 1), nrg, I, nch, wq, sb)
        buf = 0
        while it < items:                             # uniform over the block
            for q in range(WG):
                wc[q] = wq[q]
                sc[q] = sb[q]
            nx = it + step
            if nx < items:
                load_gu(bank64, bank8, lay, slots, nx, nrg, I, nch, wq, sb)
            for q in range(NG):
                acc[q] = float32(0.0)
            for u in range(GJ):
                if tid + u * nt < nch:
                    for q in range(NG):
                        decode(wc[u * NG + q], tab, v)
                        acc[q] += cscale(sc[u * NG + q]) * dot(v, xv, u * CW)
            reduce_g(acc, red, part[buf * MAX_WARPS * NG:])
            k = it // nrg
            r = (it - k * nrg) * GR + tid
            if tid < GR and r < I:
                slot = slots[k]
                g = float32(0.0)
                uu = float32(0.0)
                for w in range(nt // WARP):
                    g += part[buf * MAX_WARPS * NG + w * NG + 2 * tid]
                    uu += part[buf * MAX_WARPS * NG + w * NG + 2 * tid + 1]
                g *= POST * bankf[slot, 0] * (_rs_fp8(bankf, slot, lay[1], r) if FP8 else
                                               float32(1.0))
                uu *= POST * bankf[slot, 1] * (_rs_fp8(bankf, slot, lay[3], r) if FP8 else
                                                float32(1.0))
                act_store(act, k, r, g, uu)
            buf = 1 - buf
            it = nx

    @cuda.jit(device=True, inline=True)
    def load_dn(bank64, bank8, bankf, lay, r0, H, nch, sl, jj, wq, sb, rq):
        dq = lay[4] // 8
        for u in range(DJ):
            slot = sl[u]
            j = jj[u]
            for q in range(DR):
                r = min(r0 + q, H - 1)
                wq[u * DR + q] = bank64[slot, dq + r * nch + j]
                if NVF:
                    sb[u * DR + q] = uint32(bank8[slot, lay[5] + r * nch + j])
                if FP8:
                    rq[u * DR + q] = _rs_fp8(bankf, slot, lay[5], r)

    @pdl_kernel
    @cuda.jit
    def down(bank64, bank8, bankf, lay, slots, weights, act, out, accumulate):
        """act float32 [K, I] -> out float32 [H] (+= when accumulate); grid (blocks,),
        threads * DJ >= K * Is / CW."""
        pdl_wait()
        pdl_trigger()
        tab = cuda.shared.array(16, float32)
        red = cuda.shared.array(RED, float32)
        part = cuda.shared.array(PD, float32)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        K = int32(slots.shape[0])
        H = int32(lay[6])
        I = int32(lay[7])
        nch = int32(lay[9] // CW)
        total = K * nch
        items = (H + int32(DR - 1)) // int32(DR)
        fill_tab(tab)
        sl = cuda.local.array(DJ, int32)              # this thread's (slot, chunk, weight, act)
        jj = cuda.local.array(DJ, int32)
        kw = cuda.local.array(DJ, float32)
        av = cuda.local.array(XD, float32)
        for u in range(DJ):
            c0 = tid + u * nt
            c = min(c0, total - 1)
            k2 = c // nch
            j = c - k2 * nch
            slot = slots[k2]
            sl[u] = slot
            jj[u] = j
            kw[u] = weights[k2] * bankf[slot, 2] * (POST if c0 < total else float32(0.0))
            for t in range(CW):
                i = j * CW + t
                av[u * CW + t] = act[k2, min(i, I - 1)] * (XS if i < I else float32(0.0))
        acc = cuda.local.array(DR, float32)
        wq = cuda.local.array(WD, uint64)
        sb = cuda.local.array(WD, uint32)
        rq = cuda.local.array(WD, float32)
        wc = cuda.local.array(WD, uint64)
        sc = cuda.local.array(WD, uint32)
        rc = cuda.local.array(WD, float32)
        v = cuda.local.array(CW, float32)
        it = int32(cuda.blockIdx.x)
        step = int32(cuda.gridDim.x)
        load_dn(bank64, bank8, bankf, lay, min(it, items - 1) * DR, H, nch, sl, jj, wq, sb, rq)
        buf = 0
        while it < items:
            for q in range(WD):
                wc[q] = wq[q]
                sc[q] = sb[q]
                rc[q] = rq[q]
            nx = it + step
            if nx < items:
                load_dn(bank64, bank8, bankf, lay, nx * DR, H, nch, sl, jj, wq, sb, rq)
            for q in range(DR):
                acc[q] = float32(0.0)
            for u in range(DJ):
                for q in range(DR):
                    decode(wc[u * DR + q], tab, v)
                    s = kw[u] * cscale(sc[u * DR + q])
                    if FP8:
                        s *= rc[u * DR + q]
                    acc[q] += s * dot(v, av, u * CW)
            reduce_d(acc, red, part[buf * MAX_WARPS * DR:])
            r = it * DR + tid
            if tid < DR and r < H:
                o = float32(0.0)
                for w in range(nt // WARP):
                    o += part[buf * MAX_WARPS * DR + w * DR + tid]
                out[r] = o + (out[r] if accumulate else float32(0.0))
            buf = 1 - buf
            it = nx

    return gate_up, down


# ---- decode kernels, "q" family (qpair / qbpair / qtab / qarith): NVFP4, fewer instructions ------
#
# Why (SASS of ptab-g8j1-d4j2 on sm_90): its item loop issues ~8.8 instructions a weight: ~4.5 to
# decode a nibble through the 16-entry table (shift, mask, address, LDS), 1 FFMA, and the rest
# 64-bit index math, lay[] re-read from global every item (the act store may alias it), the
# register double buffer copied every item, a bounds branch a chunk. gate_up is bound by that
# issue rate, not by bytes. The q kernels keep the pipelined persistent structure (same GR GJ
# DR DJ meaning) and cut the rest:
#   decode "pair": one LDS.64 a byte from a 256-entry table of float32 pairs (low, high nibble),
#     replicated per lane of a half-warp ([256, 16], 32 KB), so whatever the bytes a half-warp
#     reads 16 distinct bank pairs. Per byte (2 weights), ptxas emits PRMT (byte) + SHL + OR
#     (lane) + IMAD (address) + LDS.64 + 2 FFMA; shared bandwidth is 4 B a weight (32
#     weights/clk/SM).
#   decode "bpair": the same pairs as packed bf16 (exact for E2M1) in a uint32 [256, 32]: half
#     the shared bytes, two more ALU ops a byte.
# Measured with ptxas -arch=sm_90 (instructions a weight in the steady-state loop): gate_up
# ptab-g8j1 8.8 -> qpair-g8j1 6.9; down ptab-d4j2 8.4 -> qpair-d4j2 6.5.
#   decode "tab" / "arith": the p-family nibble decoders on this skeleton (for comparison).
# Skeleton: lay read once into int32 registers; 32-bit index math; the loop unrolled twice
# over two register buffers (no copies); the routing weight folded into act (down) once per
# kernel; no per-chunk bounds branch (chunks past the row read a clamped chunk times x = 0).

_I15, _I31 = np.uint32(15), np.uint32(31)


@cuda.jit(device=True, inline=True)
def _lo_f(p):
    return int_as_float(uint32(p & M32))


@cuda.jit(device=True, inline=True)
def _hi_f(p):
    return int_as_float(uint32(p >> 32))


if SIM:
    def _byte(w, sel):
        """Byte sel & 3 of uint32 w, zero-extended (PRMT on the GPU)."""
        return np.uint32((int(w) >> (8 * (sel & 3))) & 0xFF)
else:
    from numba.cuda import libdevice as _ld

    @cuda.jit(device=True, inline=True)
    def _byte(w, sel):
        """Byte of uint32 w picked by the PRMT selector sel (0x4440 + byte: the other three
        result bytes come from the zero operand): one instruction."""
        return uint32(_ld.byte_perm(int32(w), int32(0), int32(sel)))


@cuda.jit(device=True, inline=True)
def _pair_at(tab, b, ln, v, o):
    """v[o], v[o + 1] = the E2M1 pair of byte b: one LDS.64 of tab[b, ln] (ln = lane % 16:
    a half-warp reads 16 distinct bank pairs whatever the bytes)."""
    p = tab[b, ln]
    v[o] = int_as_float(uint32(p & M32))
    v[o + 1] = int_as_float(uint32(p >> 32))


@cuda.jit(device=True, inline=True)
def _pair_word(w, tab, ln, v, o):
    """8 nibbles of uint32 w -> v[o:o+8] by 4 lookups in the uint64 [256, 16] pair table."""
    _pair_at(tab, w & _F255, ln, v, o)
    _pair_at(tab, _byte(w, 0x4441), ln, v, o + 2)
    _pair_at(tab, _byte(w, 0x4442), ln, v, o + 4)
    _pair_at(tab, w >> _S24, ln, v, o + 6)


@cuda.jit(device=True, inline=True)
def _bpair_at(tab, b, ln, v, o):
    p = tab[b, ln]
    v[o] = int_as_float(p << _S16)
    v[o + 1] = int_as_float(p & _XFFFF0000)


@cuda.jit(device=True, inline=True)
def _bpair_word(w, tab, ln, v, o):
    """8 nibbles of uint32 w -> v[o:o+8] by 4 lookups in the uint32 [256, 32] table of bf16
    pairs (low nibble in the low half; ln = lane)."""
    _bpair_at(tab, w & _F255, ln, v, o)
    _bpair_at(tab, _byte(w, 0x4441), ln, v, o + 2)
    _bpair_at(tab, _byte(w, 0x4442), ln, v, o + 4)
    _bpair_at(tab, w >> _S24, ln, v, o + 6)


@cuda.jit(device=True, inline=True)
def _tab_word(w, tab, ln, v, o):
    _e2m1_word_tab(w, tab, v, o)


@cuda.jit(device=True, inline=True)
def _arith_word(w, tab, ln, v, o):
    _e2m1_word_s(w, v, o)


@cuda.jit(device=True, inline=True)
def _fill_pair(tab):
    e2 = cuda.const.array_like(E2M1_TABLE)
    for i in range(cuda.threadIdx.x, 4096, cuda.blockDim.x):
        b = i >> 4
        tab[b, i & 15] = (uint64(float_as_uint(e2[b >> 4])) << uint64(32)) | \
            uint64(float_as_uint(e2[b & 15]))


@cuda.jit(device=True, inline=True)
def _fill_bpair(tab):
    e2 = cuda.const.array_like(E2M1_TABLE)
    for i in range(cuda.threadIdx.x, 8192, cuda.blockDim.x):
        b = i >> 5
        tab[b, i & 31] = (float_as_uint(e2[b >> 4]) & _XFFFF0000) | \
            (float_as_uint(e2[b & 15]) >> _S16)


@cuda.jit(device=True, inline=True)
def _fill_tab16(tab):
    e2 = cuda.const.array_like(E2M1_TABLE)
    if cuda.threadIdx.x < 16:
        tab[cuda.threadIdx.x] = e2[cuda.threadIdx.x]


@cuda.jit(device=True, inline=True)
def _fill_none(tab):
    pass


# decode -> (word decoder, table shape, table dtype, table fill, lane mask, 2^k the decoded
# values are scaled down by)
_Q_DEC = {
    "pair": (_pair_word, (256, 16), uint64, _fill_pair, _I15, 0),
    "bpair": (_bpair_word, (256, 32), uint32, _fill_bpair, _I31, 0),
    "tab": (_tab_word, 16, float32, _fill_tab16, _I15, 0),
    "arith": (_arith_word, 16, float32, _fill_none, _I15, 126),
}


def _make_q(fmt: str, dec: str, GR: int, GJ: int, DR: int, DJ: int, RAW: bool = False):
    """(gate_up, down) of the q family (NVFP4 only); same launch contract as _make_pipe."""
    act_store = _act_store(RAW)
    if fmt != "nvfp4":
        raise ValueError(f"q expert kernels are NVFP4 only, not {fmt}")
    CW = 16
    word, TN, TT_, fill, LM, shift = _Q_DEC[dec]
    XS = float32(2.0 ** 64) if shift else float32(1.0)
    POST = float32(2.0 ** (shift - 64)) if shift else float32(1.0)
    NG = 2 * GR
    PG, PD = MAX_WARPS * NG, MAX_WARPS * DR      # one partial-sum buffer; two of them:
    PG2, PD2 = 2 * PG, 2 * PD                    # (sizes must be plain closure constants)
    WG, WD = GJ * NG, DJ * DR
    XG, XD = GJ * CW, DJ * CW
    for n in (NG, DR):
        if n & (n - 1) or n > WARP:
            raise ValueError(f"rows per block must be a power of two up to 16; got {n}")
    reduce_g = _make_reduce(NG)
    reduce_d = _make_reduce(DR)

    @cuda.jit(device=True, inline=True)
    def chunk_dot(w, tab, ln, v, xv, base):
        """16 weights of uint64 w dotted with xv[base:base+16]."""
        word(uint32(w & M32), tab, ln, v, 0)
        word(uint32(w >> 32), tab, ln, v, 8)
        d = float32(0.0)
        for t in range(CW):
            d += v[t] * xv[base + t]
        return d

    @cuda.jit(device=True, inline=True)
    def load_gu(bank64, bank8, slots, it, nrg, I, nch, gq, gs, uq, us, wq, sb):
        k = it // nrg
        r0 = (it - k * nrg) * int32(GR)
        slot = uint32(slots[k])                 # unsigned indices: no wraparound code
        tid = int32(cuda.threadIdx.x)
        nt = int32(cuda.blockDim.x)
        for u in range(GJ):
            j = min(tid + int32(u) * nt, nch - int32(1))
            for q in range(GR):
                o = int32(min(r0 + int32(q), I - int32(1)) * nch + j)
                wq[u * NG + 2 * q] = bank64[slot, uint32(gq + o)]
                wq[u * NG + 2 * q + 1] = bank64[slot, uint32(uq + o)]
                sb[u * NG + 2 * q] = uint32(bank8[slot, uint32(gs + o)])
                sb[u * NG + 2 * q + 1] = uint32(bank8[slot, uint32(us + o)])

    @cuda.jit(device=True, inline=True)
    def item_gu(bank64, bank8, bankf, slots, act, tab, ln, xv, v, acc, red, part, pb, it, nx,
                items, nrg, I, nch, gq, gs, uq, us, wc, sc, wn, sn):
        """Issue item nx's loads into (wn, sn), then reduce item it from (wc, sc)."""
        if nx < items:
            load_gu(bank64, bank8, slots, nx, nrg, I, nch, gq, gs, uq, us, wn, sn)
        for q in range(NG):
            acc[q] = float32(0.0)
        for u in range(GJ):
            for q in range(NG):
                acc[q] += _e4m3(sc[u * NG + q]) * chunk_dot(wc[u * NG + q], tab, ln, v, xv,
                                                            u * CW)
        reduce_g(acc, red, part[pb:])
        tid = int32(cuda.threadIdx.x)
        k = it // nrg
        r = (it - k * nrg) * int32(GR) + tid
        if tid < GR and r < I:
            slot = slots[k]
            g = float32(0.0)
            uu = float32(0.0)
            for w in range(int32(cuda.blockDim.x) // int32(WARP)):
                g += part[pb + w * NG + 2 * tid]
                uu += part[pb + w * NG + 2 * tid + 1]
            act_store(act, k, r, g * POST * bankf[slot, 0], uu * POST * bankf[slot, 1])

    @pdl_kernel
    @cuda.jit
    def gate_up(bank64, bank8, bankf, lay, slots, x, act):
        """x float32 [H] -> act float32 [K, I]; grid (blocks,), threads * GJ >= Hs / 16."""
        pdl_wait()
        pdl_trigger()
        tab = cuda.shared.array(TN, TT_)
        red = cuda.shared.array(RED, float32)
        part = cuda.shared.array(PG2, float32)
        tid = int32(cuda.threadIdx.x)
        nt = int32(cuda.blockDim.x)
        K = int32(slots.shape[0])
        H = int32(lay[6])
        I = int32(lay[7])
        nch = int32(lay[8]) >> 4
        gq = int32(lay[0]) >> 3
        gs = int32(lay[1])
        uq = int32(lay[2]) >> 3
        us = int32(lay[3])
        nrg = (I + int32(GR - 1)) // int32(GR)
        items = nrg * K
        fill(tab)
        cuda.syncthreads()
        ln = uint32(tid) & LM
        xv = cuda.local.array(XG, float32)           # this thread's x chunks, for every item
        for u in range(GJ):
            for t in range(CW):
                e = (tid + int32(u) * nt) * int32(CW) + int32(t)
                xv[u * CW + t] = x[min(e, H - int32(1))] * (XS if e < H else float32(0.0))
        acc = cuda.local.array(NG, float32)
        v = cuda.local.array(CW, float32)
        wa = cuda.local.array(WG, uint64)            # two register buffers, used in turn
        sa = cuda.local.array(WG, uint32)
        wb = cuda.local.array(WG, uint64)
        sb = cuda.local.array(WG, uint32)
        it = int32(cuda.blockIdx.x)
        step = int32(cuda.gridDim.x)
        load_gu(bank64, bank8, slots, min(it, items - int32(1)), nrg, I, nch, gq, gs, uq, us,
                wa, sa)
        while it < items:                             # uniform over the block
            nx = it + step
            item_gu(bank64, bank8, bankf, slots, act, tab, ln, xv, v, acc, red, part, 0, it,
                    nx, items, nrg, I, nch, gq, gs, uq, us, wa, sa, wb, sb)
            it = nx
            if it >= items:
                break
            nx = it + step
            item_gu(bank64, bank8, bankf, slots, act, tab, ln, xv, v, acc, red, part, PG, it,
                    nx, items, nrg, I, nch, gq, gs, uq, us, wb, sb, wa, sa)
            it = nx

    @cuda.jit(device=True, inline=True)
    def load_dn(bank64, bank8, r0, H, nch, dq, ds, sl, jj, wq, sb):
        for u in range(DJ):
            slot = uint32(sl[u])
            for q in range(DR):
                o = int32(min(r0 + int32(q), H - int32(1)) * nch + jj[u])
                wq[u * DR + q] = bank64[slot, uint32(dq + o)]
                sb[u * DR + q] = uint32(bank8[slot, uint32(ds + o)])

    @cuda.jit(device=True, inline=True)
    def item_dn(bank64, bank8, out, accumulate, tab, ln, av, v, acc, red, part, pb, it, nx,
                items, H, nch, dq, ds, sl, jj, wc, sc, wn, sn):
        if nx < items:
            load_dn(bank64, bank8, nx * int32(DR), H, nch, dq, ds, sl, jj, wn, sn)
        for q in range(DR):
            acc[q] = float32(0.0)
        for u in range(DJ):
            for q in range(DR):
                acc[q] += _e4m3(sc[u * DR + q]) * chunk_dot(wc[u * DR + q], tab, ln, v, av,
                                                            u * CW)
        reduce_d(acc, red, part[pb:])
        tid = int32(cuda.threadIdx.x)
        r = it * int32(DR) + tid
        if tid < DR and r < H:
            o = float32(0.0)
            for w in range(int32(cuda.blockDim.x) // int32(WARP)):
                o += part[pb + w * DR + tid]
            out[r] = o * POST + (out[r] if accumulate else float32(0.0))

    @pdl_kernel
    @cuda.jit
    def down(bank64, bank8, bankf, lay, slots, weights, act, out, accumulate):
        """act float32 [K, I] -> out float32 [H] (+= when accumulate); grid (blocks,),
        threads * DJ >= K * Is / 16."""
        pdl_wait()
        pdl_trigger()
        tab = cuda.shared.array(TN, TT_)
        red = cuda.shared.array(RED, float32)
        part = cuda.shared.array(PD2, float32)
        tid = int32(cuda.threadIdx.x)
        nt = int32(cuda.blockDim.x)
        K = int32(slots.shape[0])
        H = int32(lay[6])
        I = int32(lay[7])
        nch = int32(lay[9]) >> 4
        dq = int32(lay[4]) >> 3
        ds = int32(lay[5])
        total = K * nch
        items = (H + int32(DR - 1)) // int32(DR)
        fill(tab)
        cuda.syncthreads()
        ln = uint32(tid) & LM
        sl = cuda.local.array(DJ, int32)              # this thread's (slot, chunk) and act values
        jj = cuda.local.array(DJ, int32)              # times its expert's routing weight
        av = cuda.local.array(XD, float32)
        for u in range(DJ):
            c0 = tid + int32(u) * nt
            c = min(c0, total - int32(1))
            k2 = c // nch
            j = c - k2 * nch
            slot = slots[k2]
            sl[u] = slot
            jj[u] = j
            kw = weights[k2] * bankf[slot, 2] * (XS if c0 < total else float32(0.0))
            for t in range(CW):
                i = j * int32(CW) + int32(t)
                av[u * CW + t] = act[k2, min(i, I - int32(1))] * (kw if i < I else float32(0.0))
        acc = cuda.local.array(DR, float32)
        v = cuda.local.array(CW, float32)
        wa = cuda.local.array(WD, uint64)
        sa = cuda.local.array(WD, uint32)
        wb = cuda.local.array(WD, uint64)
        sb = cuda.local.array(WD, uint32)
        it = int32(cuda.blockIdx.x)
        step = int32(cuda.gridDim.x)
        load_dn(bank64, bank8, min(it, items - int32(1)) * int32(DR), H, nch, dq, ds, sl, jj,
                wa, sa)
        while it < items:
            nx = it + step
            item_dn(bank64, bank8, out, accumulate, tab, ln, av, v, acc, red, part, 0, it, nx,
                    items, H, nch, dq, ds, sl, jj, wa, sa, wb, sb)
            it = nx
            if it >= items:
                break
            nx = it + step
            item_dn(bank64, bank8, out, accumulate, tab, ln, av, v, acc, red, part, PD, it, nx,
                    items, H, nch, dq, ds, sl, jj, wb, sb, wa, sa)
            it = nx

    return gate_up, down


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


# ---- gpt-oss: biased experts with a clamped SwiGLU -------------------------------------------
# gate_up runs with RAW stores (_act_raw: gate and up sums in the two halves of act [2A, I]);
# clamped_swiglu adds the biases and applies the activation in place; down runs as for any
# family on act[:A]; expert_bias_add adds the routing-weighted down biases. The biases of a
# layer are one float32 [E, 2I + H] array (gate | up | down), rows by expert id.

@pdl_kernel
@cuda.jit
def _clamped_swiglu(act, eid, bias, lo, alpha, limit):
    """grid (cdiv(I, THREADS), rows); row a = lo + blockIdx.y."""
    pdl_wait()
    pdl_trigger()
    A = act.shape[0] >> 1
    I = act.shape[1]
    a = lo + cuda.blockIdx.y
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r < I:
        e = eid[a]
        g = min(act[a, r] + bias[e, r], limit)
        u = min(max(act[A + a, r] + bias[e, I + r], -limit), limit)
        act[a, r] = (u + float32(1.0)) * g / (float32(1.0) + math.exp(-alpha * g))


@pdl_kernel
@cuda.jit
def _expert_bias_add(out, ids, weights, bias):
    """grid (cdiv(H, THREADS), T)."""
    pdl_wait()
    pdl_trigger()
    t = cuda.blockIdx.y
    h = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    H = out.shape[1]
    if h < H:
        o = bias.shape[1] - H
        s = float32(0.0)
        for k in range(ids.shape[1]):
            s += weights[t, k] * bias[ids[t, k], o + h]
        out[t, h] += s


def clamped_swiglu(act, eid, bias, alpha, limit, stream, lo=0, hi=None):
    """act float32 [2A, I] (rows < A: gate sums, A + a: up sums, as RAW gate_up stores them) ->
    act[a] = (u + 1) * g * sigmoid(alpha g) for rows lo <= a < hi (default all), g = min(gate
    + gate_b, limit), u = clip(up + up_b, +-limit), the biases of expert eid[a] (eid int32
    [A], bias float32 [E, 2I + H]): gpt-oss's activation, reference.gpt_oss_expert's."""
    a2, i = act.shape
    hi = a2 // 2 if hi is None else hi
    if a2 % 2 or bias.shape[1] <= 2 * i:
        raise ValueError(f"clamped_swiglu: act {act.shape} must hold 2A rows and bias "
                         f"{bias.shape} 2I + H columns")
    if hi > lo:
        _clamped_swiglu[(cdiv(i, THREADS), hi - lo), THREADS, stream](
            act, eid, bias, int32(lo), float32(alpha), float32(limit))


@pdl_kernel
@cuda.jit
def _limited_swiglu(act, lo, limit, after, alpha):
    """grid (cdiv(I, THREADS), rows); row a = lo + blockIdx.y."""
    pdl_wait()
    pdl_trigger()
    A = act.shape[0] >> 1
    I = act.shape[1]
    a = lo + cuda.blockIdx.y
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r < I:
        g = act[a, r]
        u = min(max(act[A + a, r], -limit), limit)
        if alpha > float32(0.0):
            g = min(g, limit)
            act[a, r] = (u + float32(1.0)) * g / (float32(1.0) + math.exp(-alpha * g))
        elif after:
            act[a, r] = min(g / (float32(1.0) + math.exp(-g)), limit) * u
        else:
            g = min(g, limit)
            act[a, r] = g / (float32(1.0) + math.exp(-g)) * u


def limited_swiglu(act, limit, stream, lo=0, hi=None, after=False, alpha=0.0):
    """act float32 [2A, I] (RAW gate and up sums) -> act[a] for rows lo <= a < hi (default
    all): SwiGLU with up clipped to +-limit and the gate clamped from above at limit, before
    the SiLU (DeepSeek-V4) or after it (after: Step-3.5); alpha > 0: gpt-oss's form without
    biases, (u + 1) * g * sigmoid(alpha g) (MiniMax-M3); reference.limited_expert's."""
    a2, i = act.shape
    hi = a2 // 2 if hi is None else hi
    if a2 % 2:
        raise ValueError(f"limited_swiglu: act {act.shape} must hold 2A rows")
    if hi > lo:
        _limited_swiglu[(cdiv(i, THREADS), hi - lo), THREADS, stream](
            act, int32(lo), float32(limit), bool(after), float32(alpha))


@pdl_kernel
@cuda.jit
def _scaled_swiglu(act, scale, lo):
    """grid (cdiv(I, THREADS), rows); row a = lo + blockIdx.y."""
    pdl_wait()
    pdl_trigger()
    A = act.shape[0] >> 1
    I = act.shape[1]
    a = lo + cuda.blockIdx.y
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r < I:
        s = scale[a]
        g = act[a, r] * s
        act[a, r] = g / (float32(1.0) + math.exp(-g)) * (act[A + a, r] * s)


def scaled_swiglu(act, scale, stream, lo=0, hi=None):
    """act float32 [2A, I] (RAW gate and up sums) -> act[a] = silu(s g) * (s u), s = scale[a]
    (float32 [A]), for rows lo <= a < hi (default all): the SwiGLU of the input times s, as
    Llama 4's routing weights scale its experts' inputs (the sums are linear in it)."""
    a2, i = act.shape
    hi = a2 // 2 if hi is None else hi
    if a2 % 2 or scale.shape[0] < hi:
        raise ValueError(f"scaled_swiglu: act {act.shape} must hold 2A rows, scale {scale.shape} a row's")
    if hi > lo:
        _scaled_swiglu[(cdiv(i, THREADS), hi - lo), THREADS, stream](act, scale, int32(lo))


@pdl_kernel
@cuda.jit
def _relu2_up(act, lo):
    """grid (cdiv(I, THREADS), rows); row a = lo + blockIdx.y."""
    pdl_wait()
    pdl_trigger()
    A = act.shape[0] >> 1
    I = act.shape[1]
    a = lo + cuda.blockIdx.y
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r < I:
        u = max(act[A + a, r], float32(0.0))
        act[a, r] = u * u


def relu2_up(act, stream, lo=0, hi=None):
    """act float32 [2A, I] (RAW sums of an ungated layout: kernel_layout's, the up sums in rows
    A + a) -> act[a] = relu(up)^2 for rows lo <= a < hi (default all): Nemotron-H's activation
    (reference.relu2_expert's)."""
    a2, i = act.shape
    hi = a2 // 2 if hi is None else hi
    if a2 % 2:
        raise ValueError(f"relu2_up: act {act.shape} must hold 2A rows")
    if hi > lo:
        _relu2_up[(cdiv(i, THREADS), hi - lo), THREADS, stream](act, int32(lo))


def kernel_layout(layout) -> np.ndarray:
    """The int64 [10] layout the kernels read (ExpertLayout.as_array()); an ungated layout's
    gate sections are its up sections, so the RAW gate_up kernels give the up sums in both
    halves of act (relu2_up reads the up half; an NVFP4 block's gate global scale, which
    such a block does not use, scales only the other)."""
    a = layout.as_array()
    if not layout.gated:
        a[0:2] = a[2:4]
    return a


def expert_bias_add(out, ids, weights, bias, stream):
    """out float32 [T, H] += sum_k weights[t, k] * down_b of expert ids[t, k] (bias float32
    [E, 2I + H], the last H columns); ids int32, weights float32 [T, K]."""
    t, h = out.shape
    _expert_bias_add[(cdiv(h, THREADS), t), THREADS, stream](out, ids, weights, bias)


# ---- prefill, "tiled" grouped kernels: one dequantized weight tile serves BT tokens --------------
#
# A block owns GT_BR weight rows x GT_BT assignments of ONE group (expert). The inner dimension
# (Hs for gate_up, Is for down) goes in steps of GT_BK columns: the GT_BR x GT_BK weight chunk
# is decoded once into shared memory as float32 (chunk scale applied; global and row scales
# wait for the epilogue), the GT_BT x GT_BK activations are gathered next to it, and each of
# the GT_TX x GT_TY threads accumulates GT_RW rows x GT_TW tokens in registers (rows
# tx + GT_TX * i, tokens ty + GT_TY * j: a warp reads 16 consecutive weights and 2 broadcast
# activations per step, no bank conflicts). The next step's 8-byte weight loads, scale bytes
# and activations are issued before the current step's FMAs (register prefetch).
#     gate_up: tile rows 0..BR/2-1 are gate rows r0.., BR/2..BR-1 the same up rows, so the
#              epilogue writes act[a, r] = silu(g) * u (no routing weight, as legacy);
#              grid (token-tile slots, cdiv(I, BR/2))
#     down:    tile rows are down rows r0..; y[a, r] = wts[a] * gd * row scale * sum;
#              grid (token-tile slots, cdiv(H, BR))
# Token-tile slots: group g owns slots ts(g) .. ts(g+1)-1, ts(g) = (gstart[g] - gstart[0]) // BT
# + g, which is at least cdiv(tokens of g, BT) of them (floor(a + b) - floor(a) >= floor(b)), so
# grid.x = A // BT + G covers any routing with at most one idle slot a group; a block finds its
# group by binary search over gstart and leaves at once when its slot is idle.

GT_TX = 4 if SIM else 16                     # threads along weight rows
GT_TY = 4 if SIM else 16                     # threads along tokens
GT_RW = 2 if SIM else 8                      # weight rows a thread (gate_up: half gate, half up)
GT_TW = 2 if SIM else 4                      # tokens a thread
GT_BK = 16 if SIM else 32                    # inner columns a step, a multiple of every CHUNK
GT_KU = 4                                    # of those, columns an unrolled inner iteration
GT_THREADS = GT_TX * GT_TY
GT_MIN_BLOCKS = 2                            # launch bounds: registers capped for 2 blocks an SM
GT_BR = GT_TX * GT_RW                        # weight rows a tile (gate_up: GT_BR / 2 act rows)
GT_BT = GT_TY * GT_TW                        # tokens a tile
GT_BRP = GT_BR + 1                           # shared row strides, padded: the decode's stores
GT_BTP = GT_BT + 1                           # and the gather's stores hit distinct banks
GT_WS = GT_BK * GT_BRP                       # shared floats of the weight tile [BK, BR + 1]
GT_XS = GT_BK * GT_BTP                       # shared floats of the activations [BK, BT + 1]
GT_XQ = GT_BT * GT_BK // GT_THREADS          # activations a thread stages a step
GT_ACC = GT_RW * GT_TW                       # accumulators a thread
GT_SHARED = 4 * (GT_WS + GT_XS + GT_BT)      # static shared bytes a block (25,088 on the GPU)
assert GT_BK % 16 == 0 and GT_KU == 4 and GT_RW % 2 == 0 and GT_XQ * GT_THREADS == GT_BT * GT_BK
assert GT_SHARED <= SHARED_LIMIT
GROUPED_VARIANT = "tiled"                    # grouped_gate_up_down's kernels: "tiled" or "legacy"


@cuda.jit(device=True, inline=True)
def _sb_nvfp4(bank8, slot, soff, r, nch, j):
    return uint32(bank8[slot, soff + r * nch + j])


@cuda.jit(device=True, inline=True)
def _sb_none(bank8, slot, soff, r, nch, j):
    return uint32(0)


@cuda.jit(device=True, inline=True)
def _sv_e4m3(b):
    return _e4m3(b)


@cuda.jit(device=True, inline=True)
def _sv_one(b):
    return float32(1.0)


# format -> (decode of an 8-byte chunk, its scale byte, that byte's value, the row scale)
_TILED_PARTS = {
    "nvfp4": (_dec_nvfp4_arith, _sb_nvfp4, _sv_e4m3, _rs_one),
    "fp8": (_dec_fp8, _sb_none, _sv_one, _rs_fp8),
    "bf16": (_dec_bf16, _sb_none, _sv_one, _rs_one),
}


@cuda.jit(device=True, inline=True)
def _tile_of(gstart, G, j):
    """Token-tile slot j -> (group, first assignment, end); first >= end for an idle slot."""
    base = gstart[0]
    lo = 0
    hi = G
    while hi - lo > 1:                        # the last g with ts(g) <= j (ts(0) = 0)
        mid = (lo + hi) // 2
        if (gstart[mid] - base) // GT_BT + mid <= j:
            lo = mid
        else:
            hi = mid
    t = j - ((gstart[lo] - base) // GT_BT + lo)
    a_lo = gstart[lo] + t * GT_BT
    return lo, a_lo, min(a_lo + GT_BT, gstart[lo + 1])


def _make_tiled(fmt: str, RAW: bool = False):
    """(grouped gate_up, grouped down) of the tiled family for one format; RAW as _make_flat's
    (act [2A, I])."""
    CW = CHUNK[fmt]
    act_store = _act_store(RAW)
    CPR = GT_BK // CW                         # chunks of a tile row a step
    CHUNKS = GT_BR * CPR
    NQ = cdiv(CHUNKS, GT_THREADS)             # 8-byte weight loads a thread a step
    decode, scale_byte, scale_val, row_scale = _TILED_PARTS[fmt]
    jit = cuda.jit if SIM else cuda.jit(launch_bounds=(GT_THREADS, GT_MIN_BLOCKS))

    @cuda.jit(device=True, inline=True)
    def load_w(bank64, bank8, slot, qa, sa, qb, sb, half, r0, R, nch, k0, wq, sq):
        """The next step's chunks into registers: tile row rr < half is row r0 + rr of section
        (qa, sa), else row r0 + rr - half of section (qb, sb); rows >= R and chunks past the
        row's end load as zeros."""
        tid = cuda.threadIdx.x
        for q in range(NQ):
            e = tid + q * GT_THREADS
            rr = e // CPR
            j = k0 // CW + e - rr * CPR
            qo = qa
            so = sa
            if rr >= half:
                rr -= half
                qo = qb
                so = sb
            r = r0 + rr
            wq[q] = uint64(0)
            sq[q] = uint32(0)
            if e < CHUNKS and r < R and j < nch:
                wq[q] = bank64[slot, qo // 8 + r * nch + j]
                sq[q] = scale_byte(bank8, slot, so, r, nch, j)

    @cuda.jit(device=True, inline=True)
    def store_w(ws, wq, sq, v):
        """Decode the prefetched chunks into ws [BK, BRP] (column-major tile: k, then row)."""
        tid = cuda.threadIdx.x
        for q in range(NQ):
            e = tid + q * GT_THREADS
            if e < CHUNKS:
                rr = e // CPR
                c0 = (e - rr * CPR) * CW
                decode(wq[q], ws, v)
                s = scale_val(sq[q])
                for t in range(CW):
                    ws[(c0 + t) * GT_BRP + rr] = v[t] * s

    @cuda.jit(device=True, inline=True)
    def mma1(ws, xs, wb, xb, acc, wr, xr):
        """acc += one column: weights ws[wb + TX * i], activations xs[xb + TY * j]."""
        for i in range(GT_RW):
            wr[i] = ws[wb + uint64(GT_TX * i)]
        for j in range(GT_TW):
            xr[j] = xs[xb + uint64(GT_TY * j)]
        for i in range(GT_RW):
            for j in range(GT_TW):
                acc[i * GT_TW + j] += wr[i] * xr[j]

    @cuda.jit(device=True, inline=True)
    def mma(ws, xs, acc, wr, xr):
        """acc [RW, TW] += the tile's rows x tokens over one step of BK columns. Unsigned
        indices: numba adds no negative-index wrap-around, so each shared load is one
        instruction with its offset folded in; KU columns an iteration (unrolled)."""
        tid = cuda.threadIdx.x
        wb = uint64(tid % GT_TX)
        xb = uint64(tid // GT_TX)
        for _ in range(GT_BK // GT_KU):            # GT_KU = 4 columns, written out
            mma1(ws, xs, wb, xb, acc, wr, xr)
            mma1(ws, xs, wb + uint64(GT_BRP), xb + uint64(GT_BTP), acc, wr, xr)
            mma1(ws, xs, wb + uint64(2 * GT_BRP), xb + uint64(2 * GT_BTP), acc, wr, xr)
            mma1(ws, xs, wb + uint64(3 * GT_BRP), xb + uint64(3 * GT_BTP), acc, wr, xr)
            wb += uint64(GT_KU * GT_BRP)
            xb += uint64(GT_KU * GT_BTP)

    @jit
    def tiled_gate_up(bank64, bank8, bankf, lay, gslot, gstart, order, x, act):
        """x float32 [T, H] -> act float32 [A, I] = silu(gate @ x[order[a]]) * (up @ x[order[a]]);
        grid (A // BT + G, cdiv(I, BR / 2)), GT_THREADS threads."""
        ws = cuda.shared.array(GT_WS, float32)   # [BK, BR + 1] decoded weights
        xs = cuda.shared.array(GT_XS, float32)   # [BK, BT + 1] gathered x rows
        tok = cuda.shared.array(GT_BT, int32)             # [BT] token of each tile column
        g, a_lo, a_hi = _tile_of(gstart, gslot.shape[0], cuda.blockIdx.x)
        if a_lo >= a_hi:
            return
        tid = cuda.threadIdx.x
        slot = gslot[g]
        H = lay[6]
        I = lay[7]
        Hs = lay[8]
        nch = Hs // CW
        half = GT_BR // 2
        r0 = cuda.blockIdx.y * half
        nt = a_hi - a_lo
        for e in range(tid, GT_BT, GT_THREADS):           # idle columns repeat the last token
            tok[e] = order[a_lo + min(e, nt - 1)]
        v = cuda.local.array(CW, float32)
        wq = cuda.local.array(NQ, uint64)
        sq = cuda.local.array(NQ, uint32)
        xv = cuda.local.array(GT_XQ, float32)
        wr = cuda.local.array(GT_RW, float32)
        xr = cuda.local.array(GT_TW, float32)
        acc = cuda.local.array(GT_ACC, float32)
        for q in range(GT_ACC):
            acc[q] = float32(0.0)
        cuda.syncthreads()
        load_w(bank64, bank8, slot, lay[0], lay[1], lay[2], lay[3], half, r0, I, nch, 0, wq, sq)
        for q in range(GT_XQ):
            e = tid + q * GT_THREADS
            tt = e // GT_BK
            c = e - tt * GT_BK
            xv[q] = x[tok[tt], c] if c < H else float32(0.0)
        for k0 in range(0, Hs, GT_BK):
            store_w(ws, wq, sq, v)
            for q in range(GT_XQ):
                e = tid + q * GT_THREADS
                tt = e // GT_BK
                xs[(e - tt * GT_BK) * GT_BTP + tt] = xv[q]
            cuda.syncthreads()
            k1 = k0 + GT_BK
            if k1 < Hs:                                   # prefetch the next step
                load_w(bank64, bank8, slot, lay[0], lay[1], lay[2], lay[3], half, r0, I, nch,
                       k1, wq, sq)
                for q in range(GT_XQ):
                    e = tid + q * GT_THREADS
                    tt = e // GT_BK
                    c = k1 + e - tt * GT_BK
                    xv[q] = x[tok[tt], c] if c < H else float32(0.0)
            mma(ws, xs, acc, wr, xr)
            cuda.syncthreads()
        tx = tid % GT_TX
        ty = tid // GT_TX
        gg = bankf[slot, 0]
        gu = bankf[slot, 1]
        for i in range(GT_RW // 2):
            r = r0 + tx + GT_TX * i
            if r < I:
                sg = gg * row_scale(bankf, slot, lay[1], r)
                su = gu * row_scale(bankf, slot, lay[3], r)
                for j in range(GT_TW):
                    tt = ty + GT_TY * j
                    if tt < nt:
                        act_store(act, a_lo + tt, r, acc[i * GT_TW + j] * sg,
                                  acc[(i + GT_RW // 2) * GT_TW + j] * su)

    @jit
    def tiled_down(bank64, bank8, bankf, lay, gslot, gstart, wts, act, y):
        """act float32 [A, I] -> y float32 [A, H] = wts[a] * down @ act[a];
        grid (A // BT + G, cdiv(H, BR)), GT_THREADS threads."""
        ws = cuda.shared.array(GT_WS, float32)   # [BK, BR + 1] decoded weights
        xs = cuda.shared.array(GT_XS, float32)   # [BK, BT + 1] act rows
        g, a_lo, a_hi = _tile_of(gstart, gslot.shape[0], cuda.blockIdx.x)
        if a_lo >= a_hi:
            return
        tid = cuda.threadIdx.x
        slot = gslot[g]
        H = lay[6]
        I = lay[7]
        Is = lay[9]
        nch = Is // CW
        r0 = cuda.blockIdx.y * GT_BR
        nt = a_hi - a_lo
        v = cuda.local.array(CW, float32)
        wq = cuda.local.array(NQ, uint64)
        sq = cuda.local.array(NQ, uint32)
        xv = cuda.local.array(GT_XQ, float32)
        wr = cuda.local.array(GT_RW, float32)
        xr = cuda.local.array(GT_TW, float32)
        acc = cuda.local.array(GT_ACC, float32)
        for q in range(GT_ACC):
            acc[q] = float32(0.0)
        load_w(bank64, bank8, slot, lay[4], lay[5], lay[4], lay[5], GT_BR, r0, H, nch, 0, wq, sq)
        for q in range(GT_XQ):
            e = tid + q * GT_THREADS
            tt = e // GT_BK
            c = e - tt * GT_BK
            xv[q] = act[a_lo + min(tt, nt - 1), c] if c < I else float32(0.0)
        for k0 in range(0, Is, GT_BK):
            store_w(ws, wq, sq, v)
            for q in range(GT_XQ):
                e = tid + q * GT_THREADS
                tt = e // GT_BK
                xs[(e - tt * GT_BK) * GT_BTP + tt] = xv[q]
            cuda.syncthreads()
            k1 = k0 + GT_BK
            if k1 < Is:                                   # prefetch the next step
                load_w(bank64, bank8, slot, lay[4], lay[5], lay[4], lay[5], GT_BR, r0, H, nch,
                       k1, wq, sq)
                for q in range(GT_XQ):
                    e = tid + q * GT_THREADS
                    tt = e // GT_BK
                    c = k1 + e - tt * GT_BK
                    xv[q] = act[a_lo + min(tt, nt - 1), c] if c < I else float32(0.0)
            mma(ws, xs, acc, wr, xr)
            cuda.syncthreads()
        tx = tid % GT_TX
        ty = tid // GT_TX
        gd = bankf[slot, 2]
        for i in range(GT_RW):
            r = r0 + tx + GT_TX * i
            if r < H:
                s = gd * row_scale(bankf, slot, lay[5], r)
                for j in range(GT_TW):
                    tt = ty + GT_TY * j
                    if tt < nt:
                        y[a_lo + tt, r] = wts[a_lo + tt] * s * acc[i * GT_TW + j]

    return tiled_gate_up, tiled_down


_TILED = {}


def tiled_kernels(fmt: str, raw: bool = False):
    """(grouped gate_up, grouped down) of the tiled family, built once per format (and raw)."""
    if (fmt, raw) not in _TILED:
        _TILED[(fmt, raw)] = _make_tiled(fmt, raw)
    return _TILED[(fmt, raw)]


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
    if parse_variant(fmt, "") is None and down_shared_bytes(fmt, lay_host, k) > SHARED_LIMIT - 2048:
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


# ---- decode variants --------------------------------------------------------------------------
# A variant name is "legacy" (the staged kernels above; "arith" = legacy with E2M1 by integer
# ops) or "<decode>-g<GR>j<GJ>-d<DR>j<DJ>" for the flat family: gate_up blocks of GR rows with GJ
# chunks a thread, down blocks of DR rows with DJ chunks a thread, decode tab / arith / mix
# (NVFP4; fp8 and bf16 have "arith" only). A "p" before the decode (ptab, parith, pmix) picks
# the pipelined persistent kernels with the same meaning of GR GJ DR DJ (they need threads * J to
# cover a row in one pass, else the flat kernel runs). A "q" before the decode (NVFP4 only:
# qpair, qbpair, qtab, qarith) picks the leaner pipelined kernels of _make_q, same contract.
# Any such name builds; SWEEP lists the ones timed; a default is switched by editing
# DEFAULT_VARIANT, or for one run by MOE_STREAM_<FMT>_VARIANT (A/B of whole decodes). Threads
# a block are always capped by the compiled kernel's registers (_cap).

DEFAULT_VARIANT = {"nvfp4": "mma-g4-d4-p5-c-l", "fp8": "parith-g8j1-d4j2", "bf16": "parith-g4j4-d4j4"}
DEFAULT_VARIANT = {f: os.environ.get(f"MOE_STREAM_{f.upper()}_VARIANT", v)
                   for f, v in DEFAULT_VARIANT.items()}
# ^ nvfp4: the lean tensor-core kernels, H200 sweep of 2026-12-02: 15.7 / 14.3 / 25.8 us a layer
# at 30B / Next / 2560x640 against mma-g4-d4-p3-c's 17.3 / 16.0 / 28.9 (-p5: coherent weight
# loads, so ptxas keeps them above the barrier, with the L1 allocating: 0.4 us ahead of -p4)
# ^ nvfp4: the tensor-core kernels (gpu_experts_mma), H200 sweep of 2026-12-01: 19.6 / 17.4 / 30.9
# us a layer at 30B / Next / 2560x640 against qtab-g8j1-d4j2's 23.0 / 26.3 / 35.6
# ^ H200 sweep of 2026-11-30 (graph replay; us per layer at 30B / Next / 2560x640): the
# pipelined persistent kernels win: nvfp4 ptab-g8j1-d4j2 24.6 / 26.5 / 38.1 (flat tab 34.4 /
# 28.7 / 48.9, legacy 51.1 / 46.8 / 68.4); fp8 parith-g8j1-d4j2 26.6 / 25.8 / 39.3; bf16
# parith-g4j4-d4j4 29.4 / 26.6 / 45.2 (g2j4-d4j2 is 2 % faster at the first two, 23 % slower
# at 2560x640).
SWEEP = {   # what tools/sweep_experts.py times
    "nvfp4": ["legacy", "tab-g8j1-d4j2", "ptab-g8j1-d4j2", "ptab-g4j1-d4j2", "parith-g8j1-d4j2",
              "pmix-g8j1-d4j2", "ptab-g4j1-d8j1", "ptab-g4j1-d4j1",
              "qpair-g8j1-d4j2", "qpair-g4j1-d4j2", "qpair-g8j1-d8j1", "qbpair-g8j1-d4j2",
              "qbpair-g4j1-d4j2", "qtab-g8j1-d4j2", "qarith-g8j1-d4j2", "lut-g32-d16",
              "lut-g16-d16", "mma-g4-d4", "mma-g4-d4-a2-p3", "mma-g4-d4-p3-c", "mma-g2-d4-a1-p3-c",
              "mma-g4-d4-p4-c-l", "mma-g4-d4-p5-c-l", "tma-g1-d2", "tma-g1-d2-w", "tma-g1-d3-w"],
    "fp8": ["legacy", "arith-g4j1-d4j4", "arith-g8j1-d8j2", "parith-g8j1-d4j2",
            "parith-g4j1-d4j1"],
    "bf16": ["legacy", "arith-g4j4-d4j4", "parith-g4j4-d4j4", "parith-g2j4-d4j2"],
}
_VARIANT_RE = re.compile(r"^(p|q)?(tab|arith|mix|pair|bpair)-g(\d+)j(\d+)-d(\d+)j(\d+)$")
_LUT_RE = re.compile(r"^lut-g(\d+)-d(\d+)(?:-m(\d))?$")   # NVFP4: gpu_experts_lut, GW / DW warps a block
_TMA_RE = re.compile(r"^tma-g(\d+)-d(\d+)(-w)?(?:-m(\d))?$")   # NVFP4: gpu_experts_tma, SG / SD steps a warp
_MMA_RE = re.compile(r"^mma-g(\d+)-d(\d+)(?:-a(\d+))?(?:-p(\d))?(-c)?(?:-m(\d))?(-l)?$")   # NVFP4: gpu_experts_mma, SG / SD
# steps a warp, LA steps loaded ahead (default all), P the weight loads' cache hints, -c the
# scales on the D columns, -m1 / -m2 diagnostic modes (wrong results), -l the lean kernels
# (32-bit addressing, fewer instructions; gpu_experts_mma.lean_steps)
_FLAT = {}


def parse_variant(fmt: str, variant: str):
    """None for the legacy kernels, else (decode, GR, GJ, DR, DJ)."""
    v = variant or DEFAULT_VARIANT[fmt]
    if v in ("legacy", "arith"):
        return None
    m = _LUT_RE.match(v)
    if m and fmt == "nvfp4":
        return ("lut", int(m.group(1)), int(m.group(3) or 0), int(m.group(2)), 0)
    m = _TMA_RE.match(v)
    if m and fmt == "nvfp4":
        return ("tma", int(m.group(1)), (int(bool(m.group(3))), int(m.group(4) or 0)),
                int(m.group(2)), 0)
    m = _MMA_RE.match(v)
    if m and fmt == "nvfp4":
        extra = (int(m.group(3) or 0), int(m.group(6) or 0), int(m.group(4) or 0),
                 int(bool(m.group(5))), int(bool(m.group(7))))       # LA, MODE, P, COLS, LEAN
        return ("mma", int(m.group(1)), extra, int(m.group(2)), 0)
    m = _VARIANT_RE.match(v)
    ok = (fmt == "nvfp4" and m.group(2) in _Q_DEC) if m and m.group(1) == "q" else \
        bool(m) and (fmt, m.group(2)) in _FLAT_DEC
    if not ok:
        raise ValueError(f"unknown {fmt} expert kernel variant {v!r}")
    return ((m.group(1) or "") + m.group(2),) + tuple(int(g) for g in m.groups()[2:])


def flat_kernels(fmt: str, cfg, raw: bool = False):
    """(gate_up, down) of a flat ("tab", ...) or pipelined ("ptab", ...) variant; raw: gate_up
    stores the gate and up sums (_act_raw)."""
    if (fmt, cfg, raw) not in _FLAT:
        dec = cfg[0]
        make = {"p": _make_pipe, "q": _make_q}.get(dec[0], _make_flat)
        _FLAT[(fmt, cfg, raw)] = make(fmt, dec[1:] if dec[0] in "pq" else dec, *cfg[1:], RAW=raw)
    return _FLAT[(fmt, cfg, raw)]


_SPEC = {}


def _specialized(kern, args):
    """kern compiled for these argument types (so its register count is known before the first
    launch); the simulator has no compile step."""
    return _specialized_smem(kern, args)[:3]


def _specialized_smem(kern, args):
    """_specialized plus the kernel's static shared bytes a block."""
    if SIM:
        return kern, 0, 1024, 0
    key = (id(kern),) + tuple(str(typeof(a)) for a in args)
    if key not in _SPEC:
        sk = kern.specialize(*args)
        ov = next(iter(sk.overloads.values()))
        _SPEC[key] = (sk, ov.regs_per_thread, ov.max_threads_per_block, ov.shared_mem_per_block)
    return _SPEC[key]


def _cap(nt: int, maxt: int) -> int:
    """Threads a block, at most what the kernel's registers allow (maxt from the driver): a
    launch never fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES."""
    return max(WARP, min(nt, maxt // WARP * WARP))


def _sm_count() -> int:
    return 2 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT


def pipe_grid(items: int, threads: int, regs: int, smem: int = 0) -> int:
    """Blocks of the pipelined kernels: b resident blocks an SM (registers, threads, 32
    blocks and smem shared bytes a block allow at most bmax), b chosen to minimise the items
    the busiest SM runs
    (b * cdiv(items, SMs * b)); ties go to more blocks (more loads in flight)."""
    sms = _sm_count()
    if SIM:
        return min(items, 3)
    rpt = max(cdiv(max(regs, 1), 8) * 8, 8)
    warps = cdiv(threads, WARP)
    bmax = max(1, min(65536 // (rpt * warps * WARP), 2048 // (warps * WARP), 32,
                      SM_SHARED // (smem + 1024)))
    best, best_b = None, 1
    for b in range(1, bmax + 1):
        load = b * cdiv(items, sms * b)
        if best is None or load <= best:
            best, best_b = load, b
    return max(1, min(items, sms * best_b))


def _one_pass_fallback(dec: str) -> str:
    """The flat decode that stands in for a pipelined one when a row needs more than one pass
    (the q decodes have no flat kernel: "tab" computes the same sums)."""
    return "tab" if dec[0] == "q" and dec[1:] not in ("tab", "arith") else dec[1:]


def _threads_for(chunks: int, per_thread: int) -> int:
    return min(cdiv(cdiv(chunks, per_thread), WARP) * WARP, 256 if SIM else 1024)


MMA_FALLBACK = "qtab-g8j1-d4j2"   # where the mma kernels cannot run a layout (Hs, Is % 128)
# gpt-oss's RAW gate_up: the format's default where its family has the RAW stores
RAW_VARIANT = {"nvfp4": MMA_FALLBACK, "fp8": "parith-g8j1-d4j2", "bf16": "parith-g4j4-d4j4"}
TMA_FALLBACK = "mma-g4-d4-p5-c-l"   # where the tma kernels cannot (before sm_90, H != Hs, ...)


def live_variants(fmt: str) -> list[str]:
    """The decode variants the engine can run for fmt: the default, what stands in for it (the
    mma kernels' fallback; a pipelined kernel's flat one-pass stand-in) and the legacy kernels.
    The GPU tests check these; tools/sweep_experts.py checks each SWEEP variant it times against
    the legacy kernels."""
    out = [DEFAULT_VARIANT[fmt]]
    if out[0].startswith("tma-"):
        out.append(TMA_FALLBACK)
    if out[-1].endswith("-l"):        # the kernels the lean ones stand in for
        out.append(out[0][:-2])
    out += [MMA_FALLBACK] if fmt == "nvfp4" else []
    for v in list(out):
        m = _VARIANT_RE.match(v)
        if m and m.group(1):
            out.append(_one_pass_fallback(m.group(1) + m.group(2)) + v[v.index("-"):])
    return out + ["legacy"]


def _tma(fmt, cfg, views, lay_host, k):
    """(the tma kernels' module or None, cfg): None and TMA_FALLBACK's cfg when cfg is a tma
    variant this device or these shapes do not allow."""
    if cfg is None or cfg[0] != "tma":
        return None, cfg
    from . import gpu_experts_tma
    if gpu_experts_tma.supported(lay_host, k, cfg, views[1].shape[1]):
        return gpu_experts_tma, cfg
    return None, parse_variant(fmt, TMA_FALLBACK)


def _mma_or_fallback(fmt, cfg, views, lay_host, k):
    """cfg, or MMA_FALLBACK's when cfg is an mma variant these shapes do not allow."""
    if cfg is None or cfg[0] != "mma":
        return cfg
    from . import gpu_experts_mma
    if gpu_experts_mma.supported(lay_host, k, cfg, views[1].shape[1]):
        return cfg
    return parse_variant(fmt, MMA_FALLBACK)


def raw_variant(fmt: str, variant: str = "") -> str:
    """The decode variant that runs a RAW gate_up (gpt-oss): variant where its family has the
    RAW stores (flat, pipelined, q), else RAW_VARIANT[fmt]."""
    cfg = parse_variant(fmt, variant)
    return variant if cfg is not None and cfg[0] not in ("mma", "tma", "lut") \
        else RAW_VARIANT[fmt]


def expert_gate_up(fmt, views, lay, lay_host, slots, x, act, stream, variant="", min_blocks=0,
                   unroll=0, threads=THREADS, raw=False):
    """x float32 [H] -> act float32 [K, I] for the K experts in slots int32 [K].
    threads: block size of the legacy kernel, a multiple of 32 up to THREADS (tuning).
    raw: act [2K, I] takes the gate and up sums (_act_raw), in raw_variant(fmt, variant)."""
    b64, b8, bf = views
    if raw:
        variant = raw_variant(fmt, variant)
    cfg = parse_variant(fmt, variant)
    if cfg is not None and cfg[0] == "lut":
        from . import gpu_experts_lut
        gpu_experts_lut.gate_up(cfg, views, lay, lay_host, slots, x, act, stream)
        return
    tma, cfg = _tma(fmt, cfg, views, lay_host, slots.shape[0])
    if tma is not None:
        tma.gate_up(cfg, views, lay, lay_host, slots, x, act, stream)
        return
    cfg = _mma_or_fallback(fmt, cfg, views, lay_host, slots.shape[0])
    if cfg is not None and cfg[0] == "mma":
        from . import gpu_experts_mma
        gpu_experts_mma.gate_up(cfg, views, lay, lay_host, slots, x, act, stream)
        return
    if cfg is not None:
        dec, gr, gj, _, _ = cfg
        nch = int(lay_host[8]) // CHUNK[fmt]
        nt = _threads_for(nch, gj)
        args = (b64, b8, bf, lay, slots, x, act)
        if dec[0] in "pq":
            k, regs, maxt, smem = _specialized_smem(flat_kernels(fmt, cfg, raw)[0], args)
            if _cap(nt, maxt) * gj >= nch:
                nt = _cap(nt, maxt)
                k[pipe_grid(cdiv(int(lay_host[7]), gr) * slots.shape[0], nt, regs, smem), nt,
                  stream](*args)
                return
            cfg = (_one_pass_fallback(dec),) + cfg[1:]   # a row too long for one pass: flat
        k, _, maxt = _specialized(flat_kernels(fmt, cfg, raw)[0], args)
        k[(cdiv(int(lay_host[7]), gr), slots.shape[0]), _cap(nt, maxt), stream](*args)
        return
    variant = "" if (variant or DEFAULT_VARIANT[fmt]) == "legacy" else variant
    gate_up = get_kernels(fmt + ("-" + variant if variant else ""), min_blocks, unroll)[0]
    gate_up[gate_up_grid(lay_host, slots.shape[0], threads), threads, stream,
            gate_up_shared_bytes(fmt, lay_host)](b64, b8, bf, lay, slots, x, act)


def expert_down(fmt, views, lay, lay_host, slots, weights, act, out, stream, accumulate=False,
                variant="", min_blocks=0, unroll=0, threads=THREADS):
    """act float32 [K, I] -> out float32 [H] = (out if accumulate) + sum_k weights[k] * down_k."""
    b64, b8, bf = views
    cfg = parse_variant(fmt, variant)
    acc = int32(1 if accumulate else 0)
    if cfg is not None and cfg[0] == "lut":
        from . import gpu_experts_lut
        gpu_experts_lut.down(cfg, views, lay, lay_host, slots, weights, act, out, stream,
                             accumulate)
        return
    tma, cfg = _tma(fmt, cfg, views, lay_host, slots.shape[0])
    if tma is not None:
        tma.down(cfg, views, lay, lay_host, slots, weights, act, out, stream, accumulate)
        return
    cfg = _mma_or_fallback(fmt, cfg, views, lay_host, slots.shape[0])
    if cfg is not None and cfg[0] == "mma":
        from . import gpu_experts_mma
        gpu_experts_mma.down(cfg, views, lay, lay_host, slots, weights, act, out, stream,
                             accumulate)
        return
    if cfg is not None:
        dec, _, _, dr, dj = cfg
        total = slots.shape[0] * (int(lay_host[9]) // CHUNK[fmt])
        nt = _threads_for(total, dj)
        args = (b64, b8, bf, lay, slots, weights, act, out, acc)
        if dec[0] in "pq":
            k, regs, maxt, smem = _specialized_smem(flat_kernels(fmt, cfg)[1], args)
            if _cap(nt, maxt) * dj >= total:
                nt = _cap(nt, maxt)
                k[pipe_grid(cdiv(int(lay_host[6]), dr), nt, regs, smem), nt, stream](*args)
                return
            cfg = (_one_pass_fallback(dec),) + cfg[1:]
        k, _, maxt = _specialized(flat_kernels(fmt, cfg)[1], args)
        k[cdiv(int(lay_host[6]), dr), _cap(nt, maxt), stream](*args)
        return
    variant = "" if (variant or DEFAULT_VARIANT[fmt]) == "legacy" else variant
    down = get_kernels(fmt + ("-" + variant if variant else ""), min_blocks, unroll)[1]
    down[down_grid(lay_host, threads), threads, stream, down_shared_bytes(fmt, lay_host, slots.shape[0])](
        b64, b8, bf, lay, slots, weights, act, out, acc)


def expert_mlp_clamped(fmt, views, lay, lay_host, slots, ids, weights, x, act, out, bias, alpha,
                       limit, stream, accumulate=False, variant=""):
    """gpt-oss's experts for one token (expert_mlp's contract): ids int32 [K] the experts'
    ids (their rows of bias float32 [E, 2I + H]), act float32 [2K, I] scratch; four launches,
    nothing allocated, no sync."""
    k = slots.shape[0]
    expert_gate_up(fmt, views, lay, lay_host, slots, x, act, stream, variant, raw=True)
    clamped_swiglu(act, ids, bias, alpha, limit, stream)
    expert_down(fmt, views, lay, lay_host, slots, weights, act[:k], out, stream, accumulate,
                variant)
    expert_bias_add(out.reshape(1, out.shape[0]), ids.reshape(1, k), weights.reshape(1, k), bias,
                    stream)


def expert_mlp_scaled(fmt, views, lay, lay_host, slots, weights, ones, x, act, out, stream,
                      accumulate=False, variant=""):
    """Experts whose routing weights scale their input, not their output (Llama 4) for one
    token (expert_mlp's contract): RAW gate_up, scaled_swiglu by weights, down by ones (float32
    [K] of 1); act float32 [2K, I] scratch; three launches, nothing allocated, no sync."""
    k = slots.shape[0]
    expert_gate_up(fmt, views, lay, lay_host, slots, x, act, stream, variant, raw=True)
    scaled_swiglu(act, weights, stream)
    expert_down(fmt, views, lay, lay_host, slots, ones, act[:k], out, stream, accumulate, variant)


def expert_mlp_limited(fmt, views, lay, lay_host, slots, weights, x, act, out, limit, stream,
                       after=False, accumulate=False, variant="", alpha=0.0):
    """Experts with a clamped SwiGLU and no biases (limited_swiglu) for one token (expert_mlp's
    contract), act float32 [2K, I] scratch; three launches, nothing allocated, no sync."""
    k = slots.shape[0]
    expert_gate_up(fmt, views, lay, lay_host, slots, x, act, stream, variant, raw=True)
    limited_swiglu(act, limit, stream, after=after, alpha=alpha)
    expert_down(fmt, views, lay, lay_host, slots, weights, act[:k], out, stream, accumulate,
                variant)


def expert_mlp_relu2(fmt, views, lay, lay_host, slots, weights, x, act, out, stream, accumulate=False,
                     variant=""):
    """Ungated experts, down(relu(up x)^2), for one token (expert_mlp's contract): lay from
    kernel_layout (gate sections = up sections), act float32 [2K, I] scratch; RAW gate_up,
    relu2_up, down: three launches, nothing allocated, no sync."""
    k = slots.shape[0]
    expert_gate_up(fmt, views, lay, lay_host, slots, x, act, stream, variant, raw=True)
    relu2_up(act, stream)
    expert_down(fmt, views, lay, lay_host, slots, weights, act[:k], out, stream, accumulate, variant)


def expert_mlp(fmt, views, lay, lay_host, slots, weights, x, act, out, stream, accumulate=False,
               variant="", min_blocks=0, unroll=0):
    """One token through its K routed experts: two launches, nothing allocated, no sync.

    views: bank_views(bank); lay int64 [10] device, lay_host its numpy copy (shapes only);
    slots int32 [K], weights float32 [K], x float32 [H], act float32 [K, I] scratch,
    out float32 [H]. Safe to capture in a CUDA graph: routing lives in slots / weights.
    variant: "" = DEFAULT_VARIANT[fmt]; see parse_variant.
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


def tiled_grid_x(a: int, groups: int) -> int:
    """Token-tile slots of the tiled kernels for at most a assignments in `groups` groups."""
    return a // GT_BT + groups


def grouped_gate_up_down(fmt, views, lay, lay_host, gslot, gstart, order, wts, x, act, y, stream,
                         variant="", clamp=None):
    """The grouped gate_up and down kernels over groups gslot int32 [G] with offsets gstart
    int32 [G + 1] (absolute assignment indices, so a slice of the groups can run alone):
    x [T, H] -> act [A, I] -> y [A, H] = wts[a] * expert(x[order[a]]) for those assignments.
    variant: "tiled" or "legacy" ("" = GROUPED_VARIANT). Nothing allocated, no sync.
    clamp: a clamped SwiGLU (tiled only): act [2A, I] takes the RAW gate and up sums, then
    clamp(act, stream) applies the activation to these groups' assignments (clamped_swiglu,
    gpt-oss's, whose y gets no down bias: expert_bias_add adds it after the combine; or
    limited_swiglu)."""
    b64, b8, bf = views
    g = gslot.shape[0]
    v = variant or GROUPED_VARIANT
    if clamp is not None and v != "tiled":
        raise ValueError(f"grouped expert kernels {v!r} have no clamped SwiGLU; use tiled")
    if v == "tiled":
        if g == 0:
            return
        tgu, tdn = tiled_kernels(fmt, clamp is not None)
        gx = tiled_grid_x(order.shape[0], g)
        tgu[(gx, cdiv(int(lay_host[7]), GT_BR // 2)), GT_THREADS, stream](
            b64, b8, bf, lay, gslot, gstart, order, x, act)
        if clamp is not None:
            clamp(act, stream)
            act = act[:order.shape[0]]
        tdn[(gx, cdiv(int(lay_host[6]), GT_BR)), GT_THREADS, stream](
            b64, b8, bf, lay, gslot, gstart, wts, act, y)
        return
    if v != "legacy":
        raise ValueError(f"unknown grouped expert kernel variant {v!r}; expected tiled or legacy")
    cw = CHUNK[fmt]
    gsh = gate_up_shared_bytes(fmt, lay_host, TT)
    dsh = int(TT * (int(lay_host[9]) // cw) * (cw + 1) * 4)
    if max(gsh, dsh) > SHARED_LIMIT:   # the launch would fail with CUDA_ERROR_INVALID_VALUE
        raise ValueError(f"legacy grouped {fmt} expert kernels: H={int(lay_host[6])}, "
                         f"I={int(lay_host[7])} stage {max(gsh, dsh)} bytes of shared memory, over "
                         f"the {SHARED_LIMIT}-byte limit; use the tiled variant")
    _, _, ggu, gdn = get_kernels(fmt)
    ggu[gate_up_grid(lay_host, g), THREADS, stream, gsh](
        b64, b8, bf, lay, gslot, gstart, order, x, act)
    gdn[(down_grid(lay_host), g), THREADS, stream, dsh](b64, b8, bf, lay, gslot, gstart, wts, act, y)


def combine(y, pos, out, stream, accumulate=False):
    """out [T, H] = (out if accumulate) + sum_k y[pos[t, k]] (pos int32 [T, K])."""
    n = out.shape[0] * out.shape[1]
    combine_kernel[cdiv(n, 256), 256, stream](y, pos, out, int32(1 if accumulate else 0))


def expert_mlp_grouped(fmt, views, lay, lay_host, gslot, gstart, order, wts, pos, x, act, y,
                       out, stream, accumulate=False, variant=""):
    """T tokens (prefill): x [T, H] -> out [T, H]; act [A, I], y [A, H] scratch (A = T*K)."""
    grouped_gate_up_down(fmt, views, lay, lay_host, gslot, gstart, order, wts, x, act, y, stream,
                         variant)
    combine(y, pos, out, stream, accumulate)
