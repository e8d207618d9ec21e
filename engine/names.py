"""Checkpoint tensor names per family: the one table that maps them to engine names.

Templates take {l} (layer) and {e} (expert); experts are addressed as (layer, expert) everywhere.
"""
from __future__ import annotations

import re

_LLAMA_LIKE = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{l}.input_layernorm.weight",
    "mlp_norm": "model.layers.{l}.post_attention_layernorm.weight",
    "q": "model.layers.{l}.self_attn.q_proj.weight",
    "k": "model.layers.{l}.self_attn.k_proj.weight",
    "v": "model.layers.{l}.self_attn.v_proj.weight",
    "o": "model.layers.{l}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{l}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{l}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{l}.self_attn.v_proj.bias",
    "o_bias": "model.layers.{l}.self_attn.o_proj.bias",
    "q_norm": "model.layers.{l}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{l}.self_attn.k_norm.weight",
    "router": "model.layers.{l}.mlp.gate.weight",
    "expert_gate": "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "expert_up": "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
    "expert_down": "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
    "mlp_gate": "model.layers.{l}.mlp.gate_proj.weight",
    "mlp_up": "model.layers.{l}.mlp.up_proj.weight",
    "mlp_down": "model.layers.{l}.mlp.down_proj.weight",
}

# Qwen3-Next / Qwen3.5-MoE: gated attention (q_proj holds query and gate), Gated DeltaNet layers
# (linear_attn), a shared expert beside the routed ones. Qwen3-Next fuses the DeltaNet input
# projections per key head (dn_qkvz, dn_ba); Qwen3.5 keeps them apart (dn_qkv, dn_z, dn_b, dn_a).
_HYBRID = {
    **_LLAMA_LIKE,
    "shared_gate": "model.layers.{l}.mlp.shared_expert.gate_proj.weight",
    "shared_up": "model.layers.{l}.mlp.shared_expert.up_proj.weight",
    "shared_down": "model.layers.{l}.mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "model.layers.{l}.mlp.shared_expert_gate.weight",
    "dn_qkvz": "model.layers.{l}.linear_attn.in_proj_qkvz.weight",
    "dn_ba": "model.layers.{l}.linear_attn.in_proj_ba.weight",
    "dn_qkv": "model.layers.{l}.linear_attn.in_proj_qkv.weight",
    "dn_z": "model.layers.{l}.linear_attn.in_proj_z.weight",
    "dn_b": "model.layers.{l}.linear_attn.in_proj_b.weight",
    "dn_a": "model.layers.{l}.linear_attn.in_proj_a.weight",
    "dn_conv": "model.layers.{l}.linear_attn.conv1d.weight",
    "dn_A_log": "model.layers.{l}.linear_attn.A_log",
    "dn_dt_bias": "model.layers.{l}.linear_attn.dt_bias",
    "dn_norm": "model.layers.{l}.linear_attn.norm.weight",
    "dn_out": "model.layers.{l}.linear_attn.out_proj.weight",
}

# DeepSeek-V3's MoE names (GLM-4.5, dots.llm1): a selection bias beside the router, ungated shared
# experts.
_SIGMOID_MOE = {
    **_LLAMA_LIKE,
    "router_bias": "model.layers.{l}.mlp.gate.e_score_correction_bias",
    "shared_gate": "model.layers.{l}.mlp.shared_experts.gate_proj.weight",
    "shared_up": "model.layers.{l}.mlp.shared_experts.up_proj.weight",
    "shared_down": "model.layers.{l}.mlp.shared_experts.down_proj.weight",
}

# DeepSeek-V3: multi-head latent attention (low-rank q, a shared latent for k and v) and the MoE
# above.
_DEEPSEEK_V3 = {
    **_SIGMOID_MOE,
    "q_a": "model.layers.{l}.self_attn.q_a_proj.weight",
    "q_a_bias": "model.layers.{l}.self_attn.q_a_proj.bias",
    "q_a_norm": "model.layers.{l}.self_attn.q_a_layernorm.weight",
    "q_b": "model.layers.{l}.self_attn.q_b_proj.weight",
    "kv_a": "model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_bias": "model.layers.{l}.self_attn.kv_a_proj_with_mqa.bias",
    "kv_a_norm": "model.layers.{l}.self_attn.kv_a_layernorm.weight",
    "kv_b": "model.layers.{l}.self_attn.kv_b_proj.weight",
}

# DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): DeepSeek-V3's names and the lightning indexer's
_DSA = {**_DEEPSEEK_V3, **{k: "model.layers.{l}.self_attn.indexer." + v for k, v in (
    ("idx_wq_b", "wq_b.weight"), ("idx_wk", "wk.weight"), ("idx_k_norm", "k_norm.weight"),
    ("idx_k_norm_bias", "k_norm.bias"), ("idx_w", "weights_proj.weight"))}}

# dots.3 note: DSA's names, a sigmoid gate a head on the attention output (g_proj), the rotated
# key's own RMSNorm (k_rope_only_layernorm)
_DOTS3 = {**_DSA, "g": "model.layers.{l}.self_attn.g_proj.weight",
          "k_rope_norm": "model.layers.{l}.self_attn.k_rope_only_layernorm.weight"}

# Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): a sigmoid-gated shared expert, the hybrids' names.
_QWEN2_MOE = {**_LLAMA_LIKE, **{k: _HYBRID[k] for k in ("shared_gate", "shared_up", "shared_down",
                                                        "shared_expert_gate")}}

# gpt-oss: biased router (mlp.router), attention sinks, expert biases. Its fused experts are
# exposed by loader/checkpoint.py under the per-expert names below.
_GPT_OSS = {
    **_LLAMA_LIKE,
    "sinks": "model.layers.{l}.self_attn.sinks",
    "router": "model.layers.{l}.mlp.router.weight",
    "router_bias": "model.layers.{l}.mlp.router.bias",
    "expert_gate_bias": "model.layers.{l}.mlp.experts.{e}.gate_proj.bias",
    "expert_up_bias": "model.layers.{l}.mlp.experts.{e}.up_proj.bias",
    "expert_down_bias": "model.layers.{l}.mlp.experts.{e}.down_proj.bias",
}

_MIXTRAL = {
    **_LLAMA_LIKE,
    "router": "model.layers.{l}.block_sparse_moe.gate.weight",
    "expert_gate": "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
    "expert_up": "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
    "expert_down": "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
}

# DeepSeek-V4: the released checkpoint's names (transformers renames them as it loads)
_V4_LAYER = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn_fn", "hc_attn_base": "hc_attn_base", "hc_attn_scale": "hc_attn_scale",
    "hc_ffn_fn": "hc_ffn_fn", "hc_ffn_base": "hc_ffn_base", "hc_ffn_scale": "hc_ffn_scale",
    "q_a": "attn.wq_a.weight", "q_a_norm": "attn.q_norm.weight", "q_b": "attn.wq_b.weight",
    "kv": "attn.wkv.weight", "kv_norm": "attn.norm.weight", "o_a": "attn.wo_a.weight",
    "o_b": "attn.wo_b.weight", "sinks": "attn.attn_sink",
    "cmp_kv": "attn.compressor.wkv.weight", "cmp_gate": "attn.compressor.wgate.weight",
    "cmp_ape": "attn.compressor.ape", "cmp_norm": "attn.compressor.norm.weight",
    "idx_kv": "attn.indexer.compressor.wkv.weight", "idx_gate": "attn.indexer.compressor.wgate.weight",
    "idx_ape": "attn.indexer.compressor.ape", "idx_norm": "attn.indexer.compressor.norm.weight",
    "idx_q": "attn.indexer.wq_b.weight", "idx_w": "attn.indexer.weights_proj.weight",
    "router": "ffn.gate.weight", "router_bias": "ffn.gate.bias", "hash": "ffn.gate.tid2eid",
    "shared_gate": "ffn.shared_experts.w1.weight", "shared_up": "ffn.shared_experts.w3.weight",
    "shared_down": "ffn.shared_experts.w2.weight",
    "expert_gate": "ffn.experts.{e}.w1.weight", "expert_up": "ffn.experts.{e}.w3.weight",
    "expert_down": "ffn.experts.{e}.w2.weight",
}
_DEEPSEEK_V4 = {"embed": "embed.weight", "final_norm": "norm.weight", "lm_head": "head.weight",
                "hc_head_fn": "hc_head_fn", "hc_head_base": "hc_head_base", "hc_head_scale": "hc_head_scale",
                **{k: "layers.{l}." + v for k, v in _V4_LAYER.items()}}

# Step-3.5 / 3.7: a gate a head; each expert projection stacked alone under .moe. (per-expert
# views: loader/checkpoint.py _STACKED), the shared expert as share_expert
_STEP = {**_LLAMA_LIKE, "g": "model.layers.{l}.self_attn.g_proj.weight",
         "router": "model.layers.{l}.moe.gate.weight", "router_bias": "model.layers.{l}.moe.router_bias",
         "shared_gate": "model.layers.{l}.share_expert.gate_proj.weight",
         "shared_up": "model.layers.{l}.share_expert.up_proj.weight",
         "shared_down": "model.layers.{l}.share_expert.down_proj.weight",
         "expert_gate": "model.layers.{l}.moe.{e}.gate_proj.weight",
         "expert_up": "model.layers.{l}.moe.{e}.up_proj.weight",
         "expert_down": "model.layers.{l}.moe.{e}.down_proj.weight"}

# MiniMax-M3's wrapper as saved: Mixtral's expert names, a shared expert, the indexer's, all
# under language_model.
_M3 = {k: v.replace("model.", "language_model.model.", 1) if v.startswith("model.") else "language_model." + v
       for k, v in {**_MIXTRAL,
                    "router_bias": "model.layers.{l}.block_sparse_moe.e_score_correction_bias",
                    "shared_gate": "model.layers.{l}.block_sparse_moe.shared_experts.gate_proj.weight",
                    "shared_up": "model.layers.{l}.block_sparse_moe.shared_experts.up_proj.weight",
                    "shared_down": "model.layers.{l}.block_sparse_moe.shared_experts.down_proj.weight",
                    "idx_q": "model.layers.{l}.self_attn.index_q_proj.weight",
                    "idx_k": "model.layers.{l}.self_attn.index_k_proj.weight",
                    "idx_q_norm": "model.layers.{l}.self_attn.index_q_norm.weight",
                    "idx_k_norm": "model.layers.{l}.self_attn.index_k_norm.weight"}.items()}

# Llama 4: the MLPs under feed_forward (router, a shared expert, the experts fused and
# transposed: loader/checkpoint.py exposes them under the per-expert names below)
_LLAMA4 = {**{k: v.replace(".mlp.", ".feed_forward.") for k, v in _LLAMA_LIKE.items()},
           "router": "model.layers.{l}.feed_forward.router.weight",
           "shared_gate": "model.layers.{l}.feed_forward.shared_expert.gate_proj.weight",
           "shared_up": "model.layers.{l}.feed_forward.shared_expert.up_proj.weight",
           "shared_down": "model.layers.{l}.feed_forward.shared_expert.down_proj.weight"}

# Hunyuan-A13B: q / k norms named query_layernorm / key_layernorm, the router under mlp.gate.wg,
# the shared expert as shared_mlp
_HUNYUAN = {**_LLAMA_LIKE,
            "q_norm": "model.layers.{l}.self_attn.query_layernorm.weight",
            "k_norm": "model.layers.{l}.self_attn.key_layernorm.weight",
            "router": "model.layers.{l}.mlp.gate.wg.weight",
            "shared_gate": "model.layers.{l}.mlp.shared_mlp.gate_proj.weight",
            "shared_up": "model.layers.{l}.mlp.shared_mlp.up_proj.weight",
            "shared_down": "model.layers.{l}.mlp.shared_mlp.down_proj.weight"}

# Hy3-preview as released (and as transformers saves it): Qwen3's attention names, the router
# under mlp.router.gate, its selection bias mlp.expert_bias, the shared expert shared_mlp
# (transformers' own names read as these: loader/checkpoint.py RENAMED)
_HY_V3 = {**_LLAMA_LIKE,
          "router": "model.layers.{l}.mlp.router.gate.weight",
          "router_bias": "model.layers.{l}.mlp.expert_bias",
          "shared_gate": "model.layers.{l}.mlp.shared_mlp.gate_proj.weight",
          "shared_up": "model.layers.{l}.mlp.shared_mlp.up_proj.weight",
          "shared_down": "model.layers.{l}.mlp.shared_mlp.down_proj.weight"}

# Granite MoE: the MoE under block_sparse_moe, the router's weight and the fused experts as
# transformers names them (loader/checkpoint.py renames the releases' input_linear /
# output_linear / router.layer), the shared expert's gate and up rows split from
# shared_mlp.input_linear, granitemoe_swa's sinks
_GRANITEMOE = {**_LLAMA_LIKE, "router": "model.layers.{l}.block_sparse_moe.router.weight",
               "expert_gate": "model.layers.{l}.block_sparse_moe.experts.{e}.gate_proj.weight",
               "expert_up": "model.layers.{l}.block_sparse_moe.experts.{e}.up_proj.weight",
               "expert_down": "model.layers.{l}.block_sparse_moe.experts.{e}.down_proj.weight",
               "shared_gate": "model.layers.{l}.shared_mlp.gate_proj.weight",
               "shared_up": "model.layers.{l}.shared_mlp.up_proj.weight",
               "shared_down": "model.layers.{l}.shared_mlp.output_linear.weight",
               "sinks": "model.layers.{l}.self_attn.sinks"}

# Granite 4.0 hybrid: Granite MoE's names, the Mamba-2 mixer's under mamba. (Nemotron-H's keys)
_GRANITEMOEHYBRID = {**_GRANITEMOE, **{k: "model.layers.{l}.mamba." + v for k, v in (
    ("m_in", "in_proj.weight"), ("m_conv", "conv1d.weight"), ("m_conv_bias", "conv1d.bias"), ("m_A_log", "A_log"),
    ("m_D", "D"), ("m_dt_bias", "dt_bias"), ("m_norm", "norm.weight"), ("m_out", "out_proj.weight"))}}

# MiMo-V2-Flash: DeepSeek-V3's router names, no shared experts, the sliding layers' sinks
_MIMO = {**_LLAMA_LIKE, "router_bias": "model.layers.{l}.mlp.gate.e_score_correction_bias",
         "sinks": "model.layers.{l}.self_attn.attention_sink_bias"}

# AFMoE (Arcee Trinity): norms before and after attention and MLP (post_attention_layernorm is
# the attention OUTPUT's), an output gate, the router and its bias under mlp
_AFMOE = {**_LLAMA_LIKE,
          "mlp_norm": "model.layers.{l}.pre_mlp_layernorm.weight",
          "post_attn_norm": "model.layers.{l}.post_attention_layernorm.weight",
          "post_mlp_norm": "model.layers.{l}.post_mlp_layernorm.weight",
          "attn_gate": "model.layers.{l}.self_attn.gate_proj.weight",
          "router": "model.layers.{l}.mlp.router.gate.weight",
          "router_bias": "model.layers.{l}.mlp.expert_bias",
          "shared_gate": "model.layers.{l}.mlp.shared_experts.gate_proj.weight",
          "shared_up": "model.layers.{l}.mlp.shared_experts.up_proj.weight",
          "shared_down": "model.layers.{l}.mlp.shared_experts.down_proj.weight"}

# FlexOlmo: OLMo-2's norms after attention and the MLP (post_attention_layernorm is the
# attention OUTPUT's), none before (no attn_norm / mlp_norm: flex_olmo.dense_spec)
_FLEX_OLMO = {**_LLAMA_LIKE,
              "post_attn_norm": "model.layers.{l}.post_attention_layernorm.weight",
              "post_mlp_norm": "model.layers.{l}.post_feedforward_layernorm.weight"}

# Phi-3.5-MoE: Mixtral's names, LayerNorms with bias, an lm_head bias
_PHIMOE = {**_MIXTRAL,
           "attn_norm_bias": "model.layers.{l}.input_layernorm.bias",
           "mlp_norm_bias": "model.layers.{l}.post_attention_layernorm.bias",
           "final_norm_bias": "model.norm.bias", "lm_head_bias": "lm_head.bias"}

# DBRX: q | k | v fused in Wqkv, LayerNorms norm_1 / norm_2 / norm_f, the experts fused flat per
# projection (w1 gate, v1 up, w2 down transposed): loader/checkpoint.py exposes each expert's under
# the per-expert names below
_DBRX = {"embed": "transformer.wte.weight", "final_norm": "transformer.norm_f.weight", "lm_head": "lm_head.weight",
         **{k: "transformer.blocks.{l}." + v for k, v in (
             ("attn_norm", "norm_attn_norm.norm_1.weight"), ("mlp_norm", "norm_attn_norm.norm_2.weight"),
             ("qkv", "norm_attn_norm.attn.Wqkv.weight"), ("o", "norm_attn_norm.attn.out_proj.weight"),
             ("router", "ffn.router.layer.weight"), ("expert_gate", "ffn.experts.mlp.{e}.w1"),
             ("expert_up", "ffn.experts.mlp.{e}.v1"), ("expert_down", "ffn.experts.mlp.{e}.w2"))}}
# Nemotron-H: one mixer a block (Mamba-2, attention, MoE or MLP) under backbone.; ungated experts
# (no expert_gate: expert_names gives None), a latent projection around them (Super)
_NEMOTRON_H = {"embed": "backbone.embeddings.weight", "final_norm": "backbone.norm_f.weight",
               "lm_head": "lm_head.weight", "norm": "backbone.layers.{l}.norm.weight",
               **{k: "backbone.layers.{l}.mixer." + v for k, v in (
                   ("q", "q_proj.weight"), ("k", "k_proj.weight"), ("v", "v_proj.weight"), ("o", "o_proj.weight"),
                   ("m_in", "in_proj.weight"), ("m_conv", "conv1d.weight"), ("m_conv_bias", "conv1d.bias"),
                   ("m_A_log", "A_log"), ("m_D", "D"), ("m_dt_bias", "dt_bias"), ("m_norm", "norm.weight"),
                   ("m_out", "out_proj.weight"), ("router", "gate.weight"),
                   ("router_bias", "gate.e_score_correction_bias"), ("shared_up", "shared_experts.up_proj.weight"),
                   ("shared_down", "shared_experts.down_proj.weight"), ("latent_in", "fc1_latent_proj.weight"),
                   ("latent_out", "fc2_latent_proj.weight"), ("mlp_up", "up_proj.weight"),
                   ("mlp_down", "down_proj.weight"), ("expert_up", "experts.{e}.up_proj.weight"),
                   ("expert_down", "experts.{e}.down_proj.weight"))}}
# Kimi-Linear as released: DeepSeek-V3's MLA names; the KDA layers' projections under self_attn
# (q_proj / k_proj / v_proj / o_proj as "q" / "k" / "v" / "o", a short conv each, the forget gate's
# f_a / f_b / A_log / dt_bias, beta's b_proj, the output gate's g_a / g_b, o_norm); the routed
# layers under block_sparse_moe (Mixtral's expert names), the dense layers' MLP under mlp
_KIMI_LINEAR = {
    **_DEEPSEEK_V3,
    **{k: v.replace(".mlp.", ".block_sparse_moe.") for k, v in _SIGMOID_MOE.items()
       if k in ("router", "router_bias", "shared_gate", "shared_up", "shared_down")},
    **{k: _MIXTRAL[k] for k in ("expert_gate", "expert_up", "expert_down")},
    **{k: "model.layers.{l}.self_attn." + v for k, v in (
        ("kda_q_conv", "q_conv1d.weight"), ("kda_k_conv", "k_conv1d.weight"), ("kda_v_conv", "v_conv1d.weight"),
        ("kda_f_a", "f_a_proj.weight"), ("kda_f_b", "f_b_proj.weight"), ("kda_A_log", "A_log"),
        ("kda_dt_bias", "dt_bias"), ("kda_b", "b_proj.weight"), ("kda_g_a", "g_a_proj.weight"),
        ("kda_g_b", "g_b_proj.weight"), ("kda_norm", "o_norm.weight"))},
}

# LFM2-MoE (LFM2-8B-A1B): the norms operator_norm / ffn_norm a layer and embedding_norm last;
# attention's out_proj and q / k norms (q_layernorm / k_layernorm); the gated short conv's in_proj
# (B | C | x), depthwise conv and out_proj under conv.; the MLPs under feed_forward (w1 gate, w3
# up, w2 down; the experts' the same under experts.{e}), the router gate with expert_bias beside it
_LFM2_MOE = {
    **_LLAMA_LIKE,
    "final_norm": "model.embedding_norm.weight",
    **{k: "model.layers.{l}." + v for k, v in (
        ("attn_norm", "operator_norm.weight"), ("mlp_norm", "ffn_norm.weight"),
        ("o", "self_attn.out_proj.weight"), ("q_norm", "self_attn.q_layernorm.weight"),
        ("k_norm", "self_attn.k_layernorm.weight"),
        ("conv_in", "conv.in_proj.weight"), ("conv_in_bias", "conv.in_proj.bias"), ("conv", "conv.conv.weight"),
        ("conv_bias", "conv.conv.bias"), ("conv_out", "conv.out_proj.weight"), ("conv_out_bias", "conv.out_proj.bias"),
        ("router", "feed_forward.gate.weight"), ("router_bias", "feed_forward.expert_bias"),
        ("mlp_gate", "feed_forward.w1.weight"), ("mlp_up", "feed_forward.w3.weight"),
        ("mlp_down", "feed_forward.w2.weight"), ("expert_gate", "feed_forward.experts.{e}.w1.weight"),
        ("expert_up", "feed_forward.experts.{e}.w3.weight"), ("expert_down", "feed_forward.experts.{e}.w2.weight"))},
}

# LongCat-Flash: each layer two sublayers j (0, 1), each with its norms (input_layernorm.j before
# attention, post_attention_layernorm.j before the MLP), DeepSeek-V3's MLA (self_attn.j) and a
# dense MLP (mlps.j), keyed "<key>.<j>"; one MoE a layer under mlp (the router's classifier and
# its selection bias, the routed experts)
_LONGCAT_FLASH = {
    **{k: _LLAMA_LIKE[k] for k in ("embed", "final_norm", "lm_head", "expert_gate", "expert_up", "expert_down")},
    "router": "model.layers.{l}.mlp.router.classifier.weight",
    "router_bias": "model.layers.{l}.mlp.router.e_score_correction_bias",
    **{f"{k}.{j}": f"model.layers.{{l}}.{v.format(j=j)}" for j in (0, 1) for k, v in (
        ("attn_norm", "input_layernorm.{j}.weight"), ("mlp_norm", "post_attention_layernorm.{j}.weight"),
        ("q_a", "self_attn.{j}.q_a_proj.weight"), ("q_a_bias", "self_attn.{j}.q_a_proj.bias"),
        ("q_a_norm", "self_attn.{j}.q_a_layernorm.weight"), ("q_b", "self_attn.{j}.q_b_proj.weight"),
        ("kv_a", "self_attn.{j}.kv_a_proj_with_mqa.weight"), ("kv_a_bias", "self_attn.{j}.kv_a_proj_with_mqa.bias"),
        ("kv_a_norm", "self_attn.{j}.kv_a_layernorm.weight"), ("kv_b", "self_attn.{j}.kv_b_proj.weight"),
        ("o", "self_attn.{j}.o_proj.weight"), ("o_bias", "self_attn.{j}.o_proj.bias"),
        ("mlp_gate", "mlps.{j}.gate_proj.weight"), ("mlp_up", "mlps.{j}.up_proj.weight"),
        ("mlp_down", "mlps.{j}.down_proj.weight"))},
}

# Mistral Large 4's wrapper as released (and as transformers saves it): Mistral's own names at the
# top level (tok_embeddings, layers.{l}.attention.wq / wkv_a_with_mqa / wkv_b / wo, the norms
# attention_norm / ffn_norm, feed_forward and the experts as w1 gate / w3 up / w2 down); LeRoPE's
# alpha (lerope.alpha); the queries' scales by position (ssmax_scaling s / b), the indexer's too
_MISTRAL_LARGE4 = {
    "embed": "tok_embeddings.weight", "final_norm": "norm.weight", "lm_head": "output.weight",
    "rope_alpha": "lerope.alpha",
    **{k: "layers.{l}." + v for k, v in (
        ("attn_norm", "attention_norm.weight"), ("mlp_norm", "ffn_norm.weight"),
        ("q", "attention.wq.weight"), ("kv_a", "attention.wkv_a_with_mqa.weight"),
        ("kv_a_bias", "attention.wkv_a_with_mqa.bias"), ("kv_a_norm", "attention.kv_a_norm.weight"),
        ("kv_b", "attention.wkv_b.weight"), ("o", "attention.wo.weight"), ("o_bias", "attention.wo.bias"),
        ("q_scale", "attention.ssmax_scaling.s"), ("q_scale_bias", "attention.ssmax_scaling.b"),
        ("idx_q_norm", "attention.indexer.q_input_norm.weight"),
        ("idx_q_norm_bias", "attention.indexer.q_input_norm.bias"), ("idx_wq_b", "attention.indexer.wq_b.weight"),
        ("idx_wk", "attention.indexer.wk.weight"), ("idx_k_norm", "attention.indexer.k_norm.weight"),
        ("idx_k_norm_bias", "attention.indexer.k_norm.bias"), ("idx_w", "attention.indexer.weights_proj.weight"),
        ("idx_q_scale", "attention.indexer.ssmax_scaling.s"), ("idx_q_scale_bias", "attention.indexer.ssmax_scaling.b"),
        ("router", "gate.weight"), ("shared_gate", "shared_experts.w1.weight"),
        ("shared_up", "shared_experts.w3.weight"), ("shared_down", "shared_experts.w2.weight"),
        ("mlp_gate", "feed_forward.w1.weight"), ("mlp_up", "feed_forward.w3.weight"),
        ("mlp_down", "feed_forward.w2.weight"), ("expert_gate", "experts.{e}.w1.weight"),
        ("expert_up", "experts.{e}.w3.weight"), ("expert_down", "experts.{e}.w2.weight"))},
}

NAMES: dict[str, dict[str, str]] = {
    "qwen3_moe": _LLAMA_LIKE,
    "qwen2_moe": _QWEN2_MOE,
    "olmoe": _LLAMA_LIKE,
    "mixtral": _MIXTRAL,
    # MiniMax-M2: Mixtral's names and a selection bias beside the router
    "minimax_m2": {**_MIXTRAL,
                   "router_bias": "model.layers.{l}.block_sparse_moe.e_score_correction_bias"},
    "glm4_moe": _SIGMOID_MOE,
    "dots1": _SIGMOID_MOE,
    # K-EXAONE: its selection bias beside the router, not under it
    "exaone_moe": {**_SIGMOID_MOE, "router_bias": "model.layers.{l}.mlp.e_score_correction_bias"},
    "deepseek_v3": _DEEPSEEK_V3,
    "deepseek_v2": _DEEPSEEK_V3,
    "glm4_moe_lite": _DEEPSEEK_V3,
    "mistral4": _DEEPSEEK_V3,   # Mistral Small 4: no selection bias (softmax routing)
    "mistral_large4": _MISTRAL_LARGE4,
    "qwen3_next": _HYBRID,
    "gpt_oss": _GPT_OSS,
    "qwen3_5_moe_text": _HYBRID,
    # the image-text wrapper (Qwen3_5MoeForConditionalGeneration): its language model, under
    # model.language_model.
    "qwen3_5_moe": {k: v.replace("model.", "model.language_model.", 1) for k, v in _HYBRID.items()},
    "qwen3_vl_moe": {k: v.replace("model.", "model.language_model.", 1) for k, v in _LLAMA_LIKE.items()},
    # DeepSeek-V3.2 and GLM-5: V3's names and the DSA indexer's
    "deepseek_v32": _DSA,
    "glm_moe_dsa": _DSA,
    # dots.3 note: the omni wrapper as released (and as transformers saves it: the language
    # model's names at model., beside vision_encoder. and audio_encoder.), or a text-only folder
    "dots3_note": _DOTS3,
    "dots3_note_text": _DOTS3,
    "deepseek_v4": _DEEPSEEK_V4,
    "step3p5": _STEP,
    "cohere2_moe": _SIGMOID_MOE,   # llama-like, shared experts as DeepSeek-V3 names them
    "minimax_m3_vl": _M3,
    "step3p7": _STEP,
    # Kimi-K2.5's wrapper as released: DeepSeek-V3's names under language_model.
    "kimi_k25": {k: "language_model." + v for k, v in _DEEPSEEK_V3.items()},
    "solar_open": _SIGMOID_MOE,
    "minicpm5_moe": _SIGMOID_MOE,   # q_proj holds each head's query and gate
    # ERNIE-4.5-VL: ERNIE-4.5's names (its text router and bias: ernie4_5_vl_moe.dense_view)
    "ernie4_5_vl_moe": {**_SIGMOID_MOE, "router_bias": "model.layers.{l}.mlp.moe_statics.e_score_correction_bias"},
    # Qwen3-Omni: the thinker's language model under thinker.
    "qwen3_omni_moe": {k: "thinker." + v for k, v in _LLAMA_LIKE.items()},
    # GLM-4.5V / 4.6V: GLM-4.5's names under the wrapper's model.language_model.
    "glm4v_moe": {k: v.replace("model.", "model.language_model.", 1) for k, v in _SIGMOID_MOE.items()},
    "mimo_v2_flash": _MIMO,
    "afmoe": _AFMOE,
    "flex_olmo": _FLEX_OLMO,
    "phimoe": _PHIMOE,
    "dbrx": _DBRX,
    "hunyuan_v1_moe": _HUNYUAN,
    "hy_v3": _HY_V3,
    "granitemoe": _GRANITEMOE,
    "granitemoeshared": _GRANITEMOE,
    "granitemoe_swa": _GRANITEMOE,
    "granitemoehybrid": _GRANITEMOEHYBRID,
    "kimi_linear": _KIMI_LINEAR,
    "lfm2_moe": _LFM2_MOE,
    "longcat_flash": _LONGCAT_FLASH,
    # Llama 4: the text-only folder, and the image-text wrapper's language model
    "llama4_text": _LLAMA4,
    "llama4": {k: "language_model." + v for k, v in _LLAMA4.items()},
    "nemotron_h": _NEMOTRON_H,
    # ERNIE-4.5: the shared experts' names of DeepSeek-V3, its selection bias under moe_statics
    "ernie4_5_moe": {**_SIGMOID_MOE,
                     "router_bias": "model.layers.{l}.mlp.moe_statics.e_score_correction_bias"},
}


def name(family: str, key: str, layer: int | None = None, expert: int | None = None) -> str:
    return NAMES[family][key].format(l=layer, e=expert)


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def key_of(family: str, n: str, keys) -> tuple[str, int | None] | None:
    """(key, layer) of dense checkpoint name n where it is one of `keys` (name()'s inverse, for a
    family's dense_view), else None."""
    m = _LAYER.search(n)
    layer = int(m.group(1)) if m else None
    table = NAMES[family]
    return next(((k, layer) for k in keys if k in table and name(family, k, layer) == n), None)


def expert_names(family: str, layer: int, expert: int) -> tuple[str | None, str, str]:
    """(gate, up, down) checkpoint names of one expert; gate None where the family's experts have
    none (Nemotron-H's up -> relu^2 -> down)."""
    return tuple(name(family, k, layer, expert) if k in NAMES[family] else None
                 for k in ("expert_gate", "expert_up", "expert_down"))
