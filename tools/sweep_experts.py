"""Time every decode expert-kernel variant (kernels_numba/gpu_experts.py SWEEP) replayed in a CUDA
graph, at the three target shapes, next to the device-to-device copy bandwidth of the same run.

For each format and shape: 16 layers of K experts in distinct bank slots (bank several times the
60 MB L2, so each replay reads the weights from HBM), one graph of all layers a variant; time per
layer for both kernels, gate_up alone and down alone. Weight GB/s = bytes of the routed experts'
q and scale sections / time; ratio = that / d2d copy GB/s. Each result is also checked against
the legacy kernels' output (max relative difference), so a fast but wrong variant shows.

    python3 tools/sweep_experts.py OUT.json [--formats nvfp4,fp8] [--variants a,b]
    NUMBA_ENABLE_CUDASIM=1 python3 tools/sweep_experts.py OUT.json --sim   # tiny, no graphs

--grouped times the prefill kernels instead (grouped_gate_up_down, variants "legacy" and
"tiled"): T tokens (default 2048) routed top-K uniformly at random over E experts in a bank of E
slots, the groups launched in slices of --group-batch (the engine's prefill batch), eager with
events; ms per layer, expert TFLOP/s (T * K * 3 * H * I * 2 flops) and the max abs / relative
difference of y [A, H] against the legacy kernels.

    python3 tools/sweep_experts.py OUT.json --grouped [--tokens 2048] [--group-batch 32]
    NUMBA_ENABLE_CUDASIM=1 python3 tools/sweep_experts.py OUT.json --grouped --sim
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
GROUPED_EXPERTS = {"qwen3-30b-a3b": 128, "qwen3-next-80b": 512, "2560x640-top10": 128,
                   "tiny": 6}         # E of each shape for --grouped
GROUPED_REPS = 5
SIM_TOKENS = 12


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--sim", action="store_true", help="tiny shapes under NUMBA_ENABLE_CUDASIM=1")
    ap.add_argument("--formats", default="nvfp4,fp8,bf16")
    ap.add_argument("--variants", default="", help="comma list (default: SWEEP of each format)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--grouped", action="store_true",
                    help="time the prefill grouped kernels, legacy vs tiled")
    ap.add_argument("--tokens", type=int, default=2048, help="--grouped: prompt tokens")
    ap.add_argument("--group-batch", type=int, default=32,
                    help="--grouped: expert groups a launch (the engine's prefill batch)")
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
    if a.grouped:
        res["grouped"] = True
        sweep_grouped(a, shapes, ExpertSetup, res)
        return _finish(a, res, t_start)
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
    return _finish(a, res, t_start)


def sweep_grouped(a, shapes, ExpertSetup, res) -> None:
    """Legacy vs tiled grouped kernels (prefill) per format and shape; rows into res."""
    from numba import cuda

    from kernels_numba import gpu_experts as ge
    from kernels_numba import reference as ref
    t = SIM_TOKENS if a.sim else a.tokens
    variants = a.variants.split(",") if a.variants else ["legacy", "tiled"]
    reps = 1 if a.sim else GROUPED_REPS
    for fmt in a.formats.split(","):
        for name, (h, i, k) in shapes.items():
            n_exp = GROUPED_EXPERTS[name]
            s = ExpertSetup(fmt, h, i, n_exp, layers=1)   # bank of n_exp tame random experts
            rng = np.random.default_rng(0)
            ids = np.argsort(rng.random((t, n_exp)), axis=1)[:, :k].astype(np.int32)
            w = rng.random((t, k)).astype(np.float32)
            w /= w.sum(1, keepdims=True)
            gslot, gstart, order, wts, _ = ge.group_assignments(ids, w, lambda e: e)
            nb = a.group_batch if a.group_batch > 0 else len(gslot)
            cuts = list(range(0, len(gslot), nb)) + [len(gslot)]
            na = t * k
            x = cuda.to_device((rng.standard_normal((t, h)) * 0.1).astype(np.float32))
            dgs, dst = cuda.to_device(gslot), cuda.to_device(gstart)
            dord, dwts = cuda.to_device(order), cuda.to_device(wts)
            act = cuda.device_array((na, i), np.float32)
            y = cuda.device_array((na, h), np.float32)
            flops = na * 3 * h * i * 2
            base = None
            for v in variants:
                t0 = time.time()

                def run(v=v, s=s):
                    for g0, g1 in zip(cuts[:-1], cuts[1:]):
                        ge.grouped_gate_up_down(fmt, s.views, s.dlay, s.lh, dgs[g0:g1],
                                                dst[g0:g1 + 1], dord, dwts, x, act, y, s.stream,
                                                variant=v)
                try:
                    y.copy_to_device(np.full((na, h), np.nan, np.float32))
                    run()                                  # compiles; the output to compare
                    s.stream.synchronize()
                    got = y.copy_to_host().astype(np.float64)
                    if base is None:
                        base = got
                    dabs = float(np.abs(got - base).max()) if np.isfinite(got).all() else \
                        float("inf")
                    drel = dabs / max(float(np.abs(base).max()), 1e-30)
                    e0, e1 = cuda.event(), cuda.event()
                    e0.record(s.stream)
                    for _ in range(reps):
                        run()
                    e1.record(s.stream)
                    e1.synchronize()
                    ms = e0.elapsed_time(e1) / reps
                    row = dict(fmt=fmt, shape=name, h=h, i=i, k=k, experts=n_exp, tokens=t,
                               groups=len(gslot), group_batch=nb, variant=v, ms=ms,
                               tflops=flops / ms / 1e9, max_abs_diff=dabs, diff_vs_legacy=drel,
                               wall_s=time.time() - t0)
                    print(f"{fmt:5s} {name:15s} grouped {v:7s} T={t} E={n_exp} K={k}: "
                          f"{ms:8.2f} ms/layer {row['tflops']:6.2f} TFLOP/s | diff vs "
                          f"{variants[0]} abs {dabs:.2e} rel {drel:.1e} ({time.time() - t0:.1f}s)",
                          flush=True)
                except Exception as e:   # one broken variant must not lose the others' numbers
                    row = dict(fmt=fmt, shape=name, variant=v, error=f"{type(e).__name__}: {e}")
                    print(f"{fmt:5s} {name:15s} grouped {v:7s} FAILED {row['error']}", flush=True)
                res["rows"].append(row)
            if base is not None and a.sim:                # the oracle too, at tiny shapes
                from loader.quant import decode_expert_block
                from loader.layout import ExpertLayout
                lay = ExpertLayout.build(fmt, h, i)
                bank = s.bank.copy_to_host()
                xs = x.copy_to_host()
                exp = np.zeros_like(base)
                for g, sl in enumerate(gslot):
                    gw, uw, dw = (m.astype(np.float64) for m in decode_expert_block(bank[sl], lay))
                    r = slice(gstart[g], gstart[g + 1])
                    xa = xs[order[r]].astype(np.float64)
                    exp[r] = wts[r, None] * ((ref.silu(xa @ gw.T) * (xa @ uw.T)) @ dw.T)
                err = float(np.abs(base - exp).max() / max(np.abs(exp).max(), 1e-30))
                print(f"{fmt:5s} {name:15s} grouped {variants[0]} vs numpy oracle: rel {err:.1e}",
                      flush=True)
                res["rows"].append(dict(fmt=fmt, shape=name, variant="oracle",
                                        diff_vs_legacy=err))
            del s


def _finish(a, res, t_start) -> int:
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
