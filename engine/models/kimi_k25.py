"""Kimi-K2.5: Kimi-K2's language model (deepseek_v3's architecture: engine/models/deepseek_v3.py)
inside an image-text wrapper: its fields under text_config, its tensors under language_model.
(language_model.model.layers..., language_model.lm_head) as released. The engine runs the
language model on text and leaves the vision tower and the image projector unread."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.deepseek_v3 import DeepseekV3Config, dense_spec, expert_spec  # noqa: F401
from engine.models.deepseek_v3 import Model  # noqa: F401
from engine.models.rope import ConfigError

VISION = (("vision_tower.", "the vision tower"), ("mm_projector.", "the image projector"))


@dataclass(frozen=True)
class KimiK25Config(DeepseekV3Config):
    @classmethod
    def from_hf(cls, cfg: dict) -> "KimiK25Config":
        if not isinstance(cfg.get("text_config"), dict):
            raise ConfigError("config.json: kimi_k25 without text_config; expected the image-text "
                              "wrapper's config (its language model's fields under text_config)")
        text = {**cfg["text_config"], "model_type": "kimi_k25"}
        for key in ("eos_token_id", "bos_token_id"):
            if text.get(key) is None and cfg.get(key) is not None:
                text[key] = cfg[key]
        c = DeepseekV3Config.from_hf(text)
        mtp = tuple(("language_model." + p, what) for p, what in c.ignored_parts)
        return cls(**{**c.__dict__, "raw": cfg, "ignored_parts": mtp + VISION})


Config = KimiK25Config
