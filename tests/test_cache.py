"""ExpertCache: eviction order per policy, the budget, per-layer shares, prefetch, checksums."""
from __future__ import annotations

import numpy as np
import pytest

from loader import arena as A
from loader.cache import ExpertCache, SplitPolicy, make_policy
from loader.layout import ExpertLayout
from loader.pinned import PinnedPool
from loader.reader import ReaderPool

H, I = 32, 48


@pytest.fixture
def packed(tmp_path):
    """bf16 arena, layers 0..3, 8 experts each; returns (arena, reader, blocks by key)."""
    rng = np.random.default_rng()
    lay = ExpertLayout.build("bf16", H, I)
    path = tmp_path / A.ARENA_NAME
    recs = A.write_arena(path, "bf16", lay, 4, 8, lambda l, e: (
        rng.standard_normal((I, H)).astype(np.float32), rng.standard_normal((I, H)).astype(np.float32),
        rng.standard_normal((H, I)).astype(np.float32)), progress=False)
    ar = A.ArenaFile.open(path, recs, {"format": "bf16", "n_experts": 8})
    reader = ReaderPool(path, n_threads=2)
    yield ar, reader, lay.block_bytes
    reader.close()
    ar.close()


def cache(packed, slots, policy="lru", **kw):
    ar, reader, bb = packed
    return ExpertCache(ar, reader, slots * bb + bb // 2, 4, 8, policy=policy, **kw)


def test_get_returns_block_and_counts(packed):
    ar = packed[0]
    with cache(packed, 8) as c:
        v = c.get(2, 5)
        np.testing.assert_array_equal(v, ar.read_block(2, 5))
        assert c.contains(2, 5) and not c.contains(2, 4)
        c.get(2, 5)
        st = c.stats()
        assert (st.hits, st.misses, st.bytes_read) == (1, 1, packed[2])
        d = c.stats_dict()
        assert d["hit_rate"] == 0.5 and d["policy"] == "lru" and d["slots"] == 8


def test_budget_refusals(packed):
    ar, reader, bb = packed
    with pytest.raises(ValueError, match=rf"budget {bb - 1} bytes is smaller than one expert block"):
        ExpertCache(ar, reader, bb - 1, 4, 8)
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'"):
        ExpertCache(ar, reader, 4 * bb, 4, 8, policy="fifo")
    with cache(packed, 2) as c:
        with pytest.raises(ValueError, match="asks for 3 experts at once but the budget holds 2"):
            c.get_many(0, [1, 2, 3])


def one_layer(packed, policy, slots=3, **kw):
    ar, reader, bb = packed
    return ExpertCache(ar, reader, slots * bb, 4, 8, policy=policy, layers=[0], **kw)


def test_resize_before_first_read(packed):
    ar, reader, bb = packed
    with cache(packed, 8) as c:
        c.resize(3 * bb)
        assert c.n_slots == 3 and c.stats_dict()["budget_bytes_used"] == 3 * bb
        for e in range(5):   # the smaller budget holds: never more than 3 blocks
            np.testing.assert_array_equal(c.get(1, e), ar.read_block(1, e))
        assert sum(c.contains(1, e) for e in range(8)) == 3
        with pytest.raises(RuntimeError, match="resize needs an empty cache"):
            c.resize(8 * bb)


def test_lru_order(packed):
    with one_layer(packed, "lru") as c:
        for e in (0, 1, 2, 0, 3):
            c.get(0, e)
        assert sorted(e for _, e in c.resident()) == [0, 2, 3]
        c.get(0, 4)                                     # 2 is now least recent
        assert sorted(e for _, e in c.resident()) == [0, 3, 4]
        assert c.stats().evictions == 2


def test_lfu_order(packed):
    with one_layer(packed, "lfu") as c:
        for e in (0, 0, 0, 1, 1, 2, 3):                 # 3 evicts 2 (count 1)
            c.get(0, e)
        assert sorted(e for _, e in c.resident()) == [0, 1, 3]
        c.get(0, 2)                                     # 2 (count 2 now) evicts 3 (count 1)
        assert sorted(e for _, e in c.resident()) == [0, 1, 2]


def test_decay_order(packed):
    with one_layer(packed, "decay", decay=0.5) as c:
        for e in (0, 0, 0):
            c.get(0, e)
        for _ in range(5):
            c.tick()                                    # 0's count: 3 * 0.5**5 < 1
        c.get(0, 1)
        c.get(0, 2)
        c.get(0, 3)                                     # plain LFU would evict 1; decay evicts 0
        assert sorted(e for _, e in c.resident()) == [1, 2, 3]
        assert c.policy.policies[0].score((0, 1)) == pytest.approx(1.0)


@pytest.mark.parametrize("policy", ["lru", "lfu", "decay"])
def test_budget_never_exceeded(packed, policy):
    ar, reader, bb = packed
    budget = 7 * bb + 123
    rng = np.random.default_rng()
    with ExpertCache(ar, reader, budget, 4, 8, policy=policy) as c:
        assert c.pool.total_bytes <= budget and c.n_slots == 7
        for _ in range(60):
            layer = int(rng.integers(4))
            es = rng.choice(8, size=int(rng.integers(1, 4)), replace=False)
            views = c.get_many(layer, es)
            for e, v in zip(es, views):
                np.testing.assert_array_equal(v[:64], ar.read_block(layer, int(e))[:64])
            c.prefetch((layer + 1) % 4, rng.choice(8, 2, replace=False))
            assert len(c.resident()) <= 7
            if rng.random() < 0.3:
                c.tick()
        st = c.stats()
        assert st.hits + st.misses > 0 and st.evictions > 0


def test_hits_below_layers_times_topk(packed):
    """4 layers x top-2 over a hot set of 3 experts per layer, 6 slots (< 4 x 2): the per-layer
    quotas keep hitting where one global LRU hits nothing."""
    rng = np.random.default_rng()
    tokens = [[rng.choice(3, 2, replace=False) for _ in range(4)] for _ in range(30)]
    rates = {}
    for split in ("layer", "global"):
        with cache(packed, 6, "lru", split=split) as c:
            for tok in tokens:
                for layer, es in enumerate(tok):
                    assert len(c.get_many(layer, es)) == 2
            rates[split] = c.stats().hit_rate
    assert rates["global"] == 0.0
    assert rates["layer"] > 0.15, rates


def test_prefetch_then_hit(packed):
    ar = packed[0]
    with cache(packed, 8) as c:
        assert c.prefetch(1, [3, 4]) == 2
        views = c.get_many(1, [4, 3, 4])
        np.testing.assert_array_equal(views[0], views[2])
        np.testing.assert_array_equal(views[1], ar.read_block(1, 3))
        st = c.stats()
        assert st.prefetches == 2 and st.hits + st.misses == 2
        assert st.prefetch_hits + st.late_prefetches == 2


def test_corrupt_block_raises_on_get(packed, tmp_path):
    ar, reader, bb = packed
    with open(ar.path, "r+b") as f:
        off = ar.block_record(3, 6)["offset"] + 77
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))
    with cache(packed, 4) as c:
        with pytest.raises(A.ArenaError, match=r"checksum mismatch in expert block \(layer 3, expert 6\)"):
            c.get(3, 6)
        c.get(3, 5)
        assert not c.contains(3, 6) and c.stats().read_errors == 1


def test_split_policy_borrows_and_returns():
    sp = SplitPolicy(lambda: make_policy("lru"), [0, 1], 4)
    assert sp.quota == {0: 2, 1: 2}
    for e in range(4):
        sp.admit((0, e))                   # layer 0 borrowed layer 1's slots
    assert sp.victim(1) == (0, 0)          # layer 1 under quota: the over-quota layer gives back
    sp.remove((0, 0))
    sp.admit((1, 0))
    assert sp.victim(0, exclude={(0, 1)}) == (0, 2)


def test_pinned_pool_fallback():
    with PinnedPool(3, 5000, use_cuda=False) as p:
        assert not p.pinned and p.buffer_bytes == 8192
        i = p.acquire()
        assert p.view(i).ctypes.data % 4096 == 0 and p.view(i).nbytes == 8192
        p.view(i)[:] = 7
        p.release(i)
        with pytest.raises(Exception, match="not in use"):
            p.release(i)
        [p.acquire() for _ in range(3)]
        with pytest.raises(Exception, match="all 3 buffers are in use"):
            p.acquire()
    with PinnedPool(1, 10) as p:           # auto: no GPU here -> mmap
        assert p.total_bytes == 4096


def test_live_cache_matches_the_simulator_on_the_demo_trace():
    """The live cache and engine.trace.simulate make the same decisions: a loading miss counts
    in its own layer's share (it is not taken from another layer)."""
    from pathlib import Path

    from engine.pack import load_manifest
    from engine.trace import load_trace, simulate
    from loader.arena import ArenaFile
    from loader.cache import ExpertCache
    from loader.reader import ReaderPool
    demo = Path(__file__).parents[1] / "engine" / "data" / "demo"
    ids, _ = load_trace(Path(__file__).parent / "data" / "demo-trace.npz")
    ids = ids[:400]
    arena = ArenaFile.from_manifest(load_manifest(demo), demo)
    try:
        layers = arena.moe_layers
        for policy in ("lru", "lfu", "decay"):
            n_slots = 2 * len(layers)
            sim = simulate(ids, n_slots, policy, "layer")
            with ReaderPool(arena.path, n_threads=2) as reader, \
                    ExpertCache(arena, reader, n_slots * arena.block_bytes, len(layers),
                                arena.n_experts, policy=policy, layers=layers, use_cuda=False) as cache:
                for t in range(ids.shape[0]):
                    for li, layer in enumerate(layers):
                        cache.get_many(layer, ids[t, li].tolist())
                    cache.tick()
                st = cache.stats()
            assert (st.hits, st.misses) == (sim["hits"], sim["misses"]), policy
    finally:
        arena.close()


def test_block_table_follows_ready_blocks(packed):
    """table[layer, expert] (what a kernel reads to find a block in the pool) holds the buffer
    of every ready block and -1 elsewhere, through evictions; note_hits counts and refreshes."""
    rng = np.random.default_rng()
    with one_layer(packed, "lru", slots=3) as c:
        for e in rng.permutation(8)[:6].tolist() + [int(rng.integers(8))]:
            v = c.get(0, e)
            want = np.full((4, 8), -1, np.int32)
            for key in c.resident():
                want[key] = c._entries[key].slot
            assert np.array_equal(c.table, want)
            assert c.table[0, e] >= 0 and np.array_equal(c.pool.view(int(c.table[0, e])), v)
        held = [k[1] for k in c.resident()]
        h0 = c.stats().hits
        assert c.note_hits(0, held + [e for e in range(8) if e not in held][:1]) == len(held)
        assert c.stats().hits == h0 + len(held)
        oldest = held[0]
        c.note_hits(0, held[:1])          # now the most recent: the next miss evicts another
        miss = next(e for e in range(8) if e not in held)
        c.get(0, miss)
        assert (0, oldest) in c.resident() and c.table[0, miss] >= 0
        assert (c.table >= 0).sum() == 3
