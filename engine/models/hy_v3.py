"""Hy3-preview (hy_v3, Tencent's HYV3ForCausalLM). CPU and cuda backends (the base decoders).

What differs from the llama-like decoder (engine/models/base.py), as transformers' modeling_hy_v3:
- q and k normed a head BEFORE RoPE (qk_norm "head", Qwen3's), RoPE over whole heads (the
  default kind, rope_theta 11158840 where config.json gives none);
- DeepSeek-V3's routing without groups: sigmoid scores chosen with a selection bias, the top-k
  weights always renormalized (sum + 1e-20) and times router_scaling_factor (2.826 by default);
  a shared expert of num_shared_experts * moe_intermediate_size (its reference falls back to
  intermediate_size where that product is 0);
- each layer's MLP dense (intermediate_size) or routed as mlp_layer_types says (the first dense
  by default, as the reference's config); layers past num_hidden_layers (the MTP layer) skipped;
- the release's names (engine/names.py): the router under mlp.router.gate, its bias mlp.expert_bias,
  the shared expert shared_mlp; transformers' own (save_original_format=False) read as those.
Refused: attention_bias, mlp_bias (neither in the release), an activation other than silu, a
partial_rotary_factor.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec, layer_list, need  # noqa: F401
from engine.models.rope import ConfigError, declared_partial, rope_params

# transformers' HYV3Config defaults, where config.json leaves a field out
DEFAULTS = dict(num_experts=192, num_experts_per_tok=8, num_shared_experts=1, moe_intermediate_size=1536,
                router_scaling_factor=2.826, rms_norm_eps=1e-5, head_dim=128)
THETA = 11_158_840.0


@dataclass(frozen=True)
class HyV3Config(MoeConfig):
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "HyV3Config":
        cfg = dict(cfg)
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConfigError(f"config.json: {key} true is not supported for hy_v3 (Hy3-preview has none)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported; hy_v3 runs silu")
        if declared_partial(cfg) not in (None, 1.0):
            raise ConfigError(f"config.json: partial_rotary_factor {declared_partial(cfg)} is not supported for "
                              "hy_v3; its RoPE turns whole heads")
        cfg.setdefault("num_experts", cfg.get("num_local_experts"))
        for key, v in DEFAULTS.items():
            if cfg.get(key) is None:
                cfg[key] = v
        if "rope_theta" not in rope_params(cfg) and cfg.get("rope_theta") is None:
            cfg["rope_theta"] = THETA
        n = int(need(cfg, "num_hidden_layers"))
        types = cfg.get("mlp_layer_types") or ["dense"] * min(n, 1) + ["sparse"] * (n - 1)
        # entries past the decoder's layers describe the MTP layer, which is skipped
        mlp = layer_list("mlp_layer_types", types[:n] if len(types) > n else types, n, ("dense", "sparse"))
        moe_i = int(cfg["moe_intermediate_size"])
        inter = int(need(cfg, "intermediate_size"))
        f = MoeConfig.common_hf(cfg)
        f.update(moe_layers=tuple(l for l, t in enumerate(mlp) if t == "sparse"), moe_intermediate=moe_i,
                 dense_intermediate=inter, norm_topk_prob=True, routing="sigmoid",
                 routed_scale=float(cfg["router_scaling_factor"]),
                 shared_intermediate=moe_i * int(cfg["num_shared_experts"]) or inter)
        return cls(**f, qk_norm="head",
                   ignored_parts=((f"model.layers.{n}.", "the multi-token-prediction (MTP) layer"),))


Model = MoeDecoder
Config = HyV3Config
