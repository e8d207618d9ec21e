"""The VRAM tier: a device bank of expert slots, a hot set pinned by profile rank, the rest LRU.

resolve(layer, experts) returns each expert's slot: a VRAM hit costs nothing; otherwise the
block comes from the host tier (a RAM-cache hit, or a demand read from the arena) and is copied
into a free or least-recently-used slot on the copy stream. The compute stream waits on one
event for the whole batch; nothing syncs the device. Slots in `protect` (the batch still
computing) are never evicted, and the copy stream first waits for `after` (the compute that
last read the slots it may overwrite).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np
from numba import cuda


class ResidencyError(RuntimeError):
    pass


@dataclass
class VramStats:
    vram_hits: int = 0
    ram_hits: int = 0
    disk_reads: int = 0
    h2d_bytes: int = 0
    host_wait_s: float = 0.0   # time the decode thread spent getting blocks from the host tier
    spec_predicted: int = 0    # routed experts the speculative router had predicted
    spec_routed: int = 0       # routed experts in layers that had a prediction
    spec_copies: int = 0       # blocks copied to VRAM on a prediction
    spec_wasted_bytes: int = 0  # of those, bytes for experts the layer did not route to

    def as_dict(self) -> dict:
        d = asdict(self)
        n = self.vram_hits + self.ram_hits + self.disk_reads
        d.update(vram_hit_rate=self.vram_hits / n if n else 0.0,
                 ram_hit_rate=self.ram_hits / n if n else 0.0,
                 disk_rate=self.disk_reads / n if n else 0.0,
                 spec_accuracy=self.spec_predicted / self.spec_routed if self.spec_routed else None)
        return d


class VramResidency:
    """host: an object with get(layer, expert) -> uint8 [B] block (pinned where it can be) and
    contains(layer, expert) -> bool (is it in host RAM already)."""

    def __init__(self, n_slots: int, block_bytes: int, host, copy_stream, compute_stream):
        if n_slots < 1:
            raise ResidencyError("VRAM bank needs at least one slot")
        self.bank = cuda.device_array((n_slots, block_bytes), np.uint8)   # uint8 [S, B]
        self.block_bytes = block_bytes
        self.host = host
        self.xs, self.cs = copy_stream, compute_stream
        self.slot_of: dict = {}            # (layer, expert) -> slot
        self.hot: set = set()              # keys never evicted
        self.lru: OrderedDict = OrderedDict()   # evictable keys, oldest first
        self.free = list(range(n_slots - 1, -1, -1))
        self.stats = VramStats()
        self._evt = cuda.event()
        self._spec: dict = {}       # layer -> (event, predicted keys, keys copied on the prediction)

    @property
    def n_slots(self) -> int:
        return self.bank.shape[0]

    def pin_hot(self, keys) -> int:
        """Load keys into slots and keep them resident; returns how many were placed."""
        placed = 0
        for key in keys:
            if not self.free:
                break
            self.slots_for_hot(key)
            placed += 1
        self.xs.synchronize()
        return placed

    def _copy_in(self, key, slot: int) -> None:
        t = time.perf_counter()
        if self.host.contains(*key):
            self.stats.ram_hits += 1
        else:
            self.stats.disk_reads += 1
            # a read may evict a host buffer that an earlier copy is still reading from
            self.xs.synchronize()
        block = self.host.get(*key)
        self.stats.host_wait_s += time.perf_counter() - t
        self.bank[slot].copy_to_device(block[:self.block_bytes], stream=self.xs)
        self.stats.h2d_bytes += self.block_bytes

    def slots_for_hot(self, key) -> int:
        """Place one more key permanently."""
        if key in self.slot_of:
            return self.slot_of[key]
        if not self.free:
            raise ResidencyError(f"no free VRAM slot for expert {key}")
        slot = self.free.pop()
        self._copy_in(key, slot)
        self.slot_of[key] = slot
        self.hot.add(key)
        return slot

    def speculate(self, layer: int, predicted, protect=()) -> None:
        """Start copies for a layer's predicted experts, taking only blocks already in host RAM
        (the rest become host prefetches), so a prediction never waits on the disk."""
        keys = [(layer, int(e)) for e in predicted]
        keep = set(protect) | set(keys)
        copied = set()
        for key in keys:
            if key in self.slot_of:
                continue
            if not self.host.contains(*key):
                prefetch = getattr(self.host, "prefetch", None)
                if prefetch is not None:
                    prefetch(key[0], [key[1]])
                continue
            slot = self._take_slot(keep)
            self._copy_in(key, slot)
            self.slot_of[key] = slot
            self.lru[key] = slot
            copied.add(key)
        evt = None
        if copied:
            evt = cuda.event()
            evt.record(self.xs)
        self.stats.spec_copies += len(copied)
        self._spec[layer] = (evt, set(keys), copied)

    def resolve(self, layer: int, experts, protect=(), after=None) -> list[int]:
        """Slots of (layer, e) for e in experts, copying in what is not resident."""
        keep = set(protect) | {(layer, int(e)) for e in experts}
        spec = self._spec.pop(layer, None)
        if spec is not None:
            evt, predicted, copied = spec
            routed = {(layer, int(e)) for e in experts}
            self.stats.spec_routed += len(routed)
            self.stats.spec_predicted += len(routed & predicted)
            self.stats.spec_wasted_bytes += len(copied - routed) * self.block_bytes
            if evt is not None:
                evt.wait(self.cs)
        copied = False
        out = []
        for e in experts:
            key = (layer, int(e))
            slot = self.slot_of.get(key)
            if slot is not None:
                self.stats.vram_hits += 1
                if key in self.lru:
                    self.lru.move_to_end(key)
                out.append(slot)
                continue
            if not copied and after is not None:
                after.wait(self.xs)
            copied = True
            slot = self._take_slot(keep)
            self._copy_in(key, slot)
            self.slot_of[key] = slot
            self.lru[key] = slot
            out.append(slot)
        if copied:
            self._evt.record(self.xs)
            self._evt.wait(self.cs)
        return out

    def _take_slot(self, keep) -> int:
        if self.free:
            return self.free.pop()
        for key in self.lru:
            if key not in keep:
                slot = self.lru.pop(key)
                del self.slot_of[key]
                return slot
        raise ResidencyError(f"all {self.n_slots} VRAM expert slots are pinned or in use by the "
                             f"current batch; the plan needs more slots")
