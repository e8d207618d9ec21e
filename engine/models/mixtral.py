"""Mixtral (8x7B, 8x22B): no q/k norm, top-k weights always renormalized, optional sliding window."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec, need  # noqa: F401


@dataclass(frozen=True)
class MixtralConfig(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "MixtralConfig":
        f = MoeConfig.common_hf(cfg)
        f["sliding_window"] = int(cfg.get("sliding_window") or 0)
        return cls(**f, moe_intermediate=int(need(cfg, "intermediate_size")), norm_topk_prob=True)


Model = MoeDecoder
Config = MixtralConfig
