"""FlexOlmo (flex_olmo). CPU backend here; cuda: engine/gpu_flex_olmo.py.

OLMoE's attention (RMSNorm over the whole q and k projections) and routing (softmax top-k,
renormalized where norm_topk_prob), with OLMo-2's norm placement: nothing normed before attention
or the MLP, their outputs normed before each residual add:
x + post_attn_norm(attention(x)), then x + post_mlp_norm(moe(x)). Every layer is MoE.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, need
from engine.names import name


@dataclass(frozen=True)
class FlexOlmoConfig(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "FlexOlmoConfig":
        cfg = dict(cfg)
        cfg.setdefault("rms_norm_eps", 1e-6)
        return cls(**MoeConfig.common_hf(cfg), moe_intermediate=int(need(cfg, "intermediate_size")),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), qk_norm="full",
                   clip_qkv=float(cfg.get("clip_qkv") or 0.0))


def dense_spec(c: FlexOlmoConfig) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    f, h = c.family, c.hidden
    for l in range(c.n_layers):   # norms after attention and the MLP, none before (the names'
        del spec[name(f, "attn_norm", l)], spec[name(f, "mlp_norm", l)]   # mlp_norm is post_attn_norm's)
        spec[name(f, "post_attn_norm", l)] = (h,)
        spec[name(f, "post_mlp_norm", l)] = (h,)
    return spec


expert_spec = base.expert_spec


class FlexOlmoDecoder(MoeDecoder):
    def layer(self, l: int, x, pos: np.ndarray, st) -> None:
        """x += post_attn_norm(attention(x)), then x += post_mlp_norm(mlp(x))."""
        c, ops, w = self.c, self.ops, self.w
        ops.add_(x, ops.rmsnorm(self.attention(l, x, pos, st), w("post_attn_norm", l), c.rms_eps))
        ops.add_(x, ops.rmsnorm(self.mlp(l, x), w("post_mlp_norm", l), c.rms_eps))

Model = FlexOlmoDecoder
Config = FlexOlmoConfig
