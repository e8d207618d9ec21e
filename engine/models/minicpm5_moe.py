"""MiniCPM5-MoE (minicpm5_moe). CPU backend here; cuda: engine/gpu_minicpm.py.

What differs from the llama-like decoder (engine/models/base.py):
- gated attention: q_proj gives each head its query and a gate ([Hq, 2D]: query first), the
  heads' output times sigmoid(gate) before o_proj; no q / k norms; RoPE over the whole head
  (rope_theta 5e6 by default);
- DeepSeek-V3's routing (sigmoid, a selection bias, groups, scaled) with ungated shared experts;
  dense layers by mlp_layer_types, else the first first_k_dense_replace.
Legend: D = head_dim, Hq = query heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, layer_list, need
from engine.models.glm4_moe import sigmoid_moe, with_experts
from engine.models.rope import ConfigError, rope_params
from engine.names import name


@dataclass(frozen=True)
class Minicpm5MoeConfig(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Minicpm5MoeConfig":
        cfg = with_experts(cfg)
        if cfg.get("attention_bias") or cfg.get("use_gated_attention", True) is False:
            raise ConfigError("config.json: attention_bias true or use_gated_attention false is not supported for "
                              "minicpm5_moe (the released models: gated attention without biases)")
        cfg.setdefault("head_dim", 128)
        if "rope_theta" not in rope_params(cfg) and "rope_theta" not in cfg:
            cfg["rope_theta"] = 5_000_000.0
        n = int(need(cfg, "num_hidden_layers"))
        first = int(cfg.get("first_k_dense_replace", 1) or 0)
        mlp = layer_list("mlp_layer_types", cfg.get("mlp_layer_types") or ["dense" if i < first else "sparse"
                                                                           for i in range(n)], n, ("dense", "sparse"))
        f = MoeConfig.common_hf({**cfg, "partial_rotary_factor": 1.0})
        f.update(sigmoid_moe({**cfg, "routed_scaling_factor": cfg.get("routed_scaling_factor", 3.66)}, f,
                             first_dense=1, shared=1, norm=True))
        f.update(moe_layers=tuple(l for l, t in enumerate(mlp) if t == "sparse"))
        return cls(**f)


def dense_spec(c: Minicpm5MoeConfig) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    for l in range(c.n_layers):   # each head's query and gate rows
        spec[name(c.family, "q", l)] = (2 * c.q_dim, c.hidden)
    return spec


expert_spec = base.expert_spec


def split_query_gate(c: Minicpm5MoeConfig, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q_proj [Hq * 2D, H] -> (query rows [Hq D, H], gate rows [Hq D, H]), heads in order."""
    heads = np.asarray(a).reshape(c.n_heads, 2, c.head_dim, -1)
    return (np.ascontiguousarray(heads[:, 0].reshape(c.q_dim, -1)),
            np.ascontiguousarray(heads[:, 1].reshape(c.q_dim, -1)))


class Minicpm5MoeDecoder(MoeDecoder):
    def attention(self, l: int, h, pos: np.ndarray, st):
        c, ops, w = self.c, self.ops, self.w
        t, d = h.shape[0], c.head_dim
        qg = ops.linear(h, w("q", l)).reshape(t, c.n_heads, 2 * d)
        q = np.ascontiguousarray(qg[..., :d])
        gate = np.ascontiguousarray(qg[..., d:]).reshape(t, c.q_dim)
        k = ops.linear(h, w("k", l)).reshape(t, c.n_kv_heads, d)
        v = ops.linear(h, w("v", l)).reshape(t, c.n_kv_heads, d)
        ops.rope(q, pos, self.inv_freq, c.rope.attention_factor)
        ops.rope(k, pos, self.inv_freq, c.rope.attention_factor)
        ops.kv_store(st.k[l], st.v[l], int(pos[0]), k, v, self.kv_bf16)
        a = ops.attention(q, st.k[l], st.v[l], pos, d ** -0.5, self.window(l), None).reshape(t, c.q_dim)
        a = (a * (np.float32(1) / (np.float32(1) + np.exp(-gate)))).astype(np.float32)
        return ops.linear(a, w("o", l))


Model = Minicpm5MoeDecoder
Config = Minicpm5MoeConfig
