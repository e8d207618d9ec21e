"""The CUDA decoder of DBRX (dbrx): GpuDecoder with LayerNorms, Wqkv and p-normed routing. Same
math as engine/models/dbrx.py (the CPU backend).

What changes against GpuDecoder:
- every norm a LayerNorm without bias (gd.layernorm); so no RMSNorm is fused into the q | k | v
  or router matvecs: the normed rows go through b.h;
- q, k, v are the row ranges of the checkpoint's one Wqkv (DbrxWeights), which is the fused
  [Hq D + 2 Hkv D, H] matrix GpuDecoder uploads as "qkv" (its clamp, clip_qkv, the base's);
- routing: gs.router_topk with the top-k weights over their p-norm (norm_p 0, 1 or 2).
"""
from __future__ import annotations

import numpy as np

from engine.gpu import GpuDecoder, pick_prefill_chunk, run_state_bytes  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_sampling as gs


class DbrxWeights:
    """weight(key, layer) -> host array: the checkpoint's, q / k / v as row ranges of Wqkv."""

    def __init__(self, c, weight):
        self.raw = weight
        self.rows = {"q": (0, c.q_dim), "k": (c.q_dim, c.q_dim + c.kv_dim),
                     "v": (c.q_dim + c.kv_dim, c.q_dim + 2 * c.kv_dim)}

    def __call__(self, key: str, layer: int | None = None, *rest) -> np.ndarray:
        if key in self.rows:
            r0, r1 = self.rows[key]
            return np.asarray(self.raw("qkv", layer))[r0:r1]
        return self.raw(key, layer, *rest)


class GpuDbrxDecoder(GpuDecoder):
    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, DbrxWeights(c, weight), *args, **kw)

    @staticmethod
    def dense_keys(c) -> list:
        return _base_dense_keys(c, attn=("qkv", "o"))

    def _norm(self, x, w, out):
        gd.layernorm(x, w, self.c.rms_eps, out, self.cs)

    def _qkv(self, l, b, t, fuse_norm: bool = True):
        return super()._qkv(l, b, t, fuse_norm=False)

    def _norm_router(self, l, b, t):
        self._linear(self.w("router", l), self._mlp_in(l, b, t), b.rl[:t])

    def _topk(self, l, rl, ids, w, slots=None):
        gs.router_topk(rl, self.c.norm_p, ids, w, self.cs, slots=slots)
