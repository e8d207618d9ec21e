"""Time the MLA decode kernels (kernels_numba/gpu_mla.py) at T = 1, the staged ones against the
first (tiled) ones (gml.STAGED, gml.STAGED_ATT), replayed in CUDA graphs, next to the d2d copy
bandwidth.

For each shape: L layers of bf16 kv_b and float32 latent caches (distinct arrays, more bytes than
the L2, so each replay reads from HBM); one graph a kernel and variant of its L launches; us a
launch; the bytes it must read (kv_b's half, or the cache rows up to the position) / time as a
ratio of copy. Outputs of the two variants are compared (max relative difference).

    python3 tools/sweep_mla.py OUT.json [--pos 530,4095] [--layers 16]
    python3 tools/sweep_mla.py OUT.json --grid [--gh 2,4,5,8,10] [--split 16,32,64]

--grid: the attention alone, the tiled kernel (its defaults) against the staged one at each
heads-a-block (gh) and fewest-keys-a-block (split), and the combine launch alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from numba import cuda  # noqa: E402

from sweep_dense import copy_gbs, time_graph_us  # noqa: E402

# heads, qk_nope, v_head (kv_lora_rank 512, rope 64 in all of them)
SHAPES = {"glm-4.7-flash": (20, 192, 256), "deepseek-v2-lite": (16, 128, 128),
          "deepseek-v3": (128, 128, 128)}
C, R, S_MAX = 512, 64, 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--pos", default="530,4095")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--gh", default="2,4,5,8")
    ap.add_argument("--split", default="16,32,64")
    a = ap.parse_args()
    from kernels_numba import gpu_attention as ga
    from kernels_numba import gpu_mla as gml
    from loader.quant import f32_to_bf16
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    bw = copy_gbs(stream)
    print(f"d2d copy {bw:.0f} GB/s", flush=True)
    rows, L, d = [], a.layers, C + R
    for name in a.shapes.split(","):
        hq, nope, v = SHAPES[name]
        kvb = [cuda.to_device(f32_to_bf16((rng.standard_normal((hq * (nope + v), C)) * 0.05)
                                          .astype(np.float32))) for _ in range(L)]
        caches = [cuda.to_device(rng.standard_normal((S_MAX, 1, d)).astype(np.float32)) for _ in range(L)]
        q = cuda.to_device(rng.standard_normal((1, hq, nope + R)).astype(np.float32))
        q_lat = cuda.to_device(rng.standard_normal((1, hq, d)).astype(np.float32))
        lat = cuda.to_device(rng.standard_normal((1, hq, C)).astype(np.float32))
        ov = cuda.device_array((1, hq, v), np.float32)
        parts = ga.alloc_partials(1, hq, d, S_MAX)
        for pos in [int(x) for x in a.pos.split(",")]:
            qp = cuda.to_device(np.array([pos], np.int32))
            if a.grid:
                rows += grid(a, name, pos, q_lat, caches, qp, lat, parts, stream, bw)
                continue
            ops = {
                "absorb_q": (lambda st: [gml.absorb_q(q, kvb[i], q_lat, st) for i in range(L)],
                             hq * nope * C * 2, q_lat),
                "attention": (lambda st: [gml.attention(q_lat, caches[i], qp, 0.1, lat, parts, st)
                                          for i in range(L)], (pos + 1) * d * 4, lat),
                "absorb_o": (lambda st: [gml.absorb_o(lat, kvb[i], ov, st) for i in range(L)],
                             hq * v * C * 2, ov),
            }
            for op, (fn, nbytes, out) in ops.items():
                if op != "attention" and pos != int(a.pos.split(",")[0]):
                    continue                       # the absorb kernels do not depend on pos
                res = {}
                for staged in (False, True):
                    gml.STAGED = gml.STAGED_ATT = staged
                    us = time_graph_us(fn, stream, L)
                    res[staged] = (us, out.copy_to_host())
                gml.STAGED = gml.STAGED_ATT = True
                ref = res[False][1]
                diff = float(np.abs(res[True][1] - ref).max() / max(np.abs(ref).max(), 1e-30))
                row = dict(shape=name, pos=pos, op=op, us_tiled=res[False][0],
                           us_staged=res[True][0], bytes=nbytes, copy_gbs=bw, diff=diff)
                rows.append(row)
                print(f"{name:17s} pos {pos:5d} {op:9s} tiled {res[False][0]:7.2f} us  staged "
                      f"{res[True][0]:7.2f} us ({nbytes / res[True][0] / 1e3 / bw:.2f} of copy) "
                      f"diff {diff:.1e}", flush=True)
    Path(a.out).write_text(json.dumps(dict(copy_gbs=bw, rows=rows), indent=1))
    return 0


def grid(a, name, pos, q_lat, caches, qp, lat, parts, stream, bw):
    from kernels_numba import gpu_attention as ga
    from kernels_numba import gpu_mla as gml
    L, d = len(caches), C + R
    nbytes = (pos + 1) * d * 4

    def run(variant, gh, split):
        fn = lambda st: [gml.attention(q_lat, caches[i], qp, 0.1, lat, parts, st, split=split,  # noqa: E731
                                       gh=gh, variant=variant) for i in range(L)]
        us = time_graph_us(fn, stream, L)
        return us, lat.copy_to_host()

    out = []
    ref_us, ref = run("tile", gml.GH, 32)
    comb = time_graph_us(lambda st: [ga.combine(qp, 0, 32, parts, lat, st) for _ in range(L)], stream, L)
    print(f"{name:17s} pos {pos:5d} tile gh {gml.GH} split 32: {ref_us:7.2f} us "
          f"({nbytes / ref_us / 1e3 / bw:.2f} of copy); combine alone {comb:.2f} us", flush=True)
    out.append(dict(shape=name, pos=pos, variant="tile", gh=gml.GH, split=32, us=ref_us,
                    combine_us=comb, bytes=nbytes, copy_gbs=bw))
    for gh in [int(x) for x in a.gh.split(",")]:
        for split in [int(x) for x in a.split.split(",")]:
            us, got = run("staged", gh, split)
            diff = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
            print(f"{name:17s} pos {pos:5d} staged gh {gh:2d} split {split:3d}: {us:7.2f} us "
                  f"({nbytes / us / 1e3 / bw:.2f} of copy) diff {diff:.1e}", flush=True)
            out.append(dict(shape=name, pos=pos, variant="staged", gh=gh, split=split, us=us,
                            bytes=nbytes, copy_gbs=bw, diff=diff))
    return out


if __name__ == "__main__":
    sys.exit(main())
