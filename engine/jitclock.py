"""Seconds spent compiling Numba's CPU kernels, from numba's "numba:compile" events (cache misses
only: a kernel loaded from numba's on-disk cache fires none; numba-cuda's kernels report to its
own event module, not counted). A first run compiles the kernels inside its prefill and first
decode tokens; the summary says so instead of reporting the rate alone."""
from __future__ import annotations

import threading
import time

from numba.core import event


class _CompileClock(event.Listener):
    """Outermost compiles only: compiling a kernel compiles the functions it calls inside it."""

    def __init__(self):
        self.seconds = 0.0
        self._open: dict = {}    # thread id -> (depth, start)

    def on_start(self, ev) -> None:
        tid = threading.get_ident()
        depth, start = self._open.get(tid, (0, 0.0))
        self._open[tid] = (depth + 1, time.perf_counter() if depth == 0 else start)

    def on_end(self, ev) -> None:
        tid = threading.get_ident()
        depth, start = self._open.pop(tid, (1, time.perf_counter()))
        if depth > 1:
            self._open[tid] = (depth - 1, start)
        else:
            self.seconds += time.perf_counter() - start


_CLOCK = _CompileClock()
event.register("numba:compile", _CLOCK)


def compile_seconds() -> float:
    """Seconds this process has spent compiling Numba functions so far."""
    return _CLOCK.seconds
