"""Hunyuan-A13B (hunyuan_v1_moe). CPU and cuda backends (the base decoders).

What differs from the llama-like decoder (engine/models/base.py):
- q and k normed a head with their weights AFTER RoPE (query_layernorm / key_layernorm:
  qk_norm "head_after_rope");
- RoPE "dynamic" with a fixed alpha: the default kind on a stretched base, rope_theta *
  alpha ** (D / (D - 2)) (rope.py); dynamic NTK without alpha (by sequence length) is refused;
- routing: softmax over all experts, the top-k renormalized (router mlp.gate.wg, float32 in
  the release); every layer routed; a shared expert (shared_mlp) of intermediate_size, the
  routed experts the same width;
- per-layer lists (moe_topk, num_experts, moe_intermediate_size, num_shared_expert) read where
  uniform, refused otherwise; cross-layer attention (use_cla) refused: transformers has none.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec, need, uniform  # noqa: F401
from engine.models.rope import ConfigError


@dataclass(frozen=True)
class HunyuanMoeConfig(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "HunyuanMoeConfig":
        cfg = dict(cfg)
        for key, ok in (("use_cla", False), ("attention_bias", False)):
            if bool(cfg.get(key, ok)) != ok:
                raise ConfigError(f"config.json: {key}={cfg[key]} is not supported for hunyuan_v1_moe "
                                  f"(expected {ok}, as Hunyuan-A13B)")
        for key in ("use_qk_norm", "use_mixed_mlp_moe"):
            if not cfg.get(key, True):
                raise ConfigError(f"config.json: {key} false is not supported for hunyuan_v1_moe "
                                  "(expected true, as Hunyuan-A13B)")
        inter = int(need(cfg, "intermediate_size"))
        moe_i = uniform(cfg, "moe_intermediate_size", inter)
        if int(moe_i) != inter:
            raise ConfigError(f"config.json: moe_intermediate_size {moe_i} differs from intermediate_size {inter}; "
                              "the reference gives its experts intermediate_size")
        if int(uniform(cfg, "num_shared_expert", 1)) != 1:
            raise ConfigError(f"config.json: num_shared_expert {cfg['num_shared_expert']}; expected 1 (one "
                              "shared expert of intermediate_size, as the reference)")
        cfg["num_experts"] = int(uniform(cfg, "num_experts", None) or need(cfg, "num_experts"))
        cfg.setdefault("num_experts_per_tok", uniform(cfg, "moe_topk", 1))
        cfg.setdefault("rms_norm_eps", 1e-5)
        cfg.setdefault("head_dim", cfg.get("attention_head_dim"))
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        if params.get("type", params.get("rope_type")) == "dynamic" and not params.get("alpha"):
            raise ConfigError("config.json: rope type dynamic without alpha (NTK scaling by sequence length) is not "
                              "supported; expected a fixed alpha, as Hunyuan-A13B")
        f = MoeConfig.common_hf(cfg)
        f.update(shared_intermediate=inter, qk_norm="head_after_rope")
        return cls(**f, moe_intermediate=inter, norm_topk_prob=True)


Model = MoeDecoder
Config = HunyuanMoeConfig
