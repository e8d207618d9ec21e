"""Phi-3.5-MoE (phimoe). CPU backend.

What differs from Mixtral (engine/models/mixtral.py):
- LayerNorms with bias (input, post-attention, final; eps rms_norm_eps);
- biases on q / k / v / o (attention_bias) and on lm_head (lm_head_bias);
- routing by sparsemixer at inference, top-2 only: the best logit's expert, weighted by its
  softmax over the logits within 2 * router_jitter_noise of the best (relative to
  max(|logit|, best)); then the same for the best of the rest;
- longrope frequencies from short_factor, cos and sin times short_mscale (the reference switches
  to long_mscale past original_max_position_embeddings; the release has the two equal, and a
  config where they differ is refused).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, need
from engine.models.rope import ConfigError, rope_params
from engine.names import name


@dataclass(frozen=True)
class PhimoeConfig(MoeConfig):
    lm_head_bias: bool = False
    jitter_eps: float = 0.01

    @classmethod
    def from_hf(cls, cfg: dict) -> "PhimoeConfig":
        cfg = dict(cfg)
        cfg.setdefault("rms_norm_eps", 1e-5)
        f = MoeConfig.common_hf(cfg)
        if f["top_k"] != 2:
            raise ConfigError(f"config.json: num_experts_per_tok={f['top_k']}: phimoe's sparsemixer routing picks "
                              "exactly 2 experts")
        rope = f["rope"]
        if rope.kind != "default":
            p = rope_params(cfg)
            short, long = p.get("short_mscale"), p.get("long_mscale")
            if not isinstance(short, (int, float)) or not isinstance(long, (int, float)):
                raise ConfigError(f"config.json: rope_parameters' short_mscale and long_mscale must be numbers; "
                                  f"got {short!r}, {long!r}")
            if short != long:
                raise ConfigError(f"config.json: rope_parameters' long_mscale {long} differs from short_mscale "
                                  f"{short}; only equal ones are supported (as Phi-3.5-MoE releases them)")
            import dataclasses
            f["rope"] = dataclasses.replace(rope, attention_factor=float(short))
        f["sliding_window"] = int(cfg.get("sliding_window") or 0)
        return cls(**f, moe_intermediate=int(need(cfg, "intermediate_size")), norm_topk_prob=False,
                   lm_head_bias=bool(cfg.get("lm_head_bias", False)),
                   jitter_eps=float(cfg.get("router_jitter_noise", 0.01) or 0.0))


def dense_spec(c: PhimoeConfig) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    f, h = c.family, c.hidden
    spec[name(f, "final_norm_bias")] = (h,)
    if c.lm_head_bias:
        spec[name(f, "lm_head_bias")] = (c.vocab_size,)
    for l in range(c.n_layers):
        spec[name(f, "attn_norm_bias", l)] = (h,)
        spec[name(f, "mlp_norm_bias", l)] = (h,)
        if c.attention_bias:
            spec[name(f, "o_bias", l)] = (h,)
    return spec


expert_spec = base.expert_spec


class PhimoeDecoder(MoeDecoder):
    def norm(self, x, key: str, l: int | None = None):
        """LayerNorm with bias."""
        return self.ops.layernorm(x, self.w(key, l), self.c.rms_eps, self.w(key + "_bias", l))

    def layer(self, l: int, x, pos: np.ndarray, st) -> None:
        self.ops.add_(x, self.attention(l, self.norm(x, "attn_norm", l), pos, st))
        self.ops.add_(x, self.mlp(l, self.norm(x, "mlp_norm", l)))

    def head(self, x):
        c, w = self.c, self.w
        logits = self.ops.linear(self.norm(x, "final_norm"), w("embed") if c.tie_embeddings else w("lm_head"))
        if c.lm_head_bias:
            self.ops.add_(logits, w("lm_head_bias"))
        return logits
    def attention(self, l: int, h, pos: np.ndarray, st):
        a = super().attention(l, h, pos, st)
        if self.c.attention_bias:
            self.ops.add_(a, self.w("o_bias", l))
        return a

    def route(self, l: int, h):
        return self.ops.router_sparsemixer(self.ops.linear(h, self.w("router", l)), self.c.jitter_eps)


Model = PhimoeDecoder
Config = PhimoeConfig
