"""Checkpoint tensor names per family: the one table that maps them to engine names.

Templates take {l} (layer) and {e} (expert); experts are addressed as (layer, expert) everywhere.
"""
from __future__ import annotations

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

NAMES: dict[str, dict[str, str]] = {
    "qwen3_moe": _LLAMA_LIKE,
    "olmoe": _LLAMA_LIKE,
    "mixtral": {
        **_LLAMA_LIKE,
        "router": "model.layers.{l}.block_sparse_moe.gate.weight",
        "expert_gate": "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
        "expert_up": "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
        "expert_down": "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
    },
}


def name(family: str, key: str, layer: int | None = None, expert: int | None = None) -> str:
    return NAMES[family][key].format(l=layer, e=expert)


def expert_names(family: str, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) checkpoint names of one expert."""
    return tuple(name(family, k, layer, expert) for k in ("expert_gate", "expert_up", "expert_down"))
