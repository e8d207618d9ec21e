"""The SMs' reads of pinned host memory (gm.expert_gather, the streamed token graph's RAM hits)
against the copy engine's H2D at one MoE layer's size: K blocks of B bytes a launch, the blocks
an expert swept. Each launch reads buffers no launch before it read (no L2 reuse); the result
of every variant is checked against the host buffers.

usage: python3 tools/gather_probe.py [--block-mb 2.65] [--k 8] [--reps 16] [--blocks 8 16 32 64]
[--json FILE]"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
from numba import cuda

from engine.residency import DeviceWriter
from kernels_numba import gpu_misc as gm
from loader.pinned import PinnedPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-mb", type=float, default=2.65)
    ap.add_argument("--k", type=int, default=8, help="experts a layer that miss VRAM")
    ap.add_argument("--reps", type=int, default=16, help="launches timed back to back")
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--json")
    a = ap.parse_args()
    K, R = a.k, a.reps
    B = int(a.block_mb * 2 ** 20) // 64 * 64
    W = B // 4
    pool = PinnedPool(K * R, B, use_cuda=True)
    words = pool.buffer_bytes // 4
    for i in range(K * R):   # buffer i, word j holds i << 24 | j (a wrong row or offset shows)
        pool.view(i).view(np.uint32)[:] = (np.uint32(i) << np.uint32(24)) | \
            np.arange(words, dtype=np.uint32) & np.uint32(0xFFFFFF)
    pv = cuda.from_cuda_array_interface(
        {"shape": (K * R, words), "strides": None, "typestr": "<u4",
         "data": (pool.device_address(), False), "version": 3}, owner=pool)
    bank = cuda.device_array((K, W), np.uint32)
    slots = cuda.to_device(np.full(K, -1, np.int32))
    ids = cuda.to_device(np.arange(K, dtype=np.int32))
    stage = cuda.to_device(np.arange(K, dtype=np.int32))
    helds = [cuda.to_device(np.arange(r * K, (r + 1) * K, dtype=np.int32)) for r in range(R)]
    s = cuda.stream()
    w = DeviceWriter(s)
    base = DeviceWriter.ptr(bank)
    nbytes = K * B

    def gather(blocks, r):
        gm.expert_gather(slots, ids, helds[r], stage, pv, bank, s, blocks)

    def engine_copy(_, r):
        for k in range(K):
            w.copy(base + k * W * 4, pool.view(r * K + k), B)

    def check(r, what):
        got = bank.copy_to_host()
        want = np.stack([pool.view(r * K + k).view(np.uint32)[:W] for k in range(K)])
        if not np.array_equal(got, want):
            raise SystemExit(f"{what}: the staged blocks differ from the host buffers")

    def timed(fn, arg):
        fn(arg, 0)
        s.synchronize()
        e0, e1 = cuda.event(), cuda.event()
        best, single = 0.0, []
        for _ in range(3):
            e0.record(s)
            for r in range(R):
                fn(arg, r)
            e1.record(s)
            e1.synchronize()
            best = max(best, R * nbytes / (cuda.event_elapsed_time(e0, e1) * 1e-3) / 1e9)
        check(R - 1, f"{fn.__name__} {arg}")
        for r in range(R):   # one launch alone: what a layer's stop in the token graph waits
            s.synchronize()
            e0.record(s)
            fn(arg, r)
            e1.record(s)
            e1.synchronize()
            single.append(cuda.event_elapsed_time(e0, e1) * 1e3)
        return best, statistics.median(single)

    rows = []
    print(f"{K} blocks of {B / 2 ** 20:.2f} MB a launch, {R} launches back to back")
    gbps, us = timed(engine_copy, None)
    rows.append({"what": "copy engine (cuMemcpyHtoDAsync a block)", "gbps": gbps, "us_one": us})
    for blocks in a.blocks:
        gbps, us = timed(gather, blocks)
        rows.append({"what": f"expert_gather, {blocks} blocks an expert", "gbps": gbps,
                     "us_one": us})
    for row in rows:
        print(f"{row['what']:<44} {row['gbps']:7.1f} GB/s back to back, "
              f"{row['us_one']:8.1f} us a launch alone")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"k": K, "block_bytes": B, "reps": R, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
