"""The CUDA decoder of MiniCPM5-MoE (minicpm5_moe): GpuDecoder with gated attention. Same math as
engine/models/minicpm5_moe.py (the CPU backend).

What changes against GpuDecoder:
- weights: q_proj's rows split once at upload into the heads' query rows ("q", fused with k and
  v as usual) and their gate rows ("attn_gate"; minicpm5_moe.split_query_gate);
- attention: attn_norm(x) kept in b.h, the gate projected from it, the heads' output times its
  sigmoid (gdn.sigmoid_gate, elementwise) before o_proj. Routing and the MLPs are the base's.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import Buffers, GpuDecoder, pick_prefill_chunk  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from engine.gpu import run_state_bytes as _base_run_state_bytes
from engine.models.minicpm5_moe import split_query_gate
from kernels_numba import gpu_deltanet as gdn


class MinicpmWeights:
    def __init__(self, c, weight):
        self.c, self.raw, self._done = c, weight, {}

    def __call__(self, key: str, layer: int | None = None, *rest):
        if key not in ("q", "attn_gate"):
            return self.raw(key, layer, *rest)
        if layer not in self._done:
            self._done[layer] = split_query_gate(self.c, self.raw("q", layer))
        return self._done[layer][key == "attn_gate"]


def run_state_bytes(c, t: int, max_context: int) -> int:
    return _base_run_state_bytes(c, t, max_context) + 4 * t * c.q_dim


class GatedBuffers(Buffers):
    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        self.gate = cuda.device_array((t, c.q_dim), np.float32)   # [T, Hq D]


class GpuMinicpmDecoder(GpuDecoder):
    buffers_cls = GatedBuffers

    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, MinicpmWeights(c, weight), *args, **kw)

    @staticmethod
    def dense_keys(c) -> list:
        return _base_dense_keys(c, extra_per_layer=("attn_gate",))   # q_proj's gate rows (MinicpmWeights)

    def _qkv(self, l, b, t, fuse_norm: bool = True):
        return super()._qkv(l, b, t, fuse_norm=False)   # h kept: the gate reads it

    def _attention(self, l, b, t, st):
        att = self._attend(l, b, t, st)
        gate = b.gate[:t]
        self._linear(self.w("attn_gate", l), b.h[:t], gate)
        gdn.sigmoid_gate(att, gate, self.cs)
        self._linear_add(self.w("o", l), att, b.o[:t], b.x[:t])
