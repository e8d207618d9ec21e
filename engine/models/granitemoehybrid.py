"""IBM Granite 4.0 hybrid (granitemoehybrid: granite-4.0-h-small 32B-A9B, -h-tiny 7B-A1B, and the
dense -h-micro). CPU backend.

Each layer x += r * mixer(rmsnorm(x)), then x += r * mlp(rmsnorm(x)) (r = residual_multiplier),
the mixer one of
- "mamba" (linear_attention): Nemotron-H's Mamba-2 mixer, the same math (in_proj -> z | xBC | dt,
  the causal conv with bias and SiLU, the selective scan with groups, D and dt_bias, the gated
  group norm, gate first, out_proj): nemotron_h.NemotronHDecoder.mamba and CpuOps.mamba;
- "attention" (full_attention): causal GQA attention, scores times attention_multiplier, RoPE
  where position_embedding_type is "rope", none otherwise (the releases: "nope"); q / k / v / o
  biases where attention_bias;
and the MLP Granite MoE's: top-k of softmax-routed SwiGLU experts (the releases' fused
block_sparse_moe.input_linear / output_linear / router.layer, read under transformers' names:
loader/checkpoint.py RENAMED) plus the shared expert (shared_mlp: input_linear holds its gate,
then its up rows); with num_local_experts 0 (-h-micro) the shared MLP alone, a dense layer.
The embeddings are times embedding_multiplier, the logits divided by logits_scaling.

Legend: T = tokens, H = hidden, D = head dim, Hq / Hkv = attention heads; the Mamba axes are
nemotron_h's (Hm heads of P, G groups, N state, C conv channels, Kc conv width).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, layer_list, need
from engine.models.granitemoe import multipliers
from engine.models.hybrid import FULL, LINEAR
from engine.models.nemotron_h import LEGACY, NemotronHConfig, NemotronHDecoder, _float, mamba_spec
from engine.models.rope import ConfigError
from engine.names import name

ROPE_TYPES = (None, "nope", "rope")   # position_embedding_type: transformers rotates only for "rope"


@dataclass(frozen=True)
class GraniteMoeHybridConfig(NemotronHConfig):
    """Nemotron-H's hybrid fields (kinds: LINEAR or FULL a layer; the Mamba sizes, which size
    the run state hybrid.HybridState) with Granite's multipliers and gated (SwiGLU) experts."""
    embedding_multiplier: float = 1.0   # the embeddings' scale
    residual_multiplier: float = 1.0    # each branch's output scale before its residual add
    logits_scaling: float = 1.0         # the logits' divisor

    @property
    def gated_experts(self) -> bool:
        return True

    @classmethod
    def from_hf(cls, cfg: dict) -> "GraniteMoeHybridConfig":
        cfg = dict(cfg)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":   # the MLPs' and the Mamba mixer's activation alike
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported; granitemoehybrid runs silu")
        n = int(need(cfg, "num_hidden_layers"))
        types = cfg.get("layer_types", cfg.get("layers_block_type"))
        if types is None:   # transformers' default: every layer Mamba
            types = [LINEAR] * n
        if isinstance(types, (list, tuple)):
            types = [LEGACY.get(t, t) for t in types]   # the releases write mamba / attention
        kinds = tuple(layer_list("layer_types", types, n, (LINEAR, FULL)))
        pe = cfg.get("position_embedding_type")
        if pe not in ROPE_TYPES:
            raise ConfigError(f"config.json: position_embedding_type {pe!r} is not supported; "
                              "expected \"rope\", \"nope\" or null (no position encoding)")
        if cfg.get("mamba_proj_bias"):
            raise ConfigError("config.json: mamba_proj_bias=true is not supported (false, as released)")
        limit = cfg.get("time_step_limit")
        limit = (0.0, math.inf) if limit is None else limit
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise ConfigError(f"config.json: time_step_limit must be [min, max]; got {limit!r}")
        limit = (_float(limit[0]), _float(limit[1]))
        if limit != (0.0, math.inf):
            # the reference clamps dt in its chunked (prefill) scan, not in its one-token step
            raise ConfigError(f"config.json: time_step_limit={list(limit)} is not supported "
                              "([0.0, Infinity] only, as released)")
        hidden = int(need(cfg, "hidden_size"))
        hm, groups = int(cfg.get("mamba_n_heads") or 128), int(cfg.get("mamba_n_groups") or 1)
        inner = int(cfg.get("mamba_expand") or 2) * hidden
        d_head = cfg.get("mamba_d_head", "auto")
        d_head = inner // hm if d_head in (None, "auto") else int(d_head)
        if LINEAR in kinds and (d_head * hm != inner or hm % groups):
            raise ConfigError(f"config.json: mamba_n_heads={hm} x mamba_d_head={d_head} must be "
                              f"mamba_expand x hidden_size={inner}, and mamba_n_heads a multiple of "
                              f"mamba_n_groups={groups}")
        n_experts = int(cfg.get("num_local_experts") if cfg.get("num_local_experts") is not None else 8)
        if n_experts < 0:
            raise ConfigError(f"config.json: num_local_experts={n_experts}; expected 0 (dense) or more")
        shared = cfg.get("shared_intermediate_size")
        shared = 1024 if shared is None else int(shared)   # transformers' default
        if shared < 1:   # the reference builds the shared MLP in every layer
            raise ConfigError(f"config.json: shared_intermediate_size={shared}; expected a positive size")
        m = multipliers(cfg)
        common = dict(cfg)
        common.setdefault("max_position_embeddings", 2048)   # transformers' default
        if pe != "rope":   # no RoPE is applied; its parameters, if any, are not read
            for key in ("rope_parameters", "rope_scaling", "partial_rotary_factor"):
                common.pop(key, None)
        # num_local_experts 0: the shared MLP alone in every layer (moe_layers empty, no experts
        # for the arena); common_hf then reads one expert of top-1, never used
        common.update(num_local_experts=n_experts or 1,
                      num_experts_per_tok=cfg.get("num_experts_per_tok", 2) if n_experts else 1)
        f = MoeConfig.common_hf(common)
        f.update(score_scale=m["attention_multiplier"],
                 moe_layers=tuple(range(n)) if n_experts else (),
                 nope_layers=() if pe == "rope" else tuple(range(n)))
        return cls(**f, kinds=kinds, moe_intermediate=int(need(cfg, "intermediate_size")) if n_experts else 0,
                   shared_intermediate=shared,
                   norm_topk_prob=True, mamba_heads=hm, mamba_head_dim=d_head, n_groups=groups,
                   ssm_state=int(cfg.get("mamba_d_state") or 256), conv_kernel=int(cfg.get("mamba_d_conv") or 4),
                   conv_bias=bool(cfg.get("mamba_conv_bias", True)), dt_limit=limit,
                   embedding_multiplier=m["embedding_multiplier"], residual_multiplier=m["residual_multiplier"],
                   logits_scaling=m["logits_scaling"])


def dense_spec(c: GraniteMoeHybridConfig) -> dict[str, tuple]:
    """Every non-expert tensor the model reads, with its shape: the completeness contract."""
    f, h = c.family, c.hidden
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,)}
    if not c.tie_embeddings:
        spec[name(f, "lm_head")] = (c.vocab_size, h)
    for l, kind in enumerate(c.kinds):
        spec[name(f, "attn_norm", l)] = (h,)
        spec[name(f, "mlp_norm", l)] = (h,)
        if kind == LINEAR:
            spec.update(mamba_spec(c, l))
        else:
            spec[name(f, "q", l)] = (c.q_dim, h)
            spec[name(f, "k", l)] = (c.kv_dim, h)
            spec[name(f, "v", l)] = (c.kv_dim, h)
            spec[name(f, "o", l)] = (h, c.q_dim)
            if c.attention_bias:
                for key, rows in (("q_bias", c.q_dim), ("k_bias", c.kv_dim), ("v_bias", c.kv_dim), ("o_bias", h)):
                    spec[name(f, key, l)] = (rows,)
        if l in c.moe_layers:
            spec[name(f, "router", l)] = (c.n_experts, h)
        spec[name(f, "shared_gate", l)] = (c.shared_intermediate, h)
        spec[name(f, "shared_up", l)] = (c.shared_intermediate, h)
        spec[name(f, "shared_down", l)] = (h, c.shared_intermediate)
    return spec


expert_spec = base.expert_spec


class GraniteMoeHybridDecoder(NemotronHDecoder):
    """NemotronHDecoder's run state, derived Mamba weights and Mamba mixer; Granite's two-branch
    layer, attention, gated experts and multipliers."""

    def embed(self, ids: np.ndarray):
        x = super().embed(ids)
        x *= np.float32(self.c.embedding_multiplier)
        return x

    def layer(self, l: int, x, pos: np.ndarray, st) -> None:
        """x += r * mixer(attn_norm(x)), then x += r * mlp(mlp_norm(x)); r = residual_multiplier."""
        c, ops, w = self.c, self.ops, self.w
        r = np.float32(c.residual_multiplier)
        h = ops.rmsnorm(x, w("attn_norm", l), c.rms_eps)
        y = self.mamba(l, h, st) if c.kinds[l] == LINEAR else self.attention(l, h, pos, st)
        ops.add_(x, r * y)
        ops.add_(x, r * self.mlp(l, ops.rmsnorm(x, w("mlp_norm", l), c.rms_eps)))

    def attention(self, l: int, h, pos: np.ndarray, st):
        """Causal GQA attention (RoPE unless NoPE), K / V in the state's slot of layer l."""
        c, ops, w = self.c, self.ops, self.w
        t = h.shape[0]
        q, k, v = self.qkv(l, h)
        if c.attention_bias:
            for a, key in ((q, "q_bias"), (k, "k_bias"), (v, "v_bias")):
                ops.add_(a, w(key, l))
        q = q.reshape(t, c.n_heads, c.head_dim)                           # [T, Hq, D]
        k = k.reshape(t, c.n_kv_heads, c.head_dim)                        # [T, Hkv, D]
        v = v.reshape(t, c.n_kv_heads, c.head_dim)
        if l not in c.nope_layers:
            ops.rope(q, pos, self.inv_freq, c.rope.attention_factor)
            ops.rope(k, pos, self.inv_freq, c.rope.attention_factor)
        s = self.slot[l]
        ops.kv_store(st.k[s], st.v[s], int(pos[0]), k, v, self.kv_bf16)
        a = ops.attention(q, st.k[s], st.v[s], pos, c.qk_scale, 0)
        o = ops.linear(a.reshape(t, c.q_dim), w("o", l))
        if c.attention_bias:
            ops.add_(o, w("o_bias", l))
        return o

    def mlp(self, l: int, h):
        """The routed experts plus the shared expert, or the shared expert alone (no experts)."""
        return self.moe(l, h) if l in self.c.moe_layers else self.shared_expert(l, h)

    moe = MoeDecoder.moe   # gated experts, not Nemotron-H's relu^2 ones

    def head(self, x):
        logits = super().head(x)
        logits /= np.float32(self.c.logits_scaling)
        return logits


Model = GraniteMoeHybridDecoder
Config = GraniteMoeHybridConfig
