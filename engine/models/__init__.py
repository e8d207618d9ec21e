"""Model families: model_type -> its family module. One small file per family.

A family module provides: `Config` (a frozen dataclass with from_hf(config_json_dict)), `Model`
(the forward pass over backend ops), `dense_spec(config)` and `expert_spec(config)` (every tensor
it reads, name -> shape: the completeness contract the loader checks); optionally
`dense_view(config, name, array)`, a checkpoint's dense tensor in the layout both backends'
decoders read, applied once at load (a release that stores one transposed; a layout the
decoders share: MiMo-V2-Flash's K / V rows in its cache's layout, MiniMax-M3's norms as 1 + w).
"""
from __future__ import annotations

from typing import NamedTuple

from engine.models import (afmoe, cohere2_moe, dbrx, deepseek_v2, deepseek_v3, deepseek_v4, deepseek_v32, dots1,
                           ernie4_5_moe, ernie4_5_vl_moe, exaone_moe, flex_olmo, glm4_moe, glm4_moe_lite, glm4v_moe,
                           glm_moe_dsa, gpt_oss, hunyuan_v1_moe, kimi_k25, llama4, mimo_v2_flash, minimax_m2,
                           minicpm5_moe, minimax_m3, mixtral, olmoe, phimoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next,
                           qwen3_omni_moe, qwen3_vl_moe, solar_open, step3p5)
from engine.models import granitemoe
from engine.models import nemotron_h
from engine.models import kimi_linear
from engine.models import granitemoehybrid
from engine.models import lfm2_moe
from engine.models import hy_v3
from engine.models import mistral4
from engine.models import longcat_flash
from engine.models import mistral_large4
from engine.models import dots3_note
from engine.models.rope import ConfigError

FAMILIES = {
    "qwen3_moe": qwen3_moe,
    "qwen3_vl_moe": qwen3_vl_moe,        # the image-text wrapper: its language model
    "qwen2_moe": qwen2_moe,
    "mixtral": mixtral,
    "olmoe": olmoe,
    "glm4_moe": glm4_moe,
    "dots1": dots1,
    "exaone_moe": exaone_moe,            # K-EXAONE: sliding layers with RoPE, full ones without
    "deepseek_v3": deepseek_v3,
    "deepseek_v2": deepseek_v2,
    "deepseek_v32": deepseek_v32,        # V3.2: V3 with DeepSeek Sparse Attention
    "deepseek_v4": deepseek_v4,          # V4-Flash / V4-Pro: compressed attention, hyper-connections (CPU backend)
    "glm4_moe_lite": glm4_moe_lite,      # GLM-4.7-Flash: DeepSeek-V3's attention and MoE
    "glm_moe_dsa": glm_moe_dsa,          # GLM-5: V3.2's sparse attention, top-k shared across layers
    "kimi_k25": kimi_k25,                # the image-text wrapper: its language model (deepseek_v3)
    "minimax_m2": minimax_m2,
    "ernie4_5_moe": ernie4_5_moe,
    "qwen3_next": qwen3_next,
    "qwen3_5_moe": qwen3_5_moe,          # the image-text wrapper: its language model
    "qwen3_5_moe_text": qwen3_5_moe,     # a text-only Qwen3.5-MoE folder
    "gpt_oss": gpt_oss,
    "cohere2_moe": cohere2_moe,          # Command A+
    "minimax_m3_vl": minimax_m3,         # MiniMax-M3: the image-text wrapper's language model
    "step3p5": step3p5,                  # Step-3.5-Flash
    "step3p7": step3p5,                  # Step-3.7-Flash: the image-text wrapper's language model
    "llama4": llama4,                    # Llama 4: the image-text wrapper's language model (CPU backend)
    "llama4_text": llama4,               # a text-only Llama 4 folder
    "solar_open": solar_open,            # Solar-Open-100B: DeepSeek-V3's MoE beside llama attention
    "hunyuan_v1_moe": hunyuan_v1_moe,    # Hunyuan-A13B: q / k norms after RoPE
    "hy_v3": hy_v3,                      # Hy3-preview: Qwen3's attention, DeepSeek-V3's routing without groups
    "mistral4": mistral4,                # Mistral Small 4: DeepSeek-V3's MLA, softmax routing in groups
    "mistral_large4": mistral_large4,    # Mistral Large 4: the image-text wrapper's language model, GLM-5's DSA (CPU backend)
    "dots3_note": dots3_note,            # dots.3 note: the omni wrapper's language model, DSA and sliding MLA layers (CPU backend)
    "dots3_note_text": dots3_note,       # a text-only dots.3 note folder
    "granitemoe": granitemoe,            # Granite MoE: muP multipliers on the embeddings, scores, branches, logits
    "granitemoeshared": granitemoe,      # Granite MoE with a shared expert
    "granitemoe_swa": granitemoe,        # Granite MoE with sliding-window layers and attention sinks
    "mimo_v2_flash": mimo_v2_flash,      # MiMo-V2-Flash: sliding layers with sinks, V heads narrower than K
    "afmoe": afmoe,                      # Arcee Trinity: sandwich norms, an attention output gate
    "glm4v_moe": glm4v_moe,              # GLM-4.5V / 4.6V: the image-text wrapper's language model (glm4_moe)
    "qwen3_omni_moe": qwen3_omni_moe,    # Qwen3-Omni: the thinker's language model, text in and out
    "ernie4_5_vl_moe": ernie4_5_vl_moe,  # ERNIE-4.5-VL: the language model's text experts
    "minicpm5_moe": minicpm5_moe,        # MiniCPM5-MoE: gated attention, DeepSeek-V3's MoE
    "flex_olmo": flex_olmo,              # FlexOlmo: OLMoE with norms after attention and the MLP
    "phimoe": phimoe,                    # Phi-3.5-MoE: LayerNorms, sparsemixer routing (CPU backend)
    "dbrx": dbrx,                        # DBRX: fused Wqkv, LayerNorms, p-normed top-k weights
    "nemotron_h": nemotron_h,            # Nemotron-3 Nano / Super: Mamba-2 + attention + relu^2 MoE (CPU backend)
    "kimi_linear": kimi_linear,          # Kimi-Linear: KDA + MLA without RoPE, DeepSeek-V3's MoE (CPU backend)
    "granitemoehybrid": granitemoehybrid,  # Granite 4.0 H: Mamba-2 + attention, Granite MoE's MLP (CPU backend)
    "lfm2_moe": lfm2_moe,                # LFM2-8B-A1B: gated short convs + attention, sigmoid routing (CPU backend)
    "longcat_flash": longcat_flash,      # LongCat-Flash: 2 MLA sublayers a layer, a shortcut MoE, zero experts (CPU backend)
}

# model types that are another family's architecture under their own name
ALIASES = {
    "kimi_k2": "deepseek_v3",            # Kimi-K2 / K2-Thinking: DeepseekV3ForCausalLM
}


class Family(NamedTuple):
    config: object
    model_cls: type
    dense_spec: dict
    expert_spec: dict
    dense_view: object = None   # fn(config, name, array) -> array, or None


def family_of(cfg: dict) -> Family:
    """The family of a config.json dict; refuses unknown model types by name."""
    mt = cfg.get("model_type")
    if mt in ALIASES:
        mt = ALIASES[mt]
        cfg = dict(cfg, model_type=mt)
    if mt not in FAMILIES:
        raise ConfigError(f"config.json: model_type {mt!r} is not supported; "
                          f"supported: {', '.join(sorted([*FAMILIES, *ALIASES]))}")
    mod = FAMILIES[mt]
    c = mod.Config.from_hf(cfg)
    return Family(c, mod.Model, mod.dense_spec(c), mod.expert_spec(c), getattr(mod, "dense_view", None))
