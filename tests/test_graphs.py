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
