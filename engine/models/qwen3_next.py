"""Qwen3-Next (Qwen3-Next-80B-A3B): Gated DeltaNet + gated attention layers, routed experts and a
gated shared expert; the DeltaNet input projections are fused per key head (in_proj_qkvz, in_proj_ba)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.hybrid import HybridConfig, HybridDecoder, dense_spec, expert_spec  # noqa: F401

MTP = ("mtp.", "the multi-token-prediction (MTP) layers")


@dataclass(frozen=True)
class Qwen3NextConfig(HybridConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3NextConfig":
        f = HybridConfig.hybrid_hf(cfg)
        only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        # a layer has experts unless listed in mlp_only_layers or off the sparse step
        f["moe_layers"] = tuple(l for l in range(f["n_layers"]) if l not in only and (l + 1) % step == 0)
        return cls(**f, dense_intermediate=int(cfg.get("intermediate_size") or 0),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), qk_norm="head",
                   fused_qkvz=True, ignored_parts=(MTP,))


Model = HybridDecoder
Config = Qwen3NextConfig
