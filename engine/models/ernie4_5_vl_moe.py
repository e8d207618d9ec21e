"""ERNIE-4.5-VL (ernie4_5_vl_moe: ERNIE-4.5-VL-28B-A3B, ERNIE-4.5-VL-424B-A47B): ERNIE-4.5's
language model (engine/models/ernie4_5_moe.py) inside an image-text wrapper, run on text. Its
MoE layers hold modality-isolated experts: a text token routes among the text experts alone
(experts 0..E-1, moe_intermediate_size[0] wide; the vision experts E..2E-1 and their router
gate.weight_1 are left unread). As released, the text router is stored transposed [H, E] and the
selection bias holds a row a modality [2, E]: dense_view gives the decoders ERNIE-4.5's layouts.
Text positions make its 3D RoPE ERNIE-4.5's RoPE over interleaved pairs. Both backends."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import ernie4_5_moe
from engine.models.base import MoeDecoder, expert_spec, layer_list, text_config  # noqa: F401
from engine.models.ernie4_5_moe import Ernie4_5MoeConfig
from engine.models.rope import ConfigError, rope_params
from engine.names import name

SKIPPED = (("model.vision_model.", "the vision tower"), ("model.resampler_model.", "the vision resampler"))


def _text(v):
    """A field given a value a modality (text first), or one value."""
    return v[0] if isinstance(v, list) else v


@dataclass(frozen=True)
class Ernie4_5VLMoeConfig(Ernie4_5MoeConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> "Ernie4_5VLMoeConfig":
        text = text_config(cfg, "ernie4_5_vl_moe", "Ernie4_5_VLMoeForConditionalGeneration")
        text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))   # the wrapper's flag rules
        kind = rope_params(text).get("rope_type", rope_params(text).get("type", "default"))
        if kind != "default":
            raise ConfigError(f"config.json: rope type {kind!r}; ernie4_5_vl_moe runs its default RoPE only")
        if "rope_theta" not in rope_params(text):
            text.setdefault("rope_theta", 500000.0)
        text.setdefault("rms_norm_eps", 1e-5)
        for key in ("moe_num_experts", "moe_intermediate_size", "moe_k"):
            if key in text:
                text[key] = _text(text[key])
        n = int(text["num_hidden_layers"])
        mlp = layer_list("mlp_layer_types", text.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1), n,
                         ("dense", "sparse"))
        c = Ernie4_5MoeConfig.from_hf(text)
        return cls(**{**c.__dict__, "raw": cfg, "moe_layers": tuple(l for l, t in enumerate(mlp) if t == "sparse"),
                      "ignored_parts": SKIPPED + c.ignored_parts})


def dense_spec(c: Ernie4_5VLMoeConfig) -> dict[str, tuple]:
    spec = ernie4_5_moe.dense_spec(c)
    for l in c.moe_layers:   # as released: the router transposed, a bias row a modality
        spec[name(c.family, "router", l)] = (c.hidden, c.n_experts)
        spec[name(c.family, "router_bias", l)] = (2, c.n_experts)
    return spec


def dense_view(c: Ernie4_5VLMoeConfig, n: str, a: np.ndarray) -> np.ndarray:
    """Checkpoint tensor n as the decoders read it: the text router [E, H], the text bias row."""
    if n.endswith(".mlp.gate.weight"):
        return np.ascontiguousarray(np.asarray(a).T)
    if n.endswith(".moe_statics.e_score_correction_bias"):
        return np.ascontiguousarray(np.asarray(a)[:1])
    return a


Model = MoeDecoder
Config = Ernie4_5VLMoeConfig
