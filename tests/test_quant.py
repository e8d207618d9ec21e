"""Encoders of loader/quant.py against float64 references; blocks round trip in every format."""
from __future__ import annotations

import numpy as np
import pytest

from kernels_numba import reference as ref
from loader import quant as Q
from loader.layout import FORMATS, ExpertLayout

E4M3_GRID = np.array(sorted({float(v) for v in ref.e4m3_to_f32(np.arange(256, dtype=np.uint8))
                             if np.isfinite(v) and v >= 0}))            # 127 magnitudes, 0..448
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def rne_on_grid(x: np.ndarray, grid: np.ndarray, even_key) -> np.ndarray:
    """float64 reference: nearest grid magnitude, ties to the entry with the even code."""
    a = np.minimum(np.abs(x.astype(np.float64)), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(even_key(lo), lo, hi)))
    return np.copysign(grid[pick], x)


def e4m3_ref(x):
    return rne_on_grid(x, E4M3_GRID, lambda i: i % 2 == 0)   # grid index == code for E4M3 >= 0


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_decoders_agree_with_reference():
    bits = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(Q.e4m3_to_f32(bits), ref.e4m3_to_f32(bits))
    b16 = np.random.default_rng().integers(0, 1 << 16, 4096, dtype=np.uint16)
    np.testing.assert_array_equal(Q.bf16_to_f32(b16), ref.bf16_to_f32(b16))
    rng = np.random.default_rng()
    q = rng.integers(0, 256, (5, 24), dtype=np.uint8)
    s = rng.integers(0, 0x7F, (5, 3), dtype=np.uint8)     # finite E4M3 scales
    np.testing.assert_array_equal(Q.dequant_nvfp4(q, s, 0.37, 40), ref.nvfp4_dequant(q, s, 0.37, 40))
    q8 = rng.integers(0, 256, (5, 9), dtype=np.uint8)
    q8[q8 & 0x7F == 0x7F] = 0
    sc = rng.random(5).astype(np.float32)
    np.testing.assert_array_equal(Q.dequant_fp8(q8, sc), ref.fp8_dequant(q8, sc))


def test_e4m3_every_code_round_trips():
    bits = np.arange(256, dtype=np.uint8)
    vals = Q.e4m3_to_f32(bits)
    finite = np.isfinite(vals)
    np.testing.assert_array_equal(Q.f32_to_e4m3(vals[finite]), bits[finite])


def test_e4m3_rne_ties_subnormals_saturation():
    rng = np.random.default_rng()
    x = np.concatenate([
        rng.standard_normal(2000) * 10.0 ** rng.uniform(-4, 2.7, 2000),
        (E4M3_GRID[1:] + E4M3_GRID[:-1]) / 2,                       # every tie
        -(E4M3_GRID[1:] + E4M3_GRID[:-1]) / 2,
        [0.0, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -30, 447.9, 448.0, 460.0, 464.0, 1e9, -1e9],
    ]).astype(np.float32)
    got = Q.e4m3_to_f32(Q.f32_to_e4m3(x)).astype(np.float64)
    np.testing.assert_array_equal(got, e4m3_ref(x))
    assert Q.f32_to_e4m3(np.array([np.inf, -np.inf, np.nan], np.float32)).tolist() == [0x7E, 0xFE, 0x7F]


def test_bf16_rne():
    rng = np.random.default_rng()
    x = (rng.standard_normal(5000) * 10.0 ** rng.uniform(-30, 30, 5000)).astype(np.float32)
    got = Q.bf16_to_f32(Q.f32_to_bf16(x)).astype(np.float64)
    # float64 reference: round the value to 8 significant bits, ties to even
    m, e = np.frexp(x.astype(np.float64))
    want = np.ldexp(np.rint(m * 256.0) / 256.0, e)
    np.testing.assert_array_equal(got, want)
    ties = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)   # halfway: to even
    assert Q.bf16_to_f32(Q.f32_to_bf16(ties)).tolist() == [1.0, 1.0 + 2.0 ** -6]
    assert np.isnan(Q.bf16_to_f32(Q.f32_to_bf16(np.array([np.nan], np.float32))))[0]


def nvfp4_ref(w: np.ndarray) -> np.ndarray:
    """float64 reference of the whole NVFP4 recipe -> dequantized [R, K]."""
    r, k = w.shape
    kp = -(-k // 16) * 16
    wp = np.zeros((r, kp))
    wp[:, :k] = w
    amax = np.abs(wp).max()
    g = float(np.float32(amax / 2688.0)) if amax > 0 else 1.0
    blocks = wp.reshape(r, kp // 16, 16)
    s = e4m3_ref(np.float32(np.abs(blocks).max(axis=2) / 6.0 / np.float32(g)))
    d = np.float32(s * g).astype(np.float64)[:, :, None]
    v = np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0).astype(np.float32)
    vals = rne_on_grid(v, E2M1_GRID, lambda i: i % 2 == 0)
    return (vals * s[:, :, None] * g).reshape(r, kp)[:, :k]


@pytest.mark.parametrize("shape", [(8, 40), (3, 72), (16, 256), (1, 5)])
def test_nvfp4_matches_float64_reference(shape):
    rng = np.random.default_rng()
    w = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    w[0, : min(3, shape[1])] = 0.0
    q, s, g = Q.quantize_nvfp4(w, name="w")
    kp = -(-shape[1] // 16) * 16
    assert q.shape == (shape[0], kp // 2) and s.shape == (shape[0], kp // 16)
    np.testing.assert_allclose(Q.dequant_nvfp4(q, s, g, shape[1]), nvfp4_ref(w), rtol=1e-6, atol=0)


def test_nvfp4_ties_and_nibble_order():
    # one block whose amax is 6 * 448 * g with g = 1 / 2**k: the block scale is exactly 448,
    # so the values are w / (448 g) exactly and the ties are exact
    g = 2.0 ** -10
    vals = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0.5, 1.0, 4.0,
                     -6.0, 0.0])
    w = (vals * 448 * g).astype(np.float32)[None, :]
    q, s, gs = Q.quantize_nvfp4(w, name="ties")
    assert gs == g and Q.e4m3_to_f32(s)[0, 0] == 448.0
    codes = np.stack([q[0] & 0xF, q[0] >> 4], axis=1).reshape(-1)   # element 2j low nibble
    want = [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 14, 1, 2, 6, 15, 0]
    assert codes.tolist() == want


def test_nvfp4_zeros_tiny_huge():
    q, s, g = Q.quantize_nvfp4(np.zeros((3, 20), np.float32), name="z")
    assert g == 1.0 and not q.any() and not s.any()
    assert np.array_equal(Q.dequant_nvfp4(q, s, g, 20), np.zeros((3, 20), np.float32))
    for scale in (1e-30, 1e-3, 3e35):
        w = (np.random.default_rng().standard_normal((4, 48)) * scale).astype(np.float32)
        q, s, g = Q.quantize_nvfp4(w, name="w")
        d = Q.dequant_nvfp4(q, s, g, 48)
        assert np.isfinite(d).all() and np.isfinite(g)
        assert rel(d, w) < 0.2, scale


def test_nvfp4_gaussian_error():
    w = np.random.default_rng().standard_normal((256, 512)).astype(np.float32)
    q, s, g = Q.quantize_nvfp4(w, name="w")
    err = rel(Q.dequant_nvfp4(q, s, g, 512), w)
    print(f"NVFP4 relative error of a Gaussian [256, 512]: {err:.4f}")
    assert 0.05 < err < 0.15


def test_fp8_matches_reference_and_error():
    rng = np.random.default_rng()
    w = (rng.standard_normal((64, 96)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    w[3] = 0.0
    w[5, 7] = 1e-30
    q, s = Q.quantize_fp8(w, name="w")
    assert s[3] == 1.0 and not q[3].any()
    amax = np.abs(w).max(axis=1)
    np.testing.assert_array_equal(s, np.where(amax == 0, np.float32(1), amax / np.float32(448)))
    want = e4m3_ref((w / s[:, None]).astype(np.float32)) * s[:, None]
    np.testing.assert_allclose(Q.dequant_fp8(q, s), want, rtol=1e-6, atol=0)
    assert Q.e4m3_to_f32(q).max() == 448.0
    err = rel(Q.dequant_fp8(q, s), w)
    print(f"FP8 relative error: {err:.4f}")
    assert err < 0.04


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fn", [Q.quantize_nvfp4, Q.quantize_fp8])
def test_non_finite_refused_naming_tensor(fn, bad):
    w = np.ones((4, 32), np.float32)
    w[2, 3] = bad
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.experts\.7\.up_proj.*NaN/Inf"):
        fn(w, name="model.layers.3.mlp.experts.7.up_proj")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("h,i", [(40, 72), (72, 40), (64, 32)])
def test_block_round_trip(fmt, h, i):
    rng = np.random.default_rng()
    lay = ExpertLayout.build(fmt, h, i)
    gate, up = (rng.standard_normal((i, h)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((h, i)).astype(np.float32) * 3
    block = Q.encode_expert_block(fmt, lay, gate, up, down, name="layer 1 expert 2")
    assert block.dtype == np.uint8 and block.shape == (lay.block_bytes,)
    assert not block[lay.payload_bytes:].any()
    globals_ = block[:12].view(np.float32)
    if fmt != "nvfp4":
        assert globals_.tolist() == [1.0, 1.0, 1.0]
    g2, u2, d2 = Q.decode_expert_block(block, lay)
    for m, w, back in (("gate", gate, g2), ("up", up, u2), ("down", down, d2)):
        assert back.shape == w.shape
        if fmt == "bf16":
            np.testing.assert_array_equal(back, Q.bf16_to_f32(Q.f32_to_bf16(w)))
        elif fmt == "fp8":
            q, s = Q.quantize_fp8(w)
            np.testing.assert_array_equal(back, Q.dequant_fp8(q, s))
        else:
            q, s, g = Q.quantize_nvfp4(w)
            np.testing.assert_array_equal(back, Q.dequant_nvfp4(q, s, g, w.shape[1]))
            sec = getattr(lay, m + "_q")
            # padded columns hold zero codes
            qq = block[sec:sec + q.nbytes].reshape(q.shape)
            np.testing.assert_array_equal(qq, q)


def test_block_shape_mismatch_named():
    lay = ExpertLayout.build("fp8", 40, 72)
    z = np.zeros
    with pytest.raises(ValueError, match=r"layer 4 expert 9\.down: shape \(72, 40\), expected \(40, 72\)"):
        Q.encode_expert_block("fp8", lay, z((72, 40)), z((72, 40)), z((72, 40)), name="layer 4 expert 9")


# ---- the numba encoders against the numpy references, byte for byte ----------------------------

def _hard_matrix(kind: str, shape, rng) -> np.ndarray:
    """float32 [R, K] of one kind of content that stresses the rounding paths."""
    r, k = shape
    if kind == "gauss":
        return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    if kind == "zeros":
        w = np.zeros(shape, np.float32)
        w[r // 2, k // 2] = -0.0
        return w
    if kind == "tiny":      # subnormals, down to the smallest: the global scale underflows
        return (rng.standard_normal(shape) * 1e-42).astype(np.float32)
    if kind == "huge":      # near float32 max: amax / 6 / g and w / denom near their limits
        return (rng.uniform(-1, 1, shape) * 3.4e38).astype(np.float32)
    if kind == "ties":      # E2M1 and E4M3 midpoints at exact scales, with zero-scale blocks
        grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 0.0, 3.0, 4.0])
        w = (rng.choice(grid, shape) * rng.choice([-1, 1], shape) * 448 * 2.0 ** -10)
        w[:, ::7] = (E4M3_GRID[1:] + E4M3_GRID[:-1])[rng.integers(0, 126, (r, len(range(0, k, 7))))] / 2
        w[r - 1] = 0.0
        return w.astype(np.float32)
    if kind == "mixed":     # rows and blocks of wildly different magnitudes, a few zero blocks
        w = rng.standard_normal(shape) * 10.0 ** rng.uniform(-38, 37, (r, 1))
        w[:, : min(16, k)] *= 10.0 ** rng.uniform(-20, 0)
        w[::3, -min(16, k):] = 0.0
        return w.astype(np.float32)
    raise ValueError(kind)


KINDS = ("gauss", "zeros", "tiny", "huge", "ties", "mixed")
SHAPES = [(1, 1), (1, 5), (3, 17), (7, 40), (16, 256), (5, 2049), (33, 768)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fast_nvfp4_fp8_bf16_bytes_equal_reference(kind, shape):
    w = _hard_matrix(kind, shape, np.random.default_rng())
    q, s, g = Q.quantize_nvfp4(w, name="w")
    qr, sr, gr = Q.quantize_nvfp4_ref(w, name="w")
    assert q.dtype == qr.dtype == np.uint8 and s.dtype == sr.dtype == np.uint8
    np.testing.assert_array_equal(q, qr)
    np.testing.assert_array_equal(s, sr)
    assert g == gr and type(g) is float
    q8, s8 = Q.quantize_fp8(w, name="w")
    q8r, s8r = Q.quantize_fp8_ref(w, name="w")
    np.testing.assert_array_equal(q8, q8r)
    np.testing.assert_array_equal(s8.view(np.uint32), s8r.view(np.uint32))
    np.testing.assert_array_equal(Q.f32_to_bf16(w), Q.f32_to_bf16_ref(w))


def test_fast_scalar_encoders_bytes_equal_reference():
    """E4M3 and bf16 over a stride through every float32 bit pattern (NaN, Inf, subnormals, -0),
    the E4M3 midpoints, and non-contiguous and 0-d inputs."""
    bits = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([bits.view(np.float32), (E4M3_GRID[1:] + E4M3_GRID[:-1]).astype(np.float32) / 2,
                        np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 448.0, 464.0], np.float32)])
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(Q.f32_to_e4m3(x), Q.f32_to_e4m3_ref(x))
        np.testing.assert_array_equal(Q.f32_to_bf16(x), Q.f32_to_bf16_ref(x))
        y = x[: 3 * 1000].reshape(3, 1000)[:, ::3]                 # strided view
        np.testing.assert_array_equal(Q.f32_to_e4m3(y), Q.f32_to_e4m3_ref(y))
        np.testing.assert_array_equal(Q.f32_to_bf16(y), Q.f32_to_bf16_ref(y))
    assert Q.f32_to_e4m3(np.float32(1.0)).shape == () and Q.f32_to_e4m3(1.0) == 0x38
    assert Q.f32_to_bf16(np.float32(1.0)).shape == () and Q.f32_to_bf16(1.0) == 0x3F80


@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_expert_block_equals_reference(fmt):
    rng = np.random.default_rng()
    lay = ExpertLayout.build(fmt, 72, 40)
    gate, up = (rng.standard_normal((40, 72)).astype(np.float32) for _ in range(2))
    down = (rng.standard_normal((72, 40)) * 1e-30).astype(np.float32)
    got = Q.encode_expert_block(fmt, lay, gate, up, down, name="e")
    want = Q.encode_expert_block(fmt, lay, gate, up, down, name="e", ref=True)
    np.testing.assert_array_equal(got, want)


def test_fast_encoders_from_many_threads():
    """The packer encodes on a thread pool, whose threads get the serial compiles (the main thread
    gets the parallel ones); every result must equal the reference."""
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng()
    ws = [_hard_matrix(KINDS[n % len(KINDS)], (24, 100), rng) for n in range(24)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda w: Q.quantize_nvfp4(w, "w"), ws))
        got8 = list(pool.map(lambda w: Q.quantize_fp8(w, "w"), ws))
    for w, (q, s, g), (q8, s8) in zip(ws, got, got8):
        qr, sr, gr = Q.quantize_nvfp4_ref(w, "w")
        assert np.array_equal(q, qr) and np.array_equal(s, sr) and g == gr
        q8r, s8r = Q.quantize_fp8_ref(w, "w")
        assert np.array_equal(q8, q8r) and np.array_equal(s8, s8r)


def test_bf16_block_refuses_non_finite_naming_tensor():
    lay = ExpertLayout.build("bf16", 32, 16)
    gate = np.ones((16, 32), np.float32)
    gate[1, 1] = np.inf
    with pytest.raises(ValueError, match=r"layer 2 expert 5\.gate: 1 NaN/Inf"):
        Q.encode_expert_block("bf16", lay, gate, np.zeros((16, 32)), np.zeros((32, 16)),
                              name="layer 2 expert 5")


def test_encode_throughput_print():
    """Not an assertion: float32 GB/s at Qwen3-30B-A3B expert shapes, numba vs numpy, per core
    (CPU time of one pool thread, as the packer runs them; batches, as the clock ticks coarsely)."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    w = np.random.default_rng(0).standard_normal((768, 2048), dtype=np.float32)   # [I, H]

    def gbps(fn, n):
        fn(w, "w")
        best = float("inf")
        for _ in range(3):
            t = time.thread_time()
            for _ in range(n):
                fn(w, "w")
            best = min(best, (time.thread_time() - t) / n)
        return w.nbytes / best / 1e9

    with ThreadPoolExecutor(1) as one:
        for name, fast, ref in (("nvfp4", Q.quantize_nvfp4, Q.quantize_nvfp4_ref),
                                ("fp8", Q.quantize_fp8, Q.quantize_fp8_ref)):
            f, r = one.submit(gbps, fast, 30).result(), one.submit(gbps, ref, 2).result()
            print(f"{name} [768, 2048]: numba {f:.2f} GB/s, numpy {r:.2f} GB/s per core "
                  f"(CPU time) = {f / r:.0f}x")


def test_grouped_int_dequant_matches_reference():
    """The numba dequantizer of integer checkpoints against the numpy reference, on a
    transposed (non-contiguous) code array and act-order groups; a group index past the scales
    is refused."""
    rng = np.random.default_rng()
    n, k, g = 37, 70, 5
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8).T       # [N, K], a transposed view
    zeros = rng.integers(0, 16, (n, g)).astype(np.int16)
    scales = rng.random((n, g)).astype(np.float32)
    groups = rng.permutation(np.arange(k) * g // k)
    assert np.array_equal(Q.dequant_grouped_int(codes, zeros, scales, groups),
                          Q.dequant_grouped_int_ref(codes, zeros, scales, groups))
    with pytest.raises(ValueError, match="outside the 5 groups"):
        Q.dequant_grouped_int(codes, zeros, scales, groups + 1)
