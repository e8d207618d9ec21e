"""AFMoE (Arcee's Trinity models). CPU backend here; cuda: engine/gpu_afmoe.py.

What differs from the llama-like decoder (engine/models/base.py):
- sandwich norms: x + post_attn_norm(attention(attn_norm(x))), then x + post_mlp_norm(mlp(
  mlp_norm(x))) (the checkpoint's post_attention_layernorm is the attention output's norm,
  pre_mlp_layernorm the MLP input's);
- the embeddings times sqrt(hidden) (mup_enabled);
- attention: q / k normed a head before RoPE; RoPE and a window (sliding_window) in sliding
  layers only, full layers without RoPE (layer_types, else every global_attn_every_n_layers-th
  full); the heads' output times sigmoid(h @ gate_proj^T), elementwise, before o_proj;
- routing: sigmoid scores chosen with the expert_bias, renormalized, times route_scale; shared
  experts of num_shared_experts * moe_intermediate_size; the first num_dense_layers dense.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, layer_list, need
from engine.models.rope import ConfigError
from engine.names import name

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class AfmoeConfig(MoeConfig):
    mup: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> "AfmoeConfig":
        cfg = dict(cfg)
        n = int(need(cfg, "num_hidden_layers"))
        every = int(cfg.get("global_attn_every_n_layers") or 4)
        types = layer_list("layer_types", cfg.get("layer_types") or [SLIDING if (i + 1) % every else FULL
                                                                     for i in range(n)], n, (SLIDING, FULL))
        for key, want in (("attention_bias", False), ("score_func", "sigmoid"), ("route_norm", True),
                          ("n_group", 1), ("topk_group", 1)):
            if key in cfg and cfg[key] is not None and cfg[key] != want:
                raise ConfigError(f"config.json: {key}={cfg[key]!r} is not supported for afmoe (expected {want!r}, "
                                  "as the reference runs)")
        window = int(cfg.get("sliding_window") or 1024)
        dense = int(cfg.get("num_dense_layers") if cfg.get("num_dense_layers") is not None else 1)
        moe_i = int(need(cfg, "moe_intermediate_size"))
        cfg.setdefault("head_dim", 128)
        cfg.setdefault("rms_norm_eps", 1e-5)
        f = MoeConfig.common_hf(cfg)
        f.update(moe_layers=tuple(range(dense, n)), routing="sigmoid", norm_topk_prob=True,
                 routed_scale=float(cfg.get("route_scale") or 1.0), qk_norm="head",
                 dense_intermediate=int(cfg.get("intermediate_size") or 0),
                 shared_intermediate=moe_i * int(cfg.get("num_shared_experts", 2) or 0),
                 layer_windows=tuple(window if t == SLIDING else 0 for t in types),
                 nope_layers=tuple(l for l, t in enumerate(types) if t == FULL))
        return cls(**f, moe_intermediate=moe_i, mup=bool(cfg.get("mup_enabled", False)))


def dense_spec(c: AfmoeConfig) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    f, h = c.family, c.hidden
    for l in range(c.n_layers):
        spec[name(f, "post_attn_norm", l)] = (h,)
        spec[name(f, "post_mlp_norm", l)] = (h,)
        spec[name(f, "attn_gate", l)] = (c.q_dim, h)
    return spec


expert_spec = base.expert_spec


class AfmoeDecoder(MoeDecoder):
    def embed(self, ids: np.ndarray):
        x = super().embed(ids)
        return x * np.float32(np.sqrt(self.c.hidden)) if self.c.mup else x

    def layer(self, l: int, x, pos: np.ndarray, st) -> None:
        """Sandwich norms: x += post_attn_norm(attention(attn_norm(x))), then the MLP the same."""
        c, ops, w = self.c, self.ops, self.w
        a = self.attention(l, ops.rmsnorm(x, w("attn_norm", l), c.rms_eps), pos, st)
        ops.add_(x, ops.rmsnorm(a, w("post_attn_norm", l), c.rms_eps))
        m = self.mlp(l, ops.rmsnorm(x, w("mlp_norm", l), c.rms_eps))
        ops.add_(x, ops.rmsnorm(m, w("post_mlp_norm", l), c.rms_eps))
    def gated(self, l: int, h, a):
        g = self.ops.linear(h, self.w("attn_gate", l))
        return (a * (np.float32(1) / (np.float32(1) + np.exp(-g)))).astype(np.float32)


Model = AfmoeDecoder
Config = AfmoeConfig
