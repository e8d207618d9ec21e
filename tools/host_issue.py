"""The decode thread's cost of serving a streamed layer (engine/gpu.py _serve_layer: resolve the
missing experts, copy their blocks, update the slot table, write the layer's slots and flag),
with a CUDA driver that does nothing: the Python between the driver calls, on this machine's
CPU, and the number of driver calls. Uniform routing over every layer's experts, the bank full
(each miss evicts). Runs on a machine without a GPU (the simulator's arrays stand in).

    python tools/host_issue.py [--layers 48 --experts 128 --top-k 8] [--batch]
"""
from __future__ import annotations

import argparse
import contextlib
import enum
import os
import sys
import time
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"   # (before numba)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from engine.residency import DeviceWriter, VramResidency  # noqa: E402


class NullDriver:
    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0

    calls = 0

    def cuMemcpyHtoDAsync(self, *a):
        self.calls += 1
        return (self.CUresult.CUDA_SUCCESS,)

    cuMemsetD32Async = cuMemcpyHtoDAsync


class Host:
    """Every block in RAM, handed out from a pool whose addresses are known."""
    def __init__(self, block: int, n: int = 64):
        self.rows = np.zeros((n, block), np.uint8)
        self.views = list(self.rows)

    def contains(self, layer, e):
        return True

    def get_many(self, layer, experts):
        return self.views[:len(experts)]

    def buffer_addresses(self):
        return [(v, self.rows.ctypes.data + i * self.rows.shape[1]) for i, v in enumerate(self.views)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--batch", action="store_true", help="table changes as one copy (MOE_STREAM_TABLE_BATCH=1)")
    a = ap.parse_args()
    L, E, K, B = a.layers, a.experts, a.top_k, 256
    DeviceWriter.ptr = staticmethod(lambda arr: 0)   # (simulated arrays have no device address)
    drv, s = NullDriver(), cuda.stream()
    res = VramResidency(2 * L * K, B, Host(B), s, s, driver=drv)
    res.attach_table(cuda.to_device(np.zeros((L, E), np.int32)))
    w = DeviceWriter(s, drv)
    slots_h = np.zeros((L, K), np.int32)
    addr = (0, slots_h.ctypes.data, 0)
    flag = cuda.to_device(np.zeros(L, np.int32))
    req = np.zeros((L, 2 * K), np.int32)
    rng = np.random.default_rng(0)

    def serve(l: int, seq: int) -> None:   # _serve_layer's host work, line for line
        row = np.array(req[l])
        ids, slots = row[:K], row[K:].copy()
        miss = slots < 0
        with res.batched_table() if a.batch else contextlib.nullcontext():
            slots[miss] = res.resolve(l, ids[miss], wait=False,
                                      protect={(l, int(e)) for e in ids[~miss]})
        slots_h[l] = slots
        slots_d, slots_a, flag_d = addr
        off = 4 * K * l
        w.copy(slots_d + off, slots_a + off, 4 * K, f"of layer {l}'s slots")
        w.set(flag, l, seq, flag_d)

    def token(seq: int, timed: list) -> None:
        for l in range(L):
            req[l, :K] = rng.choice(E, K, replace=False)
            req[l, K:] = [res.slot_of.get((l, int(e)), -1) for e in req[l, :K]]
            t = time.perf_counter()
            serve(l, seq)
            timed.append(time.perf_counter() - t)

    for t in range(20):   # fill the bank: every miss evicts from here on
        token(t, [])
    n0, timed = drv.calls, []
    for t in range(a.tokens):
        token(t, timed)
    per_layer = float(np.median(timed))
    misses = res.stats.ram_hits / (res.stats.ram_hits + res.stats.vram_hits)
    print(f"table {'batched' if a.batch else 'entry by entry'}: {per_layer * 1e6:.1f} us a served "
          f"layer (median), {per_layer * L * 1e3:.2f} ms a token of {L} layers, "
          f"{(drv.calls - n0) / a.tokens:.0f} driver calls a token, {misses:.2f} of routed experts missed")


if __name__ == "__main__":
    main()
