"""Routing traces: which experts each token chose in each MoE layer, and a cache simulator.

A trace is ids int32 [T, L, K] (T = tokens, L = MoE layers in order, K = top-k) plus a meta dict
(model, moe_layers, n_experts, block_bytes, ...). Stored as .npz (arrays "ids" and "meta", the
latter a JSON string) or as JSON lines (first line {"meta": {...}}, then one {"ids": [[K ids]
per layer]} per token). An id of -1 is a slot that reads no expert block (LongCat-Flash's zero
experts): kept in the trace, not replayed.

    python -m engine.trace simulate FILE --capacity-gb X --policy lru|lfu|decay|all [--block-bytes N]

replays the trace against the cache policies of loader/cache.py and against Belady's optimum at
the same capacity, with the cache's per-layer split of slots and with one global pool. Belady
under the per-layer split picks the farthest next use within the layer the split picks.
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
import zipfile
from pathlib import Path

import numpy as np

from loader.cache import POLICIES, Policy, SplitPolicy, make_policy


class TraceError(ValueError):
    pass


# ---- files ---------------------------------------------------------------------------------

def save_trace(path: str | Path, ids: np.ndarray, meta: dict | None = None) -> None:
    """ids int [T, L, K] -> path (.npz, or .jsonl / .json lines)."""
    ids = np.asarray(ids)
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise TraceError(f"{path}: trace ids must be an integer array [T, L, K], got "
                         f"{ids.dtype} {ids.shape}")
    ids = ids.astype(np.int32)
    meta = dict(meta or {})
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        with open(path, "w") as f:
            f.write(json.dumps({"meta": meta}) + "\n")
            for t in range(ids.shape[0]):
                f.write(json.dumps({"ids": ids[t].tolist()}) + "\n")
    else:
        with open(path, "wb") as f:  # np.savez would append .npz to other names
            np.savez_compressed(f, ids=ids, meta=np.array(json.dumps(meta)))


def load_trace(path: str | Path) -> tuple[np.ndarray, dict]:
    """path -> (ids int32 [T, L, K], meta dict); TraceError naming the file when malformed."""
    path = Path(path)
    try:
        if path.suffix in (".jsonl", ".json"):
            ids, meta = _load_jsonl(path)
        else:
            with np.load(path, allow_pickle=False) as z:
                if "ids" not in z.files:
                    raise TraceError(f"{path}: not a routing trace (no 'ids' array)")
                ids = z["ids"]
                meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
    except TraceError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise TraceError(f"{path}: cannot read the routing trace ({type(e).__name__}: {e})") from None
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer) or 0 in ids.shape:
        raise TraceError(f"{path}: trace ids must be a non-empty integer array [T, L, K], got "
                         f"{ids.dtype} {ids.shape}")
    if not isinstance(meta, dict):
        raise TraceError(f"{path}: trace meta must be a JSON object")
    if ids.min() < -1 or ("n_experts" in meta and ids.max() >= int(meta["n_experts"])):
        raise TraceError(f"{path}: expert ids out of range ({ids.min()}..{ids.max()}, "
                         f"n_experts {meta.get('n_experts', '?')})")
    return ids.astype(np.int32), meta


def _load_jsonl(path: Path) -> tuple[np.ndarray, dict]:
    meta, rows = {}, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not JSON ({e.msg})") from None
            if "meta" in obj:
                meta = obj["meta"]
            elif "ids" in obj:
                rows.append(obj["ids"])
            else:
                raise TraceError(f"{path}:{n}: expected a 'meta' or 'ids' record")
    try:
        return np.array(rows, dtype=np.int64), meta
    except ValueError:
        raise TraceError(f"{path}: token records have different numbers of layers or experts") from None


# ---- simulation ----------------------------------------------------------------------------

class BeladyPolicy(Policy):
    """Belady's optimum: evict the resident block whose next use is farthest away. The simulator
    writes each key's next use into `next_use` before it accesses the key."""

    name = "belady"

    def __init__(self):
        super().__init__()
        self.next_use: dict = {}
        self._heap: list = []                    # (-next use, key); stale entries skipped

    def access(self, key) -> None:
        heapq.heappush(self._heap, (-self.next_use[key], key))

    def admit(self, key) -> None:
        super().admit(key)
        heapq.heappush(self._heap, (-self.next_use[key], key))

    def victim(self, exclude=()):
        kept, found = [], None
        while self._heap:
            neg, k = self._heap[0]
            if k not in self._resident or self.next_use[k] != -neg:
                heapq.heappop(self._heap)        # stale
            elif k in exclude:
                kept.append(heapq.heappop(self._heap))
            else:
                found = k
                break
        for item in kept:
            heapq.heappush(self._heap, item)
        return found


def simulate(ids: np.ndarray, n_slots: int, policy: str, split: str = "layer",
             decay: float = 0.9) -> dict:
    """Replay ids [T, L, K] through the cache's eviction logic (loader.cache.SplitPolicy), no I/O.

    policy: lru | lfu | decay | belady. One layer's top-k of one token is requested at once, so
    none of them may evict another, as in ExpertCache.get_many.
    """
    t_, l_, k_ = ids.shape
    if n_slots < 1:
        raise TraceError(f"capacity of {n_slots} slots holds no expert block")
    make = BeladyPolicy if policy == "belady" else (lambda: make_policy(policy, decay))
    sp = SplitPolicy(make, list(range(l_)), n_slots, split)
    groups = [[(l, int(e)) for e in dict.fromkeys(ids[t, l].tolist()) if e >= 0]
              for t in range(t_) for l in range(l_)]
    if max(len(g) for g in groups) > n_slots:
        raise TraceError(f"capacity too small: {n_slots} slots cannot hold the "
                         f"{max(len(g) for g in groups)} experts one layer requests at once")
    if policy == "belady":
        future: list[dict] = [None] * len(groups)   # per group: key -> group index of next use
        last: dict = {}
        for g in range(len(groups) - 1, -1, -1):
            future[g] = {k: last.get(k, float("inf")) for k in groups[g]}
            for k in groups[g]:
                last[k] = g
    hits = misses = 0
    for g, group in enumerate(groups):
        if policy == "belady":
            for key in group:
                sp.policies[key[0]].next_use[key] = future[g][key]
        for key in group:
            sp.access(key)
        missing = [k for k in group if k not in sp]
        hits += len(group) - len(missing)
        misses += len(missing)
        for key in missing:
            if len(sp) >= n_slots:
                sp.remove(sp.victim(key[0], group))
            sp.admit(key)
        if (g + 1) % l_ == 0:
            sp.tick()
    return {"hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1)}


# ---- command line --------------------------------------------------------------------------

def _simulate_cmd(args) -> int:
    ids, meta = load_trace(args.file)
    block_bytes = args.block_bytes or meta.get("block_bytes")
    if not block_bytes:
        raise TraceError(f"{args.file}: the trace has no block_bytes in its meta; pass --block-bytes")
    n_slots = int(args.capacity_gb * 1e9) // int(block_bytes)
    t_, l_, k_ = ids.shape
    print(f"trace {args.file}: {t_} tokens, {l_} MoE layers, top-{k_}; block {block_bytes} bytes; "
          f"capacity {args.capacity_gb:g} GB = {n_slots} slots ({n_slots / l_:.1f} per layer)")
    policies = POLICIES if args.policy == "all" else (args.policy,)
    rows = []
    for split in ("layer", "global"):
        for p in (*policies, "belady"):
            rows.append((p, split, simulate(ids, n_slots, p, split, args.decay)))
    print(f"{'policy':<8} {'split':<7} {'hit rate':>9} {'hits':>10} {'misses':>10}")
    for p, split, r in rows:
        print(f"{p:<8} {split:<7} {r['hit_rate']:>9.4f} {r['hits']:>10} {r['misses']:>10}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.trace", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sim = sub.add_parser("simulate", help="replay a routing trace against cache policies and Belady")
    sim.add_argument("file")
    sim.add_argument("--capacity-gb", type=float, required=True, help="RAM cache budget, GB (1e9)")
    sim.add_argument("--policy", default="lru", choices=(*POLICIES, "all"))
    sim.add_argument("--block-bytes", type=int, default=0,
                     help="bytes per expert block (default: the trace's meta block_bytes)")
    sim.add_argument("--decay", type=float, default=0.9, help="decay per token for --policy decay")
    args = ap.parse_args(argv)
    try:
        return _simulate_cmd(args)
    except (TraceError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
