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
