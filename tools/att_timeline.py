"""Timeline of the v2f decode attention kernel on the GPU: when its blocks pass each phase.

The TRACE build of gpu_attention's partial2 stores %globaltimer (ns, one clock for every SM) at
each phase of every block: entry, after the PDL wait, after the first step (its K / V rows
arrived and were scored), after the loop, after the partials are stored, after the ticket, and
in the last block of a kv head after the merge factors and at its end. Run as graph replays of
COPIES launches back to back (each over its own cache copy, so the K / V rows come from HBM, as
in a model), the trace read from the last launch; and one launch alone.

    python3 tools/att_timeline.py [--s-max 4096] [--pos 2047 255 32767] [--bf16] [--out t.json]

Prints, per phase, the min / median / max over blocks in us from the first block's entry, and
the us a launch the graph replay takes without the trace (what the sweep measures).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PHASES = ("entry", "pdl wait", "first step", "loop", "stored", "ticket", "factors", "end")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--s-max", type=int, default=4096)
    ap.add_argument("--pos", type=int, nargs="+", default=[2047, 255])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--bf16", action="store_true", help="a bf16 cache (default fp32)")
    ap.add_argument("--out", help="JSON of the stamps")
    a = ap.parse_args()
    from numba import cuda, float32, int32

    from engine.graphs import capture_fn
    from kernels_numba import gpu_attention as ga

    rng = np.random.default_rng(0)
    st = cuda.stream()
    g = a.hq // a.hkv
    kind = "bf16" if a.bf16 else "f32"
    copies = max(1, min(16, math.ceil((512 << 20) / (a.s_max * a.hkv * a.d * 8))))

    def cache():
        x = rng.standard_normal((a.s_max, a.hkv, a.d)).astype(np.float32)
        if a.bf16:
            x = (x.view(np.uint32) >> 16).astype(np.uint16)
        return cuda.to_device(x)
    kc = [cache() for _ in range(copies)]
    vc = [cache() for _ in range(copies)]
    if a.bf16:
        kc = [x.view(np.uint32) for x in kc]
        vc = [x.view(np.uint32) for x in vc]
    q = cuda.to_device(rng.standard_normal((1, a.hq, a.d)).astype(np.float32))
    out = cuda.device_array((1, a.hq, a.d), np.float32)
    parts = ga.alloc_partials(1, a.hq, a.d, a.s_max)
    p_alloc = parts[0].shape[1] - 1
    p2 = ga.v2_pieces(a.s_max, a.hkv, p_alloc, True)
    if p2 >= p_alloc or a.hkv * p2 * ga.NSTAMP > a.hq * a.d:
        sys.exit(f"no room for the trace: P2 {p2} of P {p_alloc}")
    ncl = ga.cdiv(a.d // 4, ga.WARP)
    kb = ga.V2_KB if ncl == 1 else 2
    res = {}
    for pos in a.pos:
        qp = cuda.to_device(np.array([pos], np.int32))
        rows = {}
        for trace in (False, True):
            kern, nw, _ = ga.partial2_kernel(kind, g, a.d, kb, ga.V2F_WARPS, True, trace,
                                             p2=p2)

            def run(s, kern=kern, nw=nw):
                for c in range(copies):
                    kern[(a.hkv, p2), nw * ga.WARP, s](
                        q, kc[c], vc[c], qp, float32(a.d ** -0.5 * ga.LOG2E), int32(0),
                        int32(ga.SPLIT), *parts, out)
            gr = capture_fn(run, st)
            gr.upload(st)
            gr.launch(st)
            st.synchronize()
            e0, e1 = cuda.event(), cuda.event()
            e0.record(st)
            for _ in range(20):
                gr.launch(st)
            e1.record(st)
            e1.synchronize()
            us = e0.elapsed_time(e1) * 1e3 / (20 * copies)
            gr.destroy()
            rows["us_graph" + ("_trace" if trace else "")] = us
            if not trace:
                continue
            for label, launcher in (("graph", None), ("alone", run)):
                if launcher is not None:        # one launch after an idle GPU
                    st.synchronize()
                    kern[(a.hkv, p2), nw * ga.WARP, st](
                        q, kc[0], vc[0], qp, float32(a.d ** -0.5 * ga.LOG2E), int32(0),
                        int32(ga.SPLIT), *parts, out)
                    st.synchronize()
                raw = parts[2].copy_to_host()[:, -1, :].reshape(-1).view(np.uint32)
                n = a.hkv * p2
                t = raw[:n * ga.NSTAMP].astype(np.int64).reshape(n, ga.NSTAMP)
                piece = max(ga.SPLIT, -(-(pos + 1) // p2))
                nu = -(-(pos + 1) // piece)
                used = np.array([b % p2 < nu for b in range(n)])
                t0 = t[used, 0].min()
                rel = ((t - t0) & 0xFFFFFFFF).astype(np.float64) / 1e3
                rel[rel > 1e5] = np.nan          # a stamp the block did not reach (stale)
                print(f"pos {pos} ({label}; {nu} pieces a kv head of {p2}, {piece} keys each; "
                      f"graph {rows['us_graph']:.2f} us a launch, traced "
                      f"{rows['us_graph_trace']:.2f})")
                last = []
                for k, name in enumerate(PHASES):
                    v = rel[used, k]
                    if k >= 6:                   # the last block of each kv head only
                        v = np.array([rel[h * p2:(h + 1) * p2][:nu, 5].argmax() for h in
                                      range(a.hkv)])
                        v = np.array([rel[h * p2 + int(i), k] for h, i in enumerate(v)])
                        last.append(v)
                    v = v[np.isfinite(v)]
                    if len(v):
                        print(f"  {name:11s} min {v.min():7.2f}  median {np.median(v):7.2f}  "
                              f"max {v.max():7.2f} us")
                rows[label] = rel.tolist()
        res[str(pos)] = rows
    if a.out:
        Path(a.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
