"""The CUDA decoder of FlexOlmo (flex_olmo): GpuDecoder with OLMo-2's norm placement. Same math as
engine/models/flex_olmo.py (the CPU backend).

What changes against GpuDecoder:
- nothing is normed before attention or the MLP, so the buffers' "normed input" b.h is the
  residual stream b.x itself (no copy: q / k / v, the router and the experts read x);
- attention's o_proj goes into b.o, is normed (post_attn_norm) and added into x;
- a MoE layer's experts add into b.mo (zeroed with the router: _moe_target), normed
  (post_mlp_norm) and added into x after the experts (_moe_finish), in the eager, graphed and
  prefill paths alike; a dense layer's output the same way.
Legend: T = tokens, H = hidden.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import Buffers, GpuDecoder, pick_prefill_chunk  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from engine.gpu import run_state_bytes as _base_run_state_bytes
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm


def run_state_bytes(c, t: int, max_context: int) -> int:
    """GpuDecoder's activations for t tokens plus the MoE output (FlexOlmoBuffers)."""
    return _base_run_state_bytes(c, t, max_context) + 4 * t * c.hidden


class FlexOlmoBuffers(Buffers):
    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        self.h = self.x                                            # the layers' input is x, unnormed
        self.mo = cuda.device_array((t, c.hidden), np.float32)     # a MoE layer's output [T, H]


class GpuFlexOlmoDecoder(GpuDecoder):
    buffers_cls = FlexOlmoBuffers

    @staticmethod
    def dense_keys(c) -> list:
        keys = _base_dense_keys(c, extra_per_layer=("post_attn_norm", "post_mlp_norm"))
        return [k for k in keys if k[0] not in ("attn_norm", "mlp_norm")]   # nothing normed before

    def _qkv(self, l, b, t, fuse_norm: bool = True):
        c, x = self.c, b.x[:t]
        if t == 1 and self.fuse_qkv:   # q, k, v of one token are consecutive ranges of b.qkv
            gd.linear(self.w("qkv", l), x, b.qkv.reshape(1, -1), self.cs)
            return (b.qkv[:c.q_dim].reshape(1, c.q_dim),
                    b.qkv[c.q_dim:c.q_dim + c.kv_dim].reshape(1, c.kv_dim),
                    b.qkv[c.q_dim + c.kv_dim:].reshape(1, c.kv_dim))
        q, k, v = b.q[:t], b.k[:t], b.v[:t]
        for key, y in (("q", q), ("k", k), ("v", v)):
            self._linear(self.w(key, l), x, y)
        return q, k, v

    def _attention(self, l, b, t, st):
        self._linear(self.w("o", l), self._attend(l, b, t, st), b.o[:t])
        self._norm_add(b.o[:t], self.w("post_attn_norm", l), b.x[:t])

    def _mlp_in(self, l, b, t):
        return b.x[:t]

    def _dense_mlp(self, l, b, t):
        x = b.x[:t]
        g = self._swiglu_in(self.w("mlp_gate", l), self.w("mlp_up", l), x, b.g[:t], b.u[:t])
        self._linear(self.w("mlp_down", l), g, b.o[:t])
        self._norm_add(b.o[:t], self.w("post_mlp_norm", l), x)

    def _norm_add(self, y, w, x) -> None:
        """x += rmsnorm(y) * w (y normed in place)."""
        self._norm(y, w, y)
        gd.add(x.reshape(-1), y.reshape(-1), x.reshape(-1), self.cs)

    def _norm_router(self, l, b, t):
        self._linear(self.w("router", l), b.x[:t], b.rl[:t])
        gm.zero(b.mo[:t].reshape(-1), self.cs)

    def _moe_target(self, b, t):
        return b.mo[:t]

    def _moe_finish(self, l, b, t) -> None:
        self._norm_add(b.mo[:t], self.w("post_mlp_norm", l), b.x[:t])
