"""Qwen3-Omni-30B-A3B (qwen3_omni_moe: Instruct, Thinking, Captioner): the thinker's language
model, Qwen3-MoE's (per-head q/k RMSNorm, softmax top-k), inside the omni wrapper (its fields
under thinker_config.text_config, its tensors under thinker.model.* and thinker.lm_head). The
engine runs it on text: the audio and vision encoders, the talker and the speech decoder
(code2wav) are left unread, so the model answers in text only. Text positions are equal on
mRoPE's three axes: plain RoPE. Both backends (the base decoders)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import dense_spec, expert_spec  # noqa: F401
from engine.models.base import MoeDecoder
from engine.models.qwen3_moe import Qwen3MoeConfig
from engine.models.rope import ConfigError

SKIPPED = (("thinker.audio_tower.", "the audio encoder"), ("thinker.visual.", "the vision tower"),
           ("talker.", "the talker (speech output)"), ("code2wav.", "the speech decoder"))


@dataclass(frozen=True)
class Qwen3OmniMoeConfig(Qwen3MoeConfig):
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3OmniMoeConfig":
        thinker = cfg.get("thinker_config")
        if not isinstance(thinker, dict) or not isinstance(thinker.get("text_config"), dict):
            raise ConfigError("config.json: qwen3_omni_moe without thinker_config.text_config; expected the "
                              "omni wrapper's config (Qwen3OmniMoeForConditionalGeneration)")
        text = {**thinker["text_config"], "model_type": "qwen3_omni_moe"}
        text.setdefault("norm_topk_prob", True)   # the text config's default
        if text.get("eos_token_id") is None:      # the chat's end: the wrapper's im_end
            text["eos_token_id"] = thinker.get("eos_token_id") or cfg.get("im_end_token_id")
        if thinker.get("tie_word_embeddings") is not None:
            text["tie_word_embeddings"] = thinker["tie_word_embeddings"]
        c = Qwen3MoeConfig.from_hf(text)
        return cls(**{**c.__dict__, "raw": cfg}, ignored_parts=SKIPPED)


Model = MoeDecoder
Config = Qwen3OmniMoeConfig
