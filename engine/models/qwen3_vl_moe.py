"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B, Instruct and Thinking): Qwen3-MoE's
language model (per-head q/k RMSNorm, top-k weights always renormalized) inside an image-text
wrapper (Qwen3VLMoeForConditionalGeneration: its fields under text_config, its tensors under
model.language_model.). The engine runs the language model on text and leaves the vision tower
(model.visual.*) unread. Text positions are equal on mRoPE's three axes, so its rotation is
plain RoPE. The releases store each layer's experts fused and transposed (loader/checkpoint.py
reads them per expert)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import dense_spec, expert_spec  # noqa: F401
from engine.models.base import MoeDecoder, text_config
from engine.models.qwen3_moe import Qwen3MoeConfig

VISION = ("model.visual.", "the vision tower")


@dataclass(frozen=True)
class Qwen3VLMoeConfig(Qwen3MoeConfig):
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3VLMoeConfig":
        text = text_config(cfg, "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")
        if cfg.get("tie_word_embeddings") is not None:   # the wrapper ties lm_head: its flag rules
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        c = Qwen3MoeConfig.from_hf(text)
        return cls(**{**c.__dict__, "norm_topk_prob": True, "raw": cfg}, ignored_parts=(VISION,))


Model = MoeDecoder
Config = Qwen3VLMoeConfig
