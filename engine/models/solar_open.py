"""Solar Open (Solar-Open-100B): llama attention with full RoPE (head_dim 128 beside 64 heads
of a 4096 hidden: q_dim is not the hidden size), DeepSeek-V3's MoE in every layer (sigmoid
routing with a selection bias, optionally group-limited, scaled weights; ungated shared experts
of n_shared_experts times moe_intermediate_size). Both backends run it as the base decoders.
The reference deletes first_k_dense_replace, use_qk_norm and intermediate_size from its config:
every layer routed, no q / k norms, whatever config.json says."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec  # noqa: F401
from engine.models.glm4_moe import sigmoid_moe, with_experts
from engine.models.rope import ConfigError, declared_partial, rope_params


@dataclass(frozen=True)
class SolarOpenConfig(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "SolarOpenConfig":
        cfg = with_experts(cfg)
        cfg.setdefault("head_dim", 128)                 # the reference's defaults
        cfg.setdefault("rms_norm_eps", 1e-5)
        if "rope_theta" not in rope_params(cfg) and "rope_theta" not in cfg:
            cfg["rope_theta"] = 1_000_000.0
        partial = declared_partial(cfg)
        if partial is not None and partial != 1.0:
            raise ConfigError(f"config.json: partial_rotary_factor={partial}; solar_open rotates whole heads "
                              "(expected 1.0)")
        f = MoeConfig.common_hf(cfg)
        f.update(sigmoid_moe(cfg, f, first_dense=0, shared=1, norm=True))
        f.update(moe_layers=tuple(range(f["n_layers"])), dense_intermediate=0)
        return cls(**f)


Model = MoeDecoder
Config = SolarOpenConfig
