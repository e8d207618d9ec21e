"""engine/graphs.py: capture numba launches, replay with new routing, compare with the oracle.

GPU only (graphs do not exist under the simulator): skipped without a CUDA device.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kernels_numba import reference as ref
from kernels_numba.gpu_util import SIM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(SIM or not cuda.is_available(), reason="needs a CUDA GPU")]


def _bank(fmt, h, i, n, rng):
    from test_cuda_kernels import make_bank
    return make_bank(fmt, h, i, n, rng)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
def test_expert_graph_replay_follows_slot_table(fmt):
    from engine.graphs import CudaGraph
    from kernels_numba import gpu_experts as ge
    rng = np.random.default_rng(11)
    h, i, k, s = 2048, 768, 8, 20
    dbank, lay, ws = _bank(fmt, h, i, s, rng)
    lh = lay.as_array()
    views = ge.bank_views(dbank)
    stream = cuda.stream()
    dlay = cuda.to_device(lh)
    slots = cuda.to_device(np.arange(k, dtype=np.int32))
    wts = cuda.to_device(np.full(k, 1.0 / k, np.float32))
    x = cuda.to_device(rng.standard_normal(h).astype(np.float32))
    act = cuda.device_array((k, i), np.float32)
    out = cuda.device_array(h, np.float32)

    def layer(st):
        ge.expert_mlp(fmt, views, dlay, lh, slots, wts, x, act, out, st)

    layer(stream)                   # compile + load modules outside the capture
    stream.synchronize()
    g = CudaGraph()
    with g.capture(stream):
        layer(stream)
    assert g.nodes == 2
    xh = x.copy_to_host()
    for _ in range(3):
        sl = rng.choice(s, size=k, replace=False).astype(np.int32)
        w = rng.random(k).astype(np.float32)
        slots.copy_to_device(sl, stream=stream)
        wts.copy_to_device(w, stream=stream)
        out.copy_to_device(np.full(h, np.nan, np.float32), stream=stream)
        g.launch(stream)
        stream.synchronize()
        exp = ref.moe(xh[None], sl[None], w[None], ws)[0]
        got = out.copy_to_host()
        assert np.isfinite(got).all()
        assert np.abs(got - exp).max() <= 1e-5 * np.abs(exp).max()
    g.destroy()


def test_sync_inside_capture_raises_and_capture_recovers():
    from engine.graphs import CudaGraph, is_capturing
    from kernels_numba import gpu_dense as gd
    stream = cuda.stream()
    a = cuda.to_device(np.ones(1024, np.float32))
    b = cuda.to_device(np.ones(1024, np.float32))
    o = cuda.device_array(1024, np.float32)
    gd.add(a, b, o, stream)
    stream.synchronize()
    g = CudaGraph()
    with pytest.raises(Exception):
        with g.capture(stream):
            gd.add(a, b, o, stream)
            stream.synchronize()     # forbidden while capturing
    assert not is_capturing(stream)
    with g.capture(stream):
        gd.add(a, b, o, stream)
    o.copy_to_device(np.zeros(1024, np.float32), stream=stream)
    g.launch(stream)
    stream.synchronize()
    assert np.all(o.copy_to_host() == 2.0)
    # capturing the same topology again updates the executable in place
    with g.capture(stream):
        gd.add(a, o, o, stream)
    g.launch(stream)
    stream.synchronize()
    assert np.all(o.copy_to_host() == 3.0)
    g.destroy()


def test_programmatic_chain_of_dependent_kernels():
    """40 launches, each reading what the one before wrote (ping-pong buffers, so a launch also
    overwrites what the one two back read): with programmatic edges (sm_90+) every edge is one
    and the replays still give x + 40 b; without them the same graph has none."""
    from engine.graphs import capture_fn, pdl_enabled
    from kernels_numba import gpu_dense as gd
    rng = np.random.default_rng(5)
    n, steps = 1 << 20, 40
    x = cuda.to_device(rng.standard_normal(n).astype(np.float32))
    b = cuda.to_device(rng.standard_normal(n).astype(np.float32))
    bufs = [cuda.device_array(n, np.float32) for _ in range(2)]
    stream = cuda.stream()

    def chain(st):
        gd.add(x, b, bufs[0], st)
        for i in range(1, steps):
            gd.add(bufs[(i - 1) % 2], b, bufs[i % 2], st)
    for pdl, edges in ((None, steps - 1 if pdl_enabled() else 0), (False, 0)):
        g = capture_fn(chain, stream, pdl=pdl)
        assert g.programmatic == edges
        for _ in range(3):
            xh = rng.standard_normal(n).astype(np.float32)
            x.copy_to_device(xh, stream=stream)
            g.launch(stream)
            stream.synchronize()
            exp = xh.astype(np.float64) + steps * b.copy_to_host().astype(np.float64)
            got = bufs[(steps - 1) % 2].copy_to_host()
            assert np.abs(got - exp).max() <= 1e-4 * np.abs(exp).max()
        g.destroy()
