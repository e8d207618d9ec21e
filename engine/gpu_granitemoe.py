"""The CUDA decoder of IBM Granite MoE (granitemoe, granitemoeshared, granitemoe_swa): GpuDecoder
with Granite's multipliers. Same math as engine/models/granitemoe.py (the CPU backend).

Where each multiplier goes (m = embedding_multiplier, s = attention_multiplier, r =
residual_multiplier, z = logits_scaling):
- m: the gathered rows scaled in place (gm.scale; the table is lm_head too when tied, so it is
  not folded into the weights);
- s: the attention's score scale (MoeConfig.qk_scale);
- r on the attention: the heads' output scaled before o_proj, whose matvec adds into x as the
  base's does (o_proj(r a) = r o_proj(a)); o_proj's bias times r at upload (GraniteWeights);
- r on the routed experts: folded into the routing weights (softmax over the top-k times r:
  gs.router_sigmoid_topk's softmax form with no bias, one group), which the experts' down
  kernels and the prefill's combine already multiply by, so no launch of its own;
- r on the shared expert: its down projection's input scaled (gm.scale) before it adds into x;
- z: final_norm's weight divided by z at upload (the logits are linear in it).
The two weights changed at upload (final_norm / z, o_bias * r) are float32 vectors on the
device either way (a bf16 vector is widened), so the fold costs one float32 rounding, packed or
not. granitemoe_swa: its sinks through GpuDecoder._sinks, its windows and NoPE layers the base's.
Legend: T = tokens, H = hidden, Hq D = the heads' width.
"""
from __future__ import annotations

import numpy as np

from engine.gpu import GpuDecoder, as_f32, pick_prefill_chunk, run_state_bytes  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from kernels_numba import gpu_misc as gm
from kernels_numba import gpu_sampling as gs


class GraniteWeights:
    """weight(key, layer) -> host array: the checkpoint's, final_norm divided by logits_scaling,
    o_bias times residual_multiplier (float32)."""

    def __init__(self, weight, c):
        self.raw, self.c = weight, c

    def __call__(self, key: str, layer: int | None = None, *rest) -> np.ndarray:
        a = self.raw(key, layer, *rest)
        if key == "final_norm":
            return as_f32(a) / np.float32(self.c.logits_scaling)
        if key == "o_bias":
            return as_f32(a) * np.float32(self.c.residual_multiplier)
        return a


class GpuGraniteMoeDecoder(GpuDecoder):
    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, GraniteWeights(weight, c), *args, **kw)

    @staticmethod
    def dense_keys(c) -> list:
        return _base_dense_keys(c, extra_per_layer=(("o_bias",) if c.attention_bias else ())
                                + (("sinks",) if c.sinks else ()))

    def _embed(self, tok, x) -> None:
        super()._embed(tok, x)
        if self.c.embedding_multiplier != 1.0:
            gm.scale(x.reshape(-1), self.c.embedding_multiplier, self.cs)

    def _attention(self, l, b, t, st):
        """x += o_proj(r a) (+ r o_bias), a the heads' output [T, Hq D]."""
        c, x = self.c, b.x[:t]
        att = self._attend(l, b, t, st)
        if c.residual_multiplier != 1.0:
            gm.scale(att.reshape(-1), c.residual_multiplier, self.cs)
        self._linear_add(self.w("o", l), att, b.o[:t], x)
        if c.attention_bias:
            gm.add_rows(x, self.w("o_bias", l), self.cs)

    def _sinks(self, l):
        return self.w("sinks", l) if self.c.sinks else None

    def _topk(self, l, rl, ids, w, slots=None):
        """Softmax over the top-k logits, times residual_multiplier."""
        c = self.c
        if c.residual_multiplier == 1.0:
            gs.router_topk(rl, True, ids, w, self.cs, slots=slots)
            return
        gs.router_sigmoid_topk(rl, None, 1, 1, True, c.residual_multiplier, ids, w, self.cs, slots=slots,
                               softmax=True)

    def _shared_out(self, l, b, t, g):
        """x += (r g) @ shared_down^T, g the shared expert's SwiGLU [T, I_s]."""
        if self.c.residual_multiplier != 1.0:
            gm.scale(g.reshape(-1), self.c.residual_multiplier, self.cs)
        super()._shared_out(l, b, t, g)
