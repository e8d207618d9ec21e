"""Time every decode expert-kernel variant (kernels_numba/gpu_experts.py SWEEP) replayed in a CUDA
graph, at the three target shapes, next to the device-to-device copy bandwidth of the same run.

For each format and shape: 16 layers of K experts in distinct bank slots (bank several times the
60 MB L2, so each replay reads the weights from HBM), one graph of all layers a variant; time per
layer for both kernels, gate_up alone and down alone. Weight GB/s = bytes of the routed experts'
q and scale sections / time; ratio = that / d2d copy GB/s. Each result is also checked against
the legacy kernels' output (max relative difference), so a fast but wrong variant shows.

    python3 tools/sweep_experts.py OUT.json [--formats nvfp4,fp8] [--variants a,b]
    NUMBA_ENABLE_CUDASIM=1 python3 tools/sweep_experts.py OUT.json --sim   # tiny, no graphs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768, 8), "qwen3-next-80b": (2048, 512, 10),
          "2560x640-top10": (2560, 640, 10)}
SIM_SHAPES = {"tiny": (48, 32, 3)}
REPS = 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--sim", action="store_true", help="tiny shapes under NUMBA_ENABLE_CUDASIM=1")
    ap.add_argument("--formats", default="nvfp4,fp8,bf16")
    ap.add_argument("--variants", default="", help="comma list (default: SWEEP of each format)")
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args()
    if a.sim:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    from numba import config, cuda
    if a.sim != bool(config.ENABLE_CUDASIM):
        sys.exit("--sim needs NUMBA_ENABLE_CUDASIM=1 set before python starts (and a GPU run must "
                 "not have it)")
    sys.path.insert(0, str(ROOT / "asv_bench" / "benchmarks"))
    from bench_cuda import ExpertSetup, hbm_copy_gbs

    from kernels_numba import gpu_experts as ge
    t_start = time.time()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sim": a.sim,
           "defaults": dict(ge.DEFAULT_VARIANT), "rows": []}
    if not a.sim:
        res["copy_gbs"] = hbm_copy_gbs()
        dev = cuda.get_current_device()
        res["device"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        print(f"{res['device']}: d2d copy {res['copy_gbs']:.0f} GB/s", flush=True)
    copy = res.get("copy_gbs", 1.0)
    shapes = SIM_SHAPES if a.sim else SHAPES
    layers = 2 if a.sim else a.layers
    for fmt in a.formats.split(","):
        variants = a.variants.split(",") if a.variants else ge.SWEEP[fmt]
        for name, (h, i, k) in shapes.items():
            s = ExpertSetup(fmt, h, i, k, layers=layers)
            b = s.bytes_per_layer
            ref = None
            for v in ["legacy"] + [x for x in variants if x != "legacy"]:
                t0 = time.time()
                try:
                    s.out.copy_to_device(np.full(h, np.nan, np.float32))
                    s.run(None, "both", v)          # compiles; last layer's output stays in out
                    s.stream.synchronize()
                    got = s.out.copy_to_host()
                    if ref is None:
                        ref = got
                    diff = float(np.abs(got.astype(np.float64) - ref).max()
                                 / max(np.abs(ref).max(), 1e-30))
                    if not np.isfinite(got).all():
                        diff = float("inf")
                    if a.sim:
                        row = dict(fmt=fmt, shape=name, variant=v, diff_vs_legacy=diff,
                                   wall_s=time.time() - t0)
                        print(f"{fmt:5s} {name:15s} {v:18s} diff {diff:.1e} "
                              f"({time.time() - t0:.1f}s)", flush=True)
                    else:
                        us = s.layer_us(True, "both", v)
                        gu = s.layer_us(True, "gate_up", v)
                        dn = s.layer_us(True, "down", v)
                        row = dict(fmt=fmt, shape=name, h=h, i=i, k=k, variant=v,
                                   mb_per_layer=b / 1e6, us=us, gbs=b / us / 1e3,
                                   over_copy=b / us / 1e3 / copy, gate_up_us=gu, down_us=dn,
                                   gate_up_gbs=s.bytes_gate_up / gu / 1e3,
                                   down_gbs=s.bytes_down / dn / 1e3, diff_vs_legacy=diff,
                                   wall_s=time.time() - t0)
                        print(f"{fmt:5s} {name:15s} {v:18s} {us:6.1f} us {row['gbs']:5.0f} GB/s "
                              f"{row['over_copy']:.2f} of copy | gate_up {gu:5.1f} us "
                              f"{row['gate_up_gbs']:5.0f} GB/s, down {dn:5.1f} us "
                              f"{row['down_gbs']:5.0f} GB/s | diff {diff:.1e} "
                              f"({time.time() - t0:.1f}s)", flush=True)
                except Exception as e:   # one broken variant must not lose the others' numbers
                    row = dict(fmt=fmt, shape=name, variant=v, error=f"{type(e).__name__}: {e}")
                    print(f"{fmt:5s} {name:15s} {v:18s} FAILED {row['error']}", flush=True)
                res["rows"].append(row)
            del s
    res["wall_s"] = time.time() - t_start
    print(f"total {res['wall_s']:.0f}s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    bad = [r for r in res["rows"] if "error" in r or not r.get("diff_vs_legacy", 0) <= 1e-4]
    for r in bad:
        print("BAD", r, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
