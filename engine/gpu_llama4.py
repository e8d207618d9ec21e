"""The CUDA decoder of Llama 4 (llama4, llama4_text): GpuDecoder with Llama 4's attention. Same
math as engine/models/llama4.py (the CPU backend).

What changes against GpuDecoder:
- a RoPE layer normalizes q and k a head without a weight after rotating them (use_qk_norm):
  the rotation keeps a head's norm, so gd.qk_norm_rope (the norm, then the rotation, the cache
  store in the same launch) with weights of 1 gives the same rows.
- a NoPE layer scales its queries by position (gm.query_temperature: attn_temperature_tuning).
- chunked attention: a chunked layer's queries see the keys of their chunk of
  attention_chunk_size positions (ga.attention's window -attention_chunk_size).
- the routing (top-k logits, their sigmoids scaling the experts' inputs) is the base decoder's
  (routing "sigmoid_input": gx.expert_mlp_scaled, gx.scaled_swiglu), as is RoPE over
  interleaved pairs (rope.pair_rows at upload).
Legend: T = tokens, D = head dim, Hq / Hkv = query / KV heads.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import GpuDecoder, pick_prefill_chunk, run_state_bytes  # noqa: F401
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm


class GpuLlama4Decoder(GpuDecoder):
    def __init__(self, c, *args, **kw):
        super().__init__(c, *args, **kw)
        self.unit = cuda.to_device(np.ones(c.head_dim, np.float32))   # the weightless norms'

    def _window(self, l) -> int:
        return -self.c.chunk if l in self.c.chunked_layers else 0

    def _rotate_store(self, l, q3, k3, v3, pos, st):
        """A NoPE layer scales its queries by position and rotates nothing; a RoPE layer with
        use_qk_norm norms q and k a head without a weight, rotates and stores in one launch."""
        c, cs = self.c, self.cs
        if l in c.nope_layers:
            if c.temperature:
                gm.query_temperature(q3, pos, c.floor_scale, c.attn_scale, cs)
            gm.kv_store(k3, v3, st.k[l], st.v[l], pos, cs)
        elif c.qk_l2:   # the norm after the rotation cancels its attention factor: none
            gd.qk_norm_rope(q3, k3, self.unit, self.unit, c.rms_eps, pos, self.inv_freq, 1.0, cs,
                            cache=(v3, st.k[l], st.v[l]))
        else:
            super()._rotate_store(l, q3, k3, v3, pos, st)
