"""GLM-5 (glm_moe_dsa): DeepSeek-V3.2's sparse attention (engine/models/deepseek_v32.py) with two
changes. The indexer's RoPE comes in interleaved pairs, as the attention's (V3.2's in halves).
Cross-layer top-k sharing: indexer_types says of each layer whether it runs its own indexer
("full") or reads the positions the last full layer before it picked for the same tokens
("shared": no indexer weights, so no indexer keys cached: the cache holds one row of keys a
position for each full layer only). Each layer's MLP is dense or routed as mlp_layer_types says
(the first three dense by default); the MTP layer is skipped. CPU backend."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import need
from engine.models.deepseek_v32 import DeepseekV32Config, DeepseekV32Decoder, dense_spec, expert_spec  # noqa: F401
from engine.models.glm4_moe_lite import routed_layers
from engine.models.rope import ConfigError


def _int_field(cfg: dict, key: str, default: int) -> int:
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"config.json: {key} {v!r} must be an integer")
    return v


def indexer_types(cfg: dict) -> tuple:
    """Each layer's "full" or "shared", derived as transformers' GlmMoeDsaConfig.__post_init__
    does: indexer_types as given; else index_topk_pattern (a letter a layer, F full, S shared);
    else layer i full where max(i - index_skip_topk_offset + 1, 0) is a multiple of
    max(index_topk_freq, 1) (defaults 2 and 1: every layer full)."""
    n = int(need(cfg, "num_hidden_layers"))
    field, types = "indexer_types", cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        field, types = "index_topk_pattern", cfg["index_topk_pattern"]
        if isinstance(types, str):
            bad = next((i for i, ch in enumerate(types) if ch not in "FS"), None)
            if bad is not None:
                raise ConfigError(f"config.json: index_topk_pattern {types!r} has {types[bad]!r} at "
                                  f"layer {bad}; expected F (full) or S (shared)")
            types = ["full" if ch == "F" else "shared" for ch in types]
    if types is None:
        freq = max(_int_field(cfg, "index_topk_freq", 1), 1)
        offset = _int_field(cfg, "index_skip_topk_offset", 2)
        field = "index_topk_freq / index_skip_topk_offset"
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = list(types)
    if len(types) < n:
        raise ConfigError(f"config.json: {field} gives {len(types)} layers; expected at least "
                          f"num_hidden_layers={n}")
    types = types[:n]   # entries past the decoder's layers describe the MTP layers, which are skipped
    bad = next((i for i, t in enumerate(types) if t not in ("full", "shared")), None)
    if bad is not None:
        raise ConfigError(f"config.json: {field} has {types[bad]!r} at layer {bad}; expected "
                          "'full' or 'shared'")
    if types[0] != "full":
        raise ConfigError(f"config.json: {field} makes layer 0 shared; it must be full (no "
                          "earlier layer's selection to read)")
    return tuple(types)


@dataclass(frozen=True)
class GlmMoeDsaConfig(DeepseekV32Config):
    @classmethod
    def from_hf(cls, cfg: dict) -> "GlmMoeDsaConfig":
        for key in ("rope_interleave", "indexer_rope_interleave"):
            if cfg.get(key, True) is not True:   # the reference rotates pairs whatever they say
                raise ConfigError(f"config.json: {key} {cfg[key]!r} is not supported for "
                                  "glm_moe_dsa; expected true (RoPE over interleaved pairs)")
        moe, types = routed_layers(cfg, first_dense=3), indexer_types(cfg)
        c = DeepseekV32Config.from_hf(dict(cfg, first_k_dense_replace=0))
        return cls(**{**c.__dict__, "moe_layers": moe, "index_rope_pairs": True,
                      "index_layers": tuple(l for l, t in enumerate(types) if t == "full")})


Model = DeepseekV32Decoder
Config = GlmMoeDsaConfig
