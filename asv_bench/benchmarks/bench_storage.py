"""The storage stages: quantizing experts, reading the arena, and cache hit rates.

Real expert shapes (Qwen3-30B-A3B: H = 2048, I = 768) with synthetic weights. Encoding is shown
beside the numpy reference encoders (the numba kernels must match them byte for byte); read speed
with the page cache dropped beside a raw sequential O_DIRECT read of the same file in the same
run, and beside the buffered-read figure; hit rates beside Belady's optimum at the same capacity.
tools/storage_bench.py records the same stages at larger sizes for docs/PERF.md.
"""
import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.trace import load_trace, simulate
from loader import quant_fast
from loader.arena import ARENA_NAME, ArenaFile, write_arena
from loader.layout import ExpertLayout
from loader.pinned import PinnedPool
from loader.quant import encode_expert_block
from loader.reader import ReaderPool

H, I = 2048, 768
N_LAYERS, N_EXPERTS = 4, 16          # 64 blocks: ~170 MB of NVFP4
TRACE = Path(__file__).resolve().parents[2] / "tests" / "data" / "demo-trace.npz"


def _weights(rng):
    return (rng.standard_normal((I, H), dtype=np.float32), rng.standard_normal((I, H), dtype=np.float32),
            rng.standard_normal((H, I), dtype=np.float32))


def _drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_direct_gbps(path, chunk=8 << 20):
    """Sequential O_DIRECT read of the whole file, page cache dropped first: the disk's bound."""
    _drop_cache(path)
    size = os.path.getsize(path) // 4096 * 4096
    buf = mmap.mmap(-1, chunk)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t = time.perf_counter()
        for off in range(0, size, chunk):
            os.preadv(fd, [memoryview(buf)[:min(chunk, size - off)]], off)
        return size / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)
        buf.close()


class Quantize:
    """One expert block (gate, up, down) encoded by the numba kernels or the numpy reference."""
    params = (["bf16", "fp8", "nvfp4"], ["numba", "numpy"])
    param_names = ["format", "impl"]
    number = 1
    repeat = 3

    def setup(self, fmt, impl):
        self.layout = ExpertLayout.build(fmt, H, I)
        self.w = _weights(np.random.default_rng(0))
        self.ref = impl == "numpy"
        encode_expert_block(fmt, self.layout, *self.w, ref=self.ref)   # load the kernels

    def time_encode_expert_block(self, fmt, impl):
        encode_expert_block(fmt, self.layout, *self.w, ref=self.ref)

    def track_encode_gbps(self, fmt, impl):
        """float32 input bytes per CPU second of one thread (serial kernels): per-core speed that
        other load on the machine does not change."""
        with quant_fast.serial():
            best = float("inf")
            for _ in range(3):
                t = time.thread_time()
                encode_expert_block(fmt, self.layout, *self.w, ref=self.ref)
                best = min(best, time.thread_time() - t)
        return sum(w.nbytes for w in self.w) / best / 1e9
    track_encode_gbps.unit = "GB/s"


class ArenaRead:
    params = [1, 4, 8]
    param_names = ["threads"]
    number = 1
    repeat = 3
    timeout = 600

    def setup_cache(self):
        folder = tempfile.mkdtemp(prefix="moe-bench-arena-")
        layout = ExpertLayout.build("nvfp4", H, I)
        w = _weights(np.random.default_rng(0))
        recs = write_arena(os.path.join(folder, ARENA_NAME), "nvfp4", layout, N_LAYERS, N_EXPERTS,
                           lambda layer, e: w, progress=False)
        return folder, recs

    def setup(self, cache, threads):
        folder, recs = cache
        self.arena = ArenaFile.open(os.path.join(folder, ARENA_NAME), recs, {"format": "nvfp4"})
        self.pool = PinnedPool(len(recs), self.arena.block_bytes)

    def teardown(self, cache, threads):
        self.pool.close()
        self.arena.close()

    def _read_all(self, threads, direct=True):
        with ReaderPool(self.arena.path, n_threads=threads, direct=direct) as r:
            t = time.perf_counter()
            futs = [r.read(rec["layer"], rec["expert"], rec["offset"], rec["size"], self.pool.view(i))
                    for i, rec in enumerate(self.arena.records)]
            for f in futs:
                f.result()
            return len(futs) * self.arena.block_bytes / (time.perf_counter() - t) / 1e9

    def track_read_gbps(self, cache, threads):
        """O_DIRECT preads into pinned buffers (NVMe bound where the file is on NVMe)."""
        return self._read_all(threads)
    track_read_gbps.unit = "GB/s"

    def track_read_cold_over_raw_direct(self, cache, threads):
        """ReaderPool speed / raw sequential O_DIRECT speed of the same file, page cache dropped
        before each (target >= 0.9)."""
        raw = _raw_direct_gbps(self.arena.path)
        _drop_cache(self.arena.path)
        return self._read_all(threads) / raw
    track_read_cold_over_raw_direct.unit = "x of raw O_DIRECT"

    def track_read_over_buffered(self, cache, threads):
        """O_DIRECT speed / buffered speed of the same file (page-cache warm: a DRAM copy bound)."""
        self._read_all(threads, direct=False)
        return self._read_all(threads) / self._read_all(threads, direct=False)
    track_read_over_buffered.unit = "x of buffered"

    def track_verify_gbps(self, cache, threads):
        """crc32 check of blocks in RAM, one thread: it must not be what limits reads."""
        self._read_all(threads)
        t = time.perf_counter()
        for i, rec in enumerate(self.arena.records):
            self.arena.verify_block(rec["layer"], rec["expert"], self.pool.view(i))
        return len(self.arena.records) * self.arena.block_bytes / (time.perf_counter() - t) / 1e9
    track_verify_gbps.unit = "GB/s"


class CacheHitRate:
    """Simulated decode of a skewed routing trace at 48 layers x top-8 of 128 experts."""
    params = (["lru", "lfu", "decay"], ["layer", "global"], [0.5, 2.0])
    param_names = ["policy", "split", "slots_per_layer_topk"]
    timeout = 300

    def setup_cache(self):
        rng = np.random.default_rng(0)
        t_, l_, k_, e_ = 300, 48, 8, 128
        pop = rng.dirichlet(np.full(e_, 0.3), size=l_)          # per-layer expert popularity
        ids = np.stack([[rng.choice(e_, k_, replace=False, p=pop[l]) for l in range(l_)]
                        for _ in range(t_)]).astype(np.int32)
        return ids

    def _slots(self, ids, factor):
        return int(ids.shape[1] * ids.shape[2] * factor)

    def track_hit_rate(self, ids, policy, split, factor):
        return simulate(ids, self._slots(ids, factor), policy, split)["hit_rate"]
    track_hit_rate.unit = "hit rate"

    def track_over_belady(self, ids, policy, split, factor):
        n = self._slots(ids, factor)
        best = simulate(ids, n, "belady", split)["hit_rate"]
        return simulate(ids, n, policy, split)["hit_rate"] / best if best else 0.0
    track_over_belady.unit = "x of Belady"


class TraceHitRate:
    """The recorded demo routing trace (tests/data/demo-trace.npz: 256 tokens, 4 layers, top-2 of
    16) at 2, 4 and 8 slots per layer; skipped where the trace is not shipped."""
    params = (["lru", "lfu", "decay"], ["layer", "global"], [2, 4, 8])
    param_names = ["policy", "split", "slots_per_layer"]

    def setup(self, policy, split, per_layer):
        if not TRACE.exists():
            raise NotImplementedError(f"no routing trace at {TRACE}")
        self.ids, _ = load_trace(TRACE)
        self.n = per_layer * self.ids.shape[1]

    def track_hit_rate(self, policy, split, per_layer):
        return simulate(self.ids, self.n, policy, split)["hit_rate"]
    track_hit_rate.unit = "hit rate"

    def track_over_belady(self, policy, split, per_layer):
        best = simulate(self.ids, self.n, "belady", split)["hit_rate"]
        return simulate(self.ids, self.n, policy, split)["hit_rate"] / best if best else 0.0
    track_over_belady.unit = "x of Belady"
