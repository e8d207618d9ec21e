"""Kimi-K2.5: Kimi-K2's language model (deepseek_v3's architecture: engine/models/deepseek_v3.py)
inside an image-text wrapper: its fields under text_config, its tensors under language_model.
(language_model.model.layers..., language_model.lm_head) as released. The engine runs the
language model on text and leaves the vision tower and the image projector unread."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import text_config
from engine.models.deepseek_v3 import DeepseekV3Config, dense_spec, expert_spec  # noqa: F401
from engine.models.deepseek_v3 import Model  # noqa: F401

VISION = (("vision_tower.", "the vision tower"), ("mm_projector.", "the image projector"))


@dataclass(frozen=True)
class KimiK25Config(DeepseekV3Config):
    @classmethod
    def from_hf(cls, cfg: dict) -> "KimiK25Config":
        c = DeepseekV3Config.from_hf(text_config(
            cfg, "kimi_k25", "its language model's fields under text_config",
            ("eos_token_id", "bos_token_id")))
        mtp = tuple(("language_model." + p, what) for p, what in c.ignored_parts)
        return cls(**{**c.__dict__, "raw": cfg, "ignored_parts": mtp + VISION})


Config = KimiK25Config
