"""The CUDA decoder of MiMo-V2-Flash (mimo_v2_flash): GpuDecoder with its attention. Same math
as engine/models/mimo_v2_flash.py (the CPU backend).

What changes against GpuDecoder:
- weights: a full layer's K and V rows come repeated to the sliding layers' KV heads and V
  zero-padded to head_dim (mimo_v2_flash.dense_view, at load for both backends; q | k | v fused
  from them): one cache and one attention kernel for both layer kinds.
- attention a layer: its RoPE table (a theta a layer kind), its window, the sliding layers'
  sinks; then each head's first v_head_dim values times attention_value_scale
  (gm.head_prefix, into b.q, free by then) go to o_proj.
- DeepSeek-V3's routing without shared experts and the dense first layer are the base decoder's.
Legend: T = tokens, D = head_dim, Dv = v_head_dim, Hq / Hkv = query / KV heads.
"""
from __future__ import annotations

from numba import cuda

from engine.gpu import GpuDecoder, _partials, pick_prefill_chunk, run_state_bytes  # noqa: F401
from kernels_numba import gpu_attention as ga
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm


def dense_keys(c) -> list:
    """(key, layer) of every device weight the decoder reads."""
    keys = [("embed", None), ("final_norm", None)]
    if not c.tie_embeddings:
        keys.append(("lm_head", None))
    for l in range(c.n_layers):
        keys += [(k, l) for k in ("attn_norm", "mlp_norm", "q", "k", "v", "o")]
        keys += [("sinks", l)] if l in c.sink_layers else []
        keys += [(k, l) for k in (("router", "router_bias") if l in c.moe_layers else ("mlp_gate", "mlp_up", "mlp_down"))]
    return keys


class GpuMimoDecoder(GpuDecoder):
    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, weight, *args, **kw)
        self.freqs = [cuda.to_device(r.inv_freq()) for r in c.layer_ropes]

    def _attention(self, l, b, t, st):
        c, cs = self.c, self.cs
        x = b.x[:t]
        q, k, v = self._qkv(l, b, t)
        q3 = q.reshape(t, c.n_heads, c.head_dim)
        k3 = k.reshape(t, c.n_kv_heads, c.head_dim)
        v3 = v.reshape(t, c.n_kv_heads, c.head_dim)
        pos, r = b.pos[:t], c.layer_ropes[l]
        gd.rope(q3, pos, self.freqs[l], cs, r.attention_factor)
        gd.rope(k3, pos, self.freqs[l], cs, r.attention_factor)
        gm.kv_store(k3, v3, st.k[l], st.v[l], pos, cs)
        att3 = b.att[:t].reshape(t, c.n_heads, c.head_dim)
        ga.attention(q3, st.k[l], st.v[l], pos, c.head_dim ** -0.5, att3,
                     _partials(b.partials, t, c.n_heads), cs, c.layer_windows[l],
                     sinks=self.w("sinks", l) if l in c.sink_layers else None)
        out = b.q.reshape(-1)[:t * c.n_heads * c.v_head_dim].reshape(t, c.n_heads * c.v_head_dim)
        gm.head_prefix(att3, c.v_head_dim, c.v_scale, out, cs)
        self._linear_add(self.w("o", l), out, b.o[:t], x)
