"""Floors of a decode graph on this GPU: what a layer's bytes and a chain of kernels cost before
any of our kernels' arithmetic (GPU machine; planning figures for the expert and decode targets).

    python3 tools/floor_probe.py [--out F.json]

1. Reads of N MB (N = one Qwen3-30B-A3B layer's NVFP4 down / gate_up / both sections, then
   larger), each a graph of REPS back-to-back calls on buffers rotated past the L2, timed by
   events; GB/s and the ratio to the 1 GiB copy of the same run (engine.bandwidth.hbm_gbps):
   - copy: cuMemcpyDtoDAsync of N MB (its ratio counts 2 N, as the 1 GiB figure counts the
     bytes read and written);
   - read: one kernel (ratio N / time, as the expert kernels are rated), a grid of a few
     blocks an SM whose lanes issue U 16-byte loads before they use any, then fold them into
     one store a lane (the load structure of the expert and matvec kernels, without their
     arithmetic); the fastest of a few U / threads / blocks an SM.
2. A chain of NODES empty kernels in one graph, as PDL kernels (each waits at its top) with
   programmatic edges and with plain edges: us a node, the floor a decode graph of that many
   nodes pays before it does anything.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

MB = 1 << 20
LAYER_MB = {"down (7.1 MB)": 7.08, "gate_up (14.2 MB)": 14.16, "layer (21.2 MB)": 21.23}
SIZES_MB = dict(LAYER_MB, **{"64 MB": 64.0, "256 MB": 256.0})
ROTATE = 512 * MB          # bytes each case rotates through (the L2 is 60 MB)
REPS = 20
NODES = 400
READ_SHAPES = [(u, t, b) for u in (4, 8, 16) for t in (128, 256) for b in (2, 4, 8)]


def _kernels():
    from numba import cuda, uint32

    from kernels_numba.gpu_util import ld4, pdl_kernel, pdl_trigger, pdl_wait

    def make_read(U):
        @cuda.jit
        def read(src, out):
            """src uint32 [n16, 4] (16-byte rows): lane i of the grid loads rows i, i + G, ...
            (G = grid threads), U of them issued before any is used."""
            i = cuda.grid(1)
            G = cuda.gridsize(1)
            n = src.shape[0]
            acc = uint32(0)
            for r0 in range(i, n, G * U):
                w = cuda.local.array((U, 4), uint32)
                for u in range(U):
                    r = min(r0 + u * G, n - 1)
                    w[u, 0], w[u, 1], w[u, 2], w[u, 3] = ld4(src, r, 0)
                for u in range(U):
                    acc ^= w[u, 0] ^ w[u, 1] ^ w[u, 2] ^ w[u, 3]
            out[i] = acc
        return read

    @pdl_kernel
    @cuda.jit
    def empty_pdl(a):
        pdl_wait()
        pdl_trigger()

    @cuda.jit
    def empty(a):
        pass

    return make_read, empty_pdl, empty


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from numba import cuda

    from engine.bandwidth import hbm_gbps, time_ms
    from engine.graphs import capture_fn

    make_read, empty_pdl, empty = _kernels()
    dev = cuda.get_current_device()
    sms = dev.MULTIPROCESSOR_COUNT
    s = cuda.stream()
    hbm = hbm_gbps()
    rows = {"hbm_copy_gbps": round(hbm, 1), "device": str(dev.name), "reads": [], "chain": {}}
    print(f"{dev.name}: {sms} SMs, 1 GiB d2d copy {hbm:.0f} GB/s (events, back to back)")
    pool = cuda.device_array(ROTATE // 4, np.uint32)
    dst = cuda.device_array(int(max(SIZES_MB.values()) * MB) // 4, np.uint32)
    out = cuda.device_array(sms * 8 * 256, np.uint32)
    for name, mb in SIZES_MB.items():
        n = int(mb * MB) // 16 * 16
        k = max(1, ROTATE // n)
        bufs = [pool[(i * n) // 4:((i + 1) * n) // 4] for i in range(k)]

        def copies(st, bufs=bufs, n=n):
            for r in range(REPS):
                dst[:n // 4].copy_to_device(bufs[r % len(bufs)], stream=st)
        g = capture_fn(copies, s)
        us = time_ms(s, lambda: g.launch(s), 3) * 1e3 / REPS
        row = {"case": name, "mb": mb, "copy_us": round(us, 2),
               "copy_ratio": round(2 * n / us / 1e3 / hbm, 3)}
        best = None
        for (u, t, b) in READ_SHAPES:
            kern = make_read(u)
            grid = b * sms
            if grid * t * u * 16 > 4 * n:     # far more lanes than rows: not this size's shape
                continue

            def reads(st, bufs=bufs, kern=kern, grid=grid, t=t):
                for r in range(REPS):
                    kern[grid, t, st](bufs[r % len(bufs)].reshape(-1, 4), out)
            g = capture_fn(reads, s)
            us_r = time_ms(s, lambda: g.launch(s), 3) * 1e3 / REPS
            if best is None or us_r < best[0]:
                best = (us_r, u, t, b)
        row.update(read_us=round(best[0], 2), read_ratio=round(n / best[0] / 1e3 / hbm, 3),
                   read_shape=dict(loads=best[1], threads=best[2], blocks_sm=best[3]))
        rows["reads"].append(row)
        print(f"{name:20s} copy {us:7.2f} us ({row['copy_ratio']:.2f} of the 1 GiB copy) | read "
              f"{best[0]:7.2f} us ({row['read_ratio']:.2f}; {best[1]} loads a lane, {best[2]} "
              f"threads, {best[3]} blocks an SM)", flush=True)
    x = cuda.device_array(1, np.uint32)
    for name, kern, pdl in (("pdl", empty_pdl, True), ("plain", empty, False)):
        def chain(st, kern=kern):
            for _ in range(NODES):
                kern[1, 32, st](x)
        g = capture_fn(chain, s, pdl=pdl)
        us = time_ms(s, lambda: g.launch(s), 5) * 1e3 / NODES
        rows["chain"][name] = round(us, 3)
        print(f"chain of {NODES} empty kernels, {name} edges: {us:.2f} us a node", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
