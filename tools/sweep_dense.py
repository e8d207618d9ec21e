"""Sweep the dense decode kernels' variants on the GPU, each replayed in a CUDA graph, against
the device-to-device copy bandwidth measured in the same run.

    python3 tools/sweep_dense.py out.json          # H200: about a minute, compiles included
    python3 tools/sweep_dense.py --ops attention --budget 400 att.json   # decode attention only
    python3 tools/sweep_dense.py --ops qk_norm_rope,router_topk small.json   # their variants
    python3 tools/sweep_dense.py --ops linear --budget 420 lin.json      # matvec 8B vs 16B only
    NUMBA_ENABLE_CUDASIM=1 python3 tools/sweep_dense.py --sim out.json   # tiny shapes, CPU

One line per (op, shape, variant): microseconds per call, GB/s of the bytes the op must read
(the weights for linear, the K / V rows in range for attention), and GB/s over the copy
bandwidth. Every call reads its own copy of the weights / KV cache, rotating over enough copies
to be several times the 60 MB L2, so nothing is served from L2 that would not be in a model.
Each variant's output is checked against numpy once (err: max |error| / max |ref|).
Linear: the 8-byte path ("8B (R, KS, U)") against the 16-byte path ("16B R,KS,U tTHREADS
bBLOCKS_SM", gd.Wide), each path's default shape marked, ending with a table of both defaults
and each path's fastest shape per case.
Attention: every decode variant of gpu_attention (base = the partial + combine kernels; v2 =
partial2 + combine2; v2f = partial2 merging in its last block, one launch) with its knobs,
ending with a table of us per call (ratio to copy) per case; "comb" = the combine launch alone.
qk_norm_rope and router_topk: each variant (gpu_dense.QKR_VARIANTS, gpu_sampling.ROUTER_VARIANTS),
plain and with its fused extra (the k / v cache store, the slot table), us per launch as 50
launches replayed in a graph on inputs in L2 (the decode case: the previous launch wrote them);
qk_norm_rope also against its four separate launches.
Legend: N x K = weight rows x inner size, T = tokens, S = cache rows, pos = the query position.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

SIM = "--sim" in sys.argv
if SIM:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"      # before numba is imported

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from kernels_numba import gpu_attention as ga  # noqa: E402
from kernels_numba import gpu_dense as gd  # noqa: E402
from kernels_numba import gpu_sampling as gs  # noqa: E402
from kernels_numba import reference as ref  # noqa: E402

BUDGET_S = 85             # stop starting new cases after this long (--budget; default: < 100 s)
ROTATE_BYTES = 8 << 20 if SIM else 256 << 20   # bytes of copies a graph rotates through
MAX_COPIES = 2 if SIM else 256
REPS = 1 if SIM else 5    # graph replays timed

if SIM:
    LIN_SHAPES = [(6, 40)]
    LIN_TOKENS = (1, 3)
    LIN_CONFIGS = [None, "8B", (2, 2, 2), gd.Wide(1, 2, 1), "16B"]
    LIN_T_CONFIGS = LIN_CONFIGS
    ATT_CASES = [dict(s_max=12, pos=9, hq=2, hkv=1, d=8)]
    ATT_VARIANTS = [dict(variant="base"), dict(variant="base", fused=True),
                    dict(variant="base", split=2, kb=4, warps=1), dict(variant="v2"),
                    dict(variant="v2", split=2, kb=2, warps=1), dict(variant="v2f"),
                    dict(variant="v2f", split=2, splits=3)]
    QKR_CASES = [dict(t=1, hq=2, hkv=1, d=16, r=16)]
    ROUTER_CASES = [dict(t=1, e=40, k=3)]
else:
    LIN_SHAPES = [(5120, 2048), (2048, 4096), (4096, 2048), (151936, 2048), (128, 2048),
                  (768, 2048)]
    LIN_TOKENS = (1, 2, 4, 7)
    # None: linear()'s choice; "8B" / "16B": the 8-byte / 16-byte path's default shape;
    # (R rows per warp group, KS warps per row, U chunks in flight): the 8-byte path;
    # gd.Wide(R, KS, U, threads, blocks_sm): the 16-byte path (more per shape: wide_configs())
    LIN_CONFIGS = [None, "8B", (1, 1, 4), (2, 1, 4), (4, 1, 2), (2, 2, 4), (2, 2, 2), (1, 4, 4),
                   (1, 8, 2), (2, 1, 2), "16B"]
    LIN_T_CONFIGS = [None, "8B", (1, 1, 4), (2, 1, 4), (2, 2, 4), "16B", gd.Wide(1, 1, 4),
                     gd.Wide(2, 1, 4)]     # T > 1
    ATT_CASES = [dict(s_max=4096, pos=2047, hq=32, hkv=4, d=128),    # the two that decide
                 dict(s_max=32768, pos=32767, hq=32, hkv=4, d=128),
                 dict(s_max=4096, pos=4095, hq=32, hkv=4, d=128),
                 dict(s_max=4096, pos=255, hq=32, hkv=4, d=128)]
    # base: the old default (two launches), its best knobs of the last sweep; the one-launch
    # base (fused=True, 67 us) is left out. v2 / v2f: defaults first, then kb (keys a warp
    # step), warps, splits (pieces a kv head: 33 / 66 / 132 = 1 / 2 / 4 blocks an SM)
    ATT_VARIANTS = [dict(variant="base"), dict(variant="base", kb=4),
                    dict(variant="base", split=64),
                    dict(variant="v2"), dict(variant="v2", kb=2), dict(variant="v2", warps=2),
                    dict(variant="v2", warps=8), dict(variant="v2", splits=33),
                    dict(variant="v2", splits=128), dict(variant="v2", splits=33, warps=8),
                    dict(variant="v2f"),
                    dict(variant="v2f", warps=4), dict(variant="v2f", kb=2),
                    dict(variant="v2f", splits=17), dict(variant="v2f", splits=66),
                    dict(variant="v2f", splits=66, warps=4),
                    dict(variant="v2f", splits=17, warps=4)]
    QKR_CASES = [dict(t=1, hq=32, hkv=4, d=128, r=128), dict(t=7, hq=32, hkv=4, d=128, r=128),
                 dict(t=1, hq=16, hkv=2, d=256, r=64)]
    # Qwen3-30B-A3B decode and a prefill chunk, Qwen3-Next (512 experts, top-10)
    ROUTER_CASES = [dict(t=1, e=128, k=8), dict(t=16, e=128, k=8), dict(t=1, e=512, k=10)]
REPS_SMALL = 1 if SIM else 50   # qk_norm_rope / router_topk: launches a graph


def time_graph_us(fn, stream, calls: int) -> float:
    """fn(stream) makes `calls` launches; capture it once, replay REPS times: us per launch."""
    if SIM:                                  # no graphs in the simulator: just run it
        t0 = time.perf_counter()
        fn(stream)
        stream.synchronize()
        return (time.perf_counter() - t0) * 1e6 / calls
    from engine.graphs import capture_fn
    g = capture_fn(fn, stream)
    g.upload(stream)
    g.launch(stream)
    stream.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    e0.record(stream)
    for _ in range(REPS):
        g.launch(stream)
    e1.record(stream)
    e1.synchronize()
    ms = e0.elapsed_time(e1)
    g.destroy()
    return ms * 1e3 / (REPS * calls)


def copy_gbs(stream) -> float:
    """Device-to-device copy: bytes read + written per second (GB/s)."""
    n = 1 << 20 if SIM else 1 << 30
    src = cuda.device_array(n, np.uint8)
    dst = cuda.device_array(n, np.uint8)
    dst.copy_to_device(src, stream=stream)
    stream.synchronize()
    reps = 1 if SIM else 10
    e0, e1 = cuda.event(), cuda.event()
    e0.record(stream)
    for _ in range(reps):
        dst.copy_to_device(src, stream=stream)
    e1.record(stream)
    e1.synchronize()
    ms = max(e0.elapsed_time(e1), 1e-3)
    return 2 * n * reps / (ms * 1e-3) / 1e9


def bf16_weights(rng, copies: int, n: int, k: int) -> np.ndarray:
    """uint16 [copies, n, k]: random bf16 with |w| < 1 (a random 8 MB block, tiled: fast)."""
    total = copies * n * k
    blk = min(total, 4 << 20)
    base = ((rng.standard_normal(blk).astype(np.float32) * 0.05).view(np.uint32) >> 16)
    return np.resize(base.astype(np.uint16), total).reshape(copies, n, k)


def n_copies(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / nbytes)))


def wide_configs(n: int, k: int) -> list:
    """16-byte launch shapes to time for an [n, k] bf16 weight at T = 1 besides the default:
    a row in one round of loads (R rows x U loads = 8 a lane, the row's chunks over KS warps),
    in two rounds (U = 4: 64 bytes a lane, more warps resident), and the default's block with
    other register caps (blocks_sm 3: <= 80 registers; 0: none) and block sizes."""
    if SIM:
        return [gd.Wide(1, 1, 1), gd.Wide(2, 1, 2, 64, 0)]
    nw = gd.LIN16_THREADS // gd.WARP
    per_row = max(1, k // 8 // gd.WARP)            # a warp's loads to cover a row
    out = []
    for r, u in ((1, 8), (2, 4), (4, 2), (8, 1), (1, 4), (2, 2)):
        ks = max(1, per_row // u)
        if ks <= nw and gd.Wide(r, ks, u) not in out:
            out.append(gd.Wide(r, ks, u))
    out += [gd.Wide(1, 1, 4), gd.Wide(2, 1, 4), gd.Wide(4, 1, 2)]
    d = gd.linear16_config(n, k, 1)
    out += [d._replace(blocks_sm=3), d._replace(blocks_sm=0), d._replace(threads=128, blocks_sm=8),
            d._replace(threads=512, blocks_sm=2)]
    return list(dict.fromkeys(c for c in out if (c.threads // gd.WARP) % c.ks == 0))


def linear_name(cfg) -> str:
    """A launch shape as the sweep prints it: 8B (R, KS, U) or 16B R,KS,U tTHREADS bBLOCKS_SM."""
    if isinstance(cfg, gd.Wide):
        return f"16B {cfg.r},{cfg.ks},{cfg.u} t{cfg.threads} b{cfg.blocks_sm}"
    return f"8B {tuple(cfg)}"


def sweep_linear(rows, t_start, stream, rng, bw):
    for n, k in LIN_SHAPES:
        nb = n * k * 2
        copies = n_copies(nb)
        w_h = bf16_weights(rng, copies, n, k)
        w = cuda.to_device(w_h)
        w0 = ref.bf16_to_f32(w_h[0])                    # float32 [n, k] for the checks
        del w_h
        for t in LIN_TOKENS:
            x_h = rng.standard_normal((t, k)).astype(np.float32)
            x = cuda.to_device(x_h)
            y = cuda.device_array((t, n), np.float32)
            exp = x_h @ w0.T
            timed = set()
            for spec in LIN_CONFIGS + wide_configs(n, k) if t == 1 else LIN_T_CONFIGS:
                if spec == "8B":
                    cfg = gd.linear_config(n, k, t)
                elif spec == "16B":
                    cfg = gd.linear16_config(n, k, t)
                else:
                    cfg = spec
                if cfg is not None and (type(cfg), cfg) in timed:
                    continue
                timed.add((type(cfg), cfg))
                name = ("default " + linear_name(gd.linear_choice(w[0], x)) if cfg is None
                        else linear_name(cfg) + (" (default)" if spec in ("8B", "16B") else ""))
                if time.time() - t_start > BUDGET_S:
                    rows.append(dict(op="linear", shape=f"{n}x{k} T={t}", variant=name,
                                     skipped="time budget"))
                    continue
                try:
                    y.copy_to_device(np.full((t, n), np.nan, np.float32))
                    gd.linear(w[0], x, y, stream, config=cfg)
                    stream.synchronize()
                    got = y.copy_to_host()
                    err = float(np.abs(got - exp).max() / np.abs(exp).max())

                    def run(st, cfg=cfg):
                        for c in range(copies):
                            gd.linear(w[c], x, y, st, config=cfg)
                    us = time_graph_us(run, stream, copies)
                except Exception as e:   # one broken variant must not end the sweep
                    rows.append(dict(op="linear", shape=f"{n}x{k} T={t}", variant=name,
                                     error=f"{type(e).__name__}: {e}"[:300]))
                    print(f"linear {n}x{k} T={t} {name}: {type(e).__name__}: {e}", flush=True)
                    continue
                gbs = nb / (us * 1e-6) / 1e9
                rows.append(dict(op="linear", shape=f"{n}x{k} T={t}", variant=name, us=us,
                                 gbs=gbs, ratio=gbs / bw, err=err, copies=copies))
                print(f"linear  {n:6d}x{k:<5d} T={t}  {name:34s} {us:8.2f} us {gbs:7.0f} GB/s "
                      f"{gbs / bw:5.2f} of copy  err {err:.1e}", flush=True)
    linear_table(rows)


def linear_table(rows) -> None:
    """One line per (shape, T): us (ratio to copy) of the 8-byte and 16-byte paths' defaults
    and the fastest shape of each path; '!' marks err > 1e-5."""
    lin = [r for r in rows if r.get("op") == "linear" and "us" in r]
    if not lin:
        return

    def cell(r):
        if r is None:
            return f"{'-':>16s}"
        return f"{r['us']:8.2f} ({r['ratio']:4.2f}){'!' if r['err'] > 1e-5 else ' '}"

    def label(r):
        return "" if r is None else r["variant"].removeprefix("default ").removesuffix(
            " (default)")
    print("\nlinear, us per call as replayed in a graph (ratio of copy):")
    print(f"{'shape':20s}{'8B default':>16s}{'16B default':>16s}{'best 8B':>16s} {'':13s}"
          f"{'best 16B':>16s}")
    for shape in dict.fromkeys(r["shape"] for r in lin):
        rs = [r for r in lin if r["shape"] == shape]

        def best(pred):
            c = [r for r in rs if pred(r["variant"])]
            return min(c, key=lambda r: r["us"]) if c else None
        d8 = best(lambda v: v.startswith("8B") and v.endswith("(default)"))
        d16 = best(lambda v: v.startswith("16B") and v.endswith("(default)"))
        b8 = best(lambda v: "8B" in v and "16B" not in v)
        b16 = best(lambda v: "16B" in v)
        print(f"{shape:20s}{cell(d8)}{cell(d16)}{cell(b8)} {label(b8):13s}{cell(b16)} "
              f"{label(b16)}", flush=True)


def _att_combine(var, parts, hq, hkv, d, s_max, split):
    """fn(stream, qp, out) launching the variant's combine kernel alone, or None (one launch)."""
    variant = var.get("variant", ga.DECODE_VARIANT)
    p_alloc = parts[0].shape[1] - 1
    if variant == "v2":
        p2 = ga.v2_pieces(s_max, hkv, p_alloc, False, split, var.get("splits"))
        comb = ga._combine2_kernel(d)
        return lambda st, qp, out: comb[hq, ga.C2_THREADS, st](
            qp, np.int32(0), np.int32(split), np.int32(p2), *parts, out)
    if variant == "base" and not (var.get("fused", ga.FUSED) and ga.fusable(hq // hkv, p_alloc)):
        comb = ga._COMBINE[ga.MAX_D // ga.WARP // 2 if d <= ga.MAX_D // 2 else ga.MAX_D // ga.WARP]
        return lambda st, qp, out: comb[hq, ga.COMB_THREADS, st](
            qp, np.int32(0), np.int32(split), *parts, out)
    return None


def sweep_attention(rows, t_start, stream, rng, bw):
    for case in ATT_CASES:
        s_max, pos, hq, hkv, d = (case[x] for x in ("s_max", "pos", "hq", "hkv", "d"))
        layer_bytes = s_max * hkv * d * 4 * 2
        read = (pos + 1) * hkv * d * 4 * 2
        copies = max(1, min(16, math.ceil(ROTATE_BYTES / layer_bytes)))
        k_h = rng.standard_normal((s_max, hkv, d)).astype(np.float32)
        v_h = rng.standard_normal((s_max, hkv, d)).astype(np.float32)
        kc = [cuda.to_device(k_h) for _ in range(copies)]
        vc = [cuda.to_device(v_h) for _ in range(copies)]
        q_h = rng.standard_normal((1, hq, d)).astype(np.float32)
        q = cuda.to_device(q_h)
        qp_h = np.array([pos], np.int32)
        qp = cuda.to_device(qp_h)
        out = cuda.device_array((1, hq, d), np.float32)
        scale = d ** -0.5
        exp = ref.attention(q_h, k_h, v_h, qp_h, scale)
        shape = f"S={s_max} pos={pos} {hq}/{hkv}x{d}"
        for var in ATT_VARIANTS:
            name = ",".join(f"{b}" if a == "variant" else f"{a}={b}" for a, b in var.items())
            if time.time() - t_start > BUDGET_S:
                rows.append(dict(op="attention", shape=shape, variant=name, skipped="time budget"))
                continue
            split = var.get("split", ga.SPLIT)
            try:
                parts = ga.alloc_partials(1, hq, d, s_max, split)
                out.copy_to_device(np.full((1, hq, d), np.nan, np.float32))
                path = ga.attention(q, kc[0], vc[0], qp, scale, out, parts, stream, **var)
                stream.synchronize()
                err = float(np.abs(out.copy_to_host() - exp).max() / np.abs(exp).max())

                def run(st, var=var, parts=parts):
                    for c in range(copies):
                        ga.attention(q, kc[c], vc[c], qp, scale, out, parts, st, **var)
                us = time_graph_us(run, stream, copies)
                comb = _att_combine(var, parts, hq, hkv, d, s_max, split)

                def run_comb(st, comb=comb):
                    for _ in range(copies):
                        comb(st, qp, out)
                us_comb = 0.0 if comb is None else time_graph_us(run_comb, stream, copies)
                ticket = float(np.abs(parts[0].copy_to_host()[:, -1]).max())
            except Exception as e:
                rows.append(dict(op="attention", shape=shape, variant=name,
                                 error=f"{type(e).__name__}: {e}"[:300]))
                print(f"attention {shape} {name}: {type(e).__name__}: {e}", flush=True)
                continue
            gbs = read / (us * 1e-6) / 1e9
            rows.append(dict(op="attention", shape=shape, variant=name, path=path, us=us,
                             combine_us=us_comb, gbs=gbs, ratio=gbs / bw, err=err,
                             splits=parts[0].shape[1] - 1, one_launch=comb is None,
                             ticket_left=ticket, copies=copies))
            print(f"attention {shape:28s} {name:24s} {us:8.2f} us "
                  f"({'one launch' if comb is None else f'comb {us_comb:5.2f}'}) "
                  f"{gbs:7.0f} GB/s {gbs / bw:5.2f} of copy  err {err:.1e}"
                  + ("" if path == var.get("variant", ga.DECODE_VARIANT) else f"  RAN {path}")
                  + ("" if ticket == 0 else f"  TICKET LEFT {ticket}"), flush=True)
    attention_table(rows)


def attention_table(rows) -> None:
    """One line per variant: us (ratio to copy) per case; '!' marks err > 1e-5 or a fallback."""
    att = [r for r in rows if r.get("op") == "attention" and "us" in r]
    if not att:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in att))
    names = list(dict.fromkeys(r["variant"] for r in att))
    cell = {(r["variant"], r["shape"]): r for r in att}
    heads = [sh.split(" ")[0] + " " + sh.split(" ")[1] for sh in shapes]
    print("\nattention, us per call as replayed in a graph (ratio of copy):")
    print(f"{'variant':26s}" + "".join(f"{h:>24s}" for h in heads))
    for nm in names:
        line = f"{nm:26s}"
        for sh in shapes:
            r = cell.get((nm, sh))
            if r is None:
                line += f"{'-':>24s}"
                continue
            bad = r["err"] > 1e-5 or r["path"] != nm.split(",")[0] or r["ticket_left"] != 0
            comb = "" if r["one_launch"] else f"+c{r['combine_us']:.1f}"
            line += f"{r['us']:9.2f}{comb:>6s} ({r['ratio']:4.2f}){'!' if bad else ' '}"
        print(line, flush=True)


def sweep_qk_norm_rope(rows, t_start, stream, rng, bw):
    """gd.qk_norm_rope (one launch), each variant, without and with the cache store (the
    engine's call), against rmsnorm(q), rmsnorm(k), rope(q), rope(k)."""
    for case in QKR_CASES:
        t, hq, hkv, d, r = (case[x] for x in ("t", "hq", "hkv", "d", "r"))
        shape = f"T={t} {hq}/{hkv}x{d} R={r}"
        if time.time() - t_start > BUDGET_S:
            rows.append(dict(op="qk_norm_rope", shape=shape, skipped="time budget"))
            continue
        q_h = rng.standard_normal((t, hq, d)).astype(np.float32)
        k_h = rng.standard_normal((t, hkv, d)).astype(np.float32)
        v_h = rng.standard_normal((t, hkv, d)).astype(np.float32)
        wq_h = (rng.standard_normal(d) * 0.1).astype(np.float32)
        wk_h = (rng.standard_normal(d) * 0.1).astype(np.float32)
        s_max = 4096
        pos_h = rng.permutation(s_max)[:t].astype(np.int32)
        inv_h = (1.0 / (1e6 ** (np.arange(0, r, 2) / r))).astype(np.float32)
        wq, wk, pos, inv, v = (cuda.to_device(a) for a in (wq_h, wk_h, pos_h, inv_h, v_h))
        kc = cuda.device_array((s_max, hkv, d), np.float32)
        vc = cuda.device_array((s_max, hkv, d), np.float32)
        reps = REPS_SMALL
        for variant in gd.QKR_VARIANTS:
            for store in (False, True):
                name = variant + (" store" if store else "")
                cache = (v, kc, vc) if store else None
                try:
                    q, k = cuda.to_device(q_h), cuda.to_device(k_h)
                    gd.qk_norm_rope(q, k, wq, wk, 1e-6, pos, inv, 1.0, stream, w_offset=1.0,
                                    cache=cache, variant=variant)
                    stream.synchronize()
                    err = 0.0
                    for got, x, w in ((q, q_h, wq_h), (k, k_h, wk_h)):
                        exp = ref.rope(ref.rmsnorm(x, w + np.float32(1.0), 1e-6), pos_h, inv_h)
                        err = max(err, float(np.abs(got.copy_to_host() - exp).max()
                                             / np.abs(exp).max()))
                    if store:   # exp: k's
                        err = max(err, float(np.abs(kc.copy_to_host()[pos_h] - exp).max()
                                             / np.abs(exp).max()))

                    def fused(st, q=q, k=k, cache=cache, variant=variant):
                        for _ in range(reps):
                            gd.qk_norm_rope(q, k, wq, wk, 1e-6, pos, inv, 1.0, st, w_offset=1.0,
                                            cache=cache, variant=variant)
                    us = time_graph_us(fused, stream, reps)
                except Exception as e:
                    rows.append(dict(op="qk_norm_rope", shape=shape, variant=name,
                                     error=f"{type(e).__name__}: {e}"[:300]))
                    print(f"qk_norm_rope {shape} {name}: {type(e).__name__}: {e}", flush=True)
                    continue
                rows.append(dict(op="qk_norm_rope", shape=shape, variant=name, us=us, err=err))
                print(f"qk_norm_rope {shape:24s} {name:12s} {us:6.2f} us  err {err:.1e}",
                      flush=True)
        q, k = cuda.to_device(q_h), cuda.to_device(k_h)
        q2, k2 = q.reshape(t * hq, d), k.reshape(t * hkv, d)

        def separate(st):
            for _ in range(reps):
                gd.rmsnorm(q2, wq, 1e-6, q2, st, w_offset=1.0)
                gd.rmsnorm(k2, wk, 1e-6, k2, st, w_offset=1.0)
                gd.rope(q, pos, inv, st)
                gd.rope(k, pos, inv, st)
        us_s = time_graph_us(separate, stream, reps)
        rows.append(dict(op="qk_norm_rope", shape=shape, variant="4 launches", us=us_s))
        print(f"qk_norm_rope {shape:24s} {'4 launches':12s} {us_s:6.2f} us", flush=True)


def sweep_router_topk(rows, t_start, stream, rng, bw):
    """gs.router_topk, each variant, without and with the slot table (the all-resident
    decode's call); ids must match the oracle's (err: weights, max |error| / max |ref|)."""
    for case in ROUTER_CASES:
        t, e, k = (case[x] for x in ("t", "e", "k"))
        shape = f"T={t} E={e} K={k}"
        if time.time() - t_start > BUDGET_S:
            rows.append(dict(op="router_topk", shape=shape, skipped="time budget"))
            continue
        logits_h = rng.standard_normal((t, e)).astype(np.float32)
        eids, ew = ref.router_topk(logits_h, k, True)
        logits = cuda.to_device(logits_h)
        slot_of = cuda.to_device(rng.permutation(e).astype(np.int32))
        ids = cuda.device_array((t, k), np.int32)
        w = cuda.device_array((t, k), np.float32)
        out = cuda.device_array((t, k), np.int32)
        reps = REPS_SMALL
        for variant in gs.ROUTER_VARIANTS:
            for with_slots in (False, True):
                name = variant + (" slots" if with_slots else "")
                slots = (slot_of, out) if with_slots else None
                try:
                    ids.copy_to_device(np.full((t, k), -1, np.int32))
                    gs.router_topk(logits, True, ids, w, stream, slots=slots, variant=variant)
                    stream.synchronize()
                    ids_ok = bool(np.array_equal(ids.copy_to_host(), eids))
                    err = float(np.abs(w.copy_to_host() - ew).max() / np.abs(ew).max())

                    def run(st, slots=slots, variant=variant):
                        for _ in range(reps):
                            gs.router_topk(logits, True, ids, w, st, slots=slots,
                                           variant=variant)
                    us = time_graph_us(run, stream, reps)
                except Exception as ex:
                    rows.append(dict(op="router_topk", shape=shape, variant=name,
                                     error=f"{type(ex).__name__}: {ex}"[:300]))
                    print(f"router_topk {shape} {name}: {type(ex).__name__}: {ex}", flush=True)
                    continue
                rows.append(dict(op="router_topk", shape=shape, variant=name, us=us, err=err,
                                 ids_ok=ids_ok))
                print(f"router_topk {shape:18s} {name:12s} {us:6.2f} us  err {err:.1e}"
                      + ("" if ids_ok else "  IDS DIFFER"), flush=True)


OPS = ("linear", "qk_norm_rope", "router_topk", "attention")


def parse_args(argv):
    ap = argparse.ArgumentParser(description="Sweep the dense decode kernels' variants.")
    ap.add_argument("out", nargs="?", default="sweep_dense.json", help="results (JSON)")
    ap.add_argument("--sim", action="store_true", help="NUMBA_ENABLE_CUDASIM, tiny shapes")
    ap.add_argument("--ops", default=",".join(OPS),
                    help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help="seconds after which no new case starts (default %(default)s)")
    ap.add_argument("--lin-shapes", help="linear: comma-separated NxK (default: all)")
    ap.add_argument("--lin-tokens", help="linear: comma-separated T (default: all)")
    a = ap.parse_args(argv)
    a.ops = [o for o in a.ops.split(",") if o]
    bad = [o for o in a.ops if o not in OPS]
    if bad:
        ap.error(f"unknown op(s) {bad}: choose from {OPS}")
    return a


def main() -> None:
    global BUDGET_S, LIN_SHAPES, LIN_TOKENS
    args = parse_args(sys.argv[1:])
    BUDGET_S = args.budget
    if args.lin_shapes:
        LIN_SHAPES = [tuple(int(v) for v in s.split("x")) for s in args.lin_shapes.split(",")]
    if args.lin_tokens:
        LIN_TOKENS = tuple(int(v) for v in args.lin_tokens.split(","))
    out_path = args.out
    t_start = time.time()
    if not SIM and not cuda.is_available():
        sys.exit("needs a CUDA GPU (or --sim)")
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    bw = copy_gbs(stream)
    dev = "simulator" if SIM else cuda.get_current_device().name
    dev = dev.decode() if isinstance(dev, bytes) else str(dev)
    print(f"device {dev}: d2d copy {bw:.0f} GB/s", flush=True)
    res = dict(device=dev, copy_gbs=bw, sim=SIM, rows=[])
    try:
        for op, fn in (("linear", sweep_linear), ("qk_norm_rope", sweep_qk_norm_rope),
                       ("router_topk", sweep_router_topk), ("attention", sweep_attention)):
            if op in args.ops:
                fn(res["rows"], t_start, stream, rng, bw)
    finally:
        res["elapsed_s"] = time.time() - t_start
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {out_path} ({res['elapsed_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
