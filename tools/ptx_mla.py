"""Compile the MLA kernels (kernels_numba/gpu_mla.py, and the combine kernel at the latent's
width) to sm_90 PTX and cubins on a machine with no GPU: the typing errors the simulator
does not see (a shared array sized by an expression, say), and registers / spills / shared
memory a kernel. Setup as tools/sass_local.py (nvidia-cuda-nvrtc, a CUDA toolkit's ptxas):
    CUDA_HOME=/usr/local/cuda-13.0 python tools/ptx_mla.py [--ptxas PATH]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptxas", default="/usr/local/cuda-13.0/bin/ptxas")
    ap.add_argument("--sass", metavar="DIR", help="also write each kernel's SASS there "
                    "(cuobjdump from SASS_BIN, as tools/sass_local.py)")
    ap.add_argument("--only", help="kernels whose name holds this")
    a = ap.parse_args()
    from numba import cuda
    from numba import types as T

    from kernels_numba import gpu_attention as ga
    from kernels_numba import gpu_mla as gml
    f32, i32, u16 = T.float32, T.int32, T.uint16

    def arr(dt, n, layout="A"):
        return T.Array(dt, n, layout)

    def build(name, kern, sig, out):
        if a.only and a.only not in name:
            return 0
        ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
        p = out / f"{name}.ptx"
        p.write_text(ptx)
        r = subprocess.run([a.ptxas, "-arch=sm_90", "-v", str(p), "-o", str(out / f"{name}.cubin")],
                           capture_output=True, text=True)
        info = "; ".join(x.split(":")[-1].strip() for x in r.stderr.splitlines()
                         if "registers" in x or "spill" in x)
        print(f"{name}: ptxas rc {r.returncode}: {info}", flush=True)
        if a.sass and r.returncode == 0:
            import os
            tool = Path(os.environ.get("SASS_BIN", "")) / "cuobjdump"
            sass = subprocess.run([str(tool), "-sass", str(out / f"{name}.cubin")],
                                  capture_output=True, text=True).stdout
            Path(a.sass).mkdir(parents=True, exist_ok=True)
            (Path(a.sass) / f"{name}.sass").write_text(sass)
        return r.returncode

    rc = 0
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        for bf in (False, True):
            c = u16 if bf else f32
            kind = "bf16" if bf else "f32"
            rc |= build(f"prep_{kind}", gml._PREP[bf],
                        (arr(f32, 3), arr(f32, 2), arr(f32, 1), f32, arr(i32, 1), arr(f32, 1),
                         T.float64, arr(f32, 3), arr(c, 3)), out)
            rc |= build(f"absorb_q_{kind}", gml._ABSORB_Q[bf], (arr(f32, 3), arr(c, 2), arr(f32, 3)), out)
            rc |= build(f"absorb_o_{kind}", gml._ABSORB_O[bf],
                        (arr(f32, 3), arr(c, 2), i32, arr(f32, 3)), out)
            rc |= build(f"partial_{kind}", gml.partial_kernel(bf, gml.GH, 576, 512),
                        (arr(f32, 3), arr(c, 3), arr(i32, 1), arr(i32, 2), f32, i32, i32, i32, arr(f32, 2),
                         arr(f32, 2), arr(f32, 3)), out)
        csig = (arr(f32, 3), arr(f32, 3), arr(i32, 1), arr(i32, 2), f32, i32, i32, i32, arr(f32, 2),
                arr(f32, 2), arr(f32, 3))
        for g in (gml.GH, 7):
            rc |= build(f"staged_g{g}", gml.staged_kernel(g, 576, 512), csig, out)
        rc |= build("absorb_q1_bf16", gml._absorb1("q", True, 12),
                    (arr(f32, 3), arr(u16, 2), arr(f32, 3)), out)
        rc |= build("absorb_o1_bf16", gml._absorb1("o", True, 4),
                    (arr(f32, 3), arr(u16, 2), i32, arr(f32, 3)), out)
        dl = 512 // 32
        if dl not in ga._COMBINE:
            ga._COMBINE[dl] = ga._make_combine(dl)
        rc |= build("combine_512", ga._COMBINE[dl], (arr(i32, 1), i32, i32, arr(f32, 2), arr(f32, 2),
                                                    arr(f32, 3), arr(f32, 3)), out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
