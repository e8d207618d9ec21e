"""OLMoE (OLMoE-1B-7B): RMSNorm over the whole q and k projections, optional q/k/v clipping."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec, need  # noqa: F401


@dataclass(frozen=True)
class OlmoeConfig(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "OlmoeConfig":
        return cls(**MoeConfig.common_hf(cfg), moe_intermediate=int(need(cfg, "intermediate_size")),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), qk_norm="full",
                   clip_qkv=float(cfg.get("clip_qkv") or 0.0))


Model = MoeDecoder
Config = OlmoeConfig
