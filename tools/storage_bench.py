"""Storage figures for docs/PERF.md: encode, pack, arena reads, cache hit rates.

    python tools/storage_bench.py [--dir D] [--layers 4] [--experts 32] [--arena-gb 1.05]
                                  [--threads 1,2,4,8] [--reps 2] [--ref] [--json FILE]
                                  [--only encode,pack,read,cache]

Each figure is printed beside the bound it is measured against, measured in the same run:
- encode: GB/s of float32 input per core (CPU time of the encoding thread, so other load on the
  machine counts only through shared caches), numba kernels vs the numpy references, one
  Qwen3-30B-A3B expert block (gate, up, down); and wall-clock GB/s on every core, both through the
  parallel kernels (main thread) and through a thread pool of serial kernels (as write_arena).
- pack: engine.pack of a random bf16 checkpoint at real expert shapes (H 2048, I 768), source page
  cache dropped first; GB/s of source read and of arena written, against a raw sequential
  O_DIRECT read of the same source file.
- read: loader.reader.ReaderPool over a >= 1 GB NVFP4 arena, page cache dropped
  (fsync + POSIX_FADV_DONTNEED), at several thread counts, against raw sequential O_DIRECT reads
  of the same file (8 MiB requests, 1 and 4 threads) in the same run.
- cache: the routing trace tests/data/demo-trace.npz replayed through loader.cache.ExpertCache
  over the shipped demo arena and through engine.trace.simulate, per policy, against Belady.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import numpy as np

from engine.bench import drop_page_cache as drop_cache
from engine.trace import load_trace, simulate
from loader import quant as Q
from loader.arena import ARENA_NAME, ArenaFile, write_arena
from loader.cache import ExpertCache
from loader.layout import ExpertLayout
from loader.pinned import PinnedPool
from loader.reader import ReaderPool

H, I = 2048, 768                   # Qwen3-30B-A3B expert shapes
ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "data" / "demo-trace.npz"
DEMO = ROOT / "engine" / "data" / "demo"
RAW_CHUNK = 8 << 20                # raw O_DIRECT request size


# ---- disk helpers ----------------------------------------------------------------------------

def raw_direct_read(path: str | os.PathLike, threads: int = 1, chunk: int = RAW_CHUNK) -> float:
    """GB/s of reading the whole file with O_DIRECT, chunk-sized requests taken in file order by
    `threads` threads (1: plain sequential). The tail that is not 4096-aligned is skipped."""
    drop_cache(path)
    size = os.path.getsize(path) // 4096 * 4096
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]
    nxt, lock = [0], threading.Lock()

    def run(buf):
        view = memoryview(buf)
        while True:
            with lock:
                off = nxt[0]
                nxt[0] += chunk
            if off >= size:
                return
            n = min(chunk, size - off)
            got = os.preadv(fd, [view[:n]], off)
            if got != n:
                raise OSError(f"{path}: short O_DIRECT read at {off}: {got} of {n}")

    try:
        t = time.perf_counter()
        ts = [threading.Thread(target=run, args=(b,)) for b in bufs]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
    return size / dt / 1e9


def reader_read(arena: ArenaFile, threads: int, window: int = 32) -> dict:
    """Every block of the arena through ReaderPool (O_DIRECT) into `window` reused buffers, at
    most `window` reads in flight, in (layer, expert) order: GB/s of wall time."""
    drop_cache(arena.path)
    recs = sorted(arena.records, key=lambda r: r["offset"])
    window = max(window, 2 * threads)
    with PinnedPool(window, arena.block_bytes, use_cuda=False) as pool, \
            ReaderPool(arena.path, n_threads=threads, direct=True) as reader:
        futs = []
        t = time.perf_counter()
        for n, rec in enumerate(recs):
            if n >= window:
                futs[n - window].result()
            futs.append(reader.read(rec["layer"], rec["expert"], rec["offset"], rec["size"],
                                    pool.view(n % window)))
        for f in futs[-window:]:
            f.result()
        dt = time.perf_counter() - t
        st = reader.stats()
    return {"gbps": len(recs) * arena.block_bytes / dt / 1e9, "direct": reader.direct,
            "busy_gbps": st.gbps}


# ---- encode ----------------------------------------------------------------------------------

def bench_encode(reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    ws = (rng.standard_normal((I, H), dtype=np.float32), rng.standard_normal((I, H), dtype=np.float32),
          rng.standard_normal((H, I), dtype=np.float32))
    nbytes = sum(w.nbytes for w in ws)
    rows = []
    for fmt in ("nvfp4", "fp8", "bf16"):
        lay = ExpertLayout.build(fmt, H, I)

        def cpu_gbps(ref, n):
            """Best of 3 batches of n encodes, CPU time of the calling thread (it ticks in 4 ms
            steps on this VM, hence batches); run on a pool thread like write_arena's."""
            Q.encode_expert_block(fmt, lay, *ws, ref=ref)
            best = float("inf")
            for _ in range(3):
                t = time.thread_time()
                for _ in range(n):
                    Q.encode_expert_block(fmt, lay, *ws, ref=ref)
                best = min(best, (time.thread_time() - t) / n)
            return nbytes / best / 1e9

        with ThreadPoolExecutor(1) as one:
            fast = one.submit(cpu_gbps, False, 10 * max(1, reps)).result()
            ref = one.submit(cpu_gbps, True, 2).result()
        t = time.perf_counter()
        for _ in range(8):
            Q.encode_expert_block(fmt, lay, *ws)          # main thread: the parallel kernels
        par = 8 * nbytes / (time.perf_counter() - t) / 1e9
        ncpu = os.cpu_count() or 1
        with ThreadPoolExecutor(ncpu) as pool:           # as write_arena runs it: serial kernels
            t = time.perf_counter()
            list(pool.map(lambda _: Q.encode_expert_block(fmt, lay, *ws), range(4 * ncpu)))
            pooled = 4 * ncpu * nbytes / (time.perf_counter() - t) / 1e9
        rows.append({"format": fmt, "fast_gbps_per_core": fast, "ref_gbps_per_core": ref,
                     "speedup": fast / ref, "parallel_kernels_gbps_wall": par,
                     f"pool_{ncpu}_threads_gbps_wall": pooled})
        rows[-1]["loadavg_1min"] = os.getloadavg()[0]
        print(f"encode {fmt:5} (load {os.getloadavg()[0]:.1f}): numba {fast:6.2f} GB/s/core, "
              f"numpy {ref:5.2f} GB/s/core "
              f"({fast / ref:4.1f}x) [CPU time]; wall: parallel kernels {par:5.2f} GB/s, "
              f"pool of {ncpu} threads {pooled:5.2f} GB/s", flush=True)
    return rows


# ---- pack ------------------------------------------------------------------------------------

def pack_config(layers: int, experts: int) -> dict:
    from engine.demo import DEMO_CONFIG
    return {**DEMO_CONFIG, "hidden_size": H, "moe_intermediate_size": I, "intermediate_size": 6144,
            "num_hidden_layers": layers, "num_experts": experts, "num_experts_per_tok": 8,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}


def bench_pack(base: Path, layers: int, experts: int, ref: bool) -> list[dict]:
    from engine.demo import build_random_model
    from engine.pack import pack
    src = base / "src-bf16"
    t = time.perf_counter()
    build_random_model(src, pack_config(layers, experts), seed=0, bf16=True)
    st = src / "model.safetensors"
    src_bytes = st.stat().st_size
    expert_src = layers * experts * 3 * H * I * 2
    print(f"pack source: {layers} layers x {experts} experts, bf16, {src_bytes / 1e9:.2f} GB "
          f"({expert_src / 1e9:.2f} GB experts), built in {time.perf_counter() - t:.0f} s", flush=True)
    raw = raw_direct_read(st)
    print(f"raw O_DIRECT sequential read of the source: {raw:.2f} GB/s", flush=True)
    rows = []
    import loader.arena as arena_mod
    for fmt in ("nvfp4", "fp8"):       # load the kernels' numba cache before the clock starts
        t = time.perf_counter()
        with ThreadPoolExecutor(1) as pool:
            pool.submit(Q.encode_matrix, fmt, np.ones((16, 16), np.float32)).result()
        print(f"pack: loading the {fmt} serial kernels took {time.perf_counter() - t:.2f} s "
              f"(once per process, not timed below)", flush=True)
    variants = [("numba", None)]
    if ref:
        ref_encode = lambda *a, **k: Q.encode_expert_block(*a, **k, ref=True)   # noqa: E731
        variants.append(("numpy", ref_encode))
    for fmt in ("nvfp4", "fp8"):
        for label, enc in variants:
            dst = base / f"packed-{fmt}"
            drop_cache(st)
            t = time.perf_counter()
            if enc is None:
                pack(src, dst, fmt, force=True, progress=False)
            else:
                with mock.patch.object(arena_mod, "encode_expert_block", enc):
                    pack(src, dst, fmt, force=True, progress=False)
            dt = time.perf_counter() - t
            arena_bytes = (dst / ARENA_NAME).stat().st_size
            row = {"format": fmt, "encoder": label, "seconds": dt, "arena_gb": arena_bytes / 1e9,
                   "arena_write_gbps": arena_bytes / dt / 1e9, "source_read_gbps": src_bytes / dt / 1e9,
                   "raw_direct_read_gbps": raw, "ratio": src_bytes / dt / 1e9 / raw}
            row["loadavg_1min"] = os.getloadavg()[0]
            rows.append(row)
            print(f"pack {fmt:5} ({label}): {dt:6.1f} s, source {row['source_read_gbps']:.2f} GB/s "
                  f"read, arena {row['arena_write_gbps']:.2f} GB/s written; source/raw read "
                  f"{row['ratio']:.2f}", flush=True)
            shutil.rmtree(dst)
    shutil.rmtree(src)
    return rows


# ---- read ------------------------------------------------------------------------------------

def bench_read(base: Path, arena_gb: float, threads: list[int], reps: int) -> dict:
    lay = ExpertLayout.build("nvfp4", H, I)
    n_experts = 64
    n_layers = max(1, -(-int(arena_gb * 1e9) // (lay.block_bytes * n_experts)))
    folder = base / "read-arena"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ARENA_NAME
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((I, H), dtype=np.float32), rng.standard_normal((I, H), dtype=np.float32),
           rng.standard_normal((H, I), dtype=np.float32)) for _ in range(4)]
    t = time.perf_counter()
    recs = write_arena(path, "nvfp4", lay, n_layers, n_experts,
                       lambda layer, e: ws[(layer + e) % 4], progress=False)
    size = path.stat().st_size
    print(f"read arena: {len(recs)} NVFP4 blocks of {lay.block_bytes} bytes, {size / 1e9:.2f} GB, "
          f"written in {time.perf_counter() - t:.1f} s", flush=True)
    arena = ArenaFile.open(path, recs, {"format": "nvfp4"})
    out = {"arena_gb": size / 1e9, "block_bytes": lay.block_bytes, "raw": {}, "reader": {}}
    try:
        for rep in range(reps):
            for n in (1, 4):
                out["raw"].setdefault(n, []).append(raw_direct_read(path, n))
            for n in threads:
                out["reader"].setdefault(n, []).append(reader_read(arena, n)["gbps"])
            out.setdefault("loadavg_1min", []).append(os.getloadavg()[0])
            print(f"  rep {rep} (load {os.getloadavg()[0]:.1f}): raw "
                  + ", ".join(f"{n}t {v[-1]:.2f}" for n, v in out["raw"].items())
                  + " | reader " + ", ".join(f"{n}t {v[-1]:.2f}" for n, v in out["reader"].items())
                  + " GB/s", flush=True)
    finally:
        arena.close()
        shutil.rmtree(folder)
    raw1 = max(out["raw"][1])
    best_raw = max(max(v) for v in out["raw"].values())
    for n, v in out["reader"].items():
        print(f"reader {n} threads: {max(v):.2f} GB/s (best of {reps}); / raw sequential 1 thread "
              f"{max(v) / raw1:.2f}; / best raw {max(v) / best_raw:.2f}", flush=True)
    out["raw_seq_gbps"], out["raw_best_gbps"] = raw1, best_raw
    return out


# ---- cache -----------------------------------------------------------------------------------

def bench_cache() -> list[dict]:
    from engine.pack import load_manifest
    ids, meta = load_trace(TRACE)
    t_, l_, k_ = ids.shape
    arena = ArenaFile.from_manifest(load_manifest(DEMO), DEMO)
    layers = arena.moe_layers
    print(f"cache: trace {TRACE.name}: {t_} tokens x {l_} MoE layers x top-{k_} of "
          f"{meta.get('n_experts')} experts ({meta.get('text', '')})", flush=True)
    rows = []
    try:
        for per_layer in (2, 4, 8):
            n_slots = per_layer * l_
            best = {sp: simulate(ids, n_slots, "belady", sp)["hit_rate"] for sp in ("layer", "global")}
            for policy in ("lru", "lfu", "decay"):
                for split in ("layer", "global"):
                    sim = simulate(ids, n_slots, policy, split)["hit_rate"]
                    with ReaderPool(arena.path, n_threads=2) as reader, \
                            ExpertCache(arena, reader, n_slots * arena.block_bytes, l_,
                                        arena.n_experts, policy=policy, split=split,
                                        layers=layers, use_cuda=False) as cache:
                        for t in range(t_):
                            for li, layer in enumerate(layers):
                                cache.get_many(layer, ids[t, li].tolist())
                            cache.tick()
                        real = cache.stats().hit_rate
                    rows.append({"slots_per_layer": per_layer, "slots": n_slots, "policy": policy,
                                 "split": split, "cache_hit_rate": real, "sim_hit_rate": sim,
                                 "belady": best[split], "over_belady": real / best[split]})
                    print(f"  {per_layer} slots/layer ({n_slots} of {l_ * arena.n_experts}) "
                          f"{policy:5} {split:6}: ExpertCache {real:.3f}, simulator {sim:.3f}, "
                          f"Belady {best[split]:.3f} -> {real / best[split]:.2f} of Belady", flush=True)
    finally:
        arena.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/storage_bench.py", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/moe-storage-bench", help="scratch folder (on the disk to measure)")
    ap.add_argument("--layers", type=int, default=4, help="pack source: layers")
    ap.add_argument("--experts", type=int, default=32, help="pack source: experts per layer")
    ap.add_argument("--arena-gb", type=float, default=1.05, help="read benchmark arena size, GB")
    ap.add_argument("--threads", default="1,2,4,8", help="ReaderPool thread counts")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ref", action="store_true", help="also pack with the numpy reference encoders")
    ap.add_argument("--only", default="encode,pack,read,cache")
    ap.add_argument("--json", help="write every figure to this file")
    a = ap.parse_args(argv)
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(","))
    res = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "numba_threads": None}
    import numba
    res["numba_threads"] = numba.get_num_threads()
    res["threading_layer"] = None
    if "encode" in only:
        res["encode"] = bench_encode(a.reps)
        res["threading_layer"] = numba.threading_layer()
    if "pack" in only:
        res["pack"] = bench_pack(base, a.layers, a.experts, a.ref)
    if "read" in only:
        res["read"] = bench_read(base, a.arena_gb, [int(x) for x in a.threads.split(",")], a.reps)
    if "cache" in only:
        res["cache"] = bench_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
