"""Weight encoders for the expert formats (bf16, FP8 E4M3, NVFP4) and their numpy decoders.

The public encoders (f32_to_bf16, f32_to_e4m3, quantize_nvfp4, quantize_fp8, encode_matrix,
encode_expert_block) run the numba kernels of loader/quant_fast.py; the vectorized numpy versions
are kept as the reference (*_ref, encode_matrix(..., ref=True)) and the two agree byte for byte
(tests/test_quant.py). Rounding is round-to-nearest-even everywhere. Block byte layout:
loader/layout.py.
Legend: R = rows, K = columns, Kp = K rounded up to a multiple of 16 (NVFP4 row padding).
"""
from __future__ import annotations

import numpy as np

from loader import quant_fast as fast
from loader.layout import NVFP4_GROUP, ExpertLayout, matrix_bytes, padded_k

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_NAN = 0x7F

# E2M1 magnitudes by code (bit 3 is the sign).
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
_E2M1_TABLE = np.concatenate([E2M1_GRID, -E2M1_GRID])   # [16] code -> value


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, (8 + man) * 2.0 ** (exp - 10.0))
    val = np.where(b & 0x80, -mag, mag)
    val[(exp == 0xF) & (man == 0x7)] = np.nan
    return val.astype(np.float32)


_E4M3_TABLE = _e4m3_table()  # [256] bits -> value


def _refuse_non_finite(bad: int, name: str) -> None:
    if bad:
        raise ValueError(f"{name}: {bad} NaN/Inf value(s) in the weights; cannot quantize")


def _check_finite(w: np.ndarray, name: str) -> None:
    if not np.isfinite(w).all():
        _refuse_non_finite(int(np.size(w) - np.count_nonzero(np.isfinite(w))), name)


def _as_f32_matrix(w: np.ndarray, name: str) -> np.ndarray:
    """Any 2-D array -> float32 [R, K] C-contiguous (not yet checked for NaN/Inf)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D weight matrix, got shape {w.shape}")
    return np.ascontiguousarray(w, dtype=np.float32)


def _as_matrix(w: np.ndarray, name: str) -> np.ndarray:
    w = _as_f32_matrix(w, name)
    _check_finite(w, name)
    return w


def _global_scale(amax: float) -> np.float32:
    """NVFP4 per-tensor scale: amax / (6 * 448) in float64, rounded to float32; 1 for an all-zero
    tensor, the smallest subnormal where amax / 2688 underflows float32."""
    g = np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)
    if g == 0:
        g = np.float32(np.finfo(np.float32).smallest_subnormal)
    return g


# ---- scalar formats ------------------------------------------------------------------------

def _f32c(x) -> np.ndarray:
    """Any array or scalar -> float32, C-contiguous, same shape (0-d stays 0-d)."""
    x = np.asarray(x, dtype=np.float32)
    return x if x.flags.c_contiguous else x.copy(order="C")


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bfloat16 bits, round to nearest even (NaN stays a quiet NaN)."""
    return fast.bf16(_f32c(x))


def f32_to_bf16_ref(x: np.ndarray) -> np.ndarray:
    """numpy reference of f32_to_bf16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    if nan.any():
        out[nan] = (bits[nan] >> 16).astype(np.uint16) | np.uint16(0x0040)
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float -> uint8 FP8 E4M3 FN bits: round to nearest even, subnormals kept, saturate at 448.

    NaN -> 0x7F; +-Inf saturate to +-448 (the FN variant has no infinities).
    """
    return fast.e4m3(_f32c(x))


def f32_to_e4m3_ref(x: np.ndarray) -> np.ndarray:
    """numpy reference of f32_to_e4m3."""
    x = np.asarray(x, dtype=np.float32)
    a = np.minimum(np.abs(x), np.float32(E4M3_MAX))
    nan = np.isnan(a)
    a[nan] = 0
    bits = a.view(np.uint32)
    # normals: round the 23-bit mantissa to 3 bits (carry may bump the exponent), rebias 127 -> 7
    rounded = (bits + np.uint32(0x7FFFF) + ((bits >> 20) & np.uint32(1))) >> 20
    normal = rounded.astype(np.int32) - (120 << 3)
    # below 2**-6: multiples of 2**-9 (code 8 = 2**-6, the smallest normal, comes out right)
    sub = np.rint(a * np.float32(512.0)).astype(np.int32)
    code = np.where(a < np.float32(2.0 ** -6), sub, normal)
    code |= np.signbit(x).astype(np.int32) << 7
    code[nan] = E4M3_NAN
    return code.astype(np.uint8)


def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint8 FP8 E4M3 FN bits -> float32 (0x7F / 0xFF are NaN)."""
    return _E4M3_TABLE[np.asarray(bits, dtype=np.uint8)]


def _e2m1_codes(v: np.ndarray) -> np.ndarray:
    """float32 values already divided by their scale -> uint8 E2M1 codes (sign in bit 3).

    Round to nearest even on the grid (a tie goes to the even code), saturate at 6.
    """
    a = np.minimum(np.abs(v), np.float32(E2M1_MAX))
    bits = a.view(np.uint32)
    # a >= 1: round the mantissa to 1 bit, rebias 127 -> 1: code = exponent field << 1 | mantissa
    normal = ((bits + np.uint32(0x1FFFFF) + ((bits >> 22) & np.uint32(1))) >> 22).astype(np.int32) - 252
    sub = np.rint(a * np.float32(2.0)).astype(np.int32)          # a < 1: 0, 0.5, 1.0 (code 2)
    code = np.where(a < 1, sub, normal)
    code |= ((v < 0) & (code > 0)).astype(np.int32) << 3
    return code.astype(np.uint8)


# ---- matrix formats ------------------------------------------------------------------------

def quantize_nvfp4(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray, float]:
    """w float32 [R, K] -> (q uint8 [R, Kp/2], s uint8 [R, Kp/16] E4M3, global_scale float).

    Element 2j of a row sits in the low nibble of byte j; rows are zero-padded to Kp.
    dequant = E2M1 value * E4M3 block scale * global_scale.
    """
    w = _as_f32_matrix(w, name)
    bmax, bad = fast.block_amax(w)                                  # u32 [R, Kp/16] |w| bits
    _refuse_non_finite(bad, name)
    g = _global_scale(float(bmax.view(np.float32).max()) if bmax.size else 0.0)
    q, s = fast.nvfp4(w, bmax, g)
    return q, s, float(g)


def quantize_nvfp4_ref(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray, float]:
    """numpy reference of quantize_nvfp4."""
    w = _as_matrix(w, name)
    r, k = w.shape
    kp = padded_k("nvfp4", k)
    if kp != k:
        w = np.pad(w, ((0, 0), (0, kp - k)))
    g = _global_scale(float(np.abs(w).max()) if w.size else 0.0)
    blocks = w.reshape(r, kp // NVFP4_GROUP, NVFP4_GROUP)          # [R, Kp/16, 16]
    bmax = np.abs(blocks).max(axis=2)                               # [R, Kp/16]
    s = f32_to_e4m3_ref(bmax / np.float32(E2M1_MAX) / g)
    denom = e4m3_to_f32(s) * g                                     # [R, Kp/16]
    v = np.zeros_like(blocks)
    np.divide(blocks, denom[:, :, None], out=v, where=denom[:, :, None] > 0)  # zero scale: zeros
    codes = _e2m1_codes(v).reshape(r, kp)
    q = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
    return np.ascontiguousarray(q, dtype=np.uint8), s, float(g)


def dequant_nvfp4(q: np.ndarray, s: np.ndarray, global_scale: float, k: int) -> np.ndarray:
    """q uint8 [R, Kp/2], s uint8 [R, Kp/16], global scale -> float32 [R, k]."""
    r = q.shape[0]
    vals = np.empty((r, q.shape[1] * 2), dtype=np.float64)
    vals[:, 0::2] = _E2M1_TABLE[q & 0xF]
    vals[:, 1::2] = _E2M1_TABLE[q >> 4]
    scales = np.repeat(e4m3_to_f32(s).astype(np.float64), NVFP4_GROUP, axis=1)
    return (vals * scales * float(global_scale))[:, :k].astype(np.float32)


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (gpt-oss's experts): blocks uint8 [R, G, 16] (E2M1 pairs, element 2j in the low
    nibble of byte j), scales uint8 [R, G] (E8M0: 2^(s - 127), one a 32 values) -> float32
    [R, 32 G], as transformers' convert_moe_packed_tensors (before its transpose)."""
    r, g, b = blocks.shape
    vals = np.empty((r, g, 2 * b), dtype=np.float32)
    vals[..., 0::2] = _E2M1_TABLE[blocks & 0xF]
    vals[..., 1::2] = _E2M1_TABLE[blocks >> 4]
    with np.errstate(over="ignore"):   # past float32's range: inf, as transformers gives
        return np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).reshape(r, g * 2 * b)


E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8   # the powers of two E4M3 holds (2^-9: its least subnormal)


def nvfp4_from_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> tuple | None:
    """MXFP4 (blocks uint8 [R, G, 16], E8M0 scales uint8 [R, G], one a 32 values) re-expressed
    exactly as NVFP4 (q uint8 [R, 16 G], E4M3 scales uint8 [R, 2 G], global scale): the E2M1
    bytes are the same (element 2j in the low nibble of byte j); each power-of-two scale becomes
    an E4M3 power of two times one global power of two, the largest scale at 2^8. None when a
    group holding a non-zero value lies more than 17 binades under the largest (E4M3 holds
    2^-9 .. 2^8): then only re-quantizing can store it."""
    r, g, _ = blocks.shape
    nonzero = ((blocks & 0x77) != 0).any(axis=2)                   # [R, G] any |value| > 0
    if not nonzero.any():
        return blocks.reshape(r, 16 * g).copy(), np.zeros((r, 2 * g), np.uint8), 1.0
    e = scales.astype(np.int32)
    emax = int(e[nonzero].max())
    p = e - emax + E4M3_POW2_MAX                                    # [R, G] E4M3 power of two
    if int(p[nonzero].min()) < E4M3_POW2_MIN:
        return None
    pc = np.clip(p, -6, E4M3_POW2_MAX)
    code = np.where(p >= -6, (pc + 7) << 3, 1 << np.clip(p + 9, 0, 2))   # subnormals: 1, 2, 4
    code = np.where(nonzero, code, 0).astype(np.uint8)             # a group of zeros: scale 0
    gscale = float(np.ldexp(np.float32(1.0), emax - 127 - E4M3_POW2_MAX))
    return blocks.reshape(r, 16 * g).copy(), np.repeat(code, 2, axis=1), gscale


# ---- integer-quantized checkpoints (read only: dequantized on read) ---------------------------

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])   # AWQ's GEMM packing: nibble i holds column ORDER[i]


def unpack_int32(packed: np.ndarray, bits: int, n: int, axis: int) -> np.ndarray:
    """Unsigned bits-wide fields (4 or 8) packed densely into int32 words along axis, element i
    at bit i * bits of the little-endian stream -> uint8 with n elements along that axis."""
    a = np.moveaxis(np.ascontiguousarray(packed, dtype="<i4"), axis, -1)
    b = np.ascontiguousarray(a).view(np.uint8)   # [..., 4 W] bytes in stream order
    if bits == 4:
        out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), dtype=np.uint8)
        out[..., 0::2] = b & 0xF
        out[..., 1::2] = b >> 4
    elif bits == 8:
        out = b
    else:
        raise ValueError(f"{bits}-bit integer weights: the engine reads 4- and 8-bit ones")
    if out.shape[-1] < n:
        raise ValueError(f"{packed.shape} packed {bits}-bit words hold {out.shape[-1]} values "
                         f"along axis {axis}, expected {n}")
    return np.moveaxis(out[..., :n], -1, axis)


def dequant_grouped_int(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray,
                        groups: np.ndarray) -> np.ndarray:
    """q [N, K] integer codes, zeros and scales [N, G], groups int [K] (each column's group)
    -> float32 [N, K]: (q - zero) * scale, in float32 as the checkpoints' readers do."""
    groups = np.ascontiguousarray(groups, dtype=np.int64)
    if groups.size and (groups.min() < 0 or groups.max() >= scales.shape[1]):
        raise ValueError(f"a column's group index lies outside the {scales.shape[1]} groups")
    return fast.grouped_int(np.ascontiguousarray(q), np.ascontiguousarray(zeros, dtype=np.int16),
                            np.ascontiguousarray(scales, dtype=np.float32), groups)


def dequant_grouped_int_ref(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray,
                            groups: np.ndarray) -> np.ndarray:
    """numpy reference of dequant_grouped_int."""
    z = zeros.astype(np.float32)[:, groups]
    s = scales.astype(np.float32)[:, groups]
    return (q.astype(np.float32) - z) * s


def quantize_fp8(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """w float32 [R, K] -> (q uint8 [R, K] E4M3 FN bits, s float32 [R]); dequant = q * s[r]."""
    w = _as_f32_matrix(w, name)
    amax, bad = fast.row_amax(w)
    _refuse_non_finite(bad, name)
    s = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    s[s == 0] = 1.0
    return fast.fp8(w, s), s


def quantize_fp8_ref(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """numpy reference of quantize_fp8."""
    w = _as_matrix(w, name)
    amax = np.abs(w).max(axis=1) if w.shape[1] else np.zeros(w.shape[0], np.float32)
    s = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    s[s == 0] = 1.0
    q = f32_to_e4m3_ref(w / s[:, None])
    return q, s


def dequant_fp8(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q uint8 [R, K] E4M3, s float32 [R] -> float32 [R, K]."""
    return (e4m3_to_f32(q).astype(np.float64) * np.asarray(s, np.float64)[:, None]).astype(np.float32)


def dequant_fp8_blocks(q: np.ndarray, s: np.ndarray, block: tuple[int, int],
                       name: str = "weight") -> np.ndarray:
    """A block-scaled FP8 checkpoint tensor: q uint8 [R, K] E4M3 FN bits, s float32 [ceil(R / bn),
    ceil(K / bk)], one scale per bn x bk block (ragged at the edges) -> float32 [R, K] = q * s,
    the product rounded once to float32 (as transformers dequantizes)."""
    q = np.asarray(q, dtype=np.uint8)
    s = np.asarray(s, dtype=np.float32)
    (r, k), (bn, bk) = q.shape, block
    gr, gk = -(-r // bn), -(-k // bk)
    if s.shape != (gr, gk):
        raise ValueError(f"{name}: scale grid {list(s.shape)} does not match a {r} x {k} weight in "
                         f"{bn} x {bk} blocks (expected [{gr}, {gk}])")
    nan = np.count_nonzero((q & 0x7F) == E4M3_NAN)
    _refuse_non_finite(nan, name)
    _check_finite(s, name + " (scales)")
    v = e4m3_to_f32(q)
    if (gr * bn, gk * bk) != (r, k):   # ragged edge blocks: pad, then cut back
        v = np.pad(v, ((0, gr * bn - r), (0, gk * bk - k)))
    out = v.reshape(gr, bn, gk, bk) * s[:, None, :, None]
    return np.ascontiguousarray(out.reshape(gr * bn, gk * bk)[:r, :k])


# ---- expert blocks -------------------------------------------------------------------------

MATRICES = ("gate", "up", "down")


def encode_matrix(fmt: str, w: np.ndarray, name: str = "weight",
                  ref: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """One matrix in format fmt -> (q bytes, s bytes, global scale) as uint8 arrays for a block.
    ref=True encodes with the numpy references instead of the numba kernels (same bytes)."""
    if fmt == "bf16":
        if ref:
            bits = f32_to_bf16_ref(_as_matrix(w, name))
        else:
            w = _as_f32_matrix(w, name)
            _refuse_non_finite(fast.row_amax(w)[1], name)
            bits = f32_to_bf16(w)
        return bits.view(np.uint8).reshape(-1), np.empty(0, np.uint8), 1.0
    if fmt == "fp8":
        q, s = (quantize_fp8_ref if ref else quantize_fp8)(w, name)
        return q.reshape(-1), s.view(np.uint8), 1.0
    if fmt == "nvfp4":
        q, s, g = (quantize_nvfp4_ref if ref else quantize_nvfp4)(w, name)
        return q.reshape(-1), s.reshape(-1), g
    raise ValueError(f"{name}: unknown expert format {fmt!r}")


def _shapes(layout: ExpertLayout) -> dict[str, tuple[int, int]]:
    h, i = layout.hidden, layout.intermediate
    return {"gate": (i if layout.gated else 0, h), "up": (i, h), "down": (h, i)}


def assemble_expert_block(layout: ExpertLayout, parts: dict) -> np.ndarray:
    """parts[m] = (q uint8 bytes, s uint8 bytes, global scale) for m in gate/up/down
    -> uint8 [layout.block_bytes]. Used as well for pre-quantized bytes copied as released. An
    ungated layout takes no gate part."""
    block = np.zeros(layout.block_bytes, dtype=np.uint8)
    globals_ = np.ones(3, dtype=np.float32)
    for n, m in enumerate(MATRICES):
        if m == "gate" and not layout.gated:
            continue
        q, s, g = parts[m]
        rows, k = _shapes(layout)[m]
        qb, sb = matrix_bytes(layout.fmt, rows, k)
        q = np.asarray(q).reshape(-1).view(np.uint8)
        s = np.asarray(s).reshape(-1).view(np.uint8)
        if q.nbytes != qb or s.nbytes != sb:
            raise ValueError(f"{m}: {q.nbytes} value bytes / {s.nbytes} scale bytes, expected "
                             f"{qb} / {sb} for {layout.fmt} [{rows}, {k}]")
        qo, so = getattr(layout, m + "_q"), getattr(layout, m + "_s")
        block[qo:qo + qb] = q
        block[so:so + sb] = s
        globals_[n] = g
    block[:12] = globals_.view(np.uint8)
    return block


def encode_expert_block(fmt: str, layout: ExpertLayout, gate: np.ndarray, up: np.ndarray,
                        down: np.ndarray, name: str = "expert", ref: bool = False) -> np.ndarray:
    """gate [I, H], up [I, H], down [H, I] float32 -> one block, uint8 [layout.block_bytes].
    ref=True: the numpy reference encoders (the same bytes, ~20x slower). gate is None for an
    ungated layout."""
    if fmt != layout.fmt:
        raise ValueError(f"{name}: format {fmt!r} does not match the layout's {layout.fmt!r}")
    parts = {}
    for m, w in zip(MATRICES, (gate, up, down)):
        if m == "gate" and not layout.gated:
            if gate is not None:
                raise ValueError(f"{name}.gate: the layout is ungated, expected no gate")
            continue
        want = _shapes(layout)[m]
        if tuple(np.shape(w)) != want:
            raise ValueError(f"{name}.{m}: shape {tuple(np.shape(w))}, expected {want} "
                             f"(H={layout.hidden}, I={layout.intermediate})")
        parts[m] = encode_matrix(fmt, w, f"{name}.{m}", ref)
    return assemble_expert_block(layout, parts)


def decode_expert_block(block: np.ndarray, layout: ExpertLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One block uint8 [>= payload_bytes] -> (gate [I, H], up [I, H], down [H, I]) float32 (an
    ungated layout's gate: [0, H])."""
    block = np.asarray(block).reshape(-1).view(np.uint8)
    if block.nbytes < layout.payload_bytes:
        raise ValueError(f"expert block has {block.nbytes} bytes, expected {layout.payload_bytes}")
    globals_ = block[:12].copy().view(np.float32)
    out = []
    for n, m in enumerate(MATRICES):
        rows, k = _shapes(layout)[m]
        qb, sb = matrix_bytes(layout.fmt, rows, k)
        qo, so = getattr(layout, m + "_q"), getattr(layout, m + "_s")
        q, s = block[qo:qo + qb], block[so:so + sb]
        if layout.fmt == "bf16":
            out.append(bf16_to_f32(q.copy().view(np.uint16).reshape(rows, k)))
        elif layout.fmt == "fp8":
            out.append(dequant_fp8(q.reshape(rows, k), s.copy().view(np.float32)))
        else:
            kp = padded_k("nvfp4", k)
            out.append(dequant_nvfp4(q.reshape(rows, kp // 2), s.reshape(rows, kp // NVFP4_GROUP),
                                     float(globals_[n]), k))
    return out[0], out[1], out[2]
