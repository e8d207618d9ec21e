"""Shared pieces of the CUDA kernels: simulator switch, warp reductions, bit casts, tables.

The same kernel source runs on the GPU and under NUMBA_ENABLE_CUDASIM=1 (CI). The simulator has
no warp shuffles, so the warp reductions here use a shared-memory path there; callers pass a
per-block float32 scratch `red` of at least the block's thread count (`red_i` int32 likewise
for arg-reductions) and must call a reduction from every thread of the block (uniform control
flow), which the GPU path does not need but the simulator's barriers do.
Blocks are 1-D; lane = threadIdx.x % 32, warp = threadIdx.x // 32.
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda, float32, int32, uint32, uint64

SIM = bool(config.ENABLE_CUDASIM)  # read once at import: the env var must be set before numba
WARP = 32
FULL_MASK = 0xFFFFFFFF
M32 = np.uint64(0xFFFFFFFF)
U32_15 = np.uint32(15)
NEG_INF = float32(-math.inf)


def _e4m3_table() -> np.ndarray:
    """float32 [256]: every FP8 E4M3 (FN) code decoded; 0x7f / 0xff decode to NaN."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((exp == 0xF) & (man == 0x7), np.nan, val)
    return (sign * val).astype(np.float32)


E4M3_TABLE = _e4m3_table()  # float32 [256]
E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---- bit casts -------------------------------------------------------------------------------

if SIM:
    def int_as_float(i):
        return np.array([int(i) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    def float_as_uint(f):
        return np.uint32(np.array([f], dtype=np.float32).view(np.uint32)[0])
else:
    from numba.cuda import libdevice as _ld

    @cuda.jit(device=True, inline=True)
    def int_as_float(i):
        return _ld.int_as_float(int32(i))

    @cuda.jit(device=True, inline=True)
    def float_as_uint(f):
        return uint32(_ld.float_as_int(f))


@cuda.jit(device=True, inline=True)
def bf16_lo(w):
    """The bfloat16 in the low half of a uint32 word, as float32."""
    return int_as_float((w & 0xFFFF) << 16)


@cuda.jit(device=True, inline=True)
def bf16_hi(w):
    """The bfloat16 in the high half of a uint32 word, as float32."""
    return int_as_float(w & 0xFFFF0000)


@cuda.jit(device=True, inline=True)
def bf16_at(bits):
    """One uint16 bfloat16 -> float32."""
    return int_as_float(uint32(bits) << 16)


# ---- warp reductions -------------------------------------------------------------------------

if SIM:
    @cuda.jit(device=True)
    def warp_sum(v, red):
        """Sum of v over the warp, returned to every lane."""
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        red[tid] = v
        cuda.syncthreads()
        base = tid - tid % WARP
        s = float32(0.0)
        for i in range(WARP):
            s += red[base + i]
        cuda.syncthreads()
        return s

    @cuda.jit(device=True)
    def warp_max(v, red):
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        red[tid] = v
        cuda.syncthreads()
        base = tid - tid % WARP
        m = red[base]
        for i in range(1, WARP):
            m = max(m, red[base + i])
        cuda.syncthreads()
        return m

    @cuda.jit(device=True)
    def warp_argmax(v, i, red, red_i):
        """(max value, lowest index holding it) over the warp, to every lane."""
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        red[tid] = v
        red_i[tid] = i
        cuda.syncthreads()
        base = tid - tid % WARP
        bv = red[base]
        bi = red_i[base]
        for j in range(1, WARP):
            ov = red[base + j]
            oi = red_i[base + j]
            if ov > bv or (ov == bv and oi < bi):
                bv = ov
                bi = oi
        cuda.syncthreads()
        return bv, bi
else:
    @cuda.jit(device=True, inline=True)
    def warp_sum(v, red):
        """Sum of v over the warp, returned to every lane (xor butterfly)."""
        v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
        return v

    @cuda.jit(device=True, inline=True)
    def warp_max(v, red):
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 8))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 4))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 2))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 1))
        return v

    @cuda.jit(device=True, inline=True)
    def warp_argmax(v, i, red, red_i):
        """(max value, lowest index holding it) over the warp, to every lane."""
        off = 16
        while off > 0:
            ov = cuda.shfl_xor_sync(FULL_MASK, v, off)
            oi = cuda.shfl_xor_sync(FULL_MASK, i, off)
            if ov > v or (ov == v and oi < i):
                v = ov
                i = oi
            off //= 2
        return v, i


if SIM:
    @cuda.jit(device=True)
    def warp_sync():
        """Orders shared-memory accesses among a warp's lanes (the simulator has no syncwarp: a
        block barrier there, so every thread of the block must reach each call)."""
        cuda.syncthreads()
else:
    @cuda.jit(device=True, inline=True)
    def warp_sync():
        cuda.syncwarp()


@cuda.jit(device=True, inline=True)
def block_sum(v, red, wred):
    """Sum over the whole block, to every thread. wred: float32 shared [>= warps]."""
    s = warp_sum(v, red)
    tid = cuda.threadIdx.x
    nw = (cuda.blockDim.x + WARP - 1) // WARP
    cuda.syncthreads()
    if tid % WARP == 0:
        wred[tid // WARP] = s
    cuda.syncthreads()
    t = float32(0.0)
    for w in range(nw):
        t += wred[w]
    cuda.syncthreads()
    return t


@cuda.jit(device=True, inline=True)
def block_max(v, red, wred):
    m = warp_max(v, red)
    tid = cuda.threadIdx.x
    nw = (cuda.blockDim.x + WARP - 1) // WARP
    cuda.syncthreads()
    if tid % WARP == 0:
        wred[tid // WARP] = m
    cuda.syncthreads()
    t = wred[0]
    for w in range(1, nw):
        t = max(t, wred[w])
    cuda.syncthreads()
    return t


@cuda.jit(device=True, inline=True)
def block_argmax(v, i, red, red_i, wred, wred_i):
    bv, bi = warp_argmax(v, i, red, red_i)
    tid = cuda.threadIdx.x
    nw = (cuda.blockDim.x + WARP - 1) // WARP
    cuda.syncthreads()
    if tid % WARP == 0:
        wred[tid // WARP] = bv
        wred_i[tid // WARP] = bi
    cuda.syncthreads()
    bv = wred[0]
    bi = wred_i[0]
    for w in range(1, nw):
        ov = wred[w]
        oi = wred_i[w]
        if ov > bv or (ov == bv and oi < bi):
            bv = ov
            bi = oi
    cuda.syncthreads()
    return bv, bi


@cuda.jit(device=True, inline=True)
def silu(v):
    return v / (float32(1.0) + math.exp(-v))


def poison(arr) -> None:
    """Fill a float device array with NaN (tests: outputs poisoned before each run)."""
    host = np.full(arr.shape, np.nan, dtype=arr.dtype) if arr.dtype.kind == "f" else \
        np.full(arr.shape, -1, dtype=arr.dtype)
    arr.copy_to_device(host)


__all__ = ["SIM", "WARP", "E4M3_TABLE", "E2M1_TABLE", "cdiv", "int_as_float", "float_as_uint",
           "bf16_lo", "bf16_hi", "bf16_at", "warp_sum", "warp_max", "warp_argmax", "warp_sync",
           "block_sum", "block_max", "block_argmax", "silu", "poison", "uint64", "M32", "U32_15"]
