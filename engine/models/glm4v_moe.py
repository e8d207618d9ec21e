"""GLM-4.5V / GLM-4.6V (glm4v_moe): GLM-4.5's language model (engine/models/glm4_moe.py) inside an
image-text wrapper (Glm4vMoeForConditionalGeneration: its fields under text_config, its tensors
under model.language_model.). The engine runs the language model on text and leaves the vision
tower (model.visual.*) unread. Text positions are equal on mRoPE's three axes, so its rotation
is plain RoPE over the rotary share. Both backends (the base decoders)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import dense_spec, expert_spec  # noqa: F401
from engine.models.base import MoeDecoder, text_config
from engine.models.glm4_moe import Glm4MoeConfig

VISION = ("model.visual.", "the vision tower")


@dataclass(frozen=True)
class Glm4vMoeConfig(Glm4MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Glm4vMoeConfig":
        text = text_config(cfg, "glm4v_moe", "Glm4vMoeForConditionalGeneration")
        if cfg.get("tie_word_embeddings") is not None:   # the wrapper's flag rules
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        text.setdefault("attention_bias", True)           # the text config's defaults
        text.setdefault("rms_norm_eps", 1e-5)
        c = Glm4MoeConfig.from_hf(text)
        mtp = tuple((p.replace("model.", "model.language_model.", 1), what) for p, what in c.ignored_parts)
        return cls(**{**c.__dict__, "raw": cfg, "ignored_parts": (VISION,) + mtp})


Model = MoeDecoder
Config = Glm4vMoeConfig
