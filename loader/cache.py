"""Host-RAM expert cache: a byte budget of pinned slots, filled by the reader, one block per slot.

The slots are split evenly across the MoE layers and each layer evicts only within its share:
decode visits layers in order, so one global LRU smaller than layers x top-k would evict every
expert just before its layer comes round again and hit nothing. Eviction policies (LRU, LFU,
decayed frequency) are classes shared with the trace simulator (engine/trace.py).

Views returned by get / get_many / iter_ready stay valid until the next call naming the same
layer (get, get_many, iter_ready or prefetch): until then their slots are pinned.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, as_completed
from dataclasses import asdict, dataclass
from typing import Hashable, Iterable, Iterator, Sequence

import numpy as np

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


class _Share:
    """The slots of one layer (or of all layers when split="global")."""

    def __init__(self, capacity: int, policy: Policy):
        self.capacity = capacity
        self.policy = policy
        self.free: list[int] = []
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.pins: dict[int, set] = {}    # layer -> keys of its last request

    def pinned(self) -> set:
        return set().union(*self.pins.values()) if self.pins else set()


class ExpertCache:
    """ExpertCache(arena, reader, budget_bytes, n_layers, n_experts, policy="lru", verify=True)."""

    def __init__(self, arena, reader, budget_bytes: int, n_layers: int, n_experts: int,
                 policy: str = "lru", verify: bool = True, layers: Sequence[int] | None = None,
                 decay: float = 0.9, split: str = "layer", use_cuda: bool | None = None):
        self.arena, self.reader = arena, reader
        self.verify = verify
        self.n_experts = n_experts
        self.layers = list(range(n_layers)) if layers is None else [int(x) for x in layers]
        self.block_bytes = int(arena.block_record(self.layers[0], 0)["size"])
        bb = self.block_bytes
        self.n_slots = int(budget_bytes) // bb
        if self.n_slots < 1:
            raise ValueError(f"expert cache budget {budget_bytes} bytes is smaller than one expert "
                             f"block ({bb} bytes)")
        make_policy(policy, decay)  # validates the name before anything is allocated
        if split == "layer":
            per = split_slots(self.n_slots, self.layers)
            if min(per.values()) < 1:
                raise ValueError(f"expert cache budget {budget_bytes} bytes gives {self.n_slots} "
                                 f"slots of {bb} bytes for {len(self.layers)} layers; it needs at "
                                 f"least one slot per layer ({len(self.layers) * bb} bytes)")
            self._shares = {layer: _Share(n, make_policy(policy, decay)) for layer, n in per.items()}
        elif split == "global":
            one = _Share(self.n_slots, make_policy(policy, decay))
            self._shares = {layer: one for layer in self.layers}
        else:
            raise ValueError(f"expert cache split {split!r}; expected 'layer' or 'global'")
        self.policy_name, self.split = policy, split
        self.pool = PinnedPool(self.n_slots, bb, use_cuda=use_cuda)
        slot = 0
        for share in dict.fromkeys(self._shares.values()):   # distinct shares, in layer order
            share.free = list(range(slot, slot + share.capacity))[::-1]
            slot += share.capacity
        self._cv = threading.Condition()
        self._stats = CacheStats()
        self._reader_base = reader.stats().busy_seconds

    # ---- lookups ----------------------------------------------------------------------------

    def _share(self, layer: int) -> _Share:
        try:
            return self._shares[layer]
        except KeyError:
            raise KeyError(f"expert cache: layer {layer} has no experts (MoE layers: "
                           f"{self.layers})") from None

    def contains(self, layer: int, expert: int) -> bool:
        with self._cv:
            ent = self._share(layer).entries.get((layer, expert))
            return ent is not None and ent.state == _READY

    def get(self, layer: int, expert: int) -> np.ndarray:
        """uint8 [block_bytes] view of the block, read on a miss."""
        return self.get_many(layer, [expert])[0]

    def get_many(self, layer: int, experts: Sequence[int]) -> list[np.ndarray]:
        """Views in the order of experts; misses are read concurrently."""
        out: list = [None] * len(experts)
        for idx, _, view in self.iter_ready(layer, experts):
            out[idx] = view
        return out

    def iter_ready(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yield (index, expert, view): resident experts at once, then misses as they land."""
        experts = [int(e) for e in experts]
        waiting: dict[Future, int] = {}
        ready: dict[int, np.ndarray] = {}
        with self._cv:
            share = self._share(layer)
            keys = [(layer, e) for e in dict.fromkeys(experts)]
            if len(keys) > share.capacity:
                raise ValueError(f"expert cache: layer {layer} asks for {len(keys)} experts at once "
                                 f"but its share of the budget is {share.capacity} slots; raise "
                                 f"the RAM budget")
            for e in experts:
                if not 0 <= e < self.n_experts:
                    raise IndexError(f"expert cache: expert {e} out of range 0..{self.n_experts - 1} "
                                     f"(layer {layer})")
            share.pins[layer] = set(keys)
            st = self._stats
            for key in keys:
                share.policy.access(key)
                ent = share.entries.get(key)
                if ent is not None and ent.state == _READY:
                    st.hits += 1
                    if ent.prefetched and not ent.used:
                        st.prefetch_hits += 1
                    ent.used = True
                    ready[key[1]] = self.pool.view(ent.slot)
                    continue
                st.misses += 1
                if ent is not None:
                    st.late_prefetches += 1
                    ent.used = True
                    self.reader.promote(ent.read)
                else:
                    ent = self._start_read(share, key, demand=True)
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
        """Start reads of experts not resident, without blocking or evicting pinned or loading
        blocks; returns how many reads were queued. Reads queue behind every demand read."""
        n = 0
        with self._cv:
            share = self._share(layer)
            share.pins.pop(layer, None)
            for e in dict.fromkeys(int(x) for x in experts):
                key = (layer, e)
                if key in share.entries or not 0 <= e < self.n_experts:
                    continue
                if not share.free and share.policy.victim(share.pinned()) is None:
                    break
                self._start_read(share, key, demand=False)
                self._stats.prefetches += 1
                n += 1
        return n

    def tick(self) -> None:
        """One token step: decayed-frequency counts shrink by the decay factor."""
        with self._cv:
            for share in dict.fromkeys(self._shares.values()):
                share.policy.tick()

    # ---- slots and reads (called with the lock held) -----------------------------------------

    def _take_slot(self, share: _Share, demand: bool) -> int:
        while True:
            if share.free:
                return share.free.pop()
            victim = share.policy.victim(share.pinned())
            if victim is not None:
                ent = share.entries.pop(victim)
                share.policy.remove(victim)
                self._stats.evictions += 1
                return ent.slot
            # every unpinned slot is loading a prefetch: cancel one that has not started, or wait
            loading = [(k, ent) for k, ent in share.entries.items()
                       if ent.state == _LOADING and ent.prefetched and k not in share.pinned()]
            if not demand or not loading:
                raise RuntimeError("expert cache: no slot can be freed in this layer's share")
            if any(self.reader.cancel(ent.read) for _, ent in loading):
                continue  # the cancel callback (_landed, same thread) returned the slot
            self._cv.wait()

    def _start_read(self, share: _Share, key: tuple[int, int], demand: bool) -> _Entry:
        slot = self._take_slot(share, demand)
        ent = _Entry(slot, prefetched=not demand)
        share.entries[key] = ent
        rec = self.arena.block_record(*key)
        ent.read = self.reader.read(key[0], key[1], rec["offset"], rec["size"],
                                    self.pool.view(slot), demand=demand)
        ent.read.add_done_callback(lambda f, s=share, k=key, en=ent: self._landed(s, k, en, f))
        return ent

    def _landed(self, share: _Share, key: tuple[int, int], ent: _Entry, read: Future) -> None:
        """Reader thread: a read finished; verify it and make it resident (or drop it)."""
        if read.cancelled():
            with self._cv:
                if share.entries.get(key) is ent:
                    del share.entries[key]
                    share.free.append(ent.slot)
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
                share.policy.admit(key)
                self._stats.bytes_read += self.block_bytes
            else:
                self._stats.read_errors += 1
                if share.entries.get(key) is ent:
                    del share.entries[key]
                    share.free.append(ent.slot)
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

    def resident(self) -> list[tuple[int, int]]:
        """(layer, expert) of every ready block."""
        with self._cv:
            return [k for share in dict.fromkeys(self._shares.values())
                    for k, ent in share.entries.items() if ent.state == _READY]

    def close(self) -> None:
        """Cancel queued prefetches, wait for reads in flight, free the slots."""
        with self._cv:
            loading = [ent.read for share in dict.fromkeys(self._shares.values())
                       for ent in share.entries.values() if ent.state == _LOADING]
        pending = [f for f in loading if not self.reader.cancel(f)]
        for f in pending:
            try:
                f.result()
            except Exception:  # a failed read is of no interest once the cache closes
                pass
        self.pool.close()

    def __enter__(self) -> "ExpertCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
