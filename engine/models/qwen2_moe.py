"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, softmax routing, a sigmoid-gated
shared expert beside the routed ones, optional dense MLP layers."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec, need  # noqa: F401
from engine.models.rope import ConfigError


@dataclass(frozen=True)
class Qwen2MoeConfig(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen2MoeConfig":
        if cfg.get("use_sliding_window"):
            raise ConfigError("config.json: use_sliding_window is true; the engine runs Qwen2-MoE "
                              "with full attention only (the released models set it false)")
        f = MoeConfig.common_hf(cfg)
        only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        # a layer has experts unless listed in mlp_only_layers or off the sparse step
        f["moe_layers"] = tuple(l for l in range(f["n_layers"]) if l not in only and (l + 1) % step == 0)
        f["attention_bias"] = bool(cfg.get("qkv_bias", True))
        return cls(**f, moe_intermediate=int(need(cfg, "moe_intermediate_size")),
                   dense_intermediate=int(cfg.get("intermediate_size") or 0),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0),
                   shared_gated=True)


Model = MoeDecoder
Config = Qwen2MoeConfig
