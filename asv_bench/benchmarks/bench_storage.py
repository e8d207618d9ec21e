"""The storage stages: quantizing experts, reading the arena, and cache hit rates.

Real expert shapes (Qwen3-30B-A3B: H = 2048, I = 768) with synthetic weights. Read speed is
shown beside the buffered-read figure of the same file in the same run; hit rates beside
Belady's optimum at the same capacity.
"""
import os
import tempfile
import time

import numpy as np

from engine.trace import simulate
from loader.arena import ARENA_NAME, ArenaFile, write_arena
from loader.layout import ExpertLayout
from loader.pinned import PinnedPool
from loader.quant import encode_expert_block
from loader.reader import ReaderPool

H, I = 2048, 768
N_LAYERS, N_EXPERTS = 4, 16          # 64 blocks: ~160 MB of NVFP4


def _weights(rng):
    return (rng.standard_normal((I, H), dtype=np.float32), rng.standard_normal((I, H), dtype=np.float32),
            rng.standard_normal((H, I), dtype=np.float32))


class Quantize:
    params = ["bf16", "fp8", "nvfp4"]
    param_names = ["format"]
    number = 1
    repeat = 3

    def setup(self, fmt):
        self.layout = ExpertLayout.build(fmt, H, I)
        self.w = _weights(np.random.default_rng(0))

    def time_encode_expert_block(self, fmt):
        encode_expert_block(fmt, self.layout, *self.w)

    def track_encode_gbps(self, fmt):
        """float32 input bytes per second, one thread."""
        t = time.perf_counter()
        encode_expert_block(fmt, self.layout, *self.w)
        return sum(w.nbytes for w in self.w) / (time.perf_counter() - t) / 1e9
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
