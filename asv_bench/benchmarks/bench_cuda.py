"""CUDA kernels on the GPU at real model shapes, next to the HBM bandwidth measured in the same run.

Expert MLP: L layers, each with its own K routed experts in distinct bank slots (the bank is
several times the L2, so every replay reads weights from HBM), run eagerly (one Python launch
per kernel) and as one captured CUDA graph. Weight GB/s = bytes of the experts' blocks that the
kernels read / time; the bound is the device-to-device copy bandwidth (and saxpy) measured here.
Dense layer: one Qwen3-30B-A3B decoder layer (norms, bf16 q/k/v/o, rope, decode attention at
position 2047, router, top-8 NVFP4 experts), eager vs graph, microseconds.

Without a GPU every setup raises NotImplementedError (asv marks the benchmark skipped).
Run directly on a GPU machine: python asv_bench/benchmarks/bench_cuda.py [out.json]
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from engine.bandwidth import time_ms as _time_ms  # (warm once, events around reps calls)

SHAPES = {"qwen3-30b-a3b": (2048, 768, 8), "qwen3-next-80b": (2048, 512, 10),
          "2560x640-top10": (2560, 640, 10)}
LAYERS = 16
REPS = 20


def _need_gpu():
    from numba import config, cuda
    if config.ENABLE_CUDASIM or not cuda.is_available():
        raise NotImplementedError("needs a CUDA GPU")


def hbm_copy_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    from numba import cuda
    stream = cuda.stream()
    src = cuda.device_array(nbytes, np.uint8)
    dst = cuda.device_array(nbytes, np.uint8)
    ms = _time_ms(stream, lambda: dst.copy_to_device(src, stream=stream), 10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


_saxpy = None


def saxpy_gbs(n: int = 1 << 28) -> float:
    global _saxpy
    from numba import cuda, float32
    if _saxpy is None:
        @cuda.jit
        def k(a, x, y):
            i = cuda.grid(1)
            if i < x.shape[0]:
                y[i] = a * x[i] + y[i]
        _saxpy = k
    stream = cuda.stream()
    x = cuda.device_array(n, np.float32)
    y = cuda.device_array(n, np.float32)
    ms = _time_ms(stream, lambda: _saxpy[(n + 255) // 256, 256, stream](float32(2.0), x, y), 10)
    return 3 * 4 * n / (ms * 1e-3) / 1e9


def linear_gbs(n: int, k: int) -> float:
    """bf16 matvec y [1, n] = x [1, k] @ w [n, k]^T: weight GB/s (graph of 4 launches)."""
    from numba import cuda
    from engine.graphs import capture_fn
    from kernels_numba import gpu_dense as gd
    w = cuda.device_array((n, k), np.uint16)
    w.copy_to_device(np.zeros((n, k), np.uint16))
    x = cuda.to_device(np.ones((1, k), np.float32))
    y = cuda.device_array((1, n), np.float32)
    stream = cuda.stream()
    g = capture_fn(lambda st: [gd.linear(w, x, y, st) for _ in range(4)], stream)
    ms = _time_ms(stream, lambda: g.launch(stream), 5) / 4
    return n * k * 2 / (ms * 1e-3) / 1e9


def expert_weight_bytes(fmt: str, h: int, i: int) -> int:
    from loader.layout import matrix_bytes
    return 12 + sum(sum(matrix_bytes(fmt, r, c)) for r, c in ((i, h), (i, h), (h, i)))


class ExpertSetup:
    """L layers of K experts each in distinct slots of one bank; eager runs and graphs."""

    def __init__(self, fmt, h, i, k, layers=LAYERS):
        from numba import cuda
        from kernels_numba import gpu_experts as ge
        from loader.layout import ExpertLayout, matrix_bytes
        self.fmt, self.k, self.layers = fmt, k, layers
        lay = ExpertLayout.build(fmt, h, i)
        self.lh = lay.as_array()
        s = layers * k
        rng = np.random.default_rng(0)
        bank = rng.integers(0, 256, size=(s, lay.block_bytes), dtype=np.uint8)
        bank[:, :12] = np.frombuffer(np.ones(3, np.float32).tobytes(), np.uint8)
        # synthetic but tame values (|scale| < 1, finite), so outputs stay finite
        if fmt == "nvfp4":
            for off, rows, cols in ((lay.gate_s, i, lay.hp // 16), (lay.up_s, i, lay.hp // 16),
                                    (lay.down_s, h, lay.ip // 16)):
                bank[:, off:off + rows * cols] &= 0x37
        if fmt == "bf16":
            q = bank[:, lay.gate_q:lay.payload_bytes].view(np.uint16)
            q &= 0xBCFF
        if fmt == "fp8":
            bank[:, lay.gate_q:lay.down_s] &= 0x37
            for off, rows in ((lay.gate_s, i), (lay.up_s, i), (lay.down_s, h)):
                bank[:, off:off + rows * 4] = np.frombuffer(
                    np.full(rows, 0.01, np.float32).tobytes(), np.uint8)
        self.bank = cuda.to_device(bank)
        del bank
        self.views = ge.bank_views(self.bank)
        self.dlay = cuda.to_device(self.lh)
        perm = rng.permutation(s).astype(np.int32)
        self.slots = [cuda.to_device(perm[l * k:(l + 1) * k]) for l in range(layers)]
        self.wts = cuda.to_device(np.full(k, 1.0 / k, np.float32))
        self.x = cuda.to_device(rng.standard_normal(h).astype(np.float32) * 0.01)
        self.act = cuda.device_array((k, i), np.float32)
        self.out = cuda.device_array(h, np.float32)
        self.stream = cuda.stream()
        self.bytes_per_layer = k * expert_weight_bytes(fmt, h, i)
        self.bytes_gate_up = k * 2 * sum(matrix_bytes(fmt, i, h))
        self.bytes_down = self.bytes_per_layer - self.bytes_gate_up

    def run(self, stream=None, part="both", variant="", min_blocks=0, unroll=0, threads=None):
        from kernels_numba import gpu_experts as ge
        st = stream or self.stream
        threads = threads or ge.THREADS   # block size of the legacy kernels only
        for l in range(self.layers):
            if part in ("both", "gate_up"):
                ge.expert_gate_up(self.fmt, self.views, self.dlay, self.lh, self.slots[l], self.x,
                                  self.act, st, variant, min_blocks, unroll, threads)
            if part in ("both", "down"):
                ge.expert_down(self.fmt, self.views, self.dlay, self.lh, self.slots[l], self.wts,
                               self.act, self.out, st, False, variant, min_blocks, unroll,
                               threads)

    def layer_us(self, graph: bool, part="both", variant="", min_blocks=0, unroll=0,
                 threads=None, pdl=None) -> float:
        """pdl: programmatic edges in the graph (None: where the device has them)."""
        from engine.graphs import capture_fn
        run = lambda st=None: self.run(st, part, variant, min_blocks, unroll, threads)  # noqa: E731
        if graph:
            g = capture_fn(run, self.stream, pdl=pdl)
            us = _time_ms(self.stream, lambda: g.launch(self.stream), REPS) * 1e3 / self.layers
            g.destroy()
            return us
        return _time_ms(self.stream, run, REPS) * 1e3 / self.layers


class DenseLayerSetup:
    """One Qwen3-30B-A3B decoder layer for decode (T = 1), bf16 dense weights, NVFP4 experts."""

    def __init__(self, h=2048, hq=32, hkv=4, d=128, e=128, k=8, i=768, s_max=4096, pos=2047):
        from numba import cuda
        from engine.graphs import capture_fn
        from kernels_numba import gpu_attention as ga
        rng = np.random.default_rng(1)

        def bf16(*shape):
            return cuda.to_device((rng.integers(0, 1 << 16, size=shape, dtype=np.uint32)
                                   & 0xBCFF).astype(np.uint16))   # finite, |w| < 1
        self.h, self.hq, self.hkv, self.d = h, hq, hkv, d
        self.wqkv = bf16((hq + 2 * hkv) * d, h)
        self.wo = bf16(h, hq * d)
        self.wr = bf16(e, h)
        self.n1 = cuda.to_device(np.ones(h, np.float32))
        self.n2 = cuda.to_device(np.ones(h, np.float32))
        self.qn = cuda.to_device(np.ones(d, np.float32))
        self.kn = cuda.to_device(np.ones(d, np.float32))
        self.inv_freq = cuda.to_device((1.0 / (1e6 ** (np.arange(0, d, 2) / d))).astype(np.float32))
        self.kc = cuda.to_device(rng.standard_normal((s_max, hkv, d)).astype(np.float32))
        self.vc = cuda.to_device(rng.standard_normal((s_max, hkv, d)).astype(np.float32))
        self.pos = cuda.to_device(np.array([pos], np.int32))
        self.x = cuda.to_device(rng.standard_normal((1, h)).astype(np.float32))
        self.xn = cuda.device_array((1, h), np.float32)
        self.qkv = cuda.device_array((hq + 2 * hkv) * d, np.float32)      # [q | k | v]
        self.q = self.qkv[:hq * d].reshape(1, hq, d)
        self.knew = self.qkv[hq * d:(hq + hkv) * d].reshape(1, hkv, d)
        self.attn = cuda.device_array((1, hq, d), np.float32)
        self.o = cuda.device_array((1, h), np.float32)
        self.logits = cuda.device_array((1, e), np.float32)
        self.ids = cuda.device_array((1, k), np.int32)
        self.rw = cuda.device_array((1, k), np.float32)
        self.parts = ga.alloc_partials(1, hq, d, s_max)
        self.experts = ExpertSetup("nvfp4", h, i, k, layers=1)
        self.stream = cuda.stream()
        self._ops = self.ops()
        self.graph = capture_fn(self.run_eager, self.stream)
        self.graph_plain = capture_fn(self.run_eager, self.stream, pdl=False)   # no PDL edges

    def ops(self):
        """[(name, fn(stream))] of one decoder layer, in order."""
        from kernels_numba import gpu_attention as ga
        from kernels_numba import gpu_dense as gd
        from kernels_numba import gpu_experts as ge
        from kernels_numba import gpu_sampling as gs
        hq, hkv, d, h = self.hq, self.hkv, self.d, self.h
        ex = self.experts
        # the cache write of the new k / v is left out (a 1 KB copy)
        return [
            ("rmsnorm", lambda st: gd.rmsnorm(self.x, self.n1, 1e-6, self.xn, st)),
            ("qkv", lambda st: gd.linear(self.wqkv, self.xn, self.qkv.reshape(1, self.qkv.shape[0]), st)),
            ("q_norm", lambda st: gd.rmsnorm(self.q.reshape(hq, d), self.qn, 1e-6, self.q.reshape(hq, d), st)),
            ("k_norm", lambda st: gd.rmsnorm(self.knew.reshape(hkv, d), self.kn, 1e-6,
                                             self.knew.reshape(hkv, d), st)),
            ("rope_q", lambda st: gd.rope(self.q, self.pos, self.inv_freq, st)),
            ("rope_k", lambda st: gd.rope(self.knew, self.pos, self.inv_freq, st)),
            ("attention", lambda st: ga.attention(self.q, self.kc, self.vc, self.pos, d ** -0.5,
                                                  self.attn, self.parts, st)),
            ("o_proj", lambda st: gd.linear(self.wo, self.attn.reshape(1, hq * d), self.o, st)),
            ("residual", lambda st: gd.add(self.x.reshape(h), self.o.reshape(h), self.x.reshape(h), st)),
            ("rmsnorm2", lambda st: gd.rmsnorm(self.x, self.n2, 1e-6, self.xn, st)),
            ("router", lambda st: gd.linear(self.wr, self.xn, self.logits, st)),
            ("topk", lambda st: gs.router_topk(self.logits, True, self.ids, self.rw, st)),
            ("experts", lambda st: ge.expert_mlp("nvfp4", ex.views, ex.dlay, ex.lh, ex.slots[0],
                                                 self.rw.reshape(-1), self.xn.reshape(h), ex.act,
                                                 self.x.reshape(h), st, accumulate=True)),
        ]

    def run_eager(self, stream=None):
        st = stream or self.stream
        for _, fn in self._ops:
            fn(st)

    def breakdown_us(self, reps=8):
        """Each op alone, as a graph of `reps` copies of it: microseconds per op."""
        from engine.graphs import capture_fn
        out = {}
        for name, fn in self._ops:
            g = capture_fn(lambda st, fn=fn: [fn(st) for _ in range(reps)], self.stream)
            out[name] = _time_ms(self.stream, lambda: g.launch(self.stream), 5) * 1e3 / reps
            g.destroy()
        return out

    def layer_us(self, graph: bool, pdl: bool = True) -> float:
        g = self.graph if pdl else self.graph_plain
        fn = (lambda: g.launch(self.stream)) if graph else self.run_eager
        return _time_ms(self.stream, fn, REPS) * 1e3


# ---- asv suites -------------------------------------------------------------------------------

class HBM:
    timeout = 300

    def setup(self):
        _need_gpu()

    def track_copy_gbs(self):
        return hbm_copy_gbs()
    track_copy_gbs.unit = "GB/s"

    def track_saxpy_gbs(self):
        return saxpy_gbs()
    track_saxpy_gbs.unit = "GB/s"


class ExpertMLP:
    params = (["nvfp4", "fp8", "bf16"], list(SHAPES))
    param_names = ["format", "shape"]
    timeout = 600

    def setup(self, fmt, shape):
        _need_gpu()
        self.s = ExpertSetup(fmt, *SHAPES[shape])

    def track_graph_gbs(self, fmt, shape):
        return self.s.bytes_per_layer / (self.s.layer_us(True) * 1e-6) / 1e9
    track_graph_gbs.unit = "GB/s"

    def track_eager_gbs(self, fmt, shape):
        return self.s.bytes_per_layer / (self.s.layer_us(False) * 1e-6) / 1e9
    track_eager_gbs.unit = "GB/s"

    def track_graph_us(self, fmt, shape):
        return self.s.layer_us(True)
    track_graph_us.unit = "us"

    def track_graph_plain_us(self, fmt, shape):
        """The same graph with plain edges (no programmatic dependent launch)."""
        return self.s.layer_us(True, pdl=False)
    track_graph_plain_us.unit = "us"


class DenseLayer:
    timeout = 600

    def setup(self):
        _need_gpu()
        self.s = DenseLayerSetup()

    def track_graph_us(self):
        return self.s.layer_us(True)
    track_graph_us.unit = "us"

    def track_graph_plain_us(self):
        """The same graph with plain edges (no programmatic dependent launch)."""
        return self.s.layer_us(True, pdl=False)
    track_graph_plain_us.unit = "us"

    def track_eager_us(self):
        return self.s.layer_us(False)
    track_eager_us.unit = "us"


def main(out_path=None, only=None):
    _need_gpu()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    res["copy_gbs"] = hbm_copy_gbs()
    res["saxpy_gbs"] = saxpy_gbs()
    print(f"HBM: d2d copy {res['copy_gbs']:.0f} GB/s, saxpy {res['saxpy_gbs']:.0f} GB/s", flush=True)
    rows = []
    # (variant, unroll, threads): the format's default and the legacy staged kernels; every
    # variant is timed by tools/sweep_experts.py
    sweep = {"default": ("", 0, None), "legacy": ("legacy", 0, None)}
    fmts = [f for f in ("nvfp4", "fp8", "bf16") if f in only] if only else ("nvfp4", "fp8", "bf16")
    for fmt in fmts:
        for name, (h, i, k) in SHAPES.items():
            t0 = time.time()
            s = ExpertSetup(fmt, h, i, k)
            b = s.bytes_per_layer
            gu = {c: s.layer_us(True, "gate_up", v, 0, u, t) for c, (v, u, t) in sweep.items()}
            dn = {c: s.layer_us(True, "down", v, 0, u, t) for c, (v, u, t) in sweep.items()}
            cg, cd = min(gu, key=gu.get), min(dn, key=dn.get)

            def run_best(st=None, s=s, cg=cg, cd=cd):
                s.run(st, "gate_up", sweep[cg][0], 0, *sweep[cg][1:])
                s.run(st, "down", sweep[cd][0], 0, *sweep[cd][1:])
            from engine.graphs import capture_fn
            g = capture_fn(run_best, s.stream)
            gg_us = _time_ms(s.stream, lambda: g.launch(s.stream), REPS) * 1e3 / s.layers
            g.destroy()
            ge_us = _time_ms(s.stream, run_best, REPS) * 1e3 / s.layers
            row = dict(fmt=fmt, shape=name, h=h, i=i, k=k, mb_per_layer=b / 1e6,
                       gate_up_cfg=cg, down_cfg=cd, eager_us=ge_us, graph_us=gg_us,
                       eager_gbs=b / ge_us / 1e3, graph_gbs=b / gg_us / 1e3,
                       gate_up_us=gu[cg], down_us=dn[cd],
                       gate_up_gbs=s.bytes_gate_up / gu[cg] / 1e3,
                       down_gbs=s.bytes_down / dn[cd] / 1e3,
                       sweep_gate_up_us=gu,
                       sweep_down_us=dn)
            row["graph_over_copy"] = row["graph_gbs"] / res["copy_gbs"]
            row["graph_over_saxpy"] = row["graph_gbs"] / res["saxpy_gbs"]
            rows.append(row)
            print(f"experts {fmt:5s} {name:15s} {b / 1e6:5.1f} MB/layer  eager {ge_us:6.1f} us "
                  f"{row['eager_gbs']:5.0f} GB/s | graph {gg_us:6.1f} us {row['graph_gbs']:5.0f} "
                  f"GB/s = {row['graph_over_copy']:.2f} of copy, {row['graph_over_saxpy']:.2f} of "
                  f"saxpy | gate_up {cg} {gu[cg]:5.1f} us {row['gate_up_gbs']:5.0f} GB/s,"
                  f" down {cd} {dn[cd]:5.1f} us {row['down_gbs']:5.0f} GB/s "
                  f"({time.time() - t0:.0f}s)", flush=True)
            print("   sweep gate_up " + " ".join(f"{k}:{v:.1f}" for k, v in row["sweep_gate_up_us"].items())
                  + " | down " + " ".join(f"{k}:{v:.1f}" for k, v in row["sweep_down_us"].items()),
                  flush=True)
            del s
    res["experts"] = rows
    d = DenseLayerSetup()
    res["dense_layer_eager_us"] = d.layer_us(False)
    res["dense_layer_graph_us"] = d.layer_us(True)
    res["dense_layer_nodes"] = d.graph.nodes
    res["dense_layer_breakdown_us"] = d.breakdown_us()
    print("  per op (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res["dense_layer_breakdown_us"].items()))
    res["lm_head_gbs"] = linear_gbs(151936, 2048)
    print(f"lm_head bf16 151936 x 2048 matvec: {res['lm_head_gbs']:.0f} GB/s = "
          f"{res['lm_head_gbs'] / res['copy_gbs']:.2f} of copy")
    print(f"Qwen3-30B-A3B decoder layer (T=1, pos 2047, bf16 dense, nvfp4 top-8): eager "
          f"{res['dense_layer_eager_us']:.1f} us, graph {res['dense_layer_graph_us']:.1f} us "
          f"({d.graph.nodes} nodes)", flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None,
         sys.argv[2].split(",") if len(sys.argv) > 2 else None)
