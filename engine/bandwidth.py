"""Tier bandwidths measured on this machine, in the same run as the figures they bound.

Bounds: the tokens/s the tiers allow for the bytes actually moved per token,
    1 / (disk_bytes / disk_bw + h2d_bytes / h2d_bw + hbm_bytes / hbm_bw)
(tiers are taken as serial: an upper bound on time saved by overlap is reported beside it).
"""
from __future__ import annotations

import functools

import numpy as np


def time_ms(stream, fn, reps: int) -> float:
    """ms a call of fn(), which launches on the stream: warmed once, then timed by events
    around reps calls issued back to back."""
    from numba import cuda
    fn()
    stream.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    e0.record(stream)
    for _ in range(reps):
        fn()
    e1.record(stream)
    e1.synchronize()
    return e0.elapsed_time(e1) / reps


def _best_gbps(copy, nbytes: int, repeats: int, stream) -> float:
    """nbytes / time of copy(), best of two time_ms rounds of `repeats` copies back to back.
    Host timing of one synchronized copy at a time read the H200's HBM copy at 2597-3187 GB/s
    against 4117 back to back in the same process (docs/PERF.md, tenth session): the GPU idles
    between synchronized copies."""
    return max(nbytes / (time_ms(stream, copy, repeats) * 1e-3) / 1e9 for _ in range(2))


@functools.lru_cache(maxsize=None)
def h2d_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Pinned host -> device copy bandwidth."""
    from numba import cuda
    host = cuda.pinned_array(nbytes, np.uint8)
    host[:] = 1
    dev = cuda.device_array(nbytes, np.uint8)
    s = cuda.stream()
    return _best_gbps(lambda: dev.copy_to_device(host, stream=s), nbytes, repeats, s)


@functools.lru_cache(maxsize=None)
def hbm_gbps(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written."""
    from numba import cuda
    a = cuda.device_array(nbytes, np.uint8)
    b = cuda.device_array(nbytes, np.uint8)
    s = cuda.stream()
    return _best_gbps(lambda: b.copy_to_device(a, stream=s), 2 * nbytes, repeats, s)


def bound(per_token: dict, bw: dict) -> float:
    """tokens/s allowed by moving per_token[tier] bytes at bw[tier] GB/s, tiers serial."""
    t = sum(per_token[k] / (bw[k] * 1e9) for k in per_token if per_token[k] and bw.get(k))
    return 1.0 / t if t > 0 else float("inf")
