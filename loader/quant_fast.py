"""numba encoders for the expert formats, byte-identical to the numpy references in loader/quant.py.

The packer spends its time here. NVFP4 takes two passes over a matrix: one finds every 16-block's
amax (the global scale needs the matrix amax before any block can be encoded; a block holding NaN
or Inf shows as a maximum at or above Inf's bits, so the refusal costs nothing more), one encodes.
Every step keeps the reference's float32 arithmetic in the reference's order: no fastmath, no
reciprocals, true divisions. E4M3 FN and bf16 round the float bits exactly as the
reference does; E2M1 rounds |v| <= 6 by the same integer trick (mantissa to one bit, nearest
even); a zero block scale divides by +Inf so its codes come out 0, as the reference's masked
divide leaves them. The kernels are compiled with error_model="numpy" (a float division by zero
gives Inf instead of a Python exception): the check would stop LLVM from vectorizing the loops.

Each kernel is compiled twice from one body: parallel=True (row chunks over numba's threads) and a
serial nogil one. Calls from the main thread get the parallel compile; calls from any other thread
get the serial one: the packer encodes on a thread pool (loader/arena.py write_arena), which is
its own parallelism, and numba's workqueue threading layer aborts when two threads enter a
parallel kernel at once.
Legend: R = rows, K = columns, Kp = K rounded up to a multiple of 16, G = Kp / 16 blocks per row,
N = elements of a flat array.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic

GROUP = 16                # NVFP4 values per E4M3 block scale (loader/layout.py NVFP4_GROUP)
ROWS_PER_TASK = 16        # rows per parallel work item (per-task scratch is allocated once)


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


def _e4m3_values() -> np.ndarray:
    b = np.arange(256)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, (8 + man) * 2.0 ** (exp - 10.0))
    val = np.where(b & 0x80, -mag, mag)
    val[(exp == 0xF) & (man == 0x7)] = np.nan
    return val.astype(np.float32)


E4M3_VALUES = _e4m3_values()   # [256] f32, code -> value (frozen into the kernels as a constant)


@njit(inline="always")
def _e4m3(x):
    """float32 -> E4M3 FN code (uint8), as loader.quant.f32_to_e4m3_ref: RNE, subnormals kept,
    saturating at 448 (Inf too); NaN -> 0x7F."""
    a = min(abs(x), np.float32(448.0))
    b = _bits(a)
    # normals: round the 23-bit mantissa to 3 bits (the carry may bump the exponent), rebias
    normal = np.int32((b + np.uint32(0x7FFFF) + ((b >> np.uint32(20)) & np.uint32(1)))
                      >> np.uint32(20)) - np.int32(960)
    # below 2**-6: rint(a * 512). a * 512 < 8 is exact; adding 2**23 rounds it to an integer to
    # nearest even (float32 spacing is 1 in [2**23, 2**24)) and leaves it in the low bits
    sub = np.int32(_bits(a * np.float32(512.0) + np.float32(8388608.0)) - np.uint32(0x4B000000))
    code = sub if a < np.float32(2.0 ** -6) else normal
    code |= np.int32(_bits(x) >> np.uint32(31)) << np.int32(7)      # the sign bit, -0.0 included
    return np.uint8(np.int32(0x7F) if x != x else code)


@njit(inline="always")
def _e2m1(v):
    """float32 value / its scale -> E2M1 code (uint8, sign in bit 3), as loader.quant._e2m1_codes:
    RNE on the grid (a tie goes to the even code), saturating at 6; -0 and values rounding to 0
    get code 0."""
    a = min(abs(v), np.float32(6.0))
    b = _bits(a)
    # a >= 1: round the mantissa to 1 bit, rebias 127 -> 1: code = exponent field << 1 | mantissa
    normal = np.int32((b + np.uint32(0x1FFFFF) + ((b >> np.uint32(22)) & np.uint32(1)))
                      >> np.uint32(22)) - np.int32(252)
    # a < 1: rint(2 a) in {0, 1, 2}, by the same 2**23 addition as in _e4m3
    sub = np.int32(_bits(a * np.float32(2.0) + np.float32(8388608.0)) - np.uint32(0x4B000000))
    code = sub if a < np.float32(1.0) else normal
    neg = np.int32((_bits(v) >> np.uint32(31)) != np.uint32(0) and code > np.int32(0))
    return np.uint8(code | (neg << np.int32(3)))


# ---- kernel bodies (each compiled twice below) ----------------------------------------------

def _row_amax_body(w, amax):
    """w f32 [R, K] -> amax u32 [R]: the bits of each row's max |w|.

    |x| is compared as its bits: for finite floats the orders agree, integer max vectorizes, and
    a row holding NaN or Inf comes out >= INF_BITS (NaN bits sort above Inf above every finite)."""
    r, k = w.shape
    for i in prange(r):
        row = w[i]
        m = np.int32(0)
        for j in range(k):
            m = max(m, np.int32(_bits(row[j]) & np.uint32(0x7FFFFFFF)))
        amax[i] = np.uint32(m)


def _block_amax_body(w, bmax):
    """w f32 [R, K] -> bmax u32 [R, G]: the bits of each 16-block's max |w| (padding counts as 0;
    >= INF_BITS where the block holds NaN or Inf)."""
    r, k = w.shape
    nfull = k // GROUP
    nb = bmax.shape[1]
    for i in prange(r):
        row = w[i]
        for blk in range(nfull):
            m = np.int32(0)
            for t in range(GROUP):
                m = max(m, np.int32(_bits(row[blk * GROUP + t]) & np.uint32(0x7FFFFFFF)))
            bmax[i, blk] = np.uint32(m)
        if nb > nfull:                                              # the zero-padded last block
            m = np.int32(0)
            for j in range(nfull * GROUP, k):
                m = max(m, np.int32(_bits(row[j]) & np.uint32(0x7FFFFFFF)))
            bmax[i, nfull] = np.uint32(m)


def _nvfp4_body(w, bmax, g, q, s):
    """w f32 [R, K], bmax u32 [R, G] from _block_amax_body, g f32 global scale
    -> q u8 [R, Kp/2] (element 2j in the low nibble of byte j), s u8 [R, G] E4M3 block scales."""
    r, k = w.shape
    nb = s.shape[1]
    nfull = k // GROUP
    for task in prange((r + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        d = np.empty(nb, np.float32)                 # [G] divisor per block
        c = np.zeros(nb * GROUP, np.uint8)           # [Kp] codes of one row; padding stays 0
        c16 = c.view(np.uint16)                      # [Kp/2] code pairs, element 2j low byte (LE)
        for i in range(task * ROWS_PER_TASK, min(r, (task + 1) * ROWS_PER_TASK)):
            row, qi, si = w[i], q[i], s[i]
            for blk in range(nb):
                sc = _e4m3(_float(bmax[i, blk]) / np.float32(6.0) / g)
                si[blk] = sc
                dd = E4M3_VALUES[sc] * g
                d[blk] = dd if dd > np.float32(0.0) else np.float32(np.inf)   # zero scale: codes 0
            for blk in range(nfull):
                dd = d[blk]
                for t in range(GROUP):
                    c[blk * GROUP + t] = _e2m1(row[blk * GROUP + t] / dd)
            for j in range(nfull * GROUP, k):
                c[j] = _e2m1(row[j] / d[nfull])
            for t in range(nb * GROUP // 2):
                p = c16[t]
                qi[t] = np.uint8((p & np.uint16(0x0F)) | ((p >> np.uint16(4)) & np.uint16(0xF0)))


def _fp8_body(w, s, q):
    """w f32 [R, K], s f32 [R] non-zero row scales -> q u8 [R, K] E4M3 codes of w / s[r]."""
    r, k = w.shape
    for i in prange(r):
        row, qi, d = w[i], q[i], s[i]
        for j in range(k):
            qi[j] = _e4m3(row[j] / d)


def _e4m3_body(x, out):
    """x f32 [N] -> out u8 [N] E4M3 codes."""
    for i in prange(x.shape[0]):
        out[i] = _e4m3(x[i])


def _bf16_body(x, out):
    """x f32 [N] -> out u16 [N] bfloat16 bits, RNE; NaN keeps its top half with the quiet bit."""
    for i in prange(x.shape[0]):
        b = _bits(x[i])
        rounded = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                            >> np.uint32(16))
        out[i] = np.uint16(b >> np.uint32(16)) | np.uint16(0x0040) if x[i] != x[i] else rounded


def _grouped_int_body(q, zeros, scales, groups, out):
    """q int [N, K], zeros int16 / scales f32 [N, G], groups int64 [K] (each column's group)
    -> out f32 [N, K] = (q - zero) * scale (integer-quantized checkpoints, dequantized on read)."""
    for n in prange(q.shape[0]):
        for k in range(q.shape[1]):
            g = groups[k]
            out[n, k] = (np.float32(q[n, k]) - np.float32(zeros[n, g])) * scales[n, g]


# ---- the two compiles, and who gets which ----------------------------------------------------

def _compile(body):
    opts = {"cache": True, "nogil": True, "error_model": "numpy"}
    return njit(parallel=True, **opts)(body), njit(**opts)(body)


_ROW_AMAX = _compile(_row_amax_body)
_BLOCK_AMAX = _compile(_block_amax_body)
_NVFP4 = _compile(_nvfp4_body)
_FP8 = _compile(_fp8_body)
_E4M3 = _compile(_e4m3_body)
_BF16 = _compile(_bf16_body)
_GROUPED_INT = _compile(_grouped_int_body)
_serial_only = threading.local()


@contextlib.contextmanager
def serial():
    """Within this block the calling thread uses the serial compiles (benchmarks: one core)."""
    _serial_only.on = True
    try:
        yield
    finally:
        _serial_only.on = False


def _pick(kernel):
    """The parallel compile of kernel for the main thread, the serial one for any other thread."""
    if getattr(_serial_only, "on", False) or threading.current_thread() is not threading.main_thread():
        return kernel[1]
    return kernel[0]


# ---- entry points: arrays already float32 and C-contiguous ------------------------------------

INF_BITS = 0x7F800000      # |x| bits at or above this: Inf or NaN


def _non_finite(w: np.ndarray, maxima: np.ndarray) -> int:
    """How many NaN/Inf values w holds, given the bits of its row or block maxima (0 at once
    when every maximum is finite; the count itself only on the error path)."""
    if maxima.size == 0 or int(maxima.max()) < INF_BITS:
        return 0
    return int(w.size - np.count_nonzero(np.isfinite(w)))


def row_amax(w: np.ndarray) -> tuple[np.ndarray, int]:
    """w f32 [R, K] -> (amax f32 [R], number of NaN/Inf values; amax is meaningless if any)."""
    amax = np.empty(w.shape[0], np.uint32)
    _pick(_ROW_AMAX)(w, amax)
    return amax.view(np.float32), _non_finite(w, amax)


def block_amax(w: np.ndarray) -> tuple[np.ndarray, int]:
    """w f32 [R, K] -> (bits u32 [R, G] of each 16-block's max |w|, number of NaN/Inf values)."""
    r, k = w.shape
    bmax = np.empty((r, -(-k // GROUP)), np.uint32)
    _pick(_BLOCK_AMAX)(w, bmax)
    return bmax, _non_finite(w, bmax)


def nvfp4(w: np.ndarray, bmax: np.ndarray, g: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [R, K], bmax u32 [R, G] (block_amax), g f32 global scale
    -> (q u8 [R, Kp/2], s u8 [R, G])."""
    r, nb = bmax.shape
    q = np.empty((r, nb * GROUP // 2), np.uint8)
    s = np.empty((r, nb), np.uint8)
    _pick(_NVFP4)(w, bmax, np.float32(g), q, s)
    return q, s


def fp8(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """w f32 [R, K], s f32 [R] (non-zero) -> q u8 [R, K] E4M3 codes of w / s[r]."""
    q = np.empty(w.shape, np.uint8)
    _pick(_FP8)(w, s, q)
    return q


def e4m3(x: np.ndarray) -> np.ndarray:
    """x f32 (any shape, C-contiguous) -> u8 E4M3 codes of the same shape."""
    out = np.empty(x.shape, np.uint8)
    _pick(_E4M3)(x.reshape(-1), out.reshape(-1))
    return out


def bf16(x: np.ndarray) -> np.ndarray:
    """x f32 (any shape, C-contiguous) -> u16 bfloat16 bits of the same shape."""
    out = np.empty(x.shape, np.uint16)
    _pick(_BF16)(x.reshape(-1), out.reshape(-1))
    return out


def grouped_int(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray,
                groups: np.ndarray) -> np.ndarray:
    """q int [N, K] (C-contiguous), zeros int16 [N, G], scales f32 [N, G], groups int64 [K]
    -> f32 [N, K]: (q - zeros[:, groups]) * scales[:, groups]."""
    out = np.empty(q.shape, np.float32)
    _pick(_GROUPED_INT)(q, zeros, scales, groups, out)
    return out
