"""The VRAM tier: a device bank of expert slots, a hot set pinned by profile rank, the rest LRU.

resolve(layer, experts) returns each expert's slot: a VRAM hit costs nothing; otherwise the
block comes from the host tier (a RAM-cache hit, or a demand read from the arena) and is copied
into a free or least-recently-used slot on the copy stream. The compute stream waits on one
event for the whole batch; nothing syncs the device. Slots in `protect` (the batch still
computing) are never evicted, and the copy stream first waits for `after` (the compute that
last read the slots it may overwrite).
"""
from __future__ import annotations

import contextlib
import time
import weakref
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
    gathered: int = 0          # of ram_hits, blocks the GPU read from host RAM itself (counted
                               # in h2d_bytes: they cross PCIe too)
    dense_h2d_bytes: int = 0   # of h2d_bytes, dense weights of layers streamed from host RAM
    host_wait_s: float = 0.0   # time the decode thread spent getting blocks from the host tier
    h2d_wait_s: float = 0.0    # decode: time the compute stream stood waiting for expert copies
                               # (one graph a token: the copy stream's, host resolve to flag)
    issue_s: float = 0.0       # time the decode thread spent resolving slots and issuing copies
                               # (its waits on the host tier are in host_wait_s only)
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


def h2d_copier(bank, stream, buffers=None, driver=None):
    """copy(slot, host_block, nbytes) into row `slot` of the uint8 [S, B] device array `bank` on
    `stream`: cuMemcpyHtoDAsync straight from the driver (numba's copy_to_device costs tens of
    microseconds of Python a call, and a streamed decode token issues hundreds), numba's copy
    under the simulator. buffers: a function giving (array, host address) of the host tier's
    pinned buffers, the blocks it hands out, whose addresses are then known (numpy's .ctypes
    costs microseconds a call); asked at the first copy (after the plan has sized the RAM
    cache), held by weak references; driver: a stand-in for cuda.bindings.driver (tests)."""
    from kernels_numba.gpu_util import SIM
    if SIM and driver is None:
        def copy_sim(slot: int, block: np.ndarray, nbytes: int) -> None:
            bank[slot, :nbytes].copy_to_device(block[:nbytes], stream=stream)
        return copy_sim
    w = DeviceWriter(stream, driver)
    drv, h, ok = w._drv, w._h, w._drv.CUresult.CUDA_SUCCESS
    base = DeviceWriter.ptr(bank)
    row = bank.shape[1]
    known: dict = {}
    asked = [buffers is None]

    def copy(slot: int, block: np.ndarray, nbytes: int) -> None:
        if not asked[0]:
            asked[0] = True
            known.update((id(a), (weakref.ref(a), int(addr))) for a, addr in buffers())
        ent = known.get(id(block))
        if ent is not None and ent[0]() is block:   # (the same object, alive)
            src = ent[1]
        else:
            if not block.flags.c_contiguous:
                block = np.ascontiguousarray(block)
            src = block.ctypes.data
        (err,) = drv.cuMemcpyHtoDAsync(base + slot * row, src, nbytes, h)
        if err != ok:
            raise ResidencyError(f"cuMemcpyHtoDAsync of {nbytes} bytes into VRAM slot {slot} "
                                 f"failed: {err.name}")
    return copy


class DeviceWriter:
    """Writes into device memory on a stream, ordered with the copies on it, each driver call's
    status checked: set(a, i, v) writes a.flat[i] = v and fill(a, v) all of the int32 array a
    (cuMemsetD32Async: no host buffer to keep alive), put(a, h) copies the pinned host array h
    into a, copy(dst, h, n) n bytes of h to the device address dst. numba's copies (synchronous)
    under the simulator (set, fill, put). Callers that write the same array often pass its
    address (ptr(a), kept): numba builds it anew each time it is asked. driver: a stand-in for
    cuda.bindings.driver that also runs under the simulator (tests)."""

    def __init__(self, stream, driver=None):
        from kernels_numba.gpu_util import SIM
        self.sim = SIM and driver is None
        if driver is not None:
            self._drv, self._h = driver, 0
        elif not SIM:
            from cuda.bindings import driver

            from engine.graphs import stream_handle
            self._drv = driver
            self._h = stream_handle(stream)

    @staticmethod
    def ptr(a) -> int:
        return int(a.__cuda_array_interface__["data"][0])

    def _check(self, err, what: str) -> None:
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise ResidencyError(f"{what} failed: {err.name}")

    def set(self, a, i: int, v: int, addr: int | None = None) -> None:
        if self.sim:
            a.reshape(-1)[i:i + 1].copy_to_device(np.array([v], np.int32))
            return
        base = self.ptr(a) if addr is None else addr
        (err,) = self._drv.cuMemsetD32Async(base + 4 * int(i), int(v) & 0xFFFFFFFF, 1, self._h)
        self._check(err, f"cuMemsetD32Async of entry {i}")

    def fill(self, a, v: int) -> None:
        if self.sim:
            a.copy_to_device(np.full(a.shape, v, np.int32))
            return
        (err,) = self._drv.cuMemsetD32Async(self.ptr(a), int(v) & 0xFFFFFFFF, a.size, self._h)
        self._check(err, f"cuMemsetD32Async of {a.size} entries")

    def put(self, a, h: np.ndarray) -> None:
        if self.sim:
            a.copy_to_device(h)
            return
        self.copy(self.ptr(a), h, h.nbytes)

    def copy(self, dst: int, h, nbytes: int, what: str = "") -> None:
        """h: a host array, or its address."""
        src = h if isinstance(h, int) else h.ctypes.data
        (err,) = self._drv.cuMemcpyHtoDAsync(dst, src, nbytes, self._h)
        self._check(err, f"cuMemcpyHtoDAsync of {nbytes} bytes {what}".rstrip())


class VramResidency:
    """host: an object with get(layer, expert) -> uint8 [B] block (pinned where it can be) and
    contains(layer, expert) -> bool (is it in host RAM already)."""

    def __init__(self, n_slots: int, block_bytes: int, host, copy_stream, compute_stream,
                 driver=None):
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
        self.copied = False
        self._evt = cuda.event()
        self._driver = driver   # (a stand-in for the CUDA driver: tests)
        self._copy = h2d_copier(self.bank, copy_stream, getattr(host, "buffer_addresses", None),
                                driver)
        self._spec: dict = {}       # layer -> (event, predicted keys, keys copied on the prediction)
        self._table = None          # (device int32 [L, E] mirror of slot_of, its DeviceWriter,
                                    #  its device address)
        self._table_h = None        # its host copy (pinned)
        self._batched = False       # inside batched_table: entries go to _table_h only
        self._batch_changed = False
        self.spec_recent = 1.0      # running accuracy of the predictions (starts trusting them)

    def attach_table(self, table) -> None:
        """From now on keep the device int32 [L, E] table equal to slot_of, -1 where an expert
        is not in VRAM: written whole here, then an entry a placement or eviction, on the copy
        stream ahead of the copies that follow."""
        host = cuda.pinned_array(table.shape, np.int32)
        host[:] = -1
        for (layer, e), slot in self.slot_of.items():
            host[layer, e] = slot
        table.copy_to_device(host, stream=self.xs)
        self.xs.synchronize()
        w = DeviceWriter(self.xs, self._driver)
        self._table = (table, w, None if w.sim else DeviceWriter.ptr(table))
        self._table_h = host

    @contextlib.contextmanager
    def batched_table(self):
        """Many table changes at once (after a token): the host copy takes them, then one copy
        of the whole table on the copy stream, not a write an entry."""
        self._batched = self._table is not None
        self._batch_changed = False
        try:
            yield
        finally:
            self._batched = False
            if self._batch_changed:
                table, w, addr = self._table
                if w.sim:
                    w.put(table, self._table_h)
                else:
                    w.copy(addr, self._table_h, self._table_h.nbytes, "of the slot table")

    def _mirror(self, key, slot: int) -> None:
        if self._table is not None:
            self._table_h[key] = slot
            if self._batched:
                self._batch_changed = True
                return
            table, w, addr = self._table
            w.set(table, key[0] * self._table_h.shape[1] + key[1], slot, addr)

    @property
    def n_slots(self) -> int:
        return self.bank.shape[0]

    def pin_hot(self, keys) -> int:
        """Load keys into free slots and keep them resident; returns how many were placed."""
        keys = [k for k in keys if k not in self.slot_of][:len(self.free)]
        self._place(keys, hot=True)
        self.xs.synchronize()
        return len(keys)

    def slots_for_hot(self, keys, progress=None) -> None:
        """Place keys permanently (all-resident mode); raises when the slots run out."""
        keys = [k for k in keys if k not in self.slot_of]
        if len(keys) > len(self.free):
            raise ResidencyError(f"{len(keys)} experts to place, {len(self.free)} free VRAM slots")
        self._place(keys, hot=True, progress=progress)
        self.xs.synchronize()

    def _place(self, keys, hot: bool, keep=(), batch: int = 32, progress=None) -> list[int]:
        """Copy keys' blocks into slots (free first, then LRU victims not in keep), reading a
        layer's host misses together, batch blocks at a time."""
        slots = []
        i = 0
        while i < len(keys):
            layer = keys[i][0]
            j = i
            while j < len(keys) and j - i < batch and keys[j][0] == layer:
                j += 1
            group = keys[i:j]
            for key, block in zip(group, self._host_blocks(layer, group)):
                slot = self._take(keep)
                self._copy(slot, block, self.block_bytes)
                self.stats.h2d_bytes += self.block_bytes
                self.adopt(key, slot, hot)
                slots.append(slot)
            if progress is not None:
                progress.update(len(group))
            i = j
        return slots

    def _host_blocks(self, layer: int, keys) -> list:
        """The host tier's blocks for keys of one layer: RAM hits, and the misses read together."""
        t = time.perf_counter()
        missing = [k for k in keys if not self.host.contains(*k)]
        self.stats.ram_hits += len(keys) - len(missing)
        self.stats.disk_reads += len(missing)
        if missing:
            # a read may evict a host buffer that an earlier copy is still reading from
            self.xs.synchronize()
        get_many = getattr(self.host, "get_many", None)
        if get_many is not None:
            blocks = get_many(layer, [e for _, e in keys])
        else:
            blocks = [self.host.get(*k) for k in keys]
        self.stats.host_wait_s += time.perf_counter() - t
        return blocks

    SPEC_MIN_ACCURACY = 0.5   # below this (recent layers) predictions are only scored, not copied
    SPEC_DECAY = 0.05         # weight of the newest layer in the running accuracy

    @property
    def spec_useful(self) -> bool:
        """Whether recent predictions hit often enough to pay for their copies: a wrong copy
        evicts a slot and delays the layer's demand copies queued behind it."""
        return self.spec_recent >= self.SPEC_MIN_ACCURACY

    def speculate(self, layer: int, predicted, protect=(), copy: bool | None = None) -> None:
        """Start copies for a layer's predicted experts, taking only blocks already in host RAM
        (the rest become host prefetches), so a prediction never waits on the disk. With copy
        False (default: while recent accuracy is low) the prediction is only scored at resolve."""
        keys = [(layer, int(e)) for e in predicted]
        keep = set(protect) | set(keys)
        todo = []
        if copy is None:
            copy = self.spec_useful
        for key in keys if copy else ():
            if key in self.slot_of:
                continue
            if self.host.contains(*key):
                todo.append(key)
            else:
                prefetch = getattr(self.host, "prefetch", None)
                if prefetch is not None:
                    prefetch(key[0], [key[1]])
        self._place(todo, hot=False, keep=keep)
        evt = None
        if todo:
            evt = cuda.event()
            evt.record(self.xs)
        self.stats.spec_copies += len(todo)
        self._spec[layer] = (evt, set(keys), set(todo))

    def resolve(self, layer: int, experts, protect=(), after=None, wait: bool = True) -> list[int]:
        """Slots of (layer, e) for e in experts, copying in what is not resident. Afterwards
        `copied` says whether this call issued copies (the compute stream then waits for them;
        wait False: the caller orders the compute after them itself)."""
        t0, h0 = time.perf_counter(), self.stats.host_wait_s   # (issue_s leaves the host tier out)
        keys = [(layer, e) for e in (experts.tolist() if hasattr(experts, "tolist")
                                     else map(int, experts))]
        spec = self._spec.pop(layer, None) if self._spec else None
        if spec is None and all(k in self.slot_of for k in keys):   # decode's usual case
            self._hits(keys)
            self.copied = False
            self.stats.issue_s += time.perf_counter() - t0
            return [self.slot_of[k] for k in keys]
        keep = set(protect) | set(keys)
        if spec is not None:
            evt, predicted, copied = spec
            routed = set(keys)
            self.stats.spec_routed += len(routed)
            self.stats.spec_predicted += len(routed & predicted)
            self.stats.spec_wasted_bytes += len(copied - routed) * self.block_bytes
            a = len(routed & predicted) / max(len(routed), 1)
            self.spec_recent += self.SPEC_DECAY * (a - self.spec_recent)
            if evt is not None and routed & copied:   # wait only for copies this layer reads
                evt.wait(self.cs)
        missing = []
        for key in keys:
            if key in self.slot_of:
                self.stats.vram_hits += 1
                if key in self.lru:
                    self.lru.move_to_end(key)
            elif key not in missing:
                missing.append(key)
        if missing:
            if after is not None:
                after.wait(self.xs)
            self._place(missing, hot=False, keep=keep)
            if wait:
                self._evt.record(self.xs)
                self._evt.wait(self.cs)
        self.copied = bool(missing)
        self.stats.issue_s += time.perf_counter() - t0 - (self.stats.host_wait_s - h0)
        return [self.slot_of[k] for k in keys]

    def _take(self, keep) -> int:
        """A slot for a new block: a free one, else the oldest LRU entry not in keep (its table
        entry cleared)."""
        return self.free.pop() if self.free else self._evict(keep)

    def reserve(self, n: int, keep=()) -> list[int]:
        """n slots taken out of the LRU's reach (see _take)."""
        return [self._take(keep) for _ in range(n)]

    def adopt(self, key, slot: int, hot: bool = False) -> None:
        """slot now holds key's block (copied in here, or a reserved slot the device wrote):
        it joins the hot set or the LRU."""
        self.slot_of[key] = slot
        self._mirror(key, slot)
        if hot:
            self.hot.add(key)
        else:
            self.lru[key] = slot

    def gathered(self, layer: int, experts) -> None:
        """Blocks the GPU read from host RAM into staging slots (gpu_misc.expert_gather)."""
        n = len(experts)
        self.stats.ram_hits += n
        self.stats.gathered += n
        self.stats.h2d_bytes += n * self.block_bytes
        note = getattr(self.host, "note_hits", None)
        if note is not None:
            note(layer, experts)

    def touch(self, layer: int, experts) -> None:
        """VRAM hits the device resolved on its own (the streamed token graph)."""
        self._hits([(layer, int(e)) for e in experts])

    def touch_keys(self, keys) -> None:
        """touch for (layer, expert) keys of any layers (ints), in the order they were used."""
        self._hits(list(keys))

    def _hits(self, keys) -> None:
        """Keys found in VRAM: counted, and their LRU recency refreshed."""
        self.stats.vram_hits += len(keys)
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)

    def _evict(self, keep) -> int:
        for key in self.lru:
            if key not in keep:
                slot = self.lru.pop(key)
                del self.slot_of[key]
                self._mirror(key, -1)
                return slot
        raise ResidencyError(f"all {self.n_slots} VRAM expert slots are pinned or in use by the "
                             f"current batch; the plan needs more slots")
