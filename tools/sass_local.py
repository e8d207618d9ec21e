"""SASS of the NVFP4 decode expert kernels on a machine with no GPU: registers, instruction counts
and where the weight loads and barriers sit, for an edit-compile-read loop that costs no device
time (the device is for timing and the GPU tests).

numba compiles the kernel to PTX (cc 9.0), ptxas (a CUDA toolkit's) to a cubin, cuobjdump with
nvdisasm prints the SASS. Setup (development only, none of it is a dependency of the project):
    pip install "nvidia-cuda-nvrtc==13.0.*"      # numba-cuda's compile_ptx loads libnvrtc
    pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm -d W && unzip W/*.whl -d T
    CUDA_HOME=/usr/local/cuda-13.0 SASS_BIN=T/nvidia/cu13/bin python tools/sass_local.py

    python tools/sass_local.py [--variants mma-g4-d4-p3-c,mma-g4-d4-p5-c-l] [--nsi 6] [--out DIR]

Per kernel: registers, spills, SASS instructions, opcode counts, and the line of each 16-byte
weight load, HMMA and barrier (a weight load after the barrier or spread between the mma steps
means ptxas sank it to its use: one HBM round trip a step).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def sass(pyfunc, sig, name: str, out: Path, ptxas: str, bindir: str):
    from numba import cuda
    ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=(9, 0))
    p = out / f"{name}.ptx"
    p.write_text(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90", "-v", str(p), "-o", str(out / f"{name}.cubin")],
                       capture_output=True, text=True)
    info = " ".join(x.split(":")[-1].strip() for x in r.stderr.splitlines()
                    if "registers" in x or "spill" in x)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    s = subprocess.run(["cuobjdump", "-sass", str(out / f"{name}.cubin")], capture_output=True,
                       text=True, env=env).stdout
    ins = [re.sub(r"\s*;.*", "", x.split("*/", 1)[1]).strip()
           for x in s.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", x)]
    (out / f"{name}.sass").write_text("\n".join(ins) + "\n")
    return info, ins


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="mma-g4-d4-p3-c,mma-g4-d4-p5-c-l")
    ap.add_argument("--nsi", type=int, default=6, help="Is / 128 for a lean down (30B: 6)")
    ap.add_argument("--out", default=None, help="keep the PTX / cubin / SASS here")
    a = ap.parse_args()
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    ptxas = str(Path(cuda_home) / "bin" / "ptxas")
    bindir = os.environ.get("SASS_BIN", "")
    from numba import types as T

    from kernels_numba import gpu_experts as ge
    from kernels_numba import gpu_experts_mma as gm
    u32, u16, f2 = T.uint32[:, ::1], T.uint16[:, ::1], T.float32[:, ::1]
    i1, f1 = T.int32[::1], T.float32[::1]
    out = Path(a.out or tempfile.mkdtemp(prefix="sass_"))
    out.mkdir(parents=True, exist_ok=True)
    for v in a.variants.split(","):
        cfg = ge.parse_variant("nvfp4", v)
        if cfg is None or cfg[0] != "mma":
            sys.exit(f"{v}: not an mma variant")
        la, mode, p, cols, lean = cfg[2]
        if lean:
            gu, dn = gm.lean_kernels(cfg[1], p, a.nsi)
            sigs = ((u32, u16, f2, i1, f1, f2) + (T.int32,) * 6,
                    (u32, u16, f2, i1, f1, f2, f1, T.int32) + (T.int32,) * 3)
        else:
            gu, dn = gm.kernels(cfg[1], *cfg[2])
            sigs = ((u32, u16, f2, i1, f1, f2) + (T.int32,) * 7,
                    (u32, u16, f2, i1, f1, f2, f1, T.int32) + (T.int32,) * 5)
        for half, k, sig in (("gate_up", gu, sigs[0]), ("down", dn, sigs[1])):
            name = f"{v}.{half}"
            info, ins = sass(k.py_func, sig, name, out, ptxas, bindir)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split(" ")[0].split(".")[0]
                                      for x in ins)
            where = {key: [n for n, x in enumerate(ins) if re.search(pat, x)]
                     for key, pat in (("weights", r"LDG\.E\.[A-Z0-9.]*128"), ("hmma", "HMMA"),
                                      ("bar", "BAR"))}
            print(f"{name}: {info}; {len(ins)} instructions; "
                  + ", ".join(f"{o} {c}" for o, c in ops.most_common(8)))
            print(f"    16-byte loads at {where['weights']}; HMMA {where['hmma'][:1]}.."
                  f"{where['hmma'][-1:]}; barriers {where['bar']}")
    print(f"PTX / cubin / SASS in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
