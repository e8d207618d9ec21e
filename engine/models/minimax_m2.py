"""MiniMax-M2 (MiniMax-M2, M2.1, M2.5): Mixtral's layer layout and expert names with sigmoid
routing and a selection bias (all experts, one group; the top-k weights renormalized), RMSNorm over
the whole q and k projections (OLMoE's), partial RoPE (rotary_dim of head_dim)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec, need  # noqa: F401
from engine.models.rope import ConfigError, declared_partial


@dataclass(frozen=True)
class MiniMaxM2Config(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "MiniMaxM2Config":
        cfg = dict(cfg)
        # the released config.json's own fields, checked where another value would change the math
        for key, ok in (("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer"),
                        ("use_routing_bias", True)):
            if cfg.get(key) not in (None, ok):
                raise ConfigError(f"config.json: {key} {cfg[key]!r} is not supported for "
                                  f"minimax_m2; expected {ok!r}")
        if int(cfg.get("shared_intermediate_size") or 0):
            raise ConfigError("config.json: shared_intermediate_size must be 0 for minimax_m2 "
                              "(no shared expert)")
        if any(int(t) != 1 for t in cfg.get("attn_type_list") or ()):
            raise ConfigError("config.json: attn_type_list holds linear-attention layers (0); "
                              "minimax_m2 supports full attention (1) only")
        rotary_dim = cfg.get("rotary_dim")
        if rotary_dim is not None and declared_partial(cfg) is None:
            head_dim = int(cfg.get("head_dim") or int(need(cfg, "hidden_size")) //
                           int(need(cfg, "num_attention_heads")))
            cfg["partial_rotary_factor"] = int(rotary_dim) / head_dim
        f = MoeConfig.common_hf(cfg)
        return cls(**f, moe_intermediate=int(need(cfg, "intermediate_size")), norm_topk_prob=True,
                   qk_norm="full" if cfg.get("use_qk_norm", True) else "none",
                   routing="sigmoid")


Model = MoeDecoder
Config = MiniMaxM2Config
