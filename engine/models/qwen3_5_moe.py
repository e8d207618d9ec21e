"""Qwen3.5-MoE (Qwen3.5-35B-A3B .. 397B-A17B): the Qwen3-Next layer stack with separate DeltaNet input
projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), experts on every layer, top-k weights
always renormalized.

Released checkpoints are image-text wrappers (Qwen3_5MoeForConditionalGeneration: model_type
qwen3_5_moe, the text model's fields under text_config, its tensors under model.language_model.):
the engine runs the language model and leaves the vision tower (model.visual.*) unread. Text-only
folders (model_type qwen3_5_moe_text, tensors under model.) load as family qwen3_5_moe_text.
Text positions are equal on mRoPE's three axes, so its rotation is plain (partial) RoPE.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.hybrid import HybridConfig, HybridDecoder, dense_spec, expert_spec  # noqa: F401
from engine.models.qwen3_next import MTP

VISION = ("model.visual.", "the vision tower")


@dataclass(frozen=True)
class Qwen3_5MoeConfig(HybridConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3_5MoeConfig":
        if isinstance(cfg.get("text_config"), dict):
            # the wrapper: the language model's config, with the wrapper's own top-level fields
            text = {**cfg["text_config"], "model_type": "qwen3_5_moe"}
            if cfg.get("tie_word_embeddings") is not None:   # the wrapper ties lm_head, so its flag rules
                text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
            if text.get("eos_token_id") is None:
                text["eos_token_id"] = cfg.get("eos_token_id")
            f = HybridConfig.hybrid_hf(text)
            f["raw"], ignored = cfg, (VISION, MTP)
        else:
            f = HybridConfig.hybrid_hf({**cfg, "model_type": "qwen3_5_moe_text"})
            ignored = (MTP,)
        return cls(**f, norm_topk_prob=True, qk_norm="head", fused_qkvz=False, ignored_parts=ignored)


Model = HybridDecoder
Config = Qwen3_5MoeConfig
