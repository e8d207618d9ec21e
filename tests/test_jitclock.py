"""engine.jitclock: the seconds a first run spends compiling CPU kernels, reported by generate."""
from __future__ import annotations

import numpy as np
from numba import njit

from engine.jitclock import compile_seconds


def test_counts_a_compile_not_a_call():
    before = compile_seconds()
    k = float(np.random.default_rng().integers(1, 1000))

    @njit
    def inner(x):
        return x * k

    @njit
    def outer(x):   # compiles inner inside itself: counted once, not twice
        return inner(x) + 1.0

    assert outer(2.0) == 2.0 * k + 1.0
    first = compile_seconds()
    assert first > before
    outer(3.0)   # compiled already: no time
    assert compile_seconds() == first


def test_generate_reports_the_compile_seconds(tmp_path):
    import engine
    from conftest import build_hf_model
    build_hf_model(tmp_path, "qwen3_moe")
    import time
    m = engine.load(tmp_path, device="cpu")
    t0, j0 = time.perf_counter(), compile_seconds()
    s = m.generate([3, 4, 5], max_new_tokens=3).stats
    wall, jit = time.perf_counter() - t0, compile_seconds() - j0
    assert s["prefill_compile_s"] >= 0.0 and s["decode_compile_s"] >= 0.0
    # the two split what compiled during the call (its sampling setup aside) and fit inside it
    assert s["prefill_compile_s"] + s["decode_compile_s"] <= jit + 1e-9 and jit <= wall
