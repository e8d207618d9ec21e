"""CUDA dense kernels: linear (fp32 / bf16 weights), tiled GEMM, RMSNorm, RoPE, embedding, add.

Legend: T = tokens, K = a matrix's inner size, N = its rows (outputs), H = hidden,
nH = heads, D = head dim, R = rotary dims (R <= D), V = vocab.
Weights are float32 or uint16 bfloat16 bits, row-major [N, K]; activations float32.
Every launcher takes an explicit stream, allocates nothing and never syncs, so a sequence of
them can be captured in a CUDA graph; positions and token ids are read from device memory.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, uint32, uint64

from .gpu_util import M32, SIM, WARP, block_sum, cdiv, int_as_float, warp_sum

LIN_THREADS = 64 if SIM else 256    # linear: one warp per output row
LIN_TT = 4                           # linear: tokens per pass over a weight row
LIN_U = 4                            # linear: 8-byte loads in flight per lane
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


def _make_linear(cw, chunk):
    @cuda.jit
    def linear(w64, x, y):
        """w64 uint64 [N, K / cw] (weights viewed 8 bytes at a time), x float32 [T, K]
        -> y float32 [T, N]; grid cdiv(N, warps). A lane issues LIN_U loads before it computes."""
        red = cuda.shared.array(LIN_THREADS, float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        n0 = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + tid // WARP
        N = w64.shape[0]
        nch = w64.shape[1]
        T = x.shape[0]
        n = min(n0, N - 1)
        v = cuda.local.array(cw, float32)
        acc = cuda.local.array(LIN_TT, float32)
        wq = cuda.local.array(LIN_U, uint64)
        for t0 in range(0, T, LIN_TT):
            nt = min(LIN_TT, T - t0)
            for q in range(LIN_TT):
                acc[q] = float32(0.0)
            for jb in range(lane, nch, WARP * LIN_U):
                for u in range(LIN_U):
                    wq[u] = w64[n, min(jb + u * WARP, nch - 1)]
                for u in range(LIN_U):
                    j = jb + u * WARP
                    if j < nch:
                        chunk(wq[u], v)
                        for q in range(LIN_TT):
                            if q < nt:
                                s = float32(0.0)
                                for c in range(cw):
                                    s += v[c] * x[t0 + q, j * cw + c]
                                acc[q] += s
            for q in range(LIN_TT):
                acc[q] = warp_sum(acc[q], red)
            if lane == 0 and n0 < N:
                for q in range(LIN_TT):
                    if q < nt:
                        y[t0 + q, n0] = acc[q]
    return linear


_linear_bf16 = _make_linear(4, _chunk_bf16)
_linear_f32 = _make_linear(2, _chunk_f32)


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


def linear(w, x, y, stream):
    """y [T, N] = x [T, K] @ w [N, K]^T; w float32 or uint16 (bf16 bits), K a multiple of 4.

    Memory-bound matvec form (one warp per output row, tokens in passes of LIN_TT): for decode
    and small T; use gemm() for prefill."""
    n, k = w.shape
    if w.dtype == np.uint16:
        if k % 4:
            raise ValueError(f"bf16 linear needs K % 4 == 0, got K={k}")
        kern = _linear_bf16
    else:
        if k % 2:
            raise ValueError(f"fp32 linear needs K % 2 == 0, got K={k}")
        kern = _linear_f32
    kern[cdiv(n, LIN_THREADS // WARP), LIN_THREADS, stream](w.view(np.uint64), x, y)


def gemm(w, x, y, stream):
    """y [T, N] = x [T, K] @ w [N, K]^T with shared-memory tiles (prefill projections)."""
    n = w.shape[0]
    t = x.shape[0]
    kern = _gemm_bf16 if w.dtype == np.uint16 else _gemm_f32
    kern[(cdiv(n, GEMM_BN), cdiv(t, GEMM_BM)), 256, stream](x, w, y)


# ---- RMSNorm ----------------------------------------------------------------------------------

@cuda.jit
def _rmsnorm(x, w, eps, w_offset, y):
    """x float32 [R, N], w float32 [N] -> y [R, N] = x / rms(x) * (w + w_offset); one warp a row."""
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


@cuda.jit
def _rmsnorm_block(x, w, eps, w_offset, y):
    """Long rows: one block a row (NORM_BLOCK threads), block reduction."""
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


# ---- RoPE -------------------------------------------------------------------------------------

@cuda.jit
def _rope(x, positions, inv_freq, scaling):
    """In place on x float32 [T, nH, D]: rotate-half on the first R = 2 * len(inv_freq) dims.

    positions int32 [T] (device); angles in float64 so long positions stay exact."""
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
    @cuda.jit
    def embed(ids, table, out):
        """ids int32 [T] (device), table [V, H] -> out float32 [T, H]."""
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


@cuda.jit
def _add(a, b, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] + b[i]


def add(a, b, out, stream):
    """out [n] = a [n] + b [n] (1-D; out may be a or b). Pass .reshape(-1) views for 2-D."""
    _add[cdiv(out.shape[0], EW_THREADS), EW_THREADS, stream](a, b, out)
