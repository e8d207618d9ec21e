"""The CUDA decoder of IBM Granite 4.0 hybrid (granitemoehybrid): Mamba-2 layers beside attention
layers, each followed by Granite MoE's experts and shared MLP (or the shared MLP alone: -h-micro,
num_local_experts 0). Same math as engine/models/granitemoehybrid.py (the CPU backend).

What it is made of, and why the decode step (graphs, streaming) stays GpuDecoder's:
- RecurrentDecoder (engine/gpu_hybrid.py): the run state GpuHybridState, KV cache for the
  attention layers only, a conv state [Ll, Kc-1, C] and a scan state [Ll, Hm, P, N] float32 for
  the Mamba layers, zeroed per request, saved with the KV rows for the prefix cache, and put back
  around graph capture (its warm-up runs every segment for real).
- MambaDecoder here (engine/gpu_nemotron_h.py's too): the Mamba-2 mixer (kernels_numba/
  gpu_mamba.py), x += out_proj(norm(y, z)): in_proj of attn_norm(x) (one launch with the norm
  fused at decode) -> z | xBC | dt column ranges of one buffer; the causal conv with bias and SiLU in place on xBC; the selective scan
  into y; the gated group norm in place; out_proj adding into x. Its derived weights are made
  once at upload (MambaWeights: float32 conv taps [C, Kc] and bias, -exp(A_log), dt_bias, D, the
  norm's weight). Nothing allocated, no host sync: the step is graph-captured as it is.
- GpuGraniteMoeDecoder (engine/gpu_granitemoe.py): Granite's multipliers (embedding, attention
  scale, residual on the attention, the routed experts and the shared expert, logits), its
  attention (RoPE, or NoPE layers through the base's zero angles; q / k / v / o biases) and its
  softmax top-k experts. The residual multiplier on a Mamba layer's output is folded into the
  gated norm's weight (out_proj(r y) = r out_proj(y)): one float32 rounding, no launch.
- num_local_experts 0: every layer's MLP is the shared MLP, x += r shared(mlp_norm(x)) through
  GpuDecoder._shared_expert (no routed experts, so nothing streams).
Legend: T = tokens, H = hidden, Hm = Mamba heads, P = their head dim, I = Hm P, G = B / C groups,
N = state size, C = conv channels (I + 2 G N), Kc = conv width.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import Buffers, as_f32
from engine.gpu import pick_prefill_chunk as _base_pick_prefill_chunk
from engine.gpu import run_state_bytes as _base_run_state_bytes
from engine.gpu_granitemoe import GpuGraniteMoeDecoder
from engine.gpu_hybrid import RecurrentDecoder, state_bytes  # noqa: F401
from engine.models.hybrid import LINEAR
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_mamba as gmb

# a Mamba layer's weights on the device (MambaWeights' keys)
MAMBA_KEYS = ("m_in", "m_conv", "m_conv_bias", "m_neg_a", "m_dt_bias", "m_D", "m_norm", "m_out")


class MambaWeights:
    """weight(key, layer) -> host array: the Mamba-2 mixer's derived weights in float32 (conv
    taps [C, Kc]; the conv bias, zeros where the conv has none; -exp(A_log); dt_bias; D; the gated
    norm's weight times norm_scale); any other key the wrapped weight's."""

    def __init__(self, c, weight, norm_scale: float = 1.0):
        self.c, self.raw, self.norm_scale = c, weight, np.float32(norm_scale)

    def __call__(self, key: str, layer: int | None = None, *rest) -> np.ndarray:
        c, raw = self.c, self.raw
        if key == "m_conv":                                        # [C, Kc]
            return as_f32(raw(key, layer)).reshape(c.conv_dim, c.conv_kernel)
        if key == "m_conv_bias":                                   # [C]
            return as_f32(raw(key, layer)) if c.conv_bias else np.zeros(c.conv_dim, np.float32)
        if key == "m_neg_a":                                       # [Hm]
            return -np.exp(as_f32(raw("m_A_log", layer)))
        if key in ("m_dt_bias", "m_D"):                            # [Hm]
            return as_f32(raw(key, layer))
        if key == "m_norm":                                        # [I]
            return as_f32(raw(key, layer)) * self.norm_scale
        return raw(key, layer, *rest)


def run_state_bytes(c, t: int, max_context: int) -> int:
    """GpuDecoder's activations for t tokens plus the Mamba layers' (MambaBuffers)."""
    return _base_run_state_bytes(c, t, max_context) + 4 * t * (2 * c.mamba_inner + c.conv_dim + c.mamba_heads)


def pick_prefill_chunk(c, max_context: int, vram_bytes: float, share: float = 0.15) -> int:
    """The largest prefill chunk whose run state (with the Mamba buffers) fits a share of the VRAM."""
    return _base_pick_prefill_chunk(c, max_context, vram_bytes, share, run_state_bytes)


class MambaBuffers(Buffers):
    """GpuDecoder's activations plus the Mamba layers' (float32)."""

    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        f = np.float32
        if c.linear_layers:
            self.mp = cuda.device_array((t, c.mamba_inner + c.conv_dim + c.mamba_heads), f)   # z | xBC | dt
            self.my = cuda.device_array((t, c.mamba_inner), f)                                # the scan's y [T, I]


class MambaDecoder(RecurrentDecoder):
    """RecurrentDecoder whose linear layers are Mamba-2 mixers (_mamba), over MambaWeights' keys."""
    buffers_cls = MambaBuffers

    def _mamba(self, l, b, t, st):
        """x += out_proj(gated_norm(scan(conv(xBC)), z)), [z | xBC | dt] = in_proj(attn_norm(x));
        the conv and scan state of layer l's slot updated in place."""
        c, cs = self.c, self.cs
        inner, cd = c.mamba_inner, c.conv_dim
        x, p = b.x[:t], b.mp[:t]
        if t == 1:   # the norm fused into the projection's launch
            gd.linear(self.w("m_in", l), x, p, cs, norm=(self.w("attn_norm", l), c.rms_eps, 0.0, None))
        else:
            h = b.h[:t]
            self._norm(x, self.w("attn_norm", l), h)
            self._linear(self.w("m_in", l), h, p)
        z, xbc, dt = p[:, :inner], p[:, inner:inner + cd], p[:, inner + cd:]   # column views
        s, y = self.slot[l], b.my[:t]
        gmb.conv1d_silu(xbc, self.w("m_conv", l), self.w("m_conv_bias", l), st.conv[s], xbc, cs)
        gmb.scan(xbc, dt, self.w("m_neg_a", l), self.w("m_dt_bias", l), self.w("m_D", l), st.ssm[s], y, cs)
        gmb.rmsnorm_group_gated(y, z, self.w("m_norm", l), inner // c.n_groups, c.rms_eps, y, cs)
        self._linear_add(self.w("m_out", l), y, b.o[:t], x)


class GpuGraniteHybridDecoder(MambaDecoder, GpuGraniteMoeDecoder):
    def __init__(self, c, weight, *args, **kw):
        # GpuGraniteMoeDecoder wraps these in GraniteWeights (final_norm / logits_scaling,
        # o_bias * residual_multiplier); the Mamba output's residual_multiplier goes into m_norm
        super().__init__(c, MambaWeights(c, weight, c.residual_multiplier), *args, **kw)

    @staticmethod
    def dense_keys(c) -> list:
        """embed, final_norm, lm_head unless tied; per layer its two norms, its mixer's weights
        (MambaWeights' keys, or q / k / v / o and their biases), its router where it has
        experts, and the shared MLP."""
        keys = [("embed", None), ("final_norm", None)] + ([] if c.tie_embeddings else [("lm_head", None)])
        attn = ("q", "k", "v", "o") + (("q_bias", "k_bias", "v_bias", "o_bias") if c.attention_bias else ())
        for l, kind in enumerate(c.kinds):
            per = ("attn_norm", "mlp_norm") + (MAMBA_KEYS if kind == LINEAR else attn)
            per += (("router",) if l in c.moe_layers else ()) + ("shared_gate", "shared_up", "shared_down")
            keys += [(k, l) for k in per]
        return keys

    def _attention(self, l, b, t, st):
        if self.c.kinds[l] == LINEAR:
            self._mamba(l, b, t, st)
        else:
            super()._attention(l, b, t, st)

    def _sinks(self, l):
        return None

    def _dense_mlp(self, l, b, t):
        """A layer without experts (-h-micro): x += r shared(mlp_norm(x))."""
        self._mlp_in(l, b, t)
        self._shared_expert(l, b, t)
