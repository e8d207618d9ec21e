"""DBRX (dbrx: databricks/dbrx-base, dbrx-instruct). CPU backend here; cuda: engine/gpu_dbrx.py.

A llama-like MoE decoder with its own names and config nesting (attn_config, ffn_config):
- LayerNorms without bias (norm_1 before attention, norm_2 before the MoE, norm_f), eps 1e-5
  (torch's default: the config has no field for it);
- q | k | v fused in one Wqkv [Hq D + 2 Hkv D, H] (DbrxDecoder.qkv splits its output), the
  whole projection clamped to +-clip_qkv where attn_config sets it; no biases anywhere;
- routing: softmax over all experts, the top-k weights divided by their p-norm,
  p = ffn_config.moe_normalize_expert_weights (null: kept as they are; 1 and 2 run here);
- the experts fused flat in three [E I, H] tensors a layer: w1 (gate) and v1 (up) as
  x @ w^T, w2 as intermediate @ w2, so each expert's down projection is its w2 rows transposed
  (loader/checkpoint.py gives each expert's under the names of engine/names.py);
- RoPE's base: the release keeps it as attn_config.rope_theta (500000) and has no
  rope_parameters; transformers 5.x writes rope_parameters and reads only those (a release
  config loaded there gets the default 10000). attn_config.rope_theta wins where it is given,
  as DBRX's own code and transformers 4.x read it; else rope_parameters' (as 5.x saves them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, need
from engine.models.rope import ConfigError
from engine.names import name

NORM_EPS = 1e-5        # nn.LayerNorm's default; DBRX's config has no eps
NORM_P = {None: 0, 1: 1, 2: 2}   # moe_normalize_expert_weights -> the routers' norm (0: none)


def _sub(cfg: dict, key: str) -> dict:
    v = cfg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"config.json: {key} must be an object; got {v!r}")
    return v


@dataclass(frozen=True)
class DbrxConfig(MoeConfig):
    norm_p: int = 1     # the top-k weights over their p-norm: 0 (none), 1 (sum 1) or 2

    @classmethod
    def from_hf(cls, cfg: dict) -> "DbrxConfig":
        attn, ffn = _sub(cfg, "attn_config"), _sub(cfg, "ffn_config")
        act = (ffn.get("ffn_act_fn") or {"name": "silu"})
        if not isinstance(act, dict) or act.get("name", "silu") != "silu":
            raise ConfigError(f"config.json: ffn_config.ffn_act_fn {act!r}: only silu experts run here "
                              "(DBRX's SwiGLU)")
        p = ffn.get("moe_normalize_expert_weights", 1.0)
        if p not in NORM_P:
            raise ConfigError(f"config.json: ffn_config.moe_normalize_expert_weights={p!r}: supported are "
                              "null (no renormalization), 1 and 2 (the top-k weights over their 1- or 2-norm)")
        clip = attn.get("clip_qkv")
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
            raise ConfigError(f"config.json: attn_config.clip_qkv={clip!r}: expected a positive number or null")
        d, n = need(cfg, "d_model"), need(cfg, "n_heads")
        if d % n:
            raise ConfigError(f"config.json: d_model={d} is not a multiple of n_heads={n} (DBRX's head_dim "
                              "is d_model / n_heads)")
        if cfg.get("tie_word_embeddings"):
            raise ConfigError("config.json: tie_word_embeddings true: DBRX's lm_head is its own "
                              "(transformers refuses a tied DBRX too)")
        rope = dict(cfg.get("rope_parameters") or {})
        if attn.get("rope_theta") is not None:   # the release's place for it (see the docstring)
            rope["rope_theta"] = attn["rope_theta"]
        # the llama-like field names common_hf reads, from DBRX's (transformers' defaults where
        # the sub-configs leave a field out, as the release leaves moe_normalize_expert_weights)
        flat = {k: v for k, v in cfg.items() if k not in ("attn_config", "ffn_config", "rope_scaling")}
        flat.update(hidden_size=d, num_attention_heads=n,
                    num_hidden_layers=need(cfg, "n_layers"), num_key_value_heads=attn.get("kv_n_heads", 1),
                    num_local_experts=ffn.get("moe_num_experts", 4), num_experts_per_tok=ffn.get("moe_top_k", 1),
                    max_position_embeddings=cfg.get("max_seq_len") or 2048, rms_norm_eps=NORM_EPS,
                    rope_parameters=rope or None, head_dim=None)
        f = MoeConfig.common_hf(flat)
        return cls(**f, moe_intermediate=int(ffn.get("ffn_hidden_size", 3584)), norm_topk_prob=NORM_P[p] == 1,
                   norm_p=NORM_P[p], clip_qkv=float(clip or 0.0))


def dense_spec(c: DbrxConfig) -> dict[str, tuple]:
    f, h = c.family, c.hidden
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,),
            name(f, "lm_head"): (c.vocab_size, h)}
    for l in range(c.n_layers):
        spec[name(f, "attn_norm", l)] = (h,)
        spec[name(f, "qkv", l)] = (c.q_dim + 2 * c.kv_dim, h)
        spec[name(f, "o", l)] = (h, c.q_dim)
        spec[name(f, "mlp_norm", l)] = (h,)
        spec[name(f, "router", l)] = (c.n_experts, h)
    return spec


expert_spec = base.expert_spec


class DbrxDecoder(MoeDecoder):
    def norm(self, x, key: str, l: int | None = None):
        """LayerNorm without bias."""
        return self.ops.layernorm(x, self.w(key, l), self.c.rms_eps)

    def layer(self, l: int, x, pos: np.ndarray, st) -> None:
        self.ops.add_(x, self.attention(l, self.norm(x, "attn_norm", l), pos, st))
        self.ops.add_(x, self.mlp(l, self.norm(x, "mlp_norm", l)))

    def head(self, x):
        return self.ops.linear(self.norm(x, "final_norm"), self.w("lm_head"))

    def qkv(self, l: int, h):
        """One projection by Wqkv, [T, Hq D + 2 Hkv D], split into q, k, v (the clamp after, in
        attention(), is elementwise: the same on the parts)."""
        c = self.c
        a = self.ops.linear(h, self.w("qkv", l))
        return (np.ascontiguousarray(a[:, :c.q_dim]), np.ascontiguousarray(a[:, c.q_dim:c.q_dim + c.kv_dim]),
                np.ascontiguousarray(a[:, c.q_dim + c.kv_dim:]))

    def route(self, l: int, h):
        return self.ops.router(self.ops.linear(h, self.w("router", l)), self.c.top_k, self.c.norm_p)


Model = DbrxDecoder
Config = DbrxConfig
