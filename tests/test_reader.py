"""ReaderPool: demand before prefetch, cancellation, short reads, the buffered fallback."""
from __future__ import annotations

import errno
import mmap
import os
import tempfile

import numpy as np
import pytest

from loader import reader as R

BLOCK = 8192


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng().integers(0, 256, 16 * BLOCK, dtype=np.uint8)
    path = tmp_path / "experts.arena"
    data.tofile(path)
    return path, data


def aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def test_reads_land(data_file):
    path, data = data_file
    with R.ReaderPool(path, n_threads=3) as pool:
        bufs = [aligned(BLOCK) for _ in range(16)]
        futs = [pool.read(0, i, i * BLOCK, BLOCK, bufs[i], demand=i % 2 == 0) for i in range(16)]
        for i, f in enumerate(futs):
            assert f.result(timeout=10) is bufs[i]
            np.testing.assert_array_equal(bufs[i], data[i * BLOCK:(i + 1) * BLOCK])
        st = pool.stats()
        assert st.reads == 16 and st.bytes_read == 16 * BLOCK and st.busy_seconds > 0
        assert st.demand_reads == 8 and st.prefetch_reads == 8 and st.gbps > 0


def test_demand_served_before_queued_prefetch(data_file):
    path, _ = data_file
    order = []
    with R.ReaderPool(path, n_threads=1) as pool:
        with pool._cv:  # hold the queue so every request is queued before the worker picks one
            pre = [pool.read(1, e, e * BLOCK, BLOCK, aligned(BLOCK), demand=False) for e in range(6)]
            dem = [pool.read(0, e, e * BLOCK, BLOCK, aligned(BLOCK), demand=True) for e in (6, 7)]
            for f, tag in [(f, ("pre", n)) for n, f in enumerate(pre)] + [(f, ("dem", n)) for n, f in enumerate(dem)]:
                f.add_done_callback(lambda _, t=tag: order.append(t))
            promoted = pool.promote(pre[4])
        for f in pre + dem:
            f.result(timeout=10)
    assert promoted
    assert order[:3] == [("dem", 0), ("dem", 1), ("pre", 4)]
    assert order[3:] == [("pre", 0), ("pre", 1), ("pre", 2), ("pre", 3), ("pre", 5)]


def test_cancel(data_file):
    path, data = data_file
    with R.ReaderPool(path, n_threads=1) as pool:
        with pool._cv:
            a = [pool.read(1, e, e * BLOCK, BLOCK, aligned(BLOCK), demand=False) for e in range(3)]
            b = [pool.read(2, e, e * BLOCK, BLOCK, aligned(BLOCK), demand=False) for e in range(3)]
            d = pool.read(1, 9, 9 * BLOCK, BLOCK, aligned(BLOCK), demand=True)
            assert pool.cancel_prefetches(layer=1) == 3
            assert pool.cancel(b[0])
        assert all(f.cancelled() for f in a + b[:1])
        np.testing.assert_array_equal(d.result(timeout=10), data[9 * BLOCK:10 * BLOCK])
        for f in b[1:]:
            f.result(timeout=10)
        assert not pool.cancel(d)                  # done already
        assert pool.stats().cancelled == 4 and pool.stats().reads == 3


def test_short_read_names_block(data_file):
    path, _ = data_file
    with R.ReaderPool(path, n_threads=2) as pool:
        os.truncate(path, 10 * BLOCK)              # the file shrinks after it was opened
        f = pool.read(2, 5, 12 * BLOCK, BLOCK, aligned(BLOCK))
        with pytest.raises(R.ReadError, match=rf"short read of expert block \(layer 2, expert 5\) of "
                                              rf"{path}: 0 of {BLOCK} bytes"):
            f.result(timeout=10)


def test_misaligned_buffer_refused_under_o_direct(data_file):
    path, _ = data_file
    with R.ReaderPool(path, n_threads=1) as pool:
        if not pool.direct:
            pytest.skip("this filesystem refuses O_DIRECT")
        with pytest.raises(ValueError, match=r"\(layer 0, expert 1\): O_DIRECT needs offset"):
            pool.read(0, 1, 100, BLOCK, aligned(2 * BLOCK))


def test_buffered_fallback_when_o_direct_refused(monkeypatch):
    real_open = os.open

    def tmpfs_open(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        path = os.path.join(d, "experts.arena")
        data = np.random.default_rng().integers(0, 256, 4 * BLOCK, dtype=np.uint8)
        data.tofile(path)
        monkeypatch.setattr(os, "open", tmpfs_open)
        with pytest.warns(R.DirectIOFallbackWarning, match="O_DIRECT not supported"):
            pool = R.ReaderPool(path, n_threads=2)
        monkeypatch.undo()
        with pool:
            assert not pool.direct
            out = np.empty(BLOCK + 7, np.uint8)[7:]  # any alignment is fine when buffered
            pool.read(0, 3, 3 * BLOCK - 100, BLOCK, out).result(timeout=10)
            np.testing.assert_array_equal(out, data[3 * BLOCK - 100:4 * BLOCK - 100])
