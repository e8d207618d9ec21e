"""GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's multi-head latent attention and MoE (sigmoid
routing with a selection bias, scaled weights, a shared expert; engine/models/deepseek_v3.py),
each layer's MLP dense or routed as mlp_layer_types says (the first dense by default). The MTP
layer is skipped."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import need
from engine.models.deepseek_v3 import (DeepseekV3Config, DeepseekV3Decoder, dense_spec,  # noqa: F401
                                       expert_spec)
from engine.models.rope import ConfigError, declared_partial


def routed_layers(cfg: dict, first_dense: int) -> tuple:
    """The layers mlp_layer_types calls 'sparse' (routed); without it, all but the first
    first_k_dense_replace (the family's default: first_dense)."""
    n = int(need(cfg, "num_hidden_layers"))
    types = cfg.get("mlp_layer_types")
    if types is None:
        first = min(int(cfg.get("first_k_dense_replace", first_dense)), n)
        types = ["dense"] * first + ["sparse"] * (n - first)
    # entries past the decoder's layers describe the MTP layers, which are skipped
    if len(types) < n or any(t not in ("dense", "sparse") for t in types[:n]):
        raise ConfigError(f"config.json: mlp_layer_types must list 'dense' or 'sparse' for each "
                          f"of the {n} layers; got {types!r}")
    types = types[:n]
    return tuple(i for i, t in enumerate(types) if t == "sparse")


@dataclass(frozen=True)
class Glm4MoeLiteConfig(DeepseekV3Config):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Glm4MoeLiteConfig":
        cfg = dict(cfg)
        moe = routed_layers(cfg, first_dense=1)
        partial = declared_partial(cfg)
        if partial not in (None, 1.0):
            raise ConfigError(f"config.json: partial_rotary_factor {partial} is not supported for "
                              "glm4_moe_lite; expected 1.0 (qk_rope_head_dim dims all rotate)")
        cfg["first_k_dense_replace"] = 0
        c = DeepseekV3Config.from_hf(cfg)
        return cls(**{**c.__dict__, "moe_layers": moe})


Model = DeepseekV3Decoder
Config = Glm4MoeLiteConfig
