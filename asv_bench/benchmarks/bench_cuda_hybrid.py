"""One Gated DeltaNet layer of Qwen3-Next-80B-A3B on the GPU, decode (T = 1), next to the HBM
bandwidth measured in the same run; and the gated delta rule over a prefill chunk, the token scan
against the chunked kernel (DeltaRulePrefill: where the decoder's switch, CH_MIN_T, belongs).

The layer as engine/gpu_hybrid.py runs it: RMSNorm, the fused [q | k | v | z] projection
(bf16 [12288, 2048]), the [b | a] projection (bf16 [64, 2048]), causal conv1d + SiLU (rolling
state), the gated delta rule with its gates folded in (fp32 state [32, 128, 128] read and written
in place), gated RMSNorm, out projection (bf16 [2048, 4096]), residual. Eager (one Python launch
per kernel) vs one captured CUDA graph, microseconds, and each op alone (a graph of REPS copies).
The bound: bytes the layer must move (weights + state read and write) / device-to-device copy
bandwidth.

Without a GPU every setup raises NotImplementedError (asv marks the benchmark skipped).
Run directly on a GPU machine: python asv_bench/benchmarks/bench_cuda_hybrid.py [out.json]
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

H, NK, NV, DK, DV, KC = 2048, 16, 32, 128, 128, 4     # Qwen3-Next-80B-A3B
REPS = 20


def _need_gpu():
    from numba import config, cuda
    if config.ENABLE_CUDASIM or not cuda.is_available():
        raise NotImplementedError("needs a CUDA GPU")


def _time_us(stream, fn, reps=REPS):
    from engine.bandwidth import time_ms
    return time_ms(stream, fn, reps) * 1e3


class DeltaNetLayerSetup:
    """Device buffers and weights of one DeltaNet layer at decode; ops() lists its launches."""

    def __init__(self):
        from numba import cuda

        from engine.graphs import capture_fn
        rng = np.random.default_rng(1)

        def bf16(*shape):
            return cuda.to_device((rng.integers(0, 1 << 16, size=shape, dtype=np.uint32)
                                   & 0xBCFF).astype(np.uint16))   # finite, |w| < 1

        def f32(*shape, scale=1.0):
            return cuda.to_device((rng.standard_normal(shape) * scale).astype(np.float32))
        kd, vd = NK * DK, NV * DV
        self.c = 2 * kd + vd
        self.w_qkvz = bf16(self.c + vd, H)
        self.w_ba = bf16(2 * NV, H)
        self.w_out = bf16(H, vd)
        self.norm = f32(H)
        self.conv_w = f32(self.c, KC, scale=0.5)
        self.neg_a = cuda.to_device(-np.exp(rng.uniform(0, 2.7, NV)).astype(np.float32))
        self.dt_bias = f32(NV)
        self.dn_norm = f32(DV)
        self.conv_state = f32(KC - 1, self.c)
        self.ssm = f32(NV, DK, DV, scale=0.01)
        self.x = f32(1, H)
        self.h = cuda.device_array((1, H), np.float32)
        self.qkvz = cuda.device_array((1, self.c + vd), np.float32)
        self.ba = cuda.device_array((1, 2 * NV), np.float32)
        self.beta = cuda.device_array((1, NV), np.float32)
        self.g = cuda.device_array((1, NV), np.float32)
        self.o = cuda.device_array((1, vd), np.float32)
        self.y = cuda.device_array((1, H), np.float32)
        self.stream = cuda.stream()
        self._ops = self.ops()
        self.graph = capture_fn(self.run_eager, self.stream)

    def bytes_moved(self) -> int:
        """Weights read once, conv and recurrent state read and written."""
        w = sum(a.size * 2 for a in (self.w_qkvz, self.w_ba, self.w_out))
        return w + 2 * 4 * (self.ssm.size + self.conv_state.size)

    def ops(self):
        """[(name, fn(stream))] of one DeltaNet layer at decode, in order."""
        from kernels_numba import gpu_deltanet as gdn
        from kernels_numba import gpu_dense as gd
        qkv, z = self.qkvz[:, :self.c], self.qkvz[:, self.c:]
        return [
            ("rmsnorm", lambda st: gd.rmsnorm(self.x, self.norm, 1e-6, self.h, st)),
            ("qkvz_proj", lambda st: gd.linear(self.w_qkvz, self.h, self.qkvz, st)),
            ("ba_proj", lambda st: gd.linear(self.w_ba, self.h, self.ba, st)),
            ("conv1d_silu", lambda st: gdn.conv1d_silu(qkv, self.conv_w, self.conv_state, qkv, st)),
            ("delta_rule", lambda st: gdn.delta_rule(qkv, self.ba, self.neg_a, self.dt_bias, NK,
                                                     self.ssm, self.o, st)),
            ("rmsnorm_gated", lambda st: gdn.rmsnorm_gated(self.o, z, self.dn_norm, 1e-6, self.o, st)),
            ("out_proj", lambda st: gd.linear(self.w_out, self.o, self.y, st)),
            ("residual", lambda st: gd.add(self.x.reshape(H), self.y.reshape(H), self.x.reshape(H), st)),
        ]

    def run_eager(self, stream=None):
        st = stream or self.stream
        for _, fn in self._ops:
            fn(st)

    def breakdown_us(self, reps=8):
        """Each op alone, as a graph of `reps` copies of it: microseconds per op (the gates
        kernel too, for scale, though the layer folds it into the delta rule)."""
        from engine.graphs import capture_fn
        from kernels_numba import gpu_deltanet as gdn
        extra = [("gates (folded)", lambda st: gdn.gates(self.ba[:, :NV], self.ba[:, NV:], self.neg_a,
                                                         self.dt_bias, self.beta, self.g, st))]
        out = {}
        for name, fn in self._ops + extra:
            g = capture_fn(lambda st, fn=fn: [fn(st) for _ in range(reps)], self.stream)
            out[name] = _time_us(self.stream, lambda: g.launch(self.stream), 5) / reps
            g.destroy()
        return out

    def layer_us(self, graph: bool) -> float:
        fn = (lambda: self.graph.launch(self.stream)) if graph else self.run_eager
        return _time_us(self.stream, fn)


class DeltaRuleSetup:
    """Inputs of the gated delta rule over T prefill tokens at Qwen3-Next-80B shapes: the conv
    output [T, C] (a column slice of the [T, C + Nv Dv] projection buffer, as the decoder passes
    it), gate inputs [T, 2 Nv], state [Nv, Dk, Dv] (updated by every call), out [T, Nv Dv]."""

    def __init__(self, t: int):
        from numba import cuda
        rng = np.random.default_rng(2)
        c = 2 * NK * DK + NV * DV
        self.qkvz = cuda.to_device(rng.standard_normal((t, c + NV * DV)).astype(np.float32))
        self.qkv = self.qkvz[:, :c]
        self.ba = cuda.to_device(rng.standard_normal((t, 2 * NV)).astype(np.float32))
        self.neg_a = cuda.to_device(-np.exp(rng.uniform(0, 2.7, NV)).astype(np.float32))
        self.dt_bias = cuda.to_device(rng.standard_normal(NV).astype(np.float32))
        self.ssm = cuda.to_device((rng.standard_normal((NV, DK, DV)) * 0.01).astype(np.float32))
        self.o = cuda.device_array((t, NV * DV), np.float32)
        self.stream = cuda.stream()

    def us(self, kernel: str) -> float:
        from kernels_numba import gpu_deltanet as gdn
        rule = gdn.delta_rule_chunked if kernel == "chunked" else gdn.delta_rule
        return _time_us(self.stream, lambda: rule(self.qkv, self.ba, self.neg_a, self.dt_bias, NK,
                                                  self.ssm, self.o, self.stream), reps=5)


PREFILL_T = [16, 64, 256, 1024, 2048]


# ---- asv suite --------------------------------------------------------------------------------

class DeltaNetLayer:
    timeout = 300

    def setup(self):
        _need_gpu()
        self.s = DeltaNetLayerSetup()

    def track_graph_us(self):
        return self.s.layer_us(True)
    track_graph_us.unit = "us"

    def track_eager_us(self):
        return self.s.layer_us(False)
    track_eager_us.unit = "us"


class DeltaRulePrefill:
    """The delta rule over T prefill tokens, one DeltaNet layer: token scan vs chunked, us."""
    params = (PREFILL_T, ["scan", "chunked"])
    param_names = ["t", "kernel"]
    timeout = 300

    def setup(self, t, kernel):
        _need_gpu()
        self.s = DeltaRuleSetup(t)

    def track_us(self, t, kernel):
        return self.s.us(kernel)
    track_us.unit = "us"


def main(out_path=None):
    _need_gpu()
    from engine.bandwidth import hbm_gbps
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "shape": dict(hidden=H, nk=NK, nv=NV, dk=DK, dv=DV, conv=KC)}
    res["copy_gbs"] = hbm_gbps()
    s = DeltaNetLayerSetup()
    res["bytes_per_layer"] = b = s.bytes_moved()
    res["eager_us"] = s.layer_us(False)
    res["graph_us"] = s.layer_us(True)
    res["graph_nodes"] = s.graph.nodes
    res["bound_us"] = b / (res["copy_gbs"] * 1e3)
    res["graph_over_bound"] = res["bound_us"] / res["graph_us"]
    res["breakdown_us"] = s.breakdown_us()
    print(f"HBM d2d copy {res['copy_gbs']:.0f} GB/s", flush=True)
    print(f"Qwen3-Next-80B DeltaNet layer (T=1, bf16 weights, fp32 state): eager {res['eager_us']:.1f} us, "
          f"graph {res['graph_us']:.1f} us ({s.graph.nodes} nodes) | {b / 1e6:.1f} MB moved -> bound "
          f"{res['bound_us']:.1f} us at copy bandwidth | bound/graph {res['graph_over_bound']:.2f}", flush=True)
    print("  per op (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res["breakdown_us"].items()), flush=True)
    res["prefill_delta_rule_us"] = {}
    for t in PREFILL_T:
        d = DeltaRuleSetup(t)
        res["prefill_delta_rule_us"][t] = r = {k: d.us(k) for k in ("scan", "chunked")}
        print(f"  delta rule, prefill T={t}: scan {r['scan']:.1f} us, chunked {r['chunked']:.1f} us "
              f"({r['scan'] / r['chunked']:.2f}x)", flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
