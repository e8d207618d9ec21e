"""Which cores the decode thread and the reader threads run on.

The decode thread (whichever thread runs Engine.stream: the caller's, or engine.serve's worker) is
pinned to one core so the scheduler neither moves it mid-token nor puts a reader's syscalls and
copies on its core; the reader threads run on the other cores. By default the decode thread is
pinned only on the cuda backend: there it launches kernels and waits, while the cpu backend's
kernels spread over every core anyway. Pinning uses os.sched_setaffinity(0, ...), which on Linux
applies to the calling thread only; where it is missing, nothing is pinned and one note says so.

    plan = plan_cores("auto", None, device="cuda")   # allowed 0-15 -> decode 15, readers 0-14
    restore = pin_current_thread(plan.decode)         # in the decode thread
    ...
    restore()                                         # the thread's mask as it was
"""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

AUTO = "auto"
CAN_PIN = hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")
_noted: set = set()     # notes already printed, so each shows once per process


def note_once(msg: str) -> None:
    if msg not in _noted:
        _noted.add(msg)
        print(f"note: {msg}", file=sys.stderr)


def allowed_cores() -> tuple[int, ...] | None:
    """The cores this process may run on, sorted; None where the platform cannot tell."""
    return tuple(sorted(os.sched_getaffinity(0))) if CAN_PIN else None


def format_cores(cores: Iterable[int] | None) -> str:
    """(0, 1, 2, 3, 6) -> '0-3,6'; None -> 'any'."""
    if cores is None:
        return "any"
    cs, parts = sorted(set(cores)), []
    i = 0
    while i < len(cs):
        j = i
        while j + 1 < len(cs) and cs[j + 1] == cs[j] + 1:
            j += 1
        parts.append(str(cs[i]) if i == j else f"{cs[i]}-{cs[j]}")
        i = j + 1
    return ",".join(parts)


def _check(flag: str, cores: Iterable[int], allowed) -> None:
    if allowed is None:
        return
    bad = sorted(set(cores) - set(allowed))
    if bad:
        raise ValueError(f"{flag} {format_cores(bad)}: not among the cores this process may run "
                         f"on (allowed: {format_cores(allowed)})")


def parse_cores(text: str, flag: str = "--reader-cores", allowed=AUTO) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6), checked against the allowed cores (default: this process's)."""
    cores: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"{flag} {text!r}: expected core ids and ranges like 0-3,6") from None
        if a < 0 or b < a:
            raise ValueError(f"{flag} {text!r}: bad range {part!r}")
        cores.update(range(a, b + 1))
    _check(flag, cores, allowed_cores() if allowed == AUTO else allowed)
    return tuple(sorted(cores))


def parse_decode_core(value, allowed=AUTO) -> int | str | None:
    """'auto' -> 'auto'; 'none', '-1', -1 or None -> None (not pinned); an id -> that id, checked."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, str):
        if value.strip().lower() in ("none", "off", "-1"):
            return None
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"--decode-core {value!r}: expected a core id, 'auto' or 'none'") from None
    if value == -1:
        return None
    if value < 0:
        raise ValueError(f"--decode-core {value}: expected a core id, 'auto' or 'none'")
    _check("--decode-core", [value], allowed_cores() if allowed == AUTO else allowed)
    return int(value)


@dataclass(frozen=True)
class CorePlan:
    decode: int | None                  # the decode thread's core; None = not pinned
    readers: tuple[int, ...] | None     # the reader threads' cores; None = not pinned
    allowed: tuple[int, ...] | None     # what the process may use; None = cannot pin here
    why: str                            # how the choice was made

    @property
    def reader_mask(self) -> tuple[int, ...] | None:
        """The cores to pin readers to; None when that is every allowed core (nothing to do)."""
        return None if self.readers is None or self.readers == self.allowed else self.readers

    def as_dict(self) -> dict:
        return {"decode_core": self.decode, "reader_cores": None if self.readers is None else list(self.readers),
                "allowed_cores": None if self.allowed is None else list(self.allowed), "why": self.why}

    def describe(self) -> str:
        dec = "unpinned" if self.decode is None else f"on core {self.decode}"
        rd = "unpinned" if self.readers is None else f"on {format_cores(self.readers)}"
        return f"cores: decode {dec}, readers {rd} (of {format_cores(self.allowed)}; {self.why})"


def plan_cores(decode_core=AUTO, reader_cores=None, device: str = "cuda", allowed=AUTO) -> CorePlan:
    """Choose the cores. decode_core: 'auto', None/'none'/-1 or an id; reader_cores: None (the
    allowed cores but the decode core; all of them when only one is allowed), a list, or a
    string like '0-3,6'. Ids outside the allowed set raise ValueError naming the flag."""
    allowed = allowed_cores() if allowed == AUTO else (None if allowed is None else tuple(sorted(allowed)))
    asked = decode_core not in (None, AUTO, -1, "none") or reader_cores is not None
    if allowed is None:
        if asked or (decode_core == AUTO and device == "cuda"):
            note_once("this platform cannot pin threads to cores (no os.sched_setaffinity); "
                      "--decode-core and --reader-cores are ignored")
        return CorePlan(None, None, None, "no thread affinity on this platform")
    decode = parse_decode_core(decode_core, allowed)
    if isinstance(reader_cores, str):
        readers = parse_cores(reader_cores, allowed=allowed)
    elif reader_cores is not None:
        readers = tuple(sorted(set(int(c) for c in reader_cores)))
        if not readers:
            raise ValueError("--reader-cores: give at least one core")
        _check("--reader-cores", readers, allowed)
    else:
        readers = None
    if decode == AUTO:
        if device != "cuda":
            decode, why = None, "cpu backend: its kernels run on every core"
        else:
            free = [c for c in allowed if readers is None or c not in readers]
            decode = (free or allowed)[-1]
            why = "decode on the last allowed core"
    else:
        why = "as asked" if decode is not None else "decode not pinned, as asked"
    if readers is None:
        others = tuple(c for c in allowed if c != decode)
        readers = others or allowed          # one allowed core: readers share it with decode
        if not others:
            why += "; one core, shared"
    return CorePlan(decode, readers, allowed, why)


def pin_current_thread(core: int | None, before: Callable[[], None] | None = None) -> Callable[[], None]:
    """Pin the calling thread to core; returns a function that restores its previous mask (a no-op
    when called from another thread, or when nothing was pinned). `before` runs first, unpinned:
    threads the caller starts later (numba's team) inherit the mask of the thread that starts them."""
    if core is None or not CAN_PIN:
        return lambda: None
    if before is not None:
        before()
    me, old = threading.get_ident(), os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})
    except OSError as e:
        note_once(f"cannot pin the decode thread to core {core} ({e.strerror}); it runs unpinned")
        return lambda: None

    def restore() -> None:
        if threading.get_ident() == me:
            os.sched_setaffinity(0, old)
    return restore
