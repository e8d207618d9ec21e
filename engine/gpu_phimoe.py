"""The CUDA decoder of Phi-3.5-MoE (phimoe): GpuDecoder with LayerNorms and biases. Same math as
engine/models/phimoe.py (the CPU backend).

What changes against GpuDecoder:
- every norm a LayerNorm with bias: a norm's weight and bias go up as one [2, H] array
  (PhimoeWeights), gd.layernorm then the bias added (gm.add_rows); so no RMSNorm is fused into
  the q | k | v or router matvecs: the normed rows go through b.h;
- o_proj's bias added after the attention's add into x; lm_head's bias after the logits;
- routing: gs.router_sparsemixer (top-2), with the slot table where the decode asks for it.
q / k / v biases, the sliding window and longrope (its frequencies and cos / sin scale) are the
base decoder's.
"""
from __future__ import annotations

import numpy as np

from engine.gpu import GpuDecoder, as_f32, pick_prefill_chunk, run_state_bytes  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm
from kernels_numba import gpu_sampling as gs

_NORMS = ("attn_norm", "mlp_norm", "final_norm")


class PhimoeWeights:
    """weight(key, layer) -> host array: the checkpoint's, a norm as its weight and bias [2, H]."""

    def __init__(self, weight):
        self.raw = weight

    def __call__(self, key: str, layer: int | None = None, *rest) -> np.ndarray:
        a = self.raw(key, layer, *rest)
        if key in _NORMS:
            return np.stack([as_f32(a), as_f32(self.raw(key + "_bias", layer))])
        return a


class GpuPhimoeDecoder(GpuDecoder):
    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, PhimoeWeights(weight), *args, **kw)

    @staticmethod
    def dense_keys(c) -> list:
        keys = _base_dense_keys(c, extra_per_layer=("o_bias",) if c.attention_bias else ())
        return keys + ([("lm_head_bias", None)] if c.lm_head_bias else [])

    def _norm(self, x, w, out):
        """out = LayerNorm(x) * w[0] + w[1]."""
        gd.layernorm(x, w[0], self.c.rms_eps, out, self.cs)
        gm.add_rows(out, w[1], self.cs)

    def _qkv(self, l, b, t, fuse_norm: bool = True):
        return super()._qkv(l, b, t, fuse_norm=False)

    def _attention(self, l, b, t, st):
        super()._attention(l, b, t, st)
        if self.c.attention_bias:
            gm.add_rows(b.x[:t], self.w("o_bias", l), self.cs)

    def _norm_router(self, l, b, t):
        self._linear(self.w("router", l), self._mlp_in(l, b, t), b.rl[:t])

    def _topk(self, l, rl, ids, w, slots=None):
        gs.router_sparsemixer(rl, self.c.jitter_eps, ids, w, self.cs, slots=slots)

    def _lm_head(self, h, logits) -> None:
        super()._lm_head(h, logits)
        if self.c.lm_head_bias:
            gm.add_rows(logits, self.w("lm_head_bias"), self.cs)
