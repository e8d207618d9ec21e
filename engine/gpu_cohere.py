"""The CUDA decoder of Cohere's MoE (cohere2_moe: Command A+): GpuDecoder with a parallel
residual. Same math as engine/models/cohere2_moe.py (the CPU backend).

What changes against GpuDecoder:
- one norm a layer (input_layernorm: a LayerNorm without bias, gd.layernorm, or an RMSNorm);
  its output h stays in b.h, the attention and the MLP both read it and both add into x
  (x + attention(h) + mlp(h)); the final norm the same kind.
- routing: gs.router_sigmoid_topk over one group without a selection bias: softmax scores
  renormalized (the softmax of the top-k logits) or sigmoid scores (renormalized when
  norm_topk_prob); times 1/2 where shared experts are averaged with the routed output, whose
  down projection is halved once at upload (CohereWeights) for the other half.
- logit_scale folded into the final norm's weight at upload (head(norm(x) * w * s)).
- RoPE over interleaved pairs (rope.pair_rows at upload) and the full layers without RoPE
  (no_freq) are the base decoder's.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import GpuDecoder, as_f32, pick_prefill_chunk, run_state_bytes  # noqa: F401
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_sampling as gs


def _halved(a) -> np.ndarray:
    """a / 2, bf16 bits kept bf16 (exact: the exponent drops by one)."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return ((as_f32(a) * np.float32(0.5)).view(np.uint32) >> 16).astype(np.uint16)
    return a * a.dtype.type(0.5)


def _averaged(c) -> bool:
    return bool(c.shared_intermediate) and c.average_shared


class CohereWeights:
    """weight(key, layer) -> host array: the checkpoint's, with logit_scale in the final norm
    and the shared experts' down projection halved where they are averaged."""

    def __init__(self, c, weight):
        self.c, self.raw = c, weight

    def __call__(self, key: str, layer: int | None = None, *rest) -> np.ndarray:
        a = self.raw(key, layer, *rest)
        if key == "final_norm":
            return as_f32(a) * np.float32(self.c.logit_scale)
        if key == "shared_down" and _averaged(self.c):
            return _halved(a)
        return a


class GpuCohereDecoder(GpuDecoder):
    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, CohereWeights(c, weight), *args, **kw)
        # sigmoid routing's kernel chooses on score + bias: a zero bias
        self.no_bias = cuda.to_device(np.zeros(c.n_experts, np.float32)) if c.sigmoid_router else None

    def _norm(self, x, w, out):
        if self.c.layer_norm:
            gd.layernorm(x, w, self.c.rms_eps, out, self.cs)
        else:
            super()._norm(x, w, out)

    def _qkv(self, l, b, t, fuse_norm: bool = True):
        return super()._qkv(l, b, t, fuse_norm=False)   # the normed row kept in b.h for the MLP

    def _mlp_in(self, l, b, t):
        return b.h[:t]   # the parallel residual: the attention's input

    def _norm_router(self, l, b, t):
        self._linear(self.w("router", l), b.h[:t], b.rl[:t])

    def _topk(self, l, rl, ids, w, slots=None):
        c = self.c
        gs.router_sigmoid_topk(rl, self.no_bias, 1, 1, c.norm_topk_prob or not c.sigmoid_router,
                               0.5 if _averaged(c) else 1.0, ids, w, self.cs, slots=slots,
                               softmax=not c.sigmoid_router)
