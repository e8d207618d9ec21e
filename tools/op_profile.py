"""Where a token's GPU time goes, per kernel wrapper, on a packed model (GPU machine).

    python3 tools/op_profile.py MODEL [--vram-gb 40] [--ram-gb 32] [--prompt-len 2048] [--out F]

Decode: one token runs eagerly while every call into the kernel modules is taped; each taped call
is then captured alone as a graph of REPS copies and timed, so the figures are GPU time without
Python launch overhead. Their sum next to the replayed token graph's own GPU time says how much
the graph spends between nodes, and the token's wall time what the host adds (logits copy,
routing on the host); forward_sample_wall_us is the same token with its id drawn on the device.
Prefill: every wrapper call is bracketed by events on the compute stream (prefill kernels run
for milliseconds, so launch latency barely shows) and the host-side steps are wall-timed.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "asv_bench" / "benchmarks"))
from bench_cuda import _time_ms  # noqa: E402  (warm once, then events around reps launches)

REPS = 8
MODULES = ("gpu_attention", "gpu_dense", "gpu_experts", "gpu_misc", "gpu_sampling", "gpu_deltanet",
           "gpu_mla")


class Patched:
    """Wraps the public functions of the kernel modules; `hook(name, fn, args, kw)` runs the call.
    Nested calls inside a wrapper (a wrapper that calls another) go straight through."""

    def __init__(self, hook):
        import importlib
        self.saved = []
        self.depth = 0
        for mod_name in MODULES:
            mod = importlib.import_module(f"kernels_numba.{mod_name}")
            for name, fn in list(vars(mod).items()):
                if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                    continue
                self.saved.append((mod, name, fn))
                setattr(mod, name, self._wrap(f"{mod_name[4:]}.{name}", fn, hook))

    def _wrap(self, label, fn, hook):
        def call(*args, **kw):
            if self.depth:
                return fn(*args, **kw)
            self.depth += 1
            try:
                return hook(label, fn, args, kw)
            finally:
                self.depth -= 1
        return call

    def restore(self):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)


def _time_graph_ms(stream, g, reps=5) -> float:
    return _time_ms(stream, lambda: g.launch(stream), reps)


def profile_decode(m, st, tid: int) -> dict:
    """GPU microseconds per wrapper for one decode token (each call timed alone in a graph)."""
    from engine.graphs import capture_fn
    dec, cs = m.gpu, m.gpu.cs
    tape = []

    def record(label, fn, args, kw):
        tape.append((label, fn, args, kw))
        return fn(*args, **kw)

    p = Patched(record)
    use = dec.use_graphs
    dec.use_graphs = False
    try:
        dec.forward(np.array([tid]), st)
    finally:
        dec.use_graphs = use
        p.restore()
    cs.synchronize()
    per = defaultdict(float)
    calls = defaultdict(int)
    failed = set()
    for label, fn, args, kw in tape:
        try:
            g = capture_fn(lambda s, fn=fn, args=args, kw=kw: [fn(*args, **kw) for _ in range(REPS)], cs)
        except Exception:   # a wrapper that allocates or syncs cannot be captured alone
            failed.add(label)
            continue
        per[label] += _time_graph_ms(cs, g) * 1e3 / REPS
        calls[label] += 1
        g.destroy()
    return {"us": dict(per), "calls": dict(calls), "not_captured": sorted(failed)}


def profile_token_graph(m, st, tid: int, n: int = 8) -> dict:
    """The replayed decode graph(s): GPU time of the graph launches and wall time per token."""
    from numba import cuda
    dec, cs = m.gpu, m.gpu.cs
    dec.forward(np.array([tid]), st)       # captures the graphs
    g = dec._graphs
    out = {"graphs": len(g)}
    if "token" in g:
        out["token_graph_us"] = _time_graph_ms(cs, g["token"]) * 1e3
    t = time.perf_counter()
    e0, e1 = cuda.event(), cuda.event()
    e0.record(cs)
    for _ in range(n):
        dec.forward(np.array([tid]), st)
    e1.record(cs)
    e1.synchronize()
    out["forward_wall_us"] = (time.perf_counter() - t) / n * 1e6
    out["forward_gpu_span_us"] = e0.elapsed_time(e1) / n * 1e3
    # the tails after the head: logits to the host, or the device sampler (greedy; plain
    # temperature, drawn in vocabulary order; a top-p cut, one more bisection each)
    out["logits_tail_us"] = _time_graph_ms(cs, g["logits"]) * 1e3
    for name, setting in (("greedy", (0.0, 0, 1.0)), ("t1", (1.0, 0, 1.0)),
                          ("t0.7_p0.9", (0.7, 0, 0.9))):
        dec.samp_h[0] = (*setting, 0.5)
        out[f"sample_tail_us_{name}"] = _time_graph_ms(cs, g[("sample", 0)]) * 1e3
    t = time.perf_counter()
    for _ in range(n):
        dec.forward_sample(tid, st, 1.0, 0, 1.0, 0.5)
    out["forward_sample_wall_us"] = (time.perf_counter() - t) / n * 1e6
    return out


def profile_prefill(m, st, ids) -> dict:
    """Milliseconds per wrapper (events on the compute stream) and per host step (wall)."""
    from numba import cuda
    dec, cs = m.gpu, m.gpu.cs
    evs = []

    def timed(label, fn, args, kw):
        e0, e1 = cuda.event(), cuda.event()
        e0.record(cs)
        r = fn(*args, **kw)
        e1.record(cs)
        evs.append((label, e0, e1))
        return r

    host = defaultdict(float)
    res = dec.res
    orig_resolve = res.resolve

    def resolve(*a, **k):
        t = time.perf_counter()
        try:
            return orig_resolve(*a, **k)
        finally:
            host["host.resolve"] += time.perf_counter() - t

    import kernels_numba.gpu_experts as gx
    orig_group = gx.group_assignments

    def group(*a, **k):
        t = time.perf_counter()
        try:
            return orig_group(*a, **k)
        finally:
            host["host.group_assignments"] += time.perf_counter() - t

    p = Patched(timed)
    res.resolve = resolve
    gx.group_assignments = group
    cs.synchronize()
    t = time.perf_counter()
    try:
        dec.forward(np.asarray(ids), st)
        cs.synchronize()
    finally:
        wall = time.perf_counter() - t
        p.restore()
        res.resolve = orig_resolve
        gx.group_assignments = orig_group
    gpu = defaultdict(float)
    calls = defaultdict(int)
    for label, e0, e1 in evs:
        gpu[label] += e0.elapsed_time(e1)
        calls[label] += 1
    return {"wall_ms": wall * 1e3, "gpu_ms": dict(gpu), "calls": dict(calls),
            "host_ms": {k: v * 1e3 for k, v in host.items()}}


def _table(title, d, unit, total=None, calls=None):
    print(f"\n{title}")
    for k, v in sorted(d.items(), key=lambda kv: -kv[1]):
        c = f"  x{calls[k]}" if calls else ""
        print(f"  {k:34s} {v:10.1f} {unit}{c}")
    if total is not None:
        print(f"  {'sum':34s} {sum(d.values()):10.1f} {unit}   (of {total:.1f} {unit})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--vram-gb", type=float, default=40)
    ap.add_argument("--ram-gb", type=float, default=32)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import engine
    m = engine.load(a.model, device="cuda", vram_gb=a.vram_gb, ram_gb=a.ram_gb,
                    max_context=a.prompt_len + 64)
    rng = np.random.default_rng(0)
    m.generate(rng.integers(0, m.config.vocab_size, 16).tolist(), max_new_tokens=3, temperature=0)
    dec = m.gpu
    st = dec.new_state(a.prompt_len + 64)
    ids = rng.integers(0, m.config.vocab_size, a.prompt_len)
    dec.forward(ids[:32], st)                           # compile the prefill kernels
    st = dec.new_state(a.prompt_len + 64)
    out = {}
    try:
        pre = out["prefill"] = profile_prefill(m, st, ids)
        print(f"prefill {a.prompt_len} tokens: {pre['wall_ms']:.0f} ms wall "
              f"({a.prompt_len / pre['wall_ms'] * 1e3:.0f} tok/s)")
        _table("prefill, GPU ms per wrapper", pre["gpu_ms"], "ms", pre["wall_ms"], pre["calls"])
        _table("prefill, host ms", pre["host_ms"], "ms")
    except Exception:   # keep going: the decode half may still work
        traceback.print_exc()
    tid = int(rng.integers(0, m.config.vocab_size))
    try:
        dec_ = out["decode"] = profile_decode(m, st, tid)
        tok = out["token"] = profile_token_graph(m, st, tid)
        print(f"\ndecode at position {st.pos}: {tok}")
        _table("decode, GPU us per wrapper (each alone in a graph)", dec_["us"], "us",
               tok.get("token_graph_us", tok["forward_gpu_span_us"]), dec_["calls"])
        if dec_["not_captured"]:
            print("  not captured alone:", ", ".join(dec_["not_captured"]))
    except Exception:
        traceback.print_exc()
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
