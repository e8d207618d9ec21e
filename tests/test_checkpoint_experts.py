"""CheckpointExperts' RAM cache of experts built on read (FP8 / NVFP4 / MXFP4 dequantized, fused
tensors transposed): hits return what a fresh read returns, the budget bounds what is held,
the least recently used expert leaves first."""
from __future__ import annotations

import numpy as np

from engine.runtime import CheckpointExperts
from kernels_numba.cpu import CpuOps


class Stub:
    """A checkpoint whose expert tensors are fresh random arrays of a fixed size, counted."""

    def __init__(self, nbytes: int, rng):
        self.n, self.rng, self.reads, self.made = nbytes // 4, rng, 0, {}

    def get(self, name: str) -> np.ndarray:
        self.reads += 1
        if name not in self.made:
            self.made[name] = self.rng.standard_normal(self.n).astype(np.float32)
        return self.made[name].copy()


def test_lru_cache_of_built_experts():
    rng = np.random.default_rng()
    ck = Stub(400, rng)                                   # an expert: 3 x 400 bytes
    ex = CheckpointExperts(ck, "qwen3_moe", CpuOps(), budget=3 * 1200)   # room for 3 experts
    first = ex.fetch(0, [1, 2, 3])
    assert ck.reads == 9 and ex.stats()["cache_hits"] == 0
    again = ex.fetch(0, [3, 1])                           # hits, no reads; 2 is now the oldest
    assert ck.reads == 9 and ex.hits == 2
    for a, b in zip(again, (first[2], first[0])):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    ex.fetch(0, [4])                                      # evicts 2
    assert ex.held <= ex.budget and (0, 2) not in ex.cache and (0, 1) in ex.cache
    reads = ck.reads
    ex.fetch(0, [2])
    assert ck.reads == reads + 3                          # read again
    ex.fetch(1, [1])
    assert ck.reads == reads + 6                          # another layer's expert 1: a new key
    s = ex.stats()
    assert s["experts_fetched"] == 6 and s["cache_hits"] == 2 and 0 < s["hit_rate"] < 1


def test_no_budget_keeps_nothing():
    ck = Stub(400, np.random.default_rng())
    ex = CheckpointExperts(ck, "qwen3_moe", CpuOps())
    ex.fetch(0, [1, 1, 2])
    ex.fetch(0, [1])
    assert ck.reads == 12 and not ex.cache and ex.hits == 0
