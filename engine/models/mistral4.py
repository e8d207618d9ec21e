"""Mistral Small 4 (mistral4, Mistral4ForCausalLM). CPU and cuda backends: DeepSeek-V3's decoders
(engine/models/deepseek_v3.py: multi-head latent attention in its absorbed form; engine/gpu_mla.py).

What differs from deepseek_v3, as transformers' modeling_mistral4:
- routing (softmax_grouped): softmax scores without a selection bias, chosen within the
  topk_group of n_group groups whose two best scores sum highest, the top-k renormalized
  (sum + 1e-20) where norm_topk_prob, times routed_scaling_factor;
- each query (all its dims) times 1 + llama_4_scaling_beta * ln(1 + floor(pos /
  original_max_position_embeddings)), both from rope_parameters (Llama 4's scaling past the
  pretraining context: 1 below it); without llama_4_scaling_beta, none;
- rope_parameters' partial_rotary_factor is over the query's qk_nope + qk_rope dims (its
  head_dim) and must give qk_rope_head_dim, the dims deepseek_v3 rotates; RoPE over interleaved
  pairs where rope_interleave (the default); rope type default refused (the reference's default
  RoPE ignores partial_rotary_factor and fails on the qk_rope dims);
- transformers' Mistral4Config defaults where config.json leaves a field out: no dense first
  layers (first_k_dense_replace 0), q_lora_rank 1024, and YaRN (factor 128 over 8192 positions,
  theta 10000, mscale and mscale_all_dim 1, llama_4_scaling_beta 0.1) where rope_parameters is
  absent; scoring_func / topk_method are not read (the reference reads neither).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import need
from engine.models.deepseek_v3 import DeepseekV3Config, DeepseekV3Decoder, dense_spec, expert_spec  # noqa: F401
from engine.models.rope import ConfigError, declared_partial, rope_params

# transformers' Mistral4Config defaults of the fields deepseek_v3 defaults otherwise (q_lora_rank
# where absent: null is q_proj's)
DEFAULTS = dict(first_k_dense_replace=0, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                rms_norm_eps=1e-6)


def default_rope(cfg: dict) -> dict:
    """transformers' rope_parameters where config.json gives none."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
            "llama_4_scaling_beta": 0.1, "max_position_embeddings": cfg.get("max_position_embeddings", 1048576)}


@dataclass(frozen=True)
class Mistral4Config(DeepseekV3Config):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Mistral4Config":
        cfg = {k: v for k, v in cfg.items() if k not in ("scoring_func", "topk_method")}
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported; mistral4 runs silu")
        for key, v in DEFAULTS.items():
            if cfg.get(key) is None:
                cfg[key] = v
        cfg.setdefault("q_lora_rank", 1024)
        params = rope_params(cfg) or default_rope(cfg)
        if (params.get("rope_type") or params.get("type") or "default") == "default":
            raise ConfigError("config.json: rope type default is not supported for mistral4: the reference's "
                              "default RoPE spans qk_nope + qk_rope dims, not qk_rope_head_dim (its other kinds: "
                              "yarn as released, linear, llama3, longrope)")
        nope, rope = int(need(cfg, "qk_nope_head_dim")), int(need(cfg, "qk_rope_head_dim"))
        partial = declared_partial({"rope_parameters": params})
        if partial is not None and int((nope + rope) * partial) != rope:
            raise ConfigError(f"config.json: partial_rotary_factor {partial} rotates {int((nope + rope) * partial)} "
                              f"of the {nope + rope} query dims; mistral4 rotates qk_rope_head_dim={rope}")
        beta = float(params.get("llama_4_scaling_beta") or 0.0)
        period = int(params.get("original_max_position_embeddings") or 0)
        if beta and period < 1:
            raise ConfigError("config.json: rope_parameters' llama_4_scaling_beta without "
                              "original_max_position_embeddings (the queries' scale steps by it)")
        cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = {**params, "partial_rotary_factor": 1.0}   # over qk_rope_head_dim
        c = DeepseekV3Config.from_hf(cfg)
        return cls(**{**c.__dict__, "routing": "softmax_grouped", "query_scale_beta": beta,
                      "query_scale_period": period if beta else 0})


Model = DeepseekV3Decoder
Config = Mistral4Config
