"""The CUDA decoder of AFMoE (Arcee Trinity; afmoe): GpuDecoder with sandwich norms. Same math as
engine/models/afmoe.py (the CPU backend).

What changes against GpuDecoder:
- the embeddings times sqrt(hidden) (mup: gm.scale after the gather);
- attention: attn_norm(x) kept in b.h (the gate reads it), q / k / v from it, the base's
  per-head norms, RoPE (none in full layers) and windows; the heads' output times
  sigmoid(h @ attn_gate^T) (gdn.sigmoid_gate, elementwise), o_proj into b.o, post_attn_norm,
  then added into x;
- MLPs: a dense layer's output normed (post_mlp_norm) before its add; a MoE layer's experts and
  shared experts add into b.mo (zeroed with the router: _moe_target), normed and added into x
  after the experts (_moe_finish), in the eager, the graphed and the prefill paths alike.
Legend: T = tokens, H = hidden, Hq D = the heads' width.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import Buffers, GpuDecoder, pick_prefill_chunk  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from engine.gpu import run_state_bytes as _base_run_state_bytes
from kernels_numba import gpu_deltanet as gdn
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm


def run_state_bytes(c, t: int, max_context: int) -> int:
    """GpuDecoder's activations for t tokens plus the gate and the MoE output (AfmoeBuffers)."""
    return _base_run_state_bytes(c, t, max_context) + 4 * t * (c.q_dim + c.hidden)


class AfmoeBuffers(Buffers):
    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        self.gate = cuda.device_array((t, c.q_dim), np.float32)    # [T, Hq D]
        self.mo = cuda.device_array((t, c.hidden), np.float32)     # a MoE layer's output [T, H]


class GpuAfmoeDecoder(GpuDecoder):
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

    def _attention(self, l, b, t, st):
        att = self._attend(l, b, t, st)
        gate = b.gate[:t]
        self._linear(self.w("attn_gate", l), b.h[:t], gate)
        gdn.sigmoid_gate(att, gate, self.cs)   # as many gate columns as att's: elementwise
        self._linear(self.w("o", l), att, b.o[:t])
        self._norm_add(b.o[:t], self.w("post_attn_norm", l), b.x[:t])

    def _dense_mlp(self, l, b, t):
        x = b.x[:t]
        h = self._mlp_in(l, b, t)
        g = self._swiglu_in(self.w("mlp_gate", l), self.w("mlp_up", l), h, b.g[:t], b.u[:t])
        self._linear(self.w("mlp_down", l), g, b.o[:t])
        self._norm_add(b.o[:t], self.w("post_mlp_norm", l), x)

    def _norm_add(self, y, w, x) -> None:
        """x += rmsnorm(y) * w (y normed in place)."""
        self._norm(y, w, y)
        gd.add(x.reshape(-1), y.reshape(-1), x.reshape(-1), self.cs)

    def _norm_router(self, l, b, t):
        super()._norm_router(l, b, t)
        gm.zero(b.mo[:t].reshape(-1), self.cs)

    def _moe_target(self, b, t):
        return b.mo[:t]

    def _moe_finish(self, l, b, t) -> None:
        self._norm_add(b.mo[:t], self.w("post_mlp_norm", l), b.x[:t])
