"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, optional dense MLP layers."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec, need  # noqa: F401


@dataclass(frozen=True)
class Qwen3MoeConfig(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3MoeConfig":
        f = MoeConfig.common_hf(cfg)
        only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        # a layer has experts unless listed in mlp_only_layers or off the sparse step
        f["moe_layers"] = tuple(l for l in range(f["n_layers"]) if l not in only and (l + 1) % step == 0)
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            f["sliding_window"] = int(cfg["sliding_window"])
        return cls(**f, moe_intermediate=int(need(cfg, "moe_intermediate_size")),
                   dense_intermediate=int(cfg.get("intermediate_size") or 0),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), qk_norm="head")


Model = MoeDecoder
Config = Qwen3MoeConfig
