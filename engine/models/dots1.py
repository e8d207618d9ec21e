"""dots.llm1 (rednote-hilab/dots.llm1): Qwen3's attention (per-head q/k RMSNorm) with DeepSeek-V3's
MoE (sigmoid routing with a selection bias and groups, scaled weights, shared experts, the first
layers dense)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec  # noqa: F401
from engine.models.glm4_moe import sigmoid_moe, with_experts
from engine.models.rope import ConfigError


@dataclass(frozen=True)
class Dots1Config(MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Dots1Config":
        cfg = with_experts(cfg)
        n = int(cfg.get("num_hidden_layers") or 0)
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= int(cfg.get("max_window_layers", 62))
            else "full_attention" for i in range(n)]
        if any(t != "full_attention" for t in types):
            raise ConfigError("config.json: sliding-window layers (layer_types / max_window_layers)"
                              " are not supported for dots1; the released model has none")
        f = MoeConfig.common_hf(cfg)
        f.update(sigmoid_moe(cfg, f, first_dense=0, shared=0, norm=False))   # the reference's
        return cls(**f, qk_norm="head")


Model = MoeDecoder
Config = Dots1Config
