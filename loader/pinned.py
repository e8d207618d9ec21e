"""Pinned host buffer pool: one allocation cut into aligned buffers, numpy uint8 views over it.

With a working GPU the memory is page-locked through the CUDA driver (cuMemHostAlloc, portable
and mapped), so H2D copies run at full PCIe speed and asynchronously, and kernels can read it;
without one it is anonymous mmap memory (page-aligned, which O_DIRECT reads also need).
"""
from __future__ import annotations

import ctypes
import mmap
import threading
from collections import deque

import numpy as np

from loader.layout import BLOCK_ALIGN


class PinnedError(RuntimeError):
    pass


def _cuda_driver():
    """The cuda-python driver module once cuInit succeeded, else None."""
    try:
        from cuda.bindings import driver
        (err,) = driver.cuInit(0)
    except (ImportError, RuntimeError):  # no cuda-python, or no libcuda (no driver installed)
        return None
    return driver if err == driver.CUresult.CUDA_SUCCESS else None


def _check(driver, result, what: str):
    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise PinnedError(f"{what} failed: {err.name} ({msg.decode() if msg else '?'})")
    return rest[0] if len(rest) == 1 else rest


class PinnedPool:
    """n_buffers buffers of buffer_bytes (rounded up to 4096) in one allocation.

    use_cuda: True = page-locked or fail; False = plain mmap; None = page-locked when a GPU works.
    """

    def __init__(self, n_buffers: int, buffer_bytes: int, use_cuda: bool | None = None):
        if n_buffers < 1 or buffer_bytes < 1:
            raise ValueError(f"PinnedPool: need at least one buffer of at least one byte, "
                             f"got {n_buffers} x {buffer_bytes}")
        self.n_buffers = n_buffers
        self.buffer_bytes = (buffer_bytes + BLOCK_ALIGN - 1) // BLOCK_ALIGN * BLOCK_ALIGN
        self.total_bytes = self.n_buffers * self.buffer_bytes
        self.pinned = False
        self._driver = None
        self._host_ptr = 0
        self._device = None
        self._mmap: mmap.mmap | None = None
        driver = _cuda_driver() if use_cuda is not False else None
        if use_cuda and driver is None:
            raise PinnedError("PinnedPool(use_cuda=True): no working CUDA driver/GPU on this machine")
        if driver is not None:
            self._alloc_cuda(driver)
            raw = (ctypes.c_uint8 * self.total_bytes).from_address(self._host_ptr)
            self._base = np.frombuffer(raw, dtype=np.uint8)
        else:
            self._mmap = mmap.mmap(-1, self.total_bytes)
            self._base = np.frombuffer(self._mmap, dtype=np.uint8)
        self.buffers = [self._base[i * self.buffer_bytes:(i + 1) * self.buffer_bytes]
                        for i in range(n_buffers)]        # uint8 [buffer_bytes] each
        self._free = deque(range(n_buffers))
        self._in_use = [False] * n_buffers
        self._lock = threading.Lock()

    def _alloc_cuda(self, driver) -> None:
        dev = _check(driver, driver.cuDeviceGet(0), "cuDeviceGet(0)")
        ctx = _check(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if not int(ctx):  # no current context: use the device's primary context
            ctx = _check(driver, driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self._device = dev
            _check(driver, driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._host_ptr = int(_check(driver, driver.cuMemHostAlloc(
            self.total_bytes, driver.CU_MEMHOSTALLOC_PORTABLE | driver.CU_MEMHOSTALLOC_DEVICEMAP),
            f"cuMemHostAlloc({self.total_bytes} bytes)"))
        self._driver = driver
        self.pinned = True

    def acquire(self) -> int:
        """Index of a free buffer; PinnedError when all are in use."""
        with self._lock:
            if not self._free:
                raise PinnedError(f"PinnedPool: all {self.n_buffers} buffers are in use")
            i = self._free.popleft()
            self._in_use[i] = True
            return i

    def release(self, i: int) -> None:
        with self._lock:
            if not 0 <= i < self.n_buffers or not self._in_use[i]:
                raise PinnedError(f"PinnedPool: release of buffer {i}, which is not in use")
            self._in_use[i] = False
            self._free.append(i)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def view(self, i: int) -> np.ndarray:
        """uint8 [buffer_bytes] view of buffer i."""
        return self.buffers[i]

    def address(self, i: int) -> int:
        """Host address of buffer i (for cuMemcpyHtoDAsync)."""
        return self._base.ctypes.data + i * self.buffer_bytes

    def addresses(self) -> list[tuple[np.ndarray, int]]:
        """(view(i), address(i)) for every buffer: a caller that copies the views out often
        looks the address up by the view instead of asking numpy (microseconds a call)."""
        base = self._base.ctypes.data
        return [(b, base + i * self.buffer_bytes) for i, b in enumerate(self.buffers)]

    def device_address(self) -> int | None:
        """The address kernels read the pool at (mapped, over PCIe), None when it is not
        page-locked through the driver."""
        if self._driver is None or not self._host_ptr:
            return None
        return int(_check(self._driver, self._driver.cuMemHostGetDevicePointer(self._host_ptr, 0),
                          "cuMemHostGetDevicePointer"))

    def close(self) -> None:
        """Free the memory. Views handed out must not be used afterwards."""
        self.buffers = []
        self._base = None
        if self._driver is not None and self._host_ptr:
            _check(self._driver, self._driver.cuMemFreeHost(self._host_ptr), "cuMemFreeHost")
            self._host_ptr = 0
            if self._device is not None:
                _check(self._driver, self._driver.cuDevicePrimaryCtxRelease(self._device),
                       "cuDevicePrimaryCtxRelease")
                self._device = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # views still held by callers: the mapping goes when the last one does
            self._mmap = None

    def __enter__(self) -> "PinnedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
