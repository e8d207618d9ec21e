"""The CUDA decoder of Nemotron-H (nemotron_h: NVIDIA-Nemotron-3-Nano-30B-A3B): a stack of
single-mixer blocks, x += mixer(norm(x)), the mixer a Mamba-2 layer, attention without RoPE, a
MoE layer or a dense MLP. Same math as engine/models/nemotron_h.py (the CPU backend).

GpuDecoder runs every layer as its attention, then its MoE or dense MLP; here a block's kind
picks one of them and the other does nothing:
- "M" (linear_attention): MambaDecoder._mamba (engine/gpu_granite_hybrid.py) on the run state
  of RecurrentDecoder (engine/gpu_hybrid.py): conv and scan state, KV cache of the "*" layers;
- "*" (full_attention): GpuDecoder's attention, NoPE (every layer in c.nope_layers), no biases;
- "E" (moe): GpuDecoder's MoE: the router (sigmoid scores chosen with the selection bias within
  groups, scaled: routing "sigmoid"), the ungated relu^2 experts (gpu_experts.expert_mlp_relu2 at
  decode, relu2_up between the tiled grouped kernels in prefill: the RAW gate_up kernels over a
  layout whose gate sections are the up sections), and the shared expert down(relu(up h)^2);
- "-" (mlp): down(relu(up h)^2).
The block's one norm ("norm") serves as attn_norm and mlp_norm (NemotronWeights), so the base's
fused norm launches read it. Nemotron-3-Super's latent experts (moe_latent_size) are refused
(runtime.cuda_lacks: --device auto runs them on the CPU).
Legend: T = tokens, H = hidden, Is = shared expert intermediate, Id = dense MLP intermediate.
"""
from __future__ import annotations

from engine.gpu_granite_hybrid import MAMBA_KEYS, MambaDecoder, MambaWeights
from engine.gpu_granite_hybrid import pick_prefill_chunk, run_state_bytes  # noqa: F401
from engine.gpu_hybrid import state_bytes  # noqa: F401
from engine.models.hybrid import FULL, LINEAR
from engine.models.nemotron_h import MLP, MOE
from kernels_numba import gpu_misc as gm


class NemotronWeights:
    """weight(key, layer) -> host array: attn_norm and mlp_norm are the block's one norm."""

    def __init__(self, weight):
        self.raw = weight

    def __call__(self, key: str, layer: int | None = None, *rest):
        if key in ("attn_norm", "mlp_norm"):
            key = "norm"
        return self.raw(key, layer, *rest)


class GpuNemotronHDecoder(MambaDecoder):
    def __init__(self, c, weight, *args, **kw):
        from engine.runtime import cuda_lacks
        if cuda_lacks(c):
            raise ValueError(f"{cuda_lacks(c)}; --device cpu runs it")
        super().__init__(c, MambaWeights(c, NemotronWeights(weight)), *args, **kw)

    @staticmethod
    def dense_keys(c) -> list:
        """embed, final_norm, lm_head (never tied); per block its norm (as attn_norm or mlp_norm)
        and its mixer's weights."""
        keys = [("embed", None), ("final_norm", None), ("lm_head", None)]
        for l, kind in enumerate(c.kinds):
            if kind == LINEAR:
                per = ("attn_norm",) + MAMBA_KEYS
            elif kind == FULL:
                per = ("attn_norm", "q", "k", "v", "o")
            elif kind == MOE:
                per = ("mlp_norm", "router", "router_bias") + (
                    ("shared_up", "shared_down") if c.shared_intermediate else ())
            else:
                per = ("mlp_norm", "mlp_up", "mlp_down")
            keys += [(k, l) for k in per]
        return keys

    def _attention(self, l, b, t, st):
        kind = self.c.kinds[l]
        if kind == LINEAR:
            self._mamba(l, b, t, st)
        elif kind == FULL:
            super()._attention(l, b, t, st)

    def _dense_mlp(self, l, b, t):
        """A "-" block: x += down(relu(up h)^2), h = norm(x); nothing in a mixer block."""
        if self.c.kinds[l] != MLP:
            return
        g = b.g[:t]
        self._linear(self.w("mlp_up", l), self._mlp_in(l, b, t), g)
        gm.relu2(g.reshape(-1), self.cs)
        self._linear_add(self.w("mlp_down", l), g, b.o[:t], b.x[:t])

    def _shared_expert(self, l, b, t):
        """x += down(relu(up h)^2) of the shared expert, h the MoE input (b.h after the router)."""
        if not self.c.shared_intermediate:
            return
        u = b.su[:t]
        self._linear(self.w("shared_up", l), b.h[:t], u)
        gm.relu2(u.reshape(-1), self.cs)
        self._linear_add(self.w("shared_down", l), u, b.o[:t], self._moe_target(b, t))
