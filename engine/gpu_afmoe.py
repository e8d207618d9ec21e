"""The CUDA decoder of AFMoE (Arcee Trinity; afmoe): PostNormDecoder (the attention's and MLPs'
outputs normed before their adds, MoE layers through their own buffer) with norms before them
too. Same math as engine/models/afmoe.py (the CPU backend).

What changes against PostNormDecoder:
- the embeddings times sqrt(hidden) (mup: gm.scale after the gather);
- attention: attn_norm(x) kept in b.h (the gate reads it), q / k / v from it, the base's
  per-head norms, RoPE (none in full layers) and windows; the heads' output times
  sigmoid(h @ attn_gate^T) (gdn.sigmoid_gate, elementwise) before o_proj.
Legend: T = tokens, H = hidden, Hq D = the heads' width.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import PostNormBuffers, PostNormDecoder, pick_prefill_chunk  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from engine.gpu import run_state_bytes as _base_run_state_bytes
from kernels_numba import gpu_deltanet as gdn
from kernels_numba import gpu_misc as gm


def run_state_bytes(c, t: int, max_context: int) -> int:
    """GpuDecoder's activations for t tokens plus the gate and the MoE output (AfmoeBuffers)."""
    return _base_run_state_bytes(c, t, max_context) + 4 * t * (c.q_dim + c.hidden)


class AfmoeBuffers(PostNormBuffers):
    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        self.gate = cuda.device_array((t, c.q_dim), np.float32)    # [T, Hq D]


class GpuAfmoeDecoder(PostNormDecoder):
    buffers_cls = AfmoeBuffers

    @staticmethod
    def dense_keys(c) -> list:
        return _base_dense_keys(c, extra_per_layer=("post_attn_norm", "post_mlp_norm", "attn_gate"))

    def _embed(self, tok, x) -> None:
        super()._embed(tok, x)
        if self.c.mup:
            gm.scale(x.reshape(-1), float(np.sqrt(self.c.hidden)), self.cs)

    def _qkv(self, l, b, t, fuse_norm: bool = True):
        return super()._qkv(l, b, t, fuse_norm=False)   # h kept: the gate reads it

    def _attend(self, l, b, t, st):
        """The heads' output times sigmoid(h @ attn_gate^T), elementwise."""
        att = super()._attend(l, b, t, st)
        gate = b.gate[:t]
        self._linear(self.w("attn_gate", l), b.h[:t], gate)
        gdn.sigmoid_gate(att, gate, self.cs)   # as many gate columns as att's: elementwise
        return att
