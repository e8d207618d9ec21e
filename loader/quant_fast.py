"""numba encoders for the expert formats, byte-identical to the numpy references in loader/quant.py.

The packer spends its time here: one pass finds each row's amax and counts NaN/Inf, a second
encodes. Every step is the reference's arithmetic in the same float32 order (no fastmath, no
reciprocals): E4M3 FN and bf16 by the same integer rounding of the float bits, E2M1 by comparing
against the midpoints of its grid (the tie goes to the even code), which is the reference's
round-to-nearest-even on a grid of eight magnitudes.

Each kernel is compiled twice from one body: `parallel=True` (rows over numba's threads) and a
serial `nogil` one. `pick()` hands out the parallel one to one caller at a time and the serial
one to callers on other threads while it is taken (the packer's encoding pool is its own
parallelism, and numba's workqueue threading layer aborts when two threads enter a parallel
kernel at once).
Legend: R = rows, K = columns, Kp = K rounded up to a multiple of 16, G = Kp / 16 blocks per row.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic

NVFP4_GROUP = 16          # values per E4M3 block scale (loader/layout.py)


def _e4m3_values() -> np.ndarray:
    b = np.arange(256)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, (8 + man) * 2.0 ** (exp - 10.0))
    val = np.where(b & 0x80, -mag, mag)
    val[(exp == 0xF) & (man == 0x7)] = np.nan
    return val.astype(np.float32)


E4M3_VALUES = _e4m3_values()   # [256] f32, code -> value (a compile-time constant in the kernels)


@intrinsic
def _bits(typingctx, x):
    """float32 -> its uint32 bit pattern (a register bitcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _float(typingctx, b):
    """Integer holding a float32 bit pattern in its low 32 bits -> that float32."""
    if not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if b.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())
    return types.float32(b), codegen


@njit(inline="always")
def _e4m3(x):
    """float32 -> E4M3 FN code (uint8) as loader.quant.f32_to_e4m3_ref: RNE, subnormals, 448."""
    a = min(abs(x), np.float32(448.0))      # NaN: min(NaN, 448) is NaN, caught below
    b = _bits(a)
    normal = np.int32((b + np.uint32(0x7FFFF) + ((b >> np.uint32(20)) & np.uint32(1)))
                      >> np.uint32(20)) - np.int32(960)
    # below 2**-6: rint(a * 512); a * 512 < 8 is exact, and adding 2**23 rounds it to an integer
    # (float32 spacing is 1 in [2**23, 2**24)) to nearest even
    sub = np.int32(_bits(a * np.float32(512.0) + np.float32(8388608.0)) - np.uint32(0x4B000000))
    code = sub if a < np.float32(2.0 ** -6) else normal
    code |= np.int32(_bits(x) >> np.uint32(31)) << np.int32(7)   # signbit, -0.0 included
    if a != a:
        code = np.int32(0x7F)
    return np.uint8(code)


@njit(inline="always")
def _e2m1(v):
    """float32 (value / its scale) -> E2M1 code (uint8, sign in bit 3), RNE, saturating at 6."""
    a = abs(v)
    # midpoints of 0, .5, 1, 1.5, 2, 3, 4, 6; a tie goes to the even code (0, 2, 4, 6)
    code = (np.int32(a > np.float32(0.25)) + np.int32(a >= np.float32(0.75))
            + np.int32(a > np.float32(1.25)) + np.int32(a >= np.float32(1.75))
            + np.int32(a > np.float32(2.5)) + np.int32(a >= np.float32(3.5))
            + np.int32(a > np.float32(5.0)))
    if v < np.float32(0.0) and code > 0:
        code |= np.int32(8)
    return np.uint8(code)


# ---- kernel bodies (compiled twice below) ---------------------------------------------------

def _row_amax_body(w, amax, bad):
    """w f32 [R, K] -> amax f32 [R] (max |w| of the row), bad i64 [R] (NaN/Inf count of the row).

    |x| is compared as its bits: for finite floats the orders agree, and integers vectorize."""
    r, k = w.shape
    for i in prange(r):
        m = np.uint32(0)
        n = 0
        for j in range(k):
            b = _bits(w[i, j]) & np.uint32(0x7FFFFFFF)
            m = max(m, b)
            n += np.int64(b >= np.uint32(0x7F800000))   # Inf or NaN
        amax[i] = _float(m)
        bad[i] = n


def _nvfp4_body(w, g, q, s):
    """w f32 [R, K], g the float32 global scale -> q u8 [R, Kp/2], s u8 [R, G] (E4M3 scales).

    Columns past K are zeros: they never raise a block's amax and round to code 0."""
    r, k = w.shape
    nb = s.shape[1]
    for i in prange(r):
        v = np.zeros(NVFP4_GROUP, np.float32)       # [16] one block, zero-padded past K
        for blk in range(nb):
            j0 = blk * NVFP4_GROUP
            if j0 + NVFP4_GROUP <= k:
                for t in range(NVFP4_GROUP):
                    v[t] = w[i, j0 + t]
            else:
                for t in range(NVFP4_GROUP):
                    v[t] = w[i, j0 + t] if j0 + t < k else np.float32(0.0)
            m = np.uint32(0)
            for t in range(NVFP4_GROUP):
                m = max(m, _bits(v[t]) & np.uint32(0x7FFFFFFF))
            sc = _e4m3(_float(m) / np.float32(6.0) / g)
            s[i, blk] = sc
            d = E4M3_VALUES[sc] * g
            qo = blk * (NVFP4_GROUP // 2)
            if d > np.float32(0.0):
                for t in range(NVFP4_GROUP // 2):
                    q[i, qo + t] = _e2m1(v[2 * t] / d) | (_e2m1(v[2 * t + 1] / d) << np.uint8(4))
            else:                                    # a zero scale: all codes 0
                for t in range(NVFP4_GROUP // 2):
                    q[i, qo + t] = np.uint8(0)


def _fp8_body(w, s, q):
    """w f32 [R, K], s f32 [R] row scales -> q u8 [R, K] E4M3 codes of w / s[r]."""
    r, k = w.shape
    for i in prange(r):
        d = s[i]
        for j in range(k):
            q[i, j] = _e4m3(w[i, j] / d)


def _e4m3_body(x, out):
    """x f32 [N] -> out u8 [N] E4M3 codes."""
    for i in prange(x.shape[0]):
        out[i] = _e4m3(x[i])


def _bf16_body(x, out):
    """x f32 [N] -> out u16 [N] bfloat16 bits, RNE; NaN -> its top half with the quiet bit set."""
    for i in prange(x.shape[0]):
        b = _bits(x[i])
        r = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        if x[i] != x[i]:
            r = np.uint16(b >> np.uint32(16)) | np.uint16(0x0040)
        out[i] = r


# ---- the two compiles, and who gets which ----------------------------------------------------

def _compile(body):
    return (njit(parallel=True, cache=True, nogil=True)(body),
            njit(cache=True, nogil=True)(body))


_ROW_AMAX = _compile(_row_amax_body)
_NVFP4 = _compile(_nvfp4_body)
_FP8 = _compile(_fp8_body)
_E4M3 = _compile(_e4m3_body)
_BF16 = _compile(_bf16_body)
_parallel_lock = threading.Lock()


@contextlib.contextmanager
def pick(kernel):
    """Yield the parallel compile of kernel if no other thread is inside one, else the serial one."""
    if _parallel_lock.acquire(blocking=False):
        try:
            yield kernel[0]
        finally:
            _parallel_lock.release()
    else:
        yield kernel[1]


# ---- entry points (arrays already float32, C-contiguous) -------------------------------------

def row_amax(w: np.ndarray) -> tuple[np.ndarray, int]:
    """w f32 [R, K] -> (amax f32 [R], number of NaN/Inf values)."""
    amax = np.empty(w.shape[0], np.float32)
    bad = np.empty(w.shape[0], np.int64)
    with pick(_ROW_AMAX) as f:
        f(w, amax, bad)
    return amax, int(bad.sum())


def nvfp4(w: np.ndarray, g: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [R, K], g float32 global scale -> (q u8 [R, Kp/2], s u8 [R, G])."""
    r, k = w.shape
    nb = -(-k // NVFP4_GROUP)
    q = np.empty((r, nb * NVFP4_GROUP // 2), np.uint8)
    s = np.empty((r, nb), np.uint8)
    with pick(_NVFP4) as f:
        f(w, np.float32(g), q, s)
    return q, s


def fp8(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """w f32 [R, K], s f32 [R] (non-zero) -> q u8 [R, K] E4M3 codes of w / s[r]."""
    q = np.empty(w.shape, np.uint8)
    with pick(_FP8) as f:
        f(w, s, q)
    return q


def e4m3(x: np.ndarray) -> np.ndarray:
    """x f32 (any shape, C-contiguous) -> u8 E4M3 codes of the same shape."""
    out = np.empty(x.shape, np.uint8)
    with pick(_E4M3) as f:
        f(x.reshape(-1), out.reshape(-1))
    return out


def bf16(x: np.ndarray) -> np.ndarray:
    """x f32 (any shape, C-contiguous) -> u16 bfloat16 bits of the same shape."""
    out = np.empty(x.shape, np.uint16)
    with pick(_BF16) as f:
        f(x.reshape(-1), out.reshape(-1))
    return out
