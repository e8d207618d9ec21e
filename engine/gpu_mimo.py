"""The CUDA decoder of MiMo-V2-Flash (mimo_v2_flash): GpuDecoder with its attention. Same math
as engine/models/mimo_v2_flash.py (the CPU backend).

What changes against GpuDecoder:
- weights: a full layer's K and V rows come repeated to the sliding layers' KV heads and V
  zero-padded to head_dim (mimo_v2_flash.dense_view, at load for both backends; q | k | v fused
  from them): one cache and one attention kernel for both layer kinds.
- attention a layer (GpuDecoder._attend through its hooks): its RoPE table (a theta a layer
  kind: _rotate_store), its window, the sliding layers' sinks (_sinks); then each head's first
  v_head_dim values times attention_value_scale (gm.head_prefix, into b.q, free by then) go to
  o_proj.
- DeepSeek-V3's routing without shared experts and the dense first layer are the base decoder's.
Legend: T = tokens, D = head_dim, Dv = v_head_dim, Hq / Hkv = query / KV heads.
"""
from __future__ import annotations

from numba import cuda

from engine.gpu import GpuDecoder, pick_prefill_chunk, run_state_bytes  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm


class GpuMimoDecoder(GpuDecoder):
    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, weight, *args, **kw)
        self.freqs = [cuda.to_device(r.inv_freq()) for r in c.layer_ropes]

    @staticmethod
    def dense_keys(c) -> list:
        return _base_dense_keys(c, extra_per_layer=lambda l: ("sinks",) if l in c.sink_layers else ())

    def _rotate_store(self, l, q3, k3, v3, pos, st):
        """RoPE by the layer kind's table (its theta), then the cache store."""
        f, r, cs = self.freqs[l], self.c.layer_ropes[l], self.cs
        gd.rope(q3, pos, f, cs, r.attention_factor)
        gd.rope(k3, pos, f, cs, r.attention_factor)
        gm.kv_store(k3, v3, st.k[l], st.v[l], pos, cs)

    def _sinks(self, l):
        return self.w("sinks", l) if l in self.c.sink_layers else None

    def _attend(self, l, b, t, st):
        """The base's attention, then each head's first v_head_dim values times v_scale (into
        b.q, free by then): o_proj's input [T, Hq Dv]."""
        c = self.c
        att3 = super()._attend(l, b, t, st).reshape(t, c.n_heads, c.head_dim)
        out = b.q.reshape(-1)[:t * c.n_heads * c.v_head_dim].reshape(t, c.n_heads * c.v_head_dim)
        gm.head_prefix(att3, c.v_head_dim, c.v_scale, out, self.cs)
        return out
