"""How fast can one graph-replayed kernel read an expert layer's bytes? A load-only probe.

The decode expert kernels read 12-28 MB a launch; with their decode removed they still reach only
~0.33 of copy bandwidth (docs/PERF.md, fifth session). This probe times kernels that only load
(XOR-reduce, no decode) NB bytes from one of 16 regions of a buffer several times L2, each launch
a graph node, as the sweep does, over launch shapes: threads a block, blocks (waves of the SMs or
one item a thread), U loads in flight a thread, and whether a lane reads 8 or 16 contiguous
bytes (two 8-byte loads: numba emits no 16-byte load here). Next to it: a device-to-device
copy of the same bytes in the same kind of graph.

    python3 tools/load_probe.py [OUT.json] [--mb 14.2]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYERS = 16
MAGIC = np.uint64(0x9E3779B97F4A7C15)
_K = {}


def kernel(u: int, wide: bool):
    """XOR of rows [base, base + n) of buf (uint64 [N, 1], or [N, 2] when wide: 16 contiguous
    bytes a lane), grid-stride, u rows in flight a thread."""
    key = (u, wide)
    if key in _K:
        return _K[key]
    from numba import cuda, uint64

    @cuda.jit
    def probe(buf, base, n, out):
        i = cuda.grid(1)
        t = cuda.gridsize(1)
        acc = uint64(0)
        j = i
        while j < n:
            for q in range(u):
                idx = j + q * t
                if idx < n:
                    if wide:
                        acc ^= buf[base + idx, 0] ^ buf[base + idx, 1]
                    else:
                        acc ^= buf[base + idx, 0]
            j += u * t
        if acc == MAGIC:
            out[0] = acc
    _K[key] = probe
    return probe


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--mb", type=float, default=14.2, help="bytes a launch (MB)")
    a = ap.parse_args()
    from numba import cuda

    from tools.sweep_dense import time_graph_us
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    nb = int(a.mb * 1e6) // 16 * 16
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mb": nb / 1e6, "rows": []}
    stream = cuda.stream()
    narrow = cuda.to_device(np.arange(LAYERS * nb // 8, dtype=np.uint64).reshape(-1, 1))
    wide = narrow.reshape(-1, 2)
    out = cuda.device_array(1, np.uint64)

    def time_graph(fn):   # us a launch: fn makes one launch a layer
        return time_graph_us(fn, stream, LAYERS)

    src = cuda.device_array(LAYERS * nb, np.uint8)
    dst = cuda.device_array(nb, np.uint8)

    def copies(s):
        for layer in range(LAYERS):
            dst.copy_to_device(src[layer * nb:(layer + 1) * nb], stream=s)
    us = time_graph(copies)
    res["copy_us"] = us
    res["copy_gbs"] = 2 * nb / us / 1e3
    print(f"d2d copy of {nb / 1e6:.1f} MB in a graph: {us:.2f} us, {2 * nb / us / 1e3:.0f} GB/s "
          "(read + write)", flush=True)
    for is_wide in (False, True):
        buf = wide if is_wide else narrow
        rows_per_layer = buf.shape[0] // LAYERS
        for threads in (256, 512, 1024):
            for u in (1, 2, 4, 8):
                k = kernel(u, is_wide)
                for blocks in (sms, 2 * sms, 4 * sms, 8 * sms,
                               -(-rows_per_layer // (threads * u))):
                    def fn(s, k=k, blocks=blocks, threads=threads):
                        for layer in range(LAYERS):
                            k[blocks, threads, s](buf, layer * rows_per_layer, rows_per_layer,
                                                  out)
                    try:
                        us = time_graph(fn)
                    except Exception as e:   # one failing shape must not lose the others
                        print(f"wide={is_wide} t={threads} u={u} b={blocks}: {e}", flush=True)
                        continue
                    row = dict(wide=is_wide, threads=threads, u=u, blocks=blocks, us=us,
                               gbs=nb / us / 1e3)
                    res["rows"].append(row)
                    print(f"{'16B' if is_wide else ' 8B'} t={threads:4d} u={u} b={blocks:5d} "
                          f"{us:6.2f} us {nb / us / 1e3:5.0f} GB/s", flush=True)
    best = sorted(res["rows"], key=lambda r: r["us"])[:8]
    print("best:", flush=True)
    for r in best:
        print(f"  {r}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
