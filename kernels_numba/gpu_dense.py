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
from numba import cuda, float32, float64, uint32, uint64

from .gpu_util import M32, SIM, WARP, block_sum, cdiv, int_as_float, warp_sum

LIN_THREADS = 64 if SIM else 256    # linear: 8 warps a block
LIN_TT_MAX = 8                       # linear: tokens per pass over the weights (T <= 7 in one)
LIN_LOADS = 8                        # linear: 8-byte weight loads in flight per lane (U * R)
LIN_WARPS_MIN = 4 if SIM else 2560   # linear: warps wanted in flight (132 SMs x ~20)
LIN_ROWS2 = 4 if SIM else 2048       # linear: matrices of this many rows take 2 rows a warp
LIN_ROWS4 = 64 if SIM else 65536     # ... and of this many 4 (the LM head)
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


def _make_linear(cw, chunk, R, KS, U, TT, ACC=False, NORM=False, HOUT=False):
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
            if NORM:   # after the weights: the block's loads do not wait for the norm
                _norm_pass(x64, t0, nt, eps, inv, red, part, TT, NW)
                if HOUT:
                    _norm_store(x64, t0, nt, g, w_offset, inv, h_out, TT)
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

    if NORM:
        @cuda.jit
        def linear_norm(w64, x64, y, g, eps, w_offset, h_out):
            body(w64, x64, y, g, eps, w_offset, h_out)
        return linear_norm

    @cuda.jit
    def linear(w64, x64, y):
        body(w64, x64, y, y[0], float32(0.0), float32(0.0), y)   # the norm arguments unused
    return linear


@cuda.jit(device=True, inline=True)
def _norm_pass(x64, t0, nt, eps, inv, red, part, TT, NW):
    """inv[q] = 1 / rms(x[t0 + q]) for q < nt, to every thread of the block (a block reduction,
    the sum in part[:, :TT]; rmsnorm's formula). Called by every thread."""
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    k2 = x64.shape[1]
    for q in range(TT):
        ss = float32(0.0)
        if q < nt:
            for j in range(tid, k2, LIN_THREADS):
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
def _norm_store(x64, t0, nt, g, w_offset, inv, h_out, TT):
    """h_out[t0 + q] = x[t0 + q] * inv[q] * (g + w_offset) for q < nt: this block's grid-stride
    share of the float pairs (blocks write disjoint elements; h_out must not overlap x)."""
    k2 = x64.shape[1]
    i0 = cuda.blockIdx.x * LIN_THREADS + cuda.threadIdx.x
    step = cuda.gridDim.x * LIN_THREADS
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
    key = (kind, r, ks, u, tt, bool(acc), bool(norm), bool(norm and h_out))
    if key not in _LINEAR:
        if (LIN_THREADS // WARP) % ks:
            raise ValueError(f"linear: {ks} warps per row do not divide a {LIN_THREADS}-thread block")
        cw, chunk = (4, _chunk_bf16) if kind == "bf16" else (2, _chunk_f32)
        _LINEAR[key] = _make_linear(cw, chunk, r, ks, u, tt, *key[5:])
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

    Memory-bound matvec form for decode and small T (use gemm() for prefill). config: (R, KS,
    U) to override linear_config()'s choice (benchmark sweeps).
    norm = (g float32 [K], eps, w_offset, h_out float32 [T, K] or None): x is RMS-normalised
    first, rmsnorm(x, g, eps, h_out, w_offset) fused into the same launch (one graph node
    fewer); with h_out the normalised rows are written there too (h_out must not overlap x)."""
    n, k = w.shape
    t = x.shape[0]
    if w.dtype == np.uint16:
        if k % 4:
            raise ValueError(f"bf16 linear needs K % 4 == 0, got K={k}")
        kind, cw = "bf16", 4
    else:
        if k % 2:
            raise ValueError(f"fp32 linear needs K % 2 == 0, got K={k}")
        kind, cw = "f32", 2
    r, ks, u = config or linear_config(n, k, t, cw)
    grid = cdiv(n, (LIN_THREADS // WARP // ks) * r)
    if norm is None:
        kern = linear_kernel(kind, r, ks, u, _token_tile(t), accumulate)
        kern[grid, LIN_THREADS, stream](w.view(np.uint64), x.view(np.uint64), y)
        return
    g, eps, w_offset, h_out = norm
    if x.shape[1] != k or g.shape != (k,) or (h_out is not None and h_out.shape != x.shape):
        raise ValueError(f"linear norm: x {x.shape}, g {g.shape}, h_out "
                         f"{None if h_out is None else h_out.shape} for a weight of K={k}")
    kern = linear_kernel(kind, r, ks, u, _token_tile(t), accumulate, True, h_out is not None)
    kern[grid, LIN_THREADS, stream](w.view(np.uint64), x.view(np.uint64), y, g, float32(eps),
                                    float32(w_offset), y if h_out is None else h_out)


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


def _make_qk_norm_rope(STORE):
    @cuda.jit
    def qk_norm_rope(q, k, wq, wk, eps, w_offset, positions, inv_freq, scaling, v, kc, vc):
        """q [T, Hq, D], k [T, Hkv, D] in place; one warp a head, heads (t, 0..Hq-1) of q then
        (t, 0..Hkv-1) of k for each t; grid cdiv(T * (Hq + Hkv), QKR_WARPS). A warp normalizes
        its head (lanes over D, warp sum), parks the result in shared memory, then rotates pairs
        (f, f + R/2) and copies the dims past R. Padding warps join the reductions and barrier.
        STORE: a k head's warp also writes it, and v's head, into cache rows kc / vc [S, Hkv, D]
        at positions[t] (kv_store fused: one graph node fewer a layer)."""
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
                    kc[p, hh, f] = ra
                    kc[p, hh, f + r2] = rb
            for d in range(2 * r2 + lane, D, WARP):
                x[t, hh, d] = sh[wid, d]
                if store:
                    kc[p, hh, d] = sh[wid, d]
            if store:
                for d in range(lane, D, WARP):
                    vc[p, hh, d] = v[t, hh, d]
    return qk_norm_rope


_qk_norm_rope = _make_qk_norm_rope(False)
_qk_norm_rope_store = _make_qk_norm_rope(True)


def _make_qk_norm_rope_v2(STORE):
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
                    kc[p, hh, f] = ra
                    kc[p, hh, f + r2] = rb
        for i in range(QKR_DL):
            d = r + i * WARP + lane
            if d < D:
                y = xc[i] * inv * (wc[i] + w_offset)
                x[t, hh, d] = y
                if store:
                    kc[p, hh, d] = y
            if store and i * WARP + lane < D:
                vc[p, hh, i * WARP + lane] = vv[i]
    return qk_norm_rope_v2


_qk_norm_rope_v2 = _make_qk_norm_rope_v2(False)
_qk_norm_rope_v2_store = _make_qk_norm_rope_v2(True)


def qk_norm_rope(q, k, wq, wk, eps, positions, inv_freq, scaling, stream, w_offset=0.0,
                 cache=None, variant=None):
    """Per-head RMSNorm of q [T, Hq, D] and k [T, Hkv, D] (weights wq, wk [D], each plus
    w_offset), then RoPE as rope() does it (the first 2 * len(inv_freq) dims, cos / sin times
    scaling), in place, in one launch: rmsnorm(q), rmsnorm(k), rope(q), rope(k) fused.
    cache = (v, kc, vc): also kv_store(k, v, kc, vc, positions) in the same launch.
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
                              or vc.shape != kc.shape):
        raise ValueError(f"qk_norm_rope: v {v.shape} / caches {kc.shape}, {vc.shape} do not "
                         f"match k {k.shape}")
    args = (q, k, wq, wk, float32(eps), float32(w_offset), positions, inv_freq,
            float64(scaling), v, kc, vc)
    if variant == "v2":
        kern = _qk_norm_rope_v2 if cache is None else _qk_norm_rope_v2_store
        kern[heads, WARP, stream](*args)
        return
    kern = _qk_norm_rope if cache is None else _qk_norm_rope_store
    kern[cdiv(heads, QKR_WARPS), QKR_THREADS, stream](*args)
