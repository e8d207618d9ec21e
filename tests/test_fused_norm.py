"""Fused decode launches against the launch pairs they replace:
- gd.linear(..., norm=(g, eps, w_offset, h_out)) against gd.rmsnorm then gd.linear (and the
  numpy oracles), fp32 and bf16 weights, w_offset 0 and 1, with and without h_out, one token,
  two, and more than a token tile (two passes), accumulating or not;
- gs.router_topk(..., slots=(slot_of, out)) against gs.router_topk and slot_of[ids].

Two ways in, as tests/test_cuda_kernels.py: test_simulator() runs this file as a script in a
subprocess with NUMBA_ENABLE_CUDASIM=1 at tiny shapes; the tests marked `gpu` run the same
checks at real model shapes. Fresh random inputs, outputs poisoned with NaN (ids with -1) before
each run, floats compared within 1e-5 of the output's largest magnitude.
Run the simulator checks directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_fused_norm.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":   # run as a script from anywhere
    for p in (ROOT, ROOT / "tests"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))

from numba import cuda  # noqa: E402

from kernels_numba import reference as ref  # noqa: E402
from kernels_numba.gpu_util import SIM  # noqa: E402
from test_cuda_kernels import TOL, _bf16, _close, _nan  # noqa: E402

EPS = 1e-6


OUTS = ((False, False), (True, False), (True, True))   # (h_out, accumulate)


def check_linear_norm(rng, n, k, ts=(1, 2), configs=(None,), every=True):
    """Fused norm + matvec against the two launches, for each weight kind, w_offset, token
    count and config, each with every OUTS variant (every) or one in turn (the simulator);
    returns the largest error against the two launches."""
    from kernels_numba import gpu_dense as gd
    stream = cuda.stream()
    errs = []
    turn = 0
    for kind in ("f32", "bf16"):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if kind == "bf16":
            w = _bf16(w)
        wf = ref.bf16_to_f32(w) if kind == "bf16" else w
        dw = cuda.to_device(w)
        for w_offset in (0.0, 1.0):
            g = (rng.standard_normal(k) * (0.1 if w_offset else 1.0)).astype(np.float32)
            dg = cuda.to_device(g)
            for t in ts:
                for cfg in configs:
                    outs = OUTS if every else OUTS[turn % len(OUTS):][:1]
                    turn += 1
                    for with_h, acc in outs:
                        what = (f"linear norm {kind} N={n} K={k} T={t} offset={w_offset} "
                                f"h_out={with_h} accumulate={acc} config={cfg}")
                        x = (rng.standard_normal((t, k)) * 3).astype(np.float32)
                        dx = cuda.to_device(x)
                        y0 = rng.standard_normal((t, n)).astype(np.float32)
                        # the two launches the fused one replaces
                        h2 = _nan((t, k))
                        gd.rmsnorm(dx, dg, EPS, h2, stream, w_offset=w_offset)
                        y2 = cuda.to_device(y0) if acc else _nan((t, n))
                        gd.linear(dw, h2, y2, stream, config=cfg, accumulate=acc)
                        # fused
                        h1 = _nan((t, k)) if with_h else None
                        y1 = cuda.to_device(y0) if acc else _nan((t, n))
                        gd.linear(dw, dx, y1, stream, config=cfg, accumulate=acc,
                                  norm=(dg, EPS, w_offset, h1))
                        stream.synchronize()
                        want = y2.copy_to_host()
                        errs.append(_close(y1.copy_to_host(), want, what=what))
                        hn = ref.rmsnorm(x, g + np.float32(w_offset), EPS)
                        _close(want, ref.linear(hn, wf) + (y0 if acc else 0),
                               what=what + " (oracle)")
                        if with_h:
                            errs.append(_close(h1.copy_to_host(), h2.copy_to_host(),
                                               what=what + " h_out"))
                        assert np.array_equal(dx.copy_to_host(), x), what + ": x changed"
    return max(errs)


def check_linear_norm_errors():
    from kernels_numba import gpu_dense as gd
    w = cuda.to_device(np.zeros((4, 8), np.float32))
    x = cuda.to_device(np.zeros((1, 8), np.float32))
    y = cuda.device_array((1, 4), np.float32)
    with pytest.raises(ValueError, match="linear norm"):
        gd.linear(w, x, y, 0, norm=(cuda.to_device(np.ones(6, np.float32)), EPS, 0.0, None))
    with pytest.raises(ValueError, match="linear norm"):
        gd.linear(w, x, y, 0, norm=(cuda.to_device(np.ones(8, np.float32)), EPS, 0.0,
                                    cuda.device_array((2, 8), np.float32)))


def check_router_slots(rng, t, e, k):
    """router_topk with the slot table against router_topk without it and slot_of[ids]; ids
    and weights equal bit for bit."""
    from kernels_numba import gpu_sampling as gs
    stream = cuda.stream()
    for norm in (True, False):
        logits = rng.standard_normal((t, e)).astype(np.float32)
        slot_of = rng.permutation(3 * e)[:e].astype(np.int32)   # a bank larger than one layer
        dl, dso = cuda.to_device(logits), cuda.to_device(slot_of)
        ids2, w2 = _nan((t, k), np.int32), _nan((t, k))
        gs.router_topk(dl, norm, ids2, w2, stream)
        ids1, w1, slots1 = _nan((t, k), np.int32), _nan((t, k)), _nan((t, k), np.int32)
        gs.router_topk(dl, norm, ids1, w1, stream, slots=(dso, slots1))
        stream.synchronize()
        what = f"router_topk slots T={t} E={e} K={k} norm={norm}"
        ids = ids1.copy_to_host()
        assert np.array_equal(ids, ids2.copy_to_host()), what + ": ids"
        assert np.array_equal(w1.copy_to_host(), w2.copy_to_host()), what + ": weights"
        assert np.array_equal(ids, ref.router_topk(logits, k, norm)[0]), what + ": ids (oracle)"
        got = slots1.copy_to_host()
        assert np.array_equal(got, slot_of[ids]), what + ": slots"
    with pytest.raises(ValueError, match="router_topk slots"):
        gs.router_topk(dl, True, ids1, w1, stream, slots=(dso[:e - 1], slots1))


# ---- simulator (CI) -------------------------------------------------------------------------

def run_sim_checks() -> None:
    """Tiny shapes; run only under NUMBA_ENABLE_CUDASIM=1 (64-thread blocks, 2 warps)."""
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    t0 = time.time()
    from kernels_numba.gpu_dense import Wide
    # K = 136: 68 float pairs, more than a 64-thread block, so h_out is written by two blocks;
    # (1, 2, 1): 2 warps a row (the norm sums share the KS > 1 scratch); T = 9: two passes.
    # Wide: the 16-byte path (None at T = 1 too), x and g read through L1 at K = 136 and staged
    # in shared memory at K = 40 up to a token tile of 4 and at K = 8 (two passes, restaged)
    check_linear_norm(rng, n=6, k=136, ts=(1, 2), configs=(None, (1, 2, 1), Wide(1, 2, 1)),
                      every=False)
    print(f"ok linear norm {time.time() - t0:.0f}s", flush=True)
    check_linear_norm(rng, n=6, k=40, ts=(1, 3, 8), configs=(Wide(1, 1, 1), Wide(2, 2, 1)),
                      every=False)
    print(f"ok linear norm 16-byte {time.time() - t0:.0f}s", flush=True)
    check_linear_norm(rng, n=5, k=8, ts=(9,), configs=((2, 1, 1), Wide(2, 1, 1)), every=False)
    print(f"ok linear norm two passes {time.time() - t0:.0f}s", flush=True)
    check_linear_norm_errors()
    check_router_slots(rng, t=1, e=10, k=3)
    check_router_slots(rng, t=2, e=40, k=4)
    print(f"ok router slots {time.time() - t0:.0f}s", flush=True)
    print("SIM CHECKS PASSED", flush=True)


def test_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=900, cwd=str(ROOT))
    assert r.returncode == 0 and "SIM CHECKS PASSED" in r.stdout, r.stdout + r.stderr


# ---- real GPU, real shapes ------------------------------------------------------------------

_HAVE_GPU = (not SIM) and cuda.is_available()
gpu = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(5120, 2048), (128, 2048), (9216, 4096), (512, 2048)])
def test_linear_norm_gpu(n, k):
    """Qwen3-30B-A3B's fused qkv and router, a 4096-wide qkv, a 512-expert router; the default
    (16-byte at T = 1) and both paths' other shapes at every T. Each (config, token tile,
    h_out, accumulate) is a kernel of its own, so the OUTS variants take turns (every=False):
    all of them at every turn compiled past 150 s for the first shape alone (2026-12-01)."""
    from kernels_numba.gpu_dense import Wide
    err = check_linear_norm(np.random.default_rng(11), n, k, ts=(1, 3, 9),
                            configs=(None, (2, 1, 4), Wide(1, 1, 8), Wide(2, 2, 4)),
                            every=False)
    assert err <= TOL


@pytest.mark.gpu
@gpu
def test_router_slots_gpu():
    check_router_slots(np.random.default_rng(12), t=1, e=128, k=8)
    check_router_slots(np.random.default_rng(12), t=3, e=512, k=10)


if __name__ == "__main__":
    if not SIM:
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    run_sim_checks()
