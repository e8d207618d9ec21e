"""Thread pool of O_DIRECT preads from the arena into caller-owned aligned buffers.

Demand reads (the decode step waits on them) are served before queued prefetch reads. O_DIRECT
bypasses the page cache so the pinned expert cache is the only copy in RAM; it needs 512-aligned
offset, size and buffer address (arena blocks are 4096-aligned; mmap memory is page-aligned).
Where the filesystem refuses O_DIRECT the pool falls back to buffered reads (posix_fadvise
RANDOM, DONTNEED after each read) and warns once. With `cores`, each worker pins itself to those
cores as it starts (os.sched_setaffinity(0, ...) sets the calling thread's mask on Linux), so the
decode thread keeps its core to itself (engine/affinity.py chooses the cores).
"""
from __future__ import annotations

import errno
import heapq
import itertools
import os
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np

DIRECT_ALIGN = 512
DEMAND, PREFETCH = 0, 1  # queue priorities: lower is served first


class ReadError(OSError):
    """A block could not be read in full (I/O error, or the file is shorter than expected)."""


class DirectIOFallbackWarning(UserWarning):
    pass


class AffinityWarning(UserWarning):
    pass


@dataclass
class ReaderStats:
    reads: int = 0
    bytes_read: int = 0
    busy_seconds: float = 0.0     # wall time with at least one read in flight
    demand_reads: int = 0
    prefetch_reads: int = 0
    cancelled: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.busy_seconds / 1e9 if self.busy_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "gbps": self.gbps}


class _Request:
    __slots__ = ("layer", "expert", "offset", "size", "out", "demand", "future", "claimed")

    def __init__(self, layer, expert, offset, size, out, demand):
        self.layer, self.expert, self.offset, self.size = layer, expert, offset, size
        self.out, self.demand = out, demand
        self.future: Future = Future()
        self.claimed = False  # taken by a worker (guarded by the pool lock)


class ReaderPool:
    """ReaderPool(path, n_threads=4, direct=True, cores=None): read(...) -> Future resolving to
    `out`. cores: the cores the worker threads run on (None: wherever the scheduler puts them)."""

    def __init__(self, path: str | os.PathLike, n_threads: int = 4, direct: bool = True,
                 cores: Iterable[int] | None = None):
        if n_threads < 1:
            raise ValueError(f"{path}: a ReaderPool needs at least one thread, got {n_threads}")
        self.path = str(path)
        self.cores = self._check_cores(cores)
        self.direct = False
        self._fd = self._open(direct)
        self._stale_fds: list[int] = []
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._heap: list = []                 # (priority, seq, _Request)
        self._seq = itertools.count()
        self._pending: dict[Future, _Request] = {}
        self._stats = ReaderStats()
        self._inflight = 0
        self._busy_since = 0.0
        self._closed = False
        self._threads = [threading.Thread(target=self._run_worker, name=f"moe-reader-{n}", daemon=True)
                         for n in range(n_threads)]
        for t in self._threads:
            t.start()

    # ---- opening ----------------------------------------------------------------------------

    def _open(self, direct: bool) -> int:
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
                return fd
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise ReadError(e.errno, f"{self.path}: cannot open the arena ({e.strerror})") from None
                self._warn_fallback(e)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise ReadError(e.errno, f"{self.path}: cannot open the arena ({e.strerror})") from None
        self.direct = False
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def _warn_fallback(self, e: OSError) -> None:
        warnings.warn(f"{self.path}: O_DIRECT not supported here ({e.strerror}); using buffered "
                      f"reads, the page cache will hold a second copy of what is read",
                      DirectIOFallbackWarning, stacklevel=3)

    # ---- submitting -------------------------------------------------------------------------

    def read(self, layer: int, expert: int, offset: int, size: int, out: np.ndarray,
             demand: bool = True) -> Future:
        """Queue a read of size bytes at offset into out (uint8, >= size bytes)."""
        if out.dtype != np.uint8 or not out.flags.c_contiguous or out.nbytes < size:
            raise ValueError(f"read (layer {layer}, expert {expert}): out must be a contiguous "
                             f"uint8 buffer of at least {size} bytes, got {out.dtype} {out.nbytes}")
        if self.direct and (offset % DIRECT_ALIGN or size % DIRECT_ALIGN
                            or out.ctypes.data % DIRECT_ALIGN):
            raise ValueError(f"read (layer {layer}, expert {expert}): O_DIRECT needs offset, size "
                             f"and buffer address aligned to {DIRECT_ALIGN} (offset {offset}, "
                             f"size {size}, address {out.ctypes.data:#x})")
        req = _Request(layer, expert, offset, size, out, demand)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.path}: ReaderPool is closed")
            heapq.heappush(self._heap, (DEMAND if demand else PREFETCH, next(self._seq), req))
            self._pending[req.future] = req
            self._cv.notify()
        return req.future

    def promote(self, future: Future) -> bool:
        """Serve a queued prefetch as a demand read; False if it already started or finished."""
        with self._cv:
            req = self._pending.get(future)
            if req is None or req.claimed:
                return False
            if req.demand:
                return True
            req.demand = True
            heapq.heappush(self._heap, (DEMAND, next(self._seq), req))  # the old entry goes stale
            self._cv.notify()
            return True

    def cancel(self, future: Future) -> bool:
        """Cancel a read that has not started; True if it will not run."""
        with self._cv:
            req = self._pending.get(future)
            if req is None or req.claimed:
                return False
            req.claimed = True
            del self._pending[future]
            self._stats.cancelled += 1
        return future.cancel()

    def cancel_prefetches(self, layer: int | None = None) -> int:
        """Cancel queued prefetch reads (of one layer, or all); returns how many."""
        with self._cv:
            victims = [f for f, r in self._pending.items()
                       if not r.demand and not r.claimed and (layer is None or r.layer == layer)]
        return sum(self.cancel(f) for f in victims)

    # ---- workers ----------------------------------------------------------------------------

    @staticmethod
    def _check_cores(cores) -> tuple[int, ...] | None:
        if cores is None or not hasattr(os, "sched_setaffinity"):
            return None
        cores = tuple(sorted(set(int(c) for c in cores)))
        allowed = os.sched_getaffinity(0)
        if not cores or not set(cores) <= allowed:
            raise ValueError(f"reader cores {list(cores)}: need a non-empty subset of the cores this "
                             f"process may run on {sorted(allowed)}")
        return cores

    def _run_worker(self) -> None:
        if self.cores is not None:
            try:
                os.sched_setaffinity(0, self.cores)
            except OSError as e:  # a cpuset changed under us: read anyway, unpinned
                warnings.warn(f"reader thread: cannot pin to cores {list(self.cores)} ({e.strerror})",
                              AffinityWarning, stacklevel=1)
        self._worker()

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed and not self._heap:
                    return
                _, _, req = heapq.heappop(self._heap)
                if req.claimed:
                    continue  # cancelled, or a stale entry of a promoted read
                req.claimed = True
                if not req.future.set_running_or_notify_cancel():
                    self._pending.pop(req.future, None)
                    continue
                if self._inflight == 0:
                    self._busy_since = time.perf_counter()
                self._inflight += 1
            error = None
            try:
                self._pread(req)
            except BaseException as e:  # delivered through the future
                error = e
            with self._cv:
                self._inflight -= 1
                if self._inflight == 0:
                    self._stats.busy_seconds += time.perf_counter() - self._busy_since
                self._pending.pop(req.future, None)
                if error is None:
                    st = self._stats
                    st.reads += 1
                    st.bytes_read += req.size
                    if req.demand:
                        st.demand_reads += 1
                    else:
                        st.prefetch_reads += 1
            if error is None:
                req.future.set_result(req.out)
            else:
                req.future.set_exception(error)

    def _pread(self, req: _Request) -> None:
        view = memoryview(req.out)[:req.size]
        where = f"expert block (layer {req.layer}, expert {req.expert}) of {self.path}"
        done = 0
        while done < req.size:
            try:
                n = os.preadv(self._fd, [view[done:]], req.offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and self.direct:
                    self._fallback_to_buffered(e)
                    continue
                raise ReadError(e.errno, f"I/O error reading {where} at offset "
                                         f"{req.offset + done}: {e.strerror}") from None
            if n == 0:
                raise ReadError(errno.EIO, f"short read of {where}: {done} of {req.size} bytes at "
                                           f"offset {req.offset} (file truncated?)")
            done += n
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, req.offset, req.size, os.POSIX_FADV_DONTNEED)

    def _fallback_to_buffered(self, e: OSError) -> None:
        with self._lock:
            if not self.direct:
                return
            self._stale_fds.append(self._fd)  # other workers may still be inside a pread on it
            self._fd = self._open(False)
            self._warn_fallback(e)

    # ---- stats and lifetime -----------------------------------------------------------------

    def stats(self) -> ReaderStats:
        with self._lock:
            st = ReaderStats(**asdict(self._stats))
            if self._inflight:
                st.busy_seconds += time.perf_counter() - self._busy_since
            return st

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for req in self._pending.values():
                if not req.claimed:
                    req.claimed = True
                    req.future.cancel()
            self._pending.clear()
            self._heap.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        for fd in [self._fd, *self._stale_fds]:
            os.close(fd)

    def __enter__(self) -> "ReaderPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
