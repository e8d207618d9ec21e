"""The Mamba-2 mixer on the cuda backend: its kernels (kernels_numba/gpu_mamba.py) against the
numpy oracles in kernels_numba/reference.py on fresh random inputs, outputs poisoned with NaN
first, and Granite 4.0 hybrid's CUDA decoder (engine/gpu_granite_hybrid.py) against the CPU
backend and transformers.
- CPU-only CI: test_simulator_kernels() and test_simulator_decoder() run this file as a script
  in a subprocess with NUMBA_ENABLE_CUDASIM=1 (set before numba.cuda is imported), tiny shapes.
- A GPU (marker gpu): the kernels at granite-4.0-h-small's and Nemotron-3-Nano's shapes, and the
  engine end to end on tiny models: cuda = transformers, graph replay = eager, prefill = token by
  token, streamed under a tiny budget = all resident.
Run the simulator checks directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_gpu_mamba.py
[MODEL_DIR] (no argument: the kernels).
"""
from __future__ import annotations

import math
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

TOL = 1e-5


def _close(got, exp, tol=TOL, what=""):
    got = np.asarray(got, dtype=np.float64)
    exp = np.asarray(exp, dtype=np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (poison left?)"
    err = np.abs(got - exp).max() / max(np.abs(exp).max(), 1e-30)
    assert err <= tol, f"{what}: max error {err:.3g} of max |ref| exceeds {tol}"
    return err


def _nan(shape):
    return cuda.to_device(np.full(shape, np.nan, dtype=np.float32))


def _rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- kernel checks (shared by the simulator run and the GPU tests) ---------------------------

def check_conv(rng, t, c, kc):
    """In place on the xBC columns of an in_proj-shaped buffer, as the decoder runs it; the
    state carried into a second call; with a bias and with zeros (a conv without one)."""
    from kernels_numba import gpu_mamba as gmb
    stream = cuda.stream()
    for bias in (_rnd(rng, c), np.zeros(c, np.float32)):
        x, w, st = _rnd(rng, t, 3 + c + 2), _rnd(rng, c, kc), _rnd(rng, kc - 1, c)
        want, want_st = ref.causal_conv1d_silu(x[:, 3:3 + c], w, st, bias)
        dx, dst, db, dw = cuda.to_device(x), cuda.to_device(st), cuda.to_device(bias), cuda.to_device(w)
        gmb.conv1d_silu(dx[:, 3:3 + c], dw, db, dst, dx[:, 3:3 + c], stream)
        stream.synchronize()
        got = dx.copy_to_host()
        _close(got[:, 3:3 + c], want, what=f"conv T={t} C={c} Kc={kc}")
        assert np.array_equal(got[:, :3], x[:, :3]) and np.array_equal(got[:, 3 + c:], x[:, 3 + c:]), \
            "conv wrote outside its columns"
        _close(dst.copy_to_host(), want_st, tol=0, what="conv state")
        x2 = _rnd(rng, 2, c)   # a second call continues from the carried state
        want2, want2_st = ref.causal_conv1d_silu(x2, w, want_st, bias)
        out = _nan((2, c))
        gmb.conv1d_silu(cuda.to_device(x2), dw, db, dst, out, stream)
        stream.synchronize()
        _close(out.copy_to_host(), want2, what="conv continued")
        _close(dst.copy_to_host(), want2_st, tol=0, what="conv state continued")


def _scan_case(rng, t, hm, p, g, n):
    """An in_proj-shaped host buffer [T, 5 | x | B | C | dt | 2] (the scan's inputs are its
    column slices), A_log, dt_bias, D, a nonzero state; and reference.mamba2_scan's (out
    [T, Hm P], state)."""
    inner, gn = hm * p, g * n
    x, b, cm, dt = _rnd(rng, t, hm, p), _rnd(rng, t, g, n), _rnd(rng, t, g, n), _rnd(rng, t, hm, scale=2)
    buf = np.concatenate([_rnd(rng, t, 5), x.reshape(t, inner), b.reshape(t, gn), cm.reshape(t, gn), dt,
                          _rnd(rng, t, 2)], axis=1)
    dt[0, 0] = 100.0   # softplus passes dt + dt_bias through above 20 (a float32 exp overflows on a GPU)
    buf[0, 5 + inner + 2 * gn] = 100.0
    a_log = np.log(rng.uniform(0.5, 4.0, hm)).astype(np.float32)
    dt_bias, d = _rnd(rng, hm, scale=0.5) - 0.5, _rnd(rng, hm)
    dt_bias[0] = 0.0
    state = _rnd(rng, hm, p, n, scale=0.3)
    out, st = ref.mamba2_scan(x, dt, b, cm, a_log, dt_bias, d, (0.0, math.inf), state)
    return (buf, a_log, dt_bias, d, state), (out.reshape(t, inner), st)


def check_scan(rng, t, hm, p, g, n):
    """The scan on column slices of the in_proj-shaped buffer, output poisoned, the state
    updated in place; the input buffer left as it was."""
    from kernels_numba import gpu_mamba as gmb
    (buf, a_log, dt_bias, d, state), (want, want_st) = _scan_case(rng, t, hm, p, g, n)
    c = hm * p + 2 * g * n
    stream = cuda.stream()
    dbuf, dst, out = cuda.to_device(buf), cuda.to_device(state), _nan((t, hm * p))
    gmb.scan(dbuf[:, 5:5 + c], dbuf[:, 5 + c:5 + c + hm], cuda.to_device(-np.exp(a_log)),
             cuda.to_device(dt_bias), cuda.to_device(d), dst, out, stream)
    stream.synchronize()
    what = f"scan T={t} Hm={hm} P={p} G={g} N={n}"
    e = _close(out.copy_to_host(), want, what=what)
    _close(dst.copy_to_host(), want_st, what=what + " state")
    assert np.array_equal(dbuf.copy_to_host(), buf), "scan wrote into its input"
    return e


def check_norm(rng, t, width, group):
    """z a column slice of a wider buffer; into a poisoned output, and in place."""
    from kernels_numba import gpu_mamba as gmb
    stream = cuda.stream()
    x, zz, w = _rnd(rng, t, width), _rnd(rng, t, 7 + width, scale=2), _rnd(rng, width)
    want = ref.rmsnorm_group_gated(x, zz[:, 7:], w, group, 1e-5)
    dx, dz, dw = cuda.to_device(x), cuda.to_device(zz), cuda.to_device(w)
    out = _nan((t, width))
    gmb.rmsnorm_group_gated(dx, dz[:, 7:], dw, group, 1e-5, out, stream)
    gmb.rmsnorm_group_gated(dx, dz[:, 7:], dw, group, 1e-5, dx, stream)
    stream.synchronize()
    _close(out.copy_to_host(), want, what=f"gated group norm T={t} W={width} group={group}")
    _close(dx.copy_to_host(), want, what="gated group norm in place")


# ---- simulator (CI) -------------------------------------------------------------------------

def run_sim_kernel_checks() -> None:
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    t0 = time.time()
    for t in (1, 5):
        check_conv(rng, t, 20, 4)
    check_conv(rng, 3, 9, 2)
    print(f"ok conv {time.time() - t0:.0f}s", flush=True)
    check_scan(rng, 1, 4, 3, 2, 8)     # decode; P not a multiple of the warps a block
    check_scan(rng, 4, 2, 4, 1, 40)    # N past a warp (two values a lane, the second partial)
    check_scan(rng, 3, 6, 2, 3, 5)     # three groups of two heads
    print(f"ok scan {time.time() - t0:.0f}s", flush=True)
    check_norm(rng, 1, 24, 24)
    check_norm(rng, 3, 32, 8)
    check_norm(rng, 2, 150, 75)        # a group longer than the block
    print(f"ok norm {time.time() - t0:.0f}s", flush=True)
    print("SIM KERNELS PASSED", flush=True)


def _run_sim(*args, timeout=900):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


def test_simulator_kernels():
    r = _run_sim()
    assert r.returncode == 0 and "SIM KERNELS PASSED" in r.stdout, r.stdout + r.stderr


# ---- real GPU -------------------------------------------------------------------------------

_HAVE_GPU = (not SIM) and cuda.is_available()
gpu = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 77])
def test_kernels_gpu_release_shapes(t):
    """granite-4.0-h-small: Hm 128, P 64, one group, N 128, conv 4 (C = 8448); Nemotron-3-Nano:
    Hm 64, P 64, 8 groups, N 128 (the gated norm over 8 groups of 512)."""
    rng = np.random.default_rng(3 + t)
    for hm, p, g, n in ((128, 64, 1, 128), (64, 64, 8, 128)):
        check_conv(rng, t, hm * p + 2 * g * n, 4)
        check_scan(rng, t, hm, p, g, n)
        check_norm(rng, t, hm * p, hm * p // g)


if __name__ == "__main__":
    if not SIM:
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    run_sim_kernel_checks()
