"""Host-RAM expert cache: a byte budget of pinned slots, filled by the reader, one block per slot.

Decode visits the MoE layers in order, so one global LRU smaller than layers x top-k evicts
every expert just before its layer comes round again and hits nothing. Each layer therefore has
its own policy and a quota (the slots split evenly across layers): a miss evicts within its own
layer when that layer holds its quota, otherwise from the layer most over its quota. A request
for more experts than the quota borrows slots for the moment and gives them back on later misses.
Policies (LRU, LFU, decayed frequency) are classes shared with the trace simulator (engine/trace.py).

Views returned by get / get_many / iter_ready stay valid until the next one of these calls:
until then their slots are pinned. prefetch never evicts a pinned or loading block.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, as_completed
from dataclasses import asdict, dataclass
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np

from loader.arena import ArenaFile
from loader.pinned import PinnedPool

POLICIES = ("lru", "lfu", "decay")


# ---- eviction policies ---------------------------------------------------------------------

class Policy:
    """Chooses which resident key leaves. access() records a use (hit or miss), admit() makes a
    key resident, remove() drops it, victim() names the one to evict, tick() ends a token step."""

    name = "base"

    def __init__(self):
        self._resident: dict[Hashable, None] = {}

    def __contains__(self, key) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def access(self, key) -> None:
        pass

    def admit(self, key) -> None:
        self._resident[key] = None

    def remove(self, key) -> None:
        del self._resident[key]

    def victim(self, exclude: Iterable = ()) -> Hashable | None:
        raise NotImplementedError

    def tick(self) -> None:
        pass


class LRUPolicy(Policy):
    name = "lru"

    def __init__(self):
        self._resident: OrderedDict = OrderedDict()   # least recent first

    def access(self, key) -> None:
        if key in self._resident:
            self._resident.move_to_end(key)

    def victim(self, exclude: Iterable = ()):
        exclude = exclude if isinstance(exclude, (set, frozenset, dict)) else set(exclude)
        return next((k for k in self._resident if k not in exclude), None)


class LFUPolicy(Policy):
    """Least frequently used; counts persist across evictions; ties go to the least recent."""

    name = "lfu"

    def __init__(self):
        super().__init__()
        self.count: dict = {}
        self.last: dict = {}
        self._clock = 0

    def access(self, key) -> None:
        self._clock += 1
        self.count[key] = self.count.get(key, 0) + self._weight()
        self.last[key] = self._clock

    def admit(self, key) -> None:
        super().admit(key)
        self.last.setdefault(key, self._clock)
        self.count.setdefault(key, 0)

    def _weight(self) -> float:
        return 1

    def victim(self, exclude: Iterable = ()):
        exclude = exclude if isinstance(exclude, (set, frozenset, dict)) else set(exclude)
        best, best_rank = None, None
        for k in self._resident:
            if k in exclude:
                continue
            rank = (self.count[k], self.last[k])
            if best_rank is None or rank < best_rank:
                best, best_rank = k, rank
        return best


class DecayPolicy(LFUPolicy):
    """Decayed frequency: every count is multiplied by `decay` at each tick() (token step).

    Done in O(1) per tick by growing the weight of new uses instead, renormalizing rarely."""

    name = "decay"

    def __init__(self, decay: float = 0.9):
        super().__init__()
        if not 0 < decay <= 1:
            raise ValueError(f"decay policy: decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._w = 1.0

    def _weight(self) -> float:
        return self._w

    def tick(self) -> None:
        self._w /= self.decay
        if self._w > 1e100:
            for k in self.count:
                self.count[k] /= self._w
            self._w = 1.0

    def score(self, key) -> float:
        """The decayed count as of now."""
        return self.count.get(key, 0) / self._w


def make_policy(name: str, decay: float = 0.9) -> Policy:
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "decay":
        return DecayPolicy(decay)
    raise ValueError(f"unknown cache policy {name!r}; expected one of {', '.join(POLICIES)}")


def split_slots(n_slots: int, layers: Sequence[int]) -> dict[int, int]:
    """Slots per layer: an even split, the remainder to the first layers."""
    base, extra = divmod(n_slots, len(layers))
    return {layer: base + (1 if n < extra else 0) for n, layer in enumerate(layers)}


class SplitPolicy:
    """Per-layer policies over one pool of n_slots with per-layer quotas (split="layer"), or one
    policy over all layers (split="global"). Keys are (layer, expert)."""

    def __init__(self, make: Callable[[], Policy], layers: Sequence[int], n_slots: int,
                 split: str = "layer"):
        if split == "layer":
            self.quota = split_slots(n_slots, list(layers))
            self.policies = {layer: make() for layer in layers}
        elif split == "global":
            one = make()
            self.quota = None
            self.policies = {layer: one for layer in layers}
        else:
            raise ValueError(f"cache split {split!r}; expected 'layer' or 'global'")
        self.split = split
        self.n_slots = n_slots
        self._distinct = list(dict.fromkeys(self.policies.values()))

    def __contains__(self, key) -> bool:
        return key in self.policies[key[0]]

    def __len__(self) -> int:
        return sum(len(p) for p in self._distinct)

    def access(self, key) -> None:
        self.policies[key[0]].access(key)

    def admit(self, key) -> None:
        self.policies[key[0]].admit(key)

    def remove(self, key) -> None:
        self.policies[key[0]].remove(key)

    def tick(self) -> None:
        for p in self._distinct:
            p.tick()

    def victim(self, layer: int, exclude: Iterable = ()) -> Hashable | None:
        """The key to evict to make room for one block of layer."""
        exclude = exclude if isinstance(exclude, (set, frozenset, dict)) else set(exclude)
        if self.quota is None:
            return self._distinct[0].victim(exclude)
        own = self.policies[layer]
        if len(own) >= self.quota[layer]:
            v = own.victim(exclude)
            if v is not None:
                return v
        # the layer most over its quota gives one back
        for other in sorted(self.policies, key=lambda x: len(self.policies[x]) - self.quota[x],
                            reverse=True):
            v = self.policies[other].victim(exclude)
            if v is not None:
                return v
        return None


# ---- the cache -----------------------------------------------------------------------------

@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetches: int = 0          # prefetch reads issued
    prefetch_hits: int = 0       # demands served by a completed prefetch (counted in hits)
    late_prefetches: int = 0     # demands that waited on an in-flight prefetch (counted in misses)
    read_errors: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0    # reader busy time since the cache was made
    stall_seconds: float = 0.0   # time get / get_many spent waiting for reads

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


_LOADING, _READY = 0, 1


class _Entry:
    __slots__ = ("slot", "state", "read", "done", "prefetched", "used")

    def __init__(self, slot: int, prefetched: bool):
        self.slot = slot
        self.state = _LOADING
        self.read: Future | None = None   # the reader's future
        self.done: Future = Future()      # resolves after the checksum, to the slot's view
        self.prefetched = prefetched
        self.used = False


class ExpertCache:
    """ExpertCache(arena, reader, budget_bytes, n_layers, n_experts, policy="lru", verify=True)."""

    def __init__(self, arena, reader, budget_bytes: int, n_layers: int, n_experts: int,
                 policy: str = "lru", verify: bool = True, layers: Sequence[int] | None = None,
                 decay: float = 0.9, split: str = "layer", use_cuda: bool | None = None):
        self.arena, self.reader = arena, reader
        self.verify = verify
        self.n_experts = n_experts
        if layers is None:  # the layers that hold experts: an ArenaFile knows, else all of them
            layers = arena.moe_layers if isinstance(arena, ArenaFile) else range(n_layers)
        self.layers = [int(x) for x in layers]
        self.block_bytes = int(arena.block_record(self.layers[0], 0)["size"])
        make_policy(policy, decay)  # validates the name before anything is allocated
        self.policy_name, self.split = policy, split
        self._decay, self._use_cuda = decay, use_cuda
        self.pool = None
        # (layer, expert) -> buffer of each ready block, -1 elsewhere, in pinned memory that
        # kernels read (device_view): the GPU finds RAM hits without asking the host
        self._table_pool = PinnedPool(1, n_layers * n_experts * 4, use_cuda=use_cuda)
        self.table = self._table_pool.view(0)[:n_layers * n_experts * 4].view(np.int32).reshape(
            n_layers, n_experts)
        self.table[:] = -1
        self._size(budget_bytes)
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._pins: set = set()              # keys of the last demand request
        self._cv = threading.Condition()
        self._stats = CacheStats()
        self._reader_base = reader.stats().busy_seconds

    def _size(self, budget_bytes: int) -> None:
        n = int(budget_bytes) // self.block_bytes
        if n < 1:
            raise ValueError(f"expert cache budget {budget_bytes} bytes is smaller than one expert "
                             f"block ({self.block_bytes} bytes)")
        if self.pool is not None:
            self.pool.close()
        self.n_slots = n
        self.policy = SplitPolicy(lambda: make_policy(self.policy_name, self._decay), self.layers,
                                  n, self.split)
        self.pool = PinnedPool(n, self.block_bytes, use_cuda=self._use_cuda)
        self._free = list(range(n))[::-1]

    def resize(self, budget_bytes: int) -> None:
        """A new byte budget for an empty cache (the engine's plan can take RAM for other uses
        before the first read)."""
        with self._cv:
            if self._entries:
                raise RuntimeError("expert cache: resize needs an empty cache "
                                   f"({len(self._entries)} blocks held)")
            self._size(budget_bytes)

    # ---- lookups ----------------------------------------------------------------------------

    def _check(self, layer: int, e: int) -> None:
        if layer not in self.policy.policies:
            raise KeyError(f"expert cache: layer {layer} has no experts (MoE layers: {self.layers})")
        if not 0 <= e < self.n_experts:
            raise IndexError(f"expert cache: expert {e} out of range 0..{self.n_experts - 1} "
                             f"(layer {layer})")

    def contains(self, layer: int, expert: int) -> bool:
        with self._cv:
            ent = self._entries.get((layer, expert))
            return ent is not None and ent.state == _READY

    def get(self, layer: int, expert: int) -> np.ndarray:
        """uint8 [block_bytes] view of the block, read on a miss."""
        return self.get_many(layer, [expert])[0]

    def get_many(self, layer: int, experts: Sequence[int]) -> list[np.ndarray]:
        """Views in the order of experts; misses are read concurrently."""
        fast = self._all_ready(layer, experts)
        if fast is not None:
            return fast
        out: list = [None] * len(experts)
        for idx, _, view in self.iter_ready(layer, experts):
            out[idx] = view
        return out

    def _all_ready(self, layer: int, experts: Sequence[int]) -> list | None:
        """The views when every expert is resident (the decode hot path: no futures), else None."""
        keys = [(layer, int(e)) for e in experts]
        with self._cv:
            for key in keys:
                self._check(*key)
            ents = [self._entries.get(key) for key in keys]
            if any(ent is None or ent.state != _READY for ent in ents):
                return None
            self._pins = set(keys)
            for key in dict.fromkeys(keys):   # each key once, as iter_ready does
                self.policy.access(key)
                self._count_hit(self._entries[key])
            return [self.pool.view(ent.slot) for ent in ents]

    def buffer_addresses(self) -> list[tuple[np.ndarray, int]]:
        """(view, host address) of every buffer get / get_many may return."""
        return self.pool.addresses()

    def note_hits(self, layer: int, experts: Sequence[int]) -> int:
        """Blocks a kernel read from the pool itself (device_view): counted as hits and made
        recent, as get_many would; returns how many of them are still ready."""
        n = 0
        with self._cv:
            for e in dict.fromkeys(int(x) for x in experts):
                ent = self._entries.get((layer, e))
                if ent is not None and ent.state == _READY:
                    self.policy.access((layer, e))
                    self._count_hit(ent)
                    n += 1
        return n

    def _count_hit(self, ent: _Entry) -> None:
        st = self._stats
        st.hits += 1
        if ent.prefetched and not ent.used:
            st.prefetch_hits += 1
        ent.used = True

    def iter_ready(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yield (index, expert, view): resident experts at once, then misses as they land."""
        experts = [int(e) for e in experts]
        waiting: dict[Future, int] = {}
        ready: dict[int, np.ndarray] = {}
        with self._cv:
            for e in experts:
                self._check(layer, e)
            keys = [(layer, e) for e in dict.fromkeys(experts)]
            if len(keys) > self.n_slots:
                raise ValueError(f"expert cache: layer {layer} asks for {len(keys)} experts at once "
                                 f"but the budget holds {self.n_slots} blocks; raise the RAM budget")
            self._pins = set(keys)
            st = self._stats
            for key in keys:
                self.policy.access(key)
                ent = self._entries.get(key)
                if ent is not None and ent.state == _READY:
                    self._count_hit(ent)
                    ready[key[1]] = self.pool.view(ent.slot)
                    continue
                st.misses += 1
                if ent is not None:
                    st.late_prefetches += 1
                    ent.used = True
                    self.reader.promote(ent.read)
                else:
                    ent = self._start_read(key, demand=True)
                waiting[ent.done] = key[1]
        for idx, e in enumerate(experts):
            if e in ready:
                yield idx, e, ready[e]
        t0 = time.perf_counter()
        try:
            for fut in as_completed(waiting):
                view = fut.result()    # raises the read or checksum error
                e = waiting[fut]
                for idx, x in enumerate(experts):
                    if x == e:
                        yield idx, e, view
        finally:
            with self._cv:
                self._stats.stall_seconds += time.perf_counter() - t0

    def prefetch(self, layer: int, experts: Iterable[int]) -> int:
        """Start reads of experts not resident, without blocking and without evicting pinned or
        loading blocks; returns how many reads were queued. They queue behind every demand read."""
        n = 0
        with self._cv:
            for e in dict.fromkeys(int(x) for x in experts):
                self._check(layer, e)
                key = (layer, e)
                if key in self._entries:
                    continue
                if not self._free and self.policy.victim(layer, self._busy()) is None:
                    break
                self._start_read(key, demand=False)
                self._stats.prefetches += 1
                n += 1
        return n

    def tick(self) -> None:
        """One token step: decayed-frequency counts shrink by the decay factor."""
        with self._cv:
            self.policy.tick()

    # ---- slots and reads (called with the lock held) -----------------------------------------

    def _busy(self) -> set:
        """Keys that must not be evicted: the last demand request's, and blocks still loading."""
        return self._pins | {k for k, ent in self._entries.items() if ent.state == _LOADING}

    def _take_slot(self, layer: int, demand: bool) -> int:
        while True:
            if self._free:
                return self._free.pop()
            victim = self.policy.victim(layer, self._busy())
            if victim is not None:
                ent = self._entries.pop(victim)
                self.table[victim] = -1
                self.policy.remove(victim)
                self._stats.evictions += 1
                return ent.slot
            # every unpinned slot is loading a prefetch: cancel one that has not started, or wait
            loading = [ent for k, ent in self._entries.items()
                       if ent.state == _LOADING and ent.prefetched and k not in self._pins]
            if not demand or not loading:
                raise RuntimeError("expert cache: no slot can be freed (all pinned or loading)")
            if any(self.reader.cancel(ent.read) for ent in loading):
                continue  # the cancel callback (_landed, same thread) returned the slot
            self._cv.wait()

    def _start_read(self, key: tuple[int, int], demand: bool) -> _Entry:
        slot = self._take_slot(key[0], demand)
        ent = _Entry(slot, prefetched=not demand)
        self._entries[key] = ent
        # counted in its layer's share from now, so a loading miss is not taken from another layer
        self.policy.admit(key)
        rec = self.arena.block_record(*key)
        ent.read = self.reader.read(key[0], key[1], rec["offset"], rec["size"],
                                    self.pool.view(slot), demand=demand)
        ent.read.add_done_callback(lambda f, k=key, en=ent: self._landed(k, en, f))
        return ent

    def _drop(self, key, ent: _Entry) -> None:
        if self._entries.get(key) is ent:
            del self._entries[key]
            self.table[key] = -1
            self._free.append(ent.slot)
            if key in self.policy:
                self.policy.remove(key)

    def _landed(self, key: tuple[int, int], ent: _Entry, read: Future) -> None:
        """Reader thread (or a cancelling thread): verify the block and make it resident."""
        if read.cancelled():
            with self._cv:
                self._drop(key, ent)
                self._cv.notify_all()
            ent.done.cancel()
            return
        err = read.exception()
        view = self.pool.view(ent.slot)
        if err is None and self.verify:
            try:
                self.arena.verify_block(key[0], key[1], view)
            except ValueError as e:
                err = e
        with self._cv:
            if err is None:
                ent.state = _READY
                self.table[key] = ent.slot      # after the bytes: a kernel may read it now
                self._stats.bytes_read += self.block_bytes
            else:
                self._stats.read_errors += 1
                self._drop(key, ent)
            self._cv.notify_all()
        if err is None:
            ent.done.set_result(view)
        else:
            ent.done.set_exception(err)

    # ---- stats and lifetime -----------------------------------------------------------------

    def stats(self) -> CacheStats:
        with self._cv:
            st = CacheStats(**asdict(self._stats))
        st.read_seconds = self.reader.stats().busy_seconds - self._reader_base
        return st

    def stats_dict(self) -> dict:
        st = self.stats()
        return {**asdict(st), "hit_rate": st.hit_rate, "read_gbps": st.read_gbps,
                "policy": self.policy_name, "split": self.split, "slots": self.n_slots,
                "block_bytes": self.block_bytes, "budget_bytes_used": self.n_slots * self.block_bytes}

    def device_view(self):
        """(buffers' address, buffers, bytes a buffer, table's address) for kernels that read
        ready blocks straight from this pinned memory: table int32 [layers, experts] holds
        each ready block's buffer (-1 elsewhere). None when the memory is not page-locked.
        A buffer is reused only for a read that this process asks for (get_many, prefetch),
        and its entry is -1 before that read starts."""
        pool, table = self.pool.device_address(), self._table_pool.device_address()
        if pool is None or table is None:
            return None
        return pool, self.pool.n_buffers, self.pool.buffer_bytes, table

    def resident(self) -> list[tuple[int, int]]:
        """(layer, expert) of every ready block."""
        with self._cv:
            return [k for k, ent in self._entries.items() if ent.state == _READY]

    def close(self) -> None:
        """Cancel queued prefetches, wait for reads in flight, free the slots."""
        with self._cv:
            loading = [ent.read for ent in self._entries.values() if ent.state == _LOADING]
        pending = [f for f in loading if not self.reader.cancel(f)]
        for f in pending:
            try:
                f.result()
            except Exception:  # a failed read is of no interest once the cache closes
                pass
        self.pool.close()
        self.table = None
        self._table_pool.close()

    def __enter__(self) -> "ExpertCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
