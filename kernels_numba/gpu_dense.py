"""CUDA dense kernels: linear (fp32 / bf16 weights), tiled GEMM, RMSNorm, RoPE, embedding, add.

Legend: T = tokens, K = a matrix's inner size, N = its rows (outputs), H = hidden,
nH = heads, D = head dim, R = rotary dims (R <= D), V = vocab.
Weights are float32 or uint16 bfloat16 bits, row-major [N, K]; activations float32.
Every launcher takes an explicit stream, allocates nothing and never syncs, so a sequence of
them can be captured in a CUDA graph; positions and token ids are read from device memory.
linear has two kernels: the 8-byte path (a lane loads 8 bytes of a weight row at a time; any
even K) and the 16-byte path (one ld.global.nc.v4 a load, x staged in shared memory; K a
multiple of 8 bf16 / 4 fp32 values, 16-byte aligned rows), the default at T <= LIN16_T_MAX.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, float64, uint32, uint64

from .gpu_util import (M32, SIM, WARP, aligned, block_sum, cdiv, cp_async4, cp_async_wait,
                        prefetch_l2, putter,
                        int_as_float, ld4, ld4_pinned, lds4, pdl_kernel, pdl_trigger, pdl_wait,
                        warp_sum)

LIN_THREADS = 64 if SIM else 256    # linear: 8 warps a block
LIN_TT_MAX = 8                       # linear: tokens per pass over the weights (T <= 7 in one)
LIN_LOADS = 8                        # linear: 8-byte weight loads in flight per lane (U * R)
LIN_WARPS_MIN = 4 if SIM else 2560   # linear: warps wanted in flight (132 SMs x ~20)
LIN_ROWS2 = 4 if SIM else 2048       # linear: matrices of this many rows take 2 rows a warp
LIN_ROWS4 = 64 if SIM else 65536     # ... and of this many 4 (the LM head)
LIN16_THREADS = 64 if SIM else 256   # linear, 16-byte path: a block's threads (default)
LIN16_BLOCKS_SM = 4                  # ... blocks an SM the registers must allow (<= 64 a thread)
LIN16_LOADS = 8                      # ... 16-byte weight loads in flight a lane (U * R)
LIN16_WARPS = 4 if SIM else 4224     # ... warps resident at once (132 SMs x 32 at 64 registers)
LIN16_T_MAX = 1                      # ... taken by default for T <= this (else the 8-byte path)
LIN16_N_MIN = 2048                   # ... and N >= this (the router's 128 rows: 8-byte, as fast)
# ^ H200 sweep at T = 1 (PERF.md, seventh session): with linear16_config's shapes the 16-byte
# path beats the 8-byte one at every N >= 2048 (q/k/v 7.49 vs 8.95 us, o 6.83 vs 8.48, LM head
# 142 vs 155); T = 2 was 14.11 vs 10.89 in the sixth session's sweep, not re-run
LIN16_XS_BYTES = 1024 if SIM else 32768   # ... x (and g) staged in shared memory up to this
# MOE_STREAM_L2_PREFETCH=1: each warp group asks the L2 for its rows before the PDL wait, so a
# decode graph's matvec weights stream while the kernel before it runs. Off: the all-resident
# decode lost 2.5% with it (H200, PERF.md ninth session).
LIN_PREFETCH = os.environ.get("MOE_STREAM_L2_PREFETCH", "0") == "1"
NORM_THREADS = 64 if SIM else 128    # rmsnorm: one warp per row
NORM_BLOCK = 64 if SIM else 512      # rmsnorm of long rows: one block per row
NORM_BLOCK_MIN = 32 if SIM else 1024
GEMM_BM = 64                         # gemm tile: 64 x 64 outputs, 16 inner, 256 threads x 4x4
GEMM_BN = 64
GEMM_BK = 16
GEMM_BMP = GEMM_BM + 1               # shared tile row stride (padded)
GEMM_BNP = GEMM_BN + 1
EW_THREADS = 64 if SIM else 256      # elementwise kernels
_S16 = np.uint32(16)
_XFFFF = np.uint32(0xFFFF)
_XFFFF0000 = np.uint32(0xFFFF0000)


# ---- weight chunk decode: an 8-byte load -> 4 bf16 or 2 fp32 values ----------------------------

@cuda.jit(device=True, inline=True)
def _chunk_bf16(w, v):
    lo = uint32(w & M32)
    hi = uint32(w >> 32)
    v[0] = int_as_float((lo & _XFFFF) << _S16)
    v[1] = int_as_float(lo & _XFFFF0000)
    v[2] = int_as_float((hi & _XFFFF) << _S16)
    v[3] = int_as_float(hi & _XFFFF0000)


@cuda.jit(device=True, inline=True)
def _chunk_f32(w, v):
    v[0] = int_as_float(uint32(w & M32))
    v[1] = int_as_float(uint32(w >> 32))


@cuda.jit(device=True, inline=True)
def _elem_bf16(w, n, k):
    return int_as_float(uint32(w[n, k]) << _S16)


@cuda.jit(device=True, inline=True)
def _elem_f32(w, n, k):
    return w[n, k]


# Double-buffered weight loads lost on the H200 (LM head 0.85 of copy against 1.00 single-
# buffered, 5120 x 2048 14.4 us against 9.8): off, the loop issues U * R loads, then uses them.
LIN_DOUBLE_BUFFER = False


def _make_linear(cw, chunk, R, KS, U, TT, ACC=False, NORM=False, HOUT=False, PF=False):
    """Matvec kernel for cw weights per 8-byte chunk (4 bf16 / 2 fp32); ACC: y += instead of =.

    A block of LIN_THREADS threads is NW = LIN_THREADS / 32 warps in NW / KS groups; a group owns
    R consecutive output rows and its KS warps split the row's chunks (lane-interleaved, so
    every load instruction of a warp reads 256 contiguous bytes). A lane issues U * R weight
    loads before it computes, and each x chunk it loads (L1) serves R rows. With
    LIN_DOUBLE_BUFFER the next U * R are issued before the current ones are used. Tokens go
    in passes of TT (one pass for T <= TT).
    NORM: the rmsnorm before the matvec fused in: the weights meet x * (g + w_offset), and each
    block sums the squares of its pass's rows itself (a block reduction over x, read from L2)
    after its weight loads, scaling its sums by inv_rms at the end (W (x g) inv = W (x inv g)
    up to rounding); with the reduction first, every block's loads waited for it (H200: +2.6 us
    a call). HOUT: the blocks also write the normalised rows to h_out, each a disjoint grid-stride
    slice, for the kernels after that read the normed input."""
    NW = LIN_THREADS // WARP
    NG = NW // KS
    XW = cw // 2                       # uint64 words of x (float32 pairs) per weight chunk
    STEP = WARP * KS
    RT = R * TT                        # (array sizes must be plain constants for numba)
    UR = U * R
    XT = TT * cw
    DB = LIN_DOUBLE_BUFFER
    finish = _make_finish(R, TT, KS, LIN_THREADS, ACC, NORM, HOUT, False)

    @cuda.jit(device=True, inline=True)
    def body(w64, x64, y, g, eps, w_offset, h_out):
        """w64 uint64 [N, K / cw], x64 uint64 [T, K / 2] (float32 pairs) -> y float32 [T, N];
        grid cdiv(N, NG * R). NORM: g float32 [K], h_out float32 [T, K] (HOUT)."""
        red = cuda.shared.array(LIN_THREADS, float32)
        part = cuda.shared.array((NW, RT), float32)       # per-warp sums when KS > 1
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        grp = warp // KS
        ks = warp - grp * KS
        n0 = (cuda.blockIdx.x * NG + grp) * R
        N = w64.shape[0]
        nch = w64.shape[1]
        if PF and ks == 0 and lane < R and n0 + lane < N:   # (before the wait: see LIN_PREFETCH)
            prefetch_l2(w64, n0 + lane, nch * 8)
        T = x64.shape[0]
        wq = cuda.local.array(UR, uint64)
        wn = cuda.local.array(UR, uint64)
        wv = cuda.local.array(cw, float32)
        xv = cuda.local.array(XT, float32)
        acc = cuda.local.array(RT, float32)
        inv = cuda.local.array(TT, float32)              # NORM: 1 / rms of the pass's rows
        gv = cuda.local.array(cw, float32)               # NORM: g + w_offset of a chunk
        for t0 in range(0, T, TT):
            nt = min(TT, T - t0)
            for i in range(RT):
                acc[i] = float32(0.0)
            jb0 = ks * WARP + lane
            if DB:
                for u in range(U):                         # the first U * R chunks
                    jj = min(jb0 + u * STEP, nch - 1)
                    for r in range(R):
                        wn[u * R + r] = w64[min(n0 + r, N - 1), jj]
            for jb in range(jb0, nch, STEP * U):
                if DB:
                    for i in range(UR):
                        wq[i] = wn[i]
                    if jb + STEP * U < nch:                # the next ones, in flight now
                        for u in range(U):
                            jj = min(jb + (U + u) * STEP, nch - 1)
                            for r in range(R):
                                wn[u * R + r] = w64[min(n0 + r, N - 1), jj]
                else:
                    for u in range(U):                     # U * R loads issued, then used
                        jj = min(jb + u * STEP, nch - 1)
                        for r in range(R):
                            wq[u * R + r] = w64[min(n0 + r, N - 1), jj]
                if jb == jb0 and t0 == 0:                  # the first weights are on their way
                    pdl_wait()
                    pdl_trigger()
                for u in range(U):
                    j = jb + u * STEP
                    if j < nch:
                        if NORM:
                            for c in range(cw):
                                gv[c] = g[j * cw + c] + w_offset
                        for q in range(TT):
                            if q < nt:
                                for h in range(XW):
                                    xw = x64[t0 + q, j * XW + h]
                                    if NORM:
                                        xv[q * cw + 2 * h] = (int_as_float(uint32(xw & M32))
                                                              * gv[2 * h])
                                        xv[q * cw + 2 * h + 1] = (int_as_float(uint32(xw >> 32))
                                                                  * gv[2 * h + 1])
                                    else:
                                        xv[q * cw + 2 * h] = int_as_float(uint32(xw & M32))
                                        xv[q * cw + 2 * h + 1] = int_as_float(uint32(xw >> 32))
                        for r in range(R):
                            chunk(wq[u * R + r], wv)
                            for q in range(TT):
                                if q < nt:
                                    s = float32(0.0)
                                    for c in range(cw):
                                        s += wv[c] * xv[q * cw + c]
                                    acc[r * TT + q] += s
            pdl_wait()                                     # (lanes past the row's end)
            finish(acc, inv, red, part, x64, x64, t0, nt, g, eps, w_offset, h_out, y, N, n0,
                   lane, warp, ks)

    if NORM:
        @cuda.jit
        def linear_norm(w64, x64, y, g, eps, w_offset, h_out):
            body(w64, x64, y, g, eps, w_offset, h_out)
        return linear_norm

    @cuda.jit
    def linear(w64, x64, y):
        body(w64, x64, y, y[0], float32(0.0), float32(0.0), y)   # the norm arguments unused
    return linear


class Wide(NamedTuple):
    """A launch shape of the 16-byte matvec: linear(config=Wide(...))."""
    r: int                              # rows a warp group
    ks: int                             # warps a row (they split its chunks)
    u: int                              # 16-byte loads in flight a row and lane
    threads: int = LIN16_THREADS        # a block
    blocks_sm: int = LIN16_BLOCKS_SM    # launch bound: registers a thread <= 65536 /
                                        # (threads * blocks_sm); 0: no bound


def _make_linear16(BF, R, KS, U, TT, NT, BSM, XS, EXACT, ACC=False, NORM=False, HOUT=False,
                   PF=False):
    """Matvec kernel whose lanes load 16 bytes a weight load (one ld.global.nc.v4: a "chunk" of
    8 bf16 or 4 fp32 values); BF: bf16 weights as uint32 words (two values each), else fp32.

    Laid out as _make_linear's kernel: a block of NT threads is NW = NT / 32 warps in NW / KS
    groups; a group owns R consecutive rows and its KS warps split a row's chunks lane-
    interleaved (each load instruction of a warp reads 512 contiguous bytes). A lane issues
    its U * R weight loads, then uses them; a chunk's R rows are decoded once and each
    token's x values of the chunk serve the R rows. Tokens go in passes of TT.
    XS: right after its first weight loads the block copies the pass's TT rows of x (and g)
    into shared memory with cp.async (no registers held), and reads x from there. This is what
    keeps the weight loads together: ptxas schedules a global x load like a weight load and,
    short of registers, interleaves them (sm_90: 4 of 8 weight loads issued, then a stall on
    the first); a shared load it places next to its use. Without XS (TT * K too large) x is
    read through L1 with 16-byte loads, and the weight loads are not all issued first.
    EXACT: a row's chunks are a multiple of 32 * KS * U, so no load is clamped (one address
    and immediate offsets); otherwise the loads past the row's end read its last chunk and
    their sums are dropped. From the loads to the sums there is no branch around a use (a
    select drops what is not wanted): ptxas sinks a load into the branch that uses it.
    NORM / HOUT as in _make_linear: the block's norm reduction after its weight loads, inv_rms
    scaling the sums; g + w_offset scales the decoded weights (W (g x) = (W g) x up to
    rounding).
    launch_bounds (NT, BSM) caps the registers so that BSM blocks fit an SM: BSM * NT * U * R
    * 16 bytes in flight an SM (4 x 256 x 8 x 16 = 128 KB at the defaults)."""
    CW = 8 if BF else 4                # values a chunk
    NW = NT // WARP
    NG = NW // KS
    STEP = WARP * KS
    RT = R * TT                        # (array sizes must be plain constants for numba)
    UR4 = U * R * 4
    RC = R * CW
    H4 = CW // 4                       # 16-byte x loads a chunk and token
    WT = uint32 if BF else float32
    finish = _make_finish(R, TT, KS, NT, ACC, NORM, HOUT, XS)
    kernel = cuda.jit if SIM or not BSM else cuda.jit(launch_bounds=(NT, BSM))

    @cuda.jit(device=True, inline=True)
    def body(w, x, x64, y, g, eps, w_offset, h_out):
        """w uint32 [N, K / 2] (bf16 pairs) or float32 [N, K], x float32 [T, K] (x64 the same
        bytes as uint64 [T, K / 2], for the norm) -> y float32 [T, N]; grid cdiv(N, NG * R),
        XS: (TT + NORM) * K * 4 bytes of dynamic shared memory. NORM: g float32 [K], h_out
        float32 [T, K] (HOUT). w, x, g rows 16-byte aligned."""
        red = cuda.shared.array(NT, float32)
        part = cuda.shared.array((NW, RT), float32)      # per-warp sums when KS > 1
        if SIM:                                          # XS: [TT (+ 1), K], x (and g)
            xs = cuda.shared.array(0, float32)
        else:
            xs = cuda.shared.array(0, float32, alignment=16)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        grp = warp // KS
        ks = warp - grp * KS
        n0 = (cuda.blockIdx.x * NG + grp) * R
        N = w.shape[0]
        nch = w.shape[1] // 4
        if PF and ks == 0 and lane < R and n0 + lane < N:   # (before the wait: see LIN_PREFETCH)
            prefetch_l2(w, n0 + lane, nch * 16)
        T, K = x.shape
        wq = cuda.local.array(UR4, WT)                   # the loaded chunks, 4 words each
        wv = cuda.local.array(RC, float32)               # one chunk of the R rows, decoded
        acc = cuda.local.array(RT, float32)
        inv = cuda.local.array(TT, float32)              # NORM: 1 / rms of the pass's rows
        for t0 in range(0, T, TT):
            nt = min(TT, T - t0)
            for i in range(RT):
                acc[i] = float32(0.0)
            for j0 in range(0, nch, STEP * U):           # the same trip count block-wide
                jb = j0 + ks * WARP + lane
                for u in range(U):                       # U * R loads issued, then used
                    jj = 4 * (jb + u * STEP if EXACT else min(jb + u * STEP, nch - 1))
                    for r in range(R):
                        a0, a1, a2, a3 = ld4_pinned(w, min(n0 + r, N - 1), jj)
                        o = (u * R + r) * 4
                        wq[o] = a0
                        wq[o + 1] = a1
                        wq[o + 2] = a2
                        wq[o + 3] = a3
                if j0 == 0 and t0 == 0:                  # the first weights are on their way
                    pdl_wait()
                    pdl_trigger()
                if XS and j0 == 0:                       # while the first loads are in flight
                    _stage_x(x, t0, nt, g, xs, NT, TT, NORM)
                    cp_async_wait()
                    cuda.syncthreads()
                for u in range(U):
                    j = jb + u * STEP
                    on = EXACT or j < nch
                    jc = j if EXACT else min(j, nch - 1)
                    for r in range(R):
                        o = (u * R + r) * 4
                        for e in range(4):
                            if BF:
                                b = wq[o + e]
                                wv[r * CW + 2 * e] = int_as_float((b & _XFFFF) << _S16)
                                wv[r * CW + 2 * e + 1] = int_as_float(b & _XFFFF0000)
                            else:
                                wv[r * CW + e] = wq[o + e]
                    if NORM:
                        for h in range(H4):
                            if XS:
                                g0, g1, g2, g3 = lds4(xs, TT * K + CW * jc + 4 * h)
                            else:
                                g0, g1, g2, g3 = ld4(g, CW * jc + 4 * h)
                            for r in range(R):
                                c = r * CW + 4 * h
                                wv[c] *= g0 + w_offset
                                wv[c + 1] *= g1 + w_offset
                                wv[c + 2] *= g2 + w_offset
                                wv[c + 3] *= g3 + w_offset
                    for q in range(TT):
                        use = on & (q < nt)
                        for h in range(H4):
                            if XS:
                                x0, x1, x2, x3 = lds4(xs, q * K + CW * jc + 4 * h)
                            else:
                                x0, x1, x2, x3 = ld4(x, min(t0 + q, T - 1), CW * jc + 4 * h)
                            for r in range(R):
                                c = r * CW + 4 * h
                                d = (wv[c] * x0 + wv[c + 1] * x1 + wv[c + 2] * x2
                                     + wv[c + 3] * x3)
                                acc[r * TT + q] += d if use else float32(0.0)
            finish(acc, inv, red, part, x64, xs, t0, nt, g, eps, w_offset, h_out, y, N, n0,
                   lane, warp, ks)
            if XS:
                cuda.syncthreads()                       # xs is restaged by the next pass

    if NORM:
        @kernel
        def linear16_norm(w, x, x64, y, g, eps, w_offset, h_out):
            body(w, x, x64, y, g, eps, w_offset, h_out)
        return linear16_norm

    @kernel
    def linear16(w, x, y):
        body(w, x, x, y, y[0], float32(0.0), float32(0.0), y)   # the norm arguments unused
    return linear16


@cuda.jit(device=True, inline=True)
def _stage_x(x, t0, nt, g, xs, NT, TT, NORM):
    """xs[q * K:(q + 1) * K] = x[t0 + q] for q < nt (the pass's rows; rows nt..TT - 1 are left
    as they are, their sums dropped) and (NORM) xs[TT * K:(TT + 1) * K] = g, copied 16 bytes at
    a time by the NT threads of the block with cp.async: no registers held while in flight
    (the block's weight loads hold them). The caller waits and syncs."""
    K = x.shape[1]
    k4 = K // 4
    for q in range(TT):
        if q < nt:
            for i in range(cuda.threadIdx.x, k4, NT):
                cp_async4(xs, q * K + 4 * i, x, t0 + q, 4 * i)
    if NORM:
        for i in range(cuda.threadIdx.x, k4, NT):
            cp_async4(xs, TT * K + 4 * i, g, 4 * i)


def _make_finish(R, TT, KS, NT, ACC, NORM, HOUT, XS):
    """The end of a matvec pass, shared by both paths: (NORM) the block's norm reduction (over
    x staged in shared memory xs with XS, else over x64), h_out, the sums scaled by inv_rms;
    the lanes' sums reduced over the warp, then (KS > 1) over the KS warps of a row in shared
    memory; y[t0:t0 + nt, n0:n0 + R] written (ACC: added to). Called by every thread of the
    block; acc float32 [R * TT] local, inv float32 [TT] local, red float32 shared [NT], part
    float32 shared [NT / 32, R * TT]."""
    NW = NT // WARP
    RT = R * TT

    @cuda.jit(device=True, inline=True)
    def finish(acc, inv, red, part, x64, xs, t0, nt, g, eps, w_offset, h_out, y, N, n0, lane,
               warp, ks):
        if NORM:   # after the weights: the block's loads do not wait for the norm
            if XS:
                _norm_pass_xs(xs, x64.shape[1] * 2, nt, eps, inv, red, part, TT, NW, NT)
            else:
                _norm_pass(x64, t0, nt, eps, inv, red, part, TT, NW, NT)
            if HOUT:
                _norm_store(x64, t0, nt, g, w_offset, inv, h_out, TT, NT)
            for r in range(R):
                for q in range(TT):
                    acc[r * TT + q] *= inv[q]
        for i in range(RT):
            acc[i] = warp_sum(acc[i], red)
        if KS > 1:
            if lane == 0:
                for i in range(RT):
                    part[warp, i] = acc[i]
            cuda.syncthreads()
            if lane == 0 and ks == 0:
                for i in range(RT):
                    s = acc[i]
                    for o in range(1, KS):
                        s += part[warp + o, i]
                    acc[i] = s
            cuda.syncthreads()
        if lane == 0 and ks == 0:
            for r in range(R):
                if n0 + r < N:
                    for q in range(TT):
                        if q < nt:
                            if ACC:
                                y[t0 + q, n0 + r] += acc[r * TT + q]
                            else:
                                y[t0 + q, n0 + r] = acc[r * TT + q]
    return finish


@cuda.jit(device=True, inline=True)
def _norm_pass(x64, t0, nt, eps, inv, red, part, TT, NW, NT):
    """inv[q] = 1 / rms(x[t0 + q]) for q < nt, to every thread of the NT-thread block (a block
    reduction, the sum in part[:, :TT]; rmsnorm's formula). Called by every thread."""
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    k2 = x64.shape[1]
    for q in range(TT):
        ss = float32(0.0)
        if q < nt:
            for j in range(tid, k2, NT):
                xw = x64[t0 + q, j]
                a = int_as_float(uint32(xw & M32))
                b = int_as_float(uint32(xw >> 32))
                ss += a * a + b * b
        ss = warp_sum(ss, red)
        if lane == 0:
            part[warp, q] = ss
    cuda.syncthreads()
    for q in range(TT):
        s = float32(0.0)
        for o in range(NW):
            s += part[o, q]
        inv[q] = float32(1.0) / math.sqrt(s / float32(2 * k2) + eps)
    cuda.syncthreads()                 # part is free again (the KS > 1 sums reuse it)


@cuda.jit(device=True, inline=True)
def _norm_pass_xs(xs, K, nt, eps, inv, red, part, TT, NW, NT):
    """_norm_pass over the pass's rows staged in shared memory, xs[q * K:(q + 1) * K]."""
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    for q in range(TT):
        ss = float32(0.0)
        if q < nt:
            for j in range(tid, K // 4, NT):
                a, b, c, d = lds4(xs, q * K + 4 * j)
                ss += a * a + b * b + c * c + d * d
        ss = warp_sum(ss, red)
        if lane == 0:
            part[warp, q] = ss
    cuda.syncthreads()
    for q in range(TT):
        s = float32(0.0)
        for o in range(NW):
            s += part[o, q]
        inv[q] = float32(1.0) / math.sqrt(s / float32(K) + eps)
    cuda.syncthreads()                 # part is free again (the KS > 1 sums reuse it)


@cuda.jit(device=True, inline=True)
def _norm_store(x64, t0, nt, g, w_offset, inv, h_out, TT, NT):
    """h_out[t0 + q] = x[t0 + q] * inv[q] * (g + w_offset) for q < nt: this NT-thread block's
    grid-stride share of the float pairs (blocks write disjoint elements; h_out must not
    overlap x)."""
    k2 = x64.shape[1]
    i0 = cuda.blockIdx.x * NT + cuda.threadIdx.x
    step = cuda.gridDim.x * NT
    for q in range(TT):
        if q < nt:
            for j in range(i0, k2, step):
                xw = x64[t0 + q, j]
                h_out[t0 + q, 2 * j] = (int_as_float(uint32(xw & M32)) * inv[q]
                                        * (g[2 * j] + w_offset))
                h_out[t0 + q, 2 * j + 1] = (int_as_float(uint32(xw >> 32)) * inv[q]
                                            * (g[2 * j + 1] + w_offset))


_LINEAR = {}


def linear_kernel(kind: str, r: int, ks: int, u: int, tt: int, acc: bool = False,
                  norm: bool = False, h_out: bool = False):
    """The compiled-on-first-launch matvec for (weight kind "bf16" / "f32", rows per warp group,
    warps per row, chunks in flight per row, token tile, accumulate into y, RMSNorm of x fused
    in, the normalised x written out too)."""
    key = (kind, r, ks, u, tt, bool(acc), bool(norm), bool(norm and h_out), LIN_PREFETCH)
    if key not in _LINEAR:
        if (LIN_THREADS // WARP) % ks:
            raise ValueError(f"linear: {ks} warps per row do not divide a {LIN_THREADS}-thread block")
        cw, chunk = (4, _chunk_bf16) if kind == "bf16" else (2, _chunk_f32)
        _LINEAR[key] = pdl_kernel(_make_linear(cw, chunk, r, ks, u, tt, *key[5:]))
    return _LINEAR[key]


def linear_config(n: int, k: int, t: int, cw: int = 4) -> tuple[int, int, int]:
    """Default (R rows per warp group, KS warps per row, U chunks in flight) for an [n, k] weight.

    From the H200 sweep (tools/sweep_dense.py): the LM head (151936 rows) streams at copy speed
    with 4 rows a warp; 2048-5120 rows want 2 rows a warp and, below LIN_WARPS_MIN warps, 2
    warps a row (4096 x 2048, 2048 x 4096: (2, 2, 4)); small matrices (128, 768 rows) one row a
    warp split over warps until LIN_WARPS_MIN warps ((1, 4, 4), (1, 8, 2))."""
    r = 4 if n >= LIN_ROWS4 else 2 if n >= LIN_ROWS2 else 1
    if t > 4:                          # a token tile of 8 -> 8 * R accumulators
        r = min(r, 2)
    ks = 1
    ks_max = 2 if r > 1 else LIN_THREADS // WARP
    while (ks < ks_max and cdiv(n, r) * ks < LIN_WARPS_MIN
           and k // cw // (2 * ks) >= WARP * 2):
        ks *= 2
    u = max(1, min(LIN_LOADS // r, cdiv(k // cw, WARP * ks)))   # no more than a lane's chunks
    return r, ks, u


_LINEAR16 = {}


def linear16_kernel(kind: str, cfg: Wide, tt: int, xs: bool, exact: bool, acc: bool = False,
                    norm: bool = False, h_out: bool = False):
    """The compiled-on-first-launch 16-byte matvec for (weight kind "bf16" / "f32", launch
    shape, token tile, x staged in shared memory, a row's chunks a multiple of 32 * ks * u (no
    clamped loads), accumulate into y, RMSNorm of x fused in, the normalised x written)."""
    key = (kind, tuple(cfg), tt, bool(xs), bool(exact), bool(acc), bool(norm),
           bool(norm and h_out), LIN_PREFETCH)
    if key not in _LINEAR16:
        if cfg.threads % WARP or (cfg.threads // WARP) % cfg.ks:
            raise ValueError(f"linear: {cfg.ks} warps per row do not divide a "
                             f"{cfg.threads}-thread block")
        _LINEAR16[key] = pdl_kernel(_make_linear16(kind == "bf16", cfg.r, cfg.ks, cfg.u, tt,
                                                   cfg.threads, cfg.blocks_sm, *key[3:]))
    return _LINEAR16[key]


def linear16_config(n: int, k: int, t: int, cw: int = 8) -> Wide:
    """Default 16-byte launch shape for an [n, k] weight of cw values a chunk (8 bf16, 4 fp32).

    LIN16_LOADS loads in flight a lane (128 bytes) at <= 64 registers: 4 blocks of 256 an SM,
    128 KB in flight an SM, so one resident wave (LIN16_WARPS warps) holds ~17 MB of loads. A
    row's chunks go in one round of loads where U <= LIN16_LOADS allows (K = 2048 bf16: 8 loads,
    one warp a row; K = 4096: two warps a row, the o projection's 2048 rows one wave). Fewer
    warps than a wave: each row split over more warps with fewer loads (768 rows: (1, 4, 2);
    the 128-row router: 8 warps a row, one load a lane) so every SM has loads in flight. The
    LM head streams: 4 rows a warp, 2 loads a row (2 rows for a token tile over 4), at <= 80
    registers. A row of 4-8 loads (K = 2048 bf16) over >= LIN_ROWS2 rows: 2 rows a warp in two
    rounds of half the row (H200, T = 1, PERF.md seventh session: q/k/v 5120 x 2048 7.49 us,
    0.73 of copy; LM head 142 us, 1.13; the o projection's default (1, 2, 8) 6.83 us, 0.64)."""
    nw = LIN16_THREADS // WARP
    if n >= LIN_ROWS4:
        r = 4 if t <= 4 else 2
        return Wide(r, 1, LIN16_LOADS // r, blocks_sm=3)
    per_row = cdiv(k // cw, WARP)      # a warp's loads to cover a row
    if n >= LIN_ROWS2 and t == 1 and 4 <= per_row <= LIN16_LOADS and per_row % 2 == 0:
        return Wide(2, 1, per_row // 2)
    ks = 1
    while ks < nw and ks * LIN16_LOADS < per_row:
        ks *= 2
    while ks < nw and per_row > ks and n * ks * 2 <= LIN16_WARPS:
        ks *= 2
    return Wide(1, ks, cdiv(per_row, ks))   # (U: a row in one round; no clamped loads where
                                            # the row's chunks are a multiple of 32 * ks)


def _wide_fits(w, x, norm) -> bool:
    """The 16-byte path can read these: K a multiple of a chunk (8 bf16 / 4 fp32 values), the
    rows of w, x (and the norm's g) 16-byte aligned and contiguous."""
    cw = 8 if w.dtype == np.uint16 else 4
    return w.shape[1] % cw == 0 and aligned(16, w, x, *(() if norm is None else (norm[0],)))


def linear_choice(w, x, norm=None):
    """The launch shape linear(w, x, y, ..., norm=norm) takes when not told: a Wide (the 16-byte
    path, for T <= LIN16_T_MAX where it fits) or the 8-byte path's (R, KS, U)."""
    n, k = w.shape
    t = x.shape[0]
    cw = 4 if w.dtype == np.uint16 else 2
    if t <= LIN16_T_MAX and n >= LIN16_N_MIN and _wide_fits(w, x, norm):
        return linear16_config(n, k, t, 2 * cw)
    return linear_config(n, k, t, cw)


def _token_tile(t: int) -> int:
    tt = 1
    while tt < min(t, LIN_TT_MAX):
        tt *= 2
    return tt


def _make_gemm(elem):
    @cuda.jit
    def gemm(x, w, y):
        """x float32 [T, K], w [N, K] -> y float32 [T, N]; grid (cdiv(N, 64), cdiv(T, 64)),
        256 threads, each 4 x 4 outputs; tiles of x and w staged in shared memory."""
        xs = cuda.shared.array((GEMM_BK, GEMM_BMP), float32)
        ws = cuda.shared.array((GEMM_BK, GEMM_BNP), float32)
        tid = cuda.threadIdx.x
        T, K = x.shape
        N = w.shape[0]
        m0 = cuda.blockIdx.y * GEMM_BM
        n0 = cuda.blockIdx.x * GEMM_BN
        tm = (tid // 16) * 4
        tn = (tid % 16) * 4
        acc = cuda.local.array(16, float32)
        for i in range(16):
            acc[i] = float32(0.0)
        for k0 in range(0, K, GEMM_BK):
            for e in range(tid, GEMM_BM * GEMM_BK, 256):
                r = e // GEMM_BK
                c = e % GEMM_BK
                xv = float32(0.0)
                if m0 + r < T and k0 + c < K:
                    xv = x[m0 + r, k0 + c]
                xs[c, r] = xv
                wv = float32(0.0)
                if n0 + r < N and k0 + c < K:
                    wv = elem(w, n0 + r, k0 + c)
                ws[c, r] = wv
            cuda.syncthreads()
            for c in range(GEMM_BK):
                for i in range(4):
                    a = xs[c, tm + i]
                    for j in range(4):
                        acc[i * 4 + j] += a * ws[c, tn + j]
            cuda.syncthreads()
        for i in range(4):
            for j in range(4):
                if m0 + tm + i < T and n0 + tn + j < N:
                    y[m0 + tm + i, n0 + tn + j] = acc[i * 4 + j]
    return gemm


_gemm_bf16 = _make_gemm(_elem_bf16)
_gemm_f32 = _make_gemm(_elem_f32)


def linear(w, x, y, stream, config=None, accumulate=False, norm=None):
    """y [T, N] = x [T, K] @ w [N, K]^T (y += with accumulate: a residual add without its own
    launch); w float32 or uint16 (bf16 bits), K a multiple of 4 (bf16) or 2 (fp32); x
    C-contiguous rows.

    Memory-bound matvec form for decode and small T (use gemm() for prefill). Two kernels: the
    16-byte path (K a multiple of 8 bf16 / 4 fp32 values, rows 16-byte aligned) and the 8-byte
    path (any such K). config: a Wide (the 16-byte path's shape) or an (R, KS, U) tuple (the
    8-byte path's) to override linear_choice() (benchmark sweeps).
    norm = (g float32 [K], eps, w_offset, h_out float32 [T, K] or None): x is RMS-normalised
    first, rmsnorm(x, g, eps, h_out, w_offset) fused into the same launch (one graph node
    fewer); with h_out the normalised rows are written there too (h_out must not overlap x)."""
    n, k = w.shape
    t = x.shape[0]
    if w.dtype == np.uint16:
        if k % 4:
            raise ValueError(f"bf16 linear needs K % 4 == 0, got K={k}")
        kind = "bf16"
    else:
        if k % 2:
            raise ValueError(f"fp32 linear needs K % 2 == 0, got K={k}")
        kind = "f32"
    h_out = None
    if norm is not None:
        g, eps, w_offset, h_out = norm
        if x.shape[1] != k or g.shape != (k,) or (h_out is not None and h_out.shape != x.shape):
            raise ValueError(f"linear norm: x {x.shape}, g {g.shape}, h_out "
                             f"{None if h_out is None else h_out.shape} for a weight of K={k}")
        norm_args = (g, float32(eps), float32(w_offset), y if h_out is None else h_out)
    cfg = linear_choice(w, x, norm) if config is None else config
    tt = _token_tile(t)
    if isinstance(cfg, Wide):
        if not _wide_fits(w, x, norm):
            raise ValueError(f"linear: the 16-byte path needs K % {8 if kind == 'bf16' else 4} "
                             f"== 0 and 16-byte aligned rows of w, x{', g' if norm else ''} "
                             f"(K={k})")
        smem = (tt + (norm is not None)) * k * 4       # x staged (and g)
        xs = smem <= LIN16_XS_BYTES
        exact = (k // (8 if kind == "bf16" else 4)) % (WARP * cfg.ks * cfg.u) == 0
        kern = linear16_kernel(kind, cfg, tt, xs, exact, accumulate, norm is not None,
                               h_out is not None)
        launch = kern[cdiv(n, (cfg.threads // WARP // cfg.ks) * cfg.r), cfg.threads, stream,
                      smem if xs else 0]
        wa = w.view(np.uint32) if kind == "bf16" else w
        if norm is None:
            launch(wa, x, y)
        else:
            launch(wa, x, x.view(np.uint64), y, *norm_args)
        return
    r, ks, u = cfg
    grid = cdiv(n, (LIN_THREADS // WARP // ks) * r)
    if norm is None:
        kern = linear_kernel(kind, r, ks, u, tt, accumulate)
        kern[grid, LIN_THREADS, stream](w.view(np.uint64), x.view(np.uint64), y)
        return
    kern = linear_kernel(kind, r, ks, u, tt, accumulate, True, h_out is not None)
    kern[grid, LIN_THREADS, stream](w.view(np.uint64), x.view(np.uint64), y, *norm_args)


def gemm(w, x, y, stream):
    """y [T, N] = x [T, K] @ w [N, K]^T with shared-memory tiles (prefill projections)."""
    n = w.shape[0]
    t = x.shape[0]
    kern = _gemm_bf16 if w.dtype == np.uint16 else _gemm_f32
    kern[(cdiv(n, GEMM_BN), cdiv(t, GEMM_BM)), 256, stream](x, w, y)


# ---- RMSNorm ----------------------------------------------------------------------------------

@pdl_kernel
@cuda.jit
def _rmsnorm(x, w, eps, w_offset, y):
    """x float32 [R, N], w float32 [N] -> y [R, N] = x / rms(x) * (w + w_offset); one warp a row."""
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(NORM_THREADS, float32)
    tid = cuda.threadIdx.x
    lane = tid % WARP
    r0 = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + tid // WARP
    R, N = x.shape
    r = min(r0, R - 1)
    ss = float32(0.0)
    for i in range(lane, N, WARP):
        v = x[r, i]
        ss += v * v
    ss = warp_sum(ss, red)
    inv = float32(1.0) / math.sqrt(ss / float32(N) + eps)
    if r0 < R:
        for i in range(lane, N, WARP):
            y[r, i] = x[r, i] * inv * (w[i] + w_offset)


@pdl_kernel
@cuda.jit
def _rmsnorm_block(x, w, eps, w_offset, y):
    """Long rows: one block a row (NORM_BLOCK threads), block reduction."""
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(NORM_BLOCK, float32)
    wred = cuda.shared.array(32, float32)
    r = cuda.blockIdx.x
    N = x.shape[1]
    ss = float32(0.0)
    for i in range(cuda.threadIdx.x, N, cuda.blockDim.x):
        v = x[r, i]
        ss += v * v
    ss = block_sum(ss, red, wred)
    inv = float32(1.0) / math.sqrt(ss / float32(N) + eps)
    for i in range(cuda.threadIdx.x, N, cuda.blockDim.x):
        y[r, i] = x[r, i] * inv * (w[i] + w_offset)


def rmsnorm(x, w, eps, y, stream, w_offset=0.0):
    """x [R, N] -> y [R, N] (y may be x). Per-head q/k norm: pass x as [T * nH, D].
    Rows of N >= NORM_BLOCK_MIN take a block each, shorter rows a warp each."""
    r, n = x.shape
    if n >= NORM_BLOCK_MIN:
        _rmsnorm_block[r, NORM_BLOCK, stream](x, w, float32(eps), float32(w_offset), y)
    else:
        _rmsnorm[cdiv(r, NORM_THREADS // WARP), NORM_THREADS, stream](
            x, w, float32(eps), float32(w_offset), y)


@pdl_kernel
@cuda.jit
def _layernorm(x, w, eps, y):
    """x float32 [R, N], w float32 [N] -> y [R, N] = (x - mean) / sqrt(var + eps) * w (no bias);
    one warp a row, the mean then the variance of the centred row (two reductions, no
    cancellation)."""
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(NORM_THREADS, float32)
    tid = cuda.threadIdx.x
    lane = tid % WARP
    r0 = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + tid // WARP
    R, N = x.shape
    r = min(r0, R - 1)
    s = float32(0.0)
    for i in range(lane, N, WARP):
        s += x[r, i]
    mean = warp_sum(s, red) / float32(N)
    ss = float32(0.0)
    for i in range(lane, N, WARP):
        v = x[r, i] - mean
        ss += v * v
    ss = warp_sum(ss, red)
    inv = float32(1.0) / math.sqrt(ss / float32(N) + eps)
    if r0 < R:
        for i in range(lane, N, WARP):
            y[r, i] = (x[r, i] - mean) * inv * w[i]


@pdl_kernel
@cuda.jit
def _layernorm_block(x, w, eps, y):
    """Long rows: one block a row (NORM_BLOCK threads), block reductions."""
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(NORM_BLOCK, float32)
    wred = cuda.shared.array(32, float32)
    r = cuda.blockIdx.x
    N = x.shape[1]
    s = float32(0.0)
    for i in range(cuda.threadIdx.x, N, cuda.blockDim.x):
        s += x[r, i]
    mean = block_sum(s, red, wred) / float32(N)
    ss = float32(0.0)
    for i in range(cuda.threadIdx.x, N, cuda.blockDim.x):
        v = x[r, i] - mean
        ss += v * v
    ss = block_sum(ss, red, wred)
    inv = float32(1.0) / math.sqrt(ss / float32(N) + eps)
    for i in range(cuda.threadIdx.x, N, cuda.blockDim.x):
        y[r, i] = (x[r, i] - mean) * inv * w[i]


def layernorm(x, w, eps, y, stream):
    """LayerNorm without bias (Cohere): x [R, N] -> y [R, N] (y may be x); reference.layernorm.
    Rows as rmsnorm's."""
    r, n = x.shape
    if n >= NORM_BLOCK_MIN:
        _layernorm_block[r, NORM_BLOCK, stream](x, w, float32(eps), y)
    else:
        _layernorm[cdiv(r, NORM_THREADS // WARP), NORM_THREADS, stream](x, w, float32(eps), y)


# ---- RoPE -------------------------------------------------------------------------------------

@pdl_kernel
@cuda.jit
def _rope(x, positions, inv_freq, scaling):
    """In place on x float32 [T, nH, D]: rotate-half on the first R = 2 * len(inv_freq) dims.

    positions int32 [T] (device); angles in float64 so long positions stay exact."""
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    T, nh, D = x.shape
    r2 = inv_freq.shape[0]
    if i < T * nh * r2:
        t = i // (nh * r2)
        rem = i - t * nh * r2
        h = rem // r2
        f = rem - h * r2
        ang = float64(positions[t]) * float64(inv_freq[f])
        c = float32(math.cos(ang) * scaling)
        s = float32(math.sin(ang) * scaling)
        a = x[t, h, f]
        b = x[t, h, f + r2]
        x[t, h, f] = a * c - b * s
        x[t, h, f + r2] = b * c + a * s


def rope(x, positions, inv_freq, stream, scaling=1.0):
    t, nh, _ = x.shape
    n = t * nh * inv_freq.shape[0]
    _rope[cdiv(n, EW_THREADS), EW_THREADS, stream](x, positions, inv_freq, float64(scaling))


# ---- embedding, residual ----------------------------------------------------------------------

def _make_embed(elem):
    @pdl_kernel
    @cuda.jit
    def embed(ids, table, out):
        """ids int32 [T] (device), table [V, H] -> out float32 [T, H]."""
        pdl_wait()
        pdl_trigger()
        i = cuda.grid(1)
        T, H = out.shape
        if i < T * H:
            t = i // H
            h = i - t * H
            out[t, h] = elem(table, ids[t], h)
    return embed


_embed_bf16 = _make_embed(_elem_bf16)
_embed_f32 = _make_embed(_elem_f32)


def embed(ids, table, out, stream):
    kern = _embed_bf16 if table.dtype == np.uint16 else _embed_f32
    n = out.shape[0] * out.shape[1]
    kern[cdiv(n, EW_THREADS), EW_THREADS, stream](ids, table, out)


@pdl_kernel
@cuda.jit
def _add(a, b, out):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] + b[i]


def add(a, b, out, stream):
    """out [n] = a [n] + b [n] (1-D; out may be a or b). Pass .reshape(-1) views for 2-D."""
    _add[cdiv(out.shape[0], EW_THREADS), EW_THREADS, stream](a, b, out)


# ---- fused per-head q/k RMSNorm + RoPE ---------------------------------------------------------

QKR_VARIANTS = ("base", "v2")
QKR_VARIANT = "v2"                   # qk_norm_rope()'s default
QKR_WARPS = 2 if SIM else 4          # qk_norm_rope base: heads a block (one warp each)
QKR_MAX_D = 256
QKR_DL = QKR_MAX_D // WARP           # head-dim values a lane holds
QKR_FL = QKR_MAX_D // 2 // WARP      # v2: rotary frequencies a lane holds (R / 2 <= D / 2)
QKR_THREADS = QKR_WARPS * WARP       # a module constant: shared.array needs a literal size

if SIM:
    def _sincos64(a):
        return math.sin(a), math.cos(a)
else:
    from numba.cuda import libdevice as _ld

    @cuda.jit(device=True, inline=True)
    def _sincos64(a):
        """(sin a, cos a) in float64, one range reduction for both."""
        return _ld.sincos(a)


def _make_qk_norm_rope(STORE, BF=False):
    put = putter(BF)             # the cache kind: float32 or bf16 bits

    @pdl_kernel
    @cuda.jit
    def qk_norm_rope(q, k, wq, wk, eps, w_offset, positions, inv_freq, scaling, v, kc, vc):
        """q [T, Hq, D], k [T, Hkv, D] in place; one warp a head, heads (t, 0..Hq-1) of q then
        (t, 0..Hkv-1) of k for each t; grid cdiv(T * (Hq + Hkv), QKR_WARPS). A warp normalizes
        its head (lanes over D, warp sum), parks the result in shared memory, then rotates pairs
        (f, f + R/2) and copies the dims past R. Padding warps join the reductions and barrier.
        STORE: a k head's warp also writes it, and v's head, into cache rows kc / vc [S, Hkv, D]
        at positions[t] (kv_store fused: one graph node fewer a layer)."""
        pdl_wait()
        pdl_trigger()
        red = cuda.shared.array(QKR_THREADS, float32)
        sh = cuda.shared.array((QKR_WARPS, QKR_MAX_D), float32)
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        nh = Hq + Hkv
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        g0 = cuda.blockIdx.x * QKR_WARPS + wid
        live = g0 < T * nh
        g = min(g0, T * nh - 1)
        t = g // nh
        h = g - t * nh
        isq = h < Hq                       # uniform over the warp
        x = q if isq else k
        w = wq if isq else wk
        hh = h if isq else h - Hq
        r2 = inv_freq.shape[0]
        v_ = cuda.local.array(QKR_DL, float32)
        ss = float32(0.0)
        for i in range(QKR_DL):
            d = i * WARP + lane
            a = float32(0.0)
            if d < D:
                a = x[t, hh, d]
            v_[i] = a
            ss += a * a
        ss = warp_sum(ss, red)
        inv = float32(1.0) / math.sqrt(ss / float32(D) + eps)
        for i in range(QKR_DL):
            d = i * WARP + lane
            if d < D:
                sh[wid, d] = v_[i] * inv * (w[d] + w_offset)
        cuda.syncthreads()
        if live:
            p = positions[t]
            pos = float64(p)
            store = STORE and not isq
            for f in range(lane, r2, WARP):
                ang = pos * float64(inv_freq[f])
                c = float32(math.cos(ang) * scaling)
                s = float32(math.sin(ang) * scaling)
                a = sh[wid, f]
                b = sh[wid, f + r2]
                ra = a * c - b * s
                rb = b * c + a * s
                x[t, hh, f] = ra
                x[t, hh, f + r2] = rb
                if store:
                    put(kc, p, hh, f, ra)
                    put(kc, p, hh, f + r2, rb)
            for d in range(2 * r2 + lane, D, WARP):
                x[t, hh, d] = sh[wid, d]
                if store:
                    put(kc, p, hh, d, sh[wid, d])
            if store:
                for d in range(lane, D, WARP):
                    put(vc, p, hh, d, v[t, hh, d])
    return qk_norm_rope


_qk_norm_rope = _make_qk_norm_rope(False)
_qk_norm_rope_store = {bf: _make_qk_norm_rope(True, bf) for bf in (False, True)}   # by cache kind


def _make_qk_norm_rope_v2(STORE, BF=False):
    put = putter(BF)             # the cache kind: float32 or bf16 bits

    @cuda.jit
    def qk_norm_rope_v2(q, k, wq, wk, eps, w_offset, positions, inv_freq, scaling, v, kc, vc):
        """The base kernel's result, one warp (block) a head: grid T * (Hq + Hkv), block b =
        head b % (Hq + Hkv) (q's heads, then k's) of token b // (Hq + Hkv). Every load is issued
        first (one memory latency), all in registers, no shared memory or barrier: lane l holds
        the rotary pairs (f, f + R/2) for f = l, l + 32, ... < R/2 (xa, xb) with the cos / sin of
        those frequencies (float64 angle and sincos, computed while the norm's sum reduces), and
        the dims past R at 2 * (R/2) + l, + 32, ... (xc). STORE: a k head's warp also writes
        it, and v's head (lane l: dims l, l + 32, ...), into the cache rows at positions[t]."""
        red = cuda.shared.array(WARP, float32)        # the simulator's warp_sum only
        T, Hq, D = q.shape
        nh = Hq + k.shape[1]
        lane = cuda.threadIdx.x
        t = cuda.blockIdx.x // nh
        h = cuda.blockIdx.x - t * nh
        isq = h < Hq                                  # uniform over the block
        x = q if isq else k
        w = wq if isq else wk
        hh = h if isq else h - Hq
        store = STORE and not isq
        r2 = inv_freq.shape[0]
        r = 2 * r2
        xa = cuda.local.array(QKR_FL, float32)
        xb = cuda.local.array(QKR_FL, float32)
        wa = cuda.local.array(QKR_FL, float32)
        wb = cuda.local.array(QKR_FL, float32)
        fr = cuda.local.array(QKR_FL, float32)
        xc = cuda.local.array(QKR_DL, float32)
        wc = cuda.local.array(QKR_DL, float32)
        vv = cuda.local.array(QKR_DL, float32)
        pdl_wait()
        pdl_trigger()
        p = positions[t]
        for j in range(QKR_FL):
            f = j * WARP + lane
            if f < r2:
                fr[j] = inv_freq[f]
                xa[j] = x[t, hh, f]
                xb[j] = x[t, hh, f + r2]
                wa[j] = w[f]
                wb[j] = w[f + r2]
        for i in range(QKR_DL):
            d = r + i * WARP + lane
            if d < D:
                xc[i] = x[t, hh, d]
                wc[i] = w[d]
            if store and i * WARP + lane < D:
                vv[i] = v[t, hh, i * WARP + lane]
        ss = float32(0.0)
        for j in range(QKR_FL):
            if j * WARP + lane < r2:
                ss += xa[j] * xa[j] + xb[j] * xb[j]
        for i in range(QKR_DL):
            if r + i * WARP + lane < D:
                ss += xc[i] * xc[i]
        cs = cuda.local.array(QKR_FL, float32)
        sn = cuda.local.array(QKR_FL, float32)
        pos = float64(p)
        for j in range(QKR_FL):
            if j * WARP + lane < r2:
                s64, c64 = _sincos64(pos * float64(fr[j]))
                cs[j] = float32(c64 * scaling)
                sn[j] = float32(s64 * scaling)
        ss = warp_sum(ss, red)
        inv = float32(1.0) / math.sqrt(ss / float32(D) + eps)
        for j in range(QKR_FL):
            f = j * WARP + lane
            if f < r2:
                a = xa[j] * inv * (wa[j] + w_offset)
                b = xb[j] * inv * (wb[j] + w_offset)
                ra = a * cs[j] - b * sn[j]
                rb = b * cs[j] + a * sn[j]
                x[t, hh, f] = ra
                x[t, hh, f + r2] = rb
                if store:
                    put(kc, p, hh, f, ra)
                    put(kc, p, hh, f + r2, rb)
        for i in range(QKR_DL):
            d = r + i * WARP + lane
            if d < D:
                y = xc[i] * inv * (wc[i] + w_offset)
                x[t, hh, d] = y
                if store:
                    put(kc, p, hh, d, y)
            if store and i * WARP + lane < D:
                put(vc, p, hh, i * WARP + lane, vv[i])
    return qk_norm_rope_v2


_qk_norm_rope_v2 = pdl_kernel(_make_qk_norm_rope_v2(False))
_qk_norm_rope_v2_store = {bf: pdl_kernel(_make_qk_norm_rope_v2(True, bf)) for bf in (False, True)}


def qk_norm_rope(q, k, wq, wk, eps, positions, inv_freq, scaling, stream, w_offset=0.0,
                 cache=None, variant=None):
    """Per-head RMSNorm of q [T, Hq, D] and k [T, Hkv, D] (weights wq, wk [D], each plus
    w_offset), then RoPE as rope() does it (the first 2 * len(inv_freq) dims, cos / sin times
    scaling), in place, in one launch: rmsnorm(q), rmsnorm(k), rope(q), rope(k) fused.
    cache = (v, kc, vc): also kv_store(k, v, kc, vc, positions) in the same launch (caches
    float32, or uint16 bf16 bits: the rows rounded to nearest even).
    variant: one of QKR_VARIANTS (default QKR_VARIANT): "base" = QKR_WARPS heads a block,
    the normed head parked in shared memory; "v2" = one warp a block, registers only."""
    t, hq, d = q.shape
    if d > QKR_MAX_D or k.shape[2] != d or k.shape[0] != t:
        raise ValueError(f"qk_norm_rope: q {q.shape}, k {k.shape} (head dim <= {QKR_MAX_D})")
    if 2 * inv_freq.shape[0] > d:
        raise ValueError(f"qk_norm_rope: {inv_freq.shape[0]} frequencies exceed head dim {d}")
    variant = QKR_VARIANT if variant is None else variant
    if variant not in QKR_VARIANTS:
        raise ValueError(f"unknown qk_norm_rope variant {variant!r} (one of {QKR_VARIANTS})")
    heads = t * (hq + k.shape[1])
    v, kc, vc = (k, k, k) if cache is None else cache
    if cache is not None and (v.shape != k.shape or kc.shape[1:] != k.shape[1:]
                              or vc.shape != kc.shape or vc.dtype != kc.dtype):
        raise ValueError(f"qk_norm_rope: v {v.shape} / caches {kc.shape}, {vc.shape} do not "
                         f"match k {k.shape}")
    args = (q, k, wq, wk, float32(eps), float32(w_offset), positions, inv_freq,
            float64(scaling), v, kc, vc)
    if variant == "v2":
        bf = kc.dtype == np.uint16
        kern = _qk_norm_rope_v2 if cache is None else _qk_norm_rope_v2_store[bf]
        kern[heads, WARP, stream](*args)
        return
    kern = _qk_norm_rope if cache is None else _qk_norm_rope_store[kc.dtype == np.uint16]
    kern[cdiv(heads, QKR_WARPS), QKR_THREADS, stream](*args)
