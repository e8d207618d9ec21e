"""One Qwen3-30B-A3B decoder layer's kernels, each launched once, for Nsight Compute.

The kernels are compiled and run once first; then, between cuda.profile_start() and
profile_stop(), each op of bench_cuda.DenseLayerSetup (norms, q/k/v, attention at position
2047 of 4096 over an fp32 cache, o_proj, router, top-k, the NVFP4 experts' gate_up and down),
the attention again over a bf16 cache, and the load-only probe of tools/load_probe.py over the
gate + up bytes of one layer (its best shape: 256 threads, 8 blocks an SM, 8 x 16 bytes in
flight a thread), and the experts again as variant ALT (env NCU_ALT, default the two-launch
mma kernels the lean default stands in for). Run under ncu with --profile-from-start off (tools/gpu_ncu.sh does).

    ncu --profile-from-start off ... python3 tools/ncu_layer.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import os

import numpy as np

ALT = os.environ.get("NCU_ALT", "mma-g4-d4-p3-c")
ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "asv_bench" / "benchmarks", ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def main() -> int:
    from numba import cuda

    from bench_cuda import DenseLayerSetup
    from kernels_numba import gpu_attention as ga
    from load_probe import kernel as probe_kernel

    s = DenseLayerSetup()
    st = s.stream
    kb = cuda.to_device((np.random.default_rng(2).integers(0, 1 << 16, size=s.kc.shape,
                                                          dtype=np.uint32) & 0xBCFF).astype(np.uint16))
    vb = cuda.to_device((np.random.default_rng(3).integers(0, 1 << 16, size=s.vc.shape,
                                                          dtype=np.uint32) & 0xBCFF).astype(np.uint16))
    nbytes = int(s.experts.bytes_gate_up)
    rows = nbytes // 16
    buf = cuda.to_device(np.random.default_rng(4).integers(0, 1 << 62, size=(rows * 4, 2),
                                                           dtype=np.uint64))
    pout = cuda.device_array(1, np.uint64)
    probe = probe_kernel(8, True)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT

    ex = s.experts
    from kernels_numba import gpu_experts as ge

    def extra():
        ga.attention(s.q, kb, vb, s.pos, s.d ** -0.5, s.attn, s.parts, st)
        probe[8 * sms, 256, st](buf, np.int64(rows), np.int64(rows), pout)
        ge.expert_mlp("nvfp4", ex.views, ex.dlay, ex.lh, ex.slots[0], s.rw.reshape(-1),
                      s.xn.reshape(-1), ex.act, s.x.reshape(-1), st, accumulate=True,
                      variant=ALT)

    s.run_eager()
    extra()
    st.synchronize()
    names = [n for n, _ in s.ops()] + ["attention_bf16", "load_probe", f"experts ({ALT})"]
    print("profiled, in order:", ", ".join(names), flush=True)
    cuda.profile_start()
    s.run_eager()
    extra()
    st.synchronize()
    cuda.profile_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
