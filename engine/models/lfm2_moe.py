"""LFM2-MoE (LiquidAI's LFM2-8B-A1B). CPU backend.

Each layer x += op(operator_norm(x)), then x += mlp(ffn_norm(x)), the operator by layer_types one of
- "conv": the gated short conv. in_proj -> B | C | x [H each]; B * x through a causal depthwise
  conv of conv_L_cache taps (no activation); times C; out_proj. Biases on all three where
  conv_bias. Its state: the last Kc-1 conv inputs (B * x), as transformers' conv cache keeps them;
- "full_attention": causal GQA attention with q / k RMSNormed a head (q_layernorm / k_layernorm)
  before RoPE;
and the MLP SwiGLU (w1 gate, w3 up, w2 down): dense in the first num_dense_layers layers, routed
experts in the rest. Routing (Lfm2MoeTopKRouter): sigmoid scores of the router's logits, the top-k
chosen on score + expert_bias (use_expert_bias; on the scores alone without), weighted by their
scores, over their sum + 1e-6 (norm_topk_prob), times routed_scaling_factor; no shared expert.
The last norm is embedding_norm; lm_head is the embedding where tied (tie_embedding, as released,
or tie_word_embeddings). The run state is the hybrids' (hybrid.HybridState): K / V rows of the
attention layers, the conv layers' conv state, no recurrent state beside it.

Legend: T = tokens, H = hidden, D = head dim, Hq / Hkv = attention heads, Kc = conv width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, layer_list, need
from engine.models.hybrid import FULL, HybridState
from engine.models.rope import ConfigError, rope_params
from engine.names import name

CONV = "conv"
TOPK_EPS = 1e-6   # the router's renormalization: weights / (their sum + 1e-6), as Lfm2MoeTopKRouter
# the reference's defaults (Lfm2MoeConfig's: LFM2-8B-A1B's sizes) where config.json has no value
DEFAULTS = {"num_experts": 32, "num_experts_per_tok": 4, "num_key_value_heads": 8,
            "max_position_embeddings": 128000, "moe_intermediate_size": 1792, "intermediate_size": 7168}


@dataclass(frozen=True)
class Lfm2MoeConfig(MoeConfig):
    layer_types: tuple = ()     # per layer: CONV (the gated short conv) or FULL (attention)
    conv_kernel: int = 0        # Kc: conv_L_cache
    conv_bias: bool = False     # biases on the conv layers' in_proj, conv and out_proj
    expert_bias: bool = True    # use_expert_bias: experts chosen on score + the router's expert_bias

    @property
    def conv_dim(self) -> int:  # the conv's channels: H
        return self.hidden

    @property
    def ssm_shape(self) -> tuple:   # no recurrent state beside the conv's (HybridState's ssm is empty)
        return (0,)

    @property
    def full_layers(self) -> tuple:
        return tuple(l for l, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple:   # the conv layers (HybridState's conv rows, one a conv layer)
        return tuple(l for l, t in enumerate(self.layer_types) if t == CONV)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Lfm2MoeConfig":
        cfg = dict(cfg)
        n = int(need(cfg, "num_hidden_layers"))
        # the reference builds attention for any type but "conv", and its masks name these two only
        types = tuple(layer_list("layer_types", need(cfg, "layer_types"), n, (CONV, FULL)))
        kc = int(cfg["conv_L_cache"]) if cfg.get("conv_L_cache") is not None else 3
        if kc < 1:
            raise ConfigError(f"config.json: conv_L_cache={kc}; expected a conv width of 1 or more")
        dense = int(cfg["num_dense_layers"]) if cfg.get("num_dense_layers") is not None else 2
        if not 0 <= dense <= n:
            raise ConfigError(f"config.json: num_dense_layers={dense} must be in 0..{n} (num_hidden_layers)")
        for key, v in DEFAULTS.items():
            if cfg.get(key) is None:
                cfg[key] = v
        if "rope_theta" not in rope_params(cfg) and cfg.get("rope_theta") is None:
            cfg["rope_theta"] = 1e6   # the reference's default_theta
        # the release writes tie_embedding, which the reference reads ahead of tie_word_embeddings
        tie = cfg["tie_embedding"] if "tie_embedding" in cfg else cfg.get("tie_word_embeddings", True)
        cfg.update(tie_word_embeddings=bool(tie),
                   rms_norm_eps=cfg["norm_eps"] if cfg.get("norm_eps") is not None else 1e-5)
        f = MoeConfig.common_hf(cfg)
        # attention_bias is not read: the reference's projections have no biases
        f.update(moe_layers=tuple(range(dense, n)), attention_bias=False, qk_norm="head", routing="sigmoid",
                 routed_scale=float(cfg.get("routed_scaling_factor", 1.0)))
        return cls(**f, layer_types=types, conv_kernel=kc, conv_bias=bool(cfg.get("conv_bias", False)),
                   expert_bias=bool(cfg.get("use_expert_bias", True)),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   moe_intermediate=int(cfg["moe_intermediate_size"]) if dense < n else 0,
                   dense_intermediate=int(cfg["intermediate_size"]) if dense else 0)


def dense_spec(c: Lfm2MoeConfig) -> dict[str, tuple]:
    """Every non-expert tensor the model reads, with its shape: the completeness contract."""
    f, h = c.family, c.hidden
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,)}
    if not c.tie_embeddings:
        spec[name(f, "lm_head")] = (c.vocab_size, h)
    for l, kind in enumerate(c.layer_types):
        spec[name(f, "attn_norm", l)] = (h,)
        spec[name(f, "mlp_norm", l)] = (h,)
        if kind == CONV:
            spec[name(f, "conv_in", l)] = (3 * h, h)
            spec[name(f, "conv", l)] = (h, 1, c.conv_kernel)
            spec[name(f, "conv_out", l)] = (h, h)
            if c.conv_bias:
                for key, rows in (("conv_in_bias", 3 * h), ("conv_bias", h), ("conv_out_bias", h)):
                    spec[name(f, key, l)] = (rows,)
        else:
            spec[name(f, "q", l)] = (c.q_dim, h)
            spec[name(f, "k", l)] = (c.kv_dim, h)
            spec[name(f, "v", l)] = (c.kv_dim, h)
            spec[name(f, "o", l)] = (h, c.q_dim)
            spec[name(f, "q_norm", l)] = (c.head_dim,)
            spec[name(f, "k_norm", l)] = (c.head_dim,)
        if l in c.moe_layers:
            spec[name(f, "router", l)] = (c.n_experts, h)
            if c.expert_bias:
                spec[name(f, "router_bias", l)] = (c.n_experts,)
        else:
            spec[name(f, "mlp_gate", l)] = (c.dense_intermediate, h)
            spec[name(f, "mlp_up", l)] = (c.dense_intermediate, h)
            spec[name(f, "mlp_down", l)] = (h, c.dense_intermediate)
    return spec


expert_spec = base.expert_spec


class Lfm2MoeDecoder(MoeDecoder):
    """MoeDecoder (the layer, dense MLP, experts and head) whose operator is the gated short conv
    or attention by layer; the run state is hybrid.HybridState's."""
    rewinds = False   # the conv state holds the inputs just before pos: it cannot go back

    def __init__(self, c: Lfm2MoeConfig, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        # each layer's slot in the state of its kind
        self.slot = {l: i for kind in (c.full_layers, c.linear_layers) for i, l in enumerate(kind)}
        self.no_bias = np.zeros(c.n_experts, np.float32)   # routing without expert_bias
        # Derived weights, float32 once: the conv taps as [H, Kc] with their bias (zeros without).
        # self.w serves them ahead of the raw ones.
        f32 = ops.deltanet.f32
        derived = {}
        for l in c.linear_layers:
            derived["conv", l] = f32(weights("conv", l)).reshape(c.hidden, c.conv_kernel)
            derived["conv_bias", l] = f32(weights("conv_bias", l)) if c.conv_bias else np.zeros(c.hidden, np.float32)
        self.derive({k: ops.weight(np.ascontiguousarray(v, np.float32)) for k, v in derived.items()})

    def new_state(self, max_context: int) -> HybridState:
        return HybridState(self.ops, self.c, max_context)

    # MoeDecoder.layer calls attention() for every layer's operator
    def attention(self, l: int, h, pos: np.ndarray, st: HybridState):
        if self.c.layer_types[l] == CONV:
            return self.short_conv(l, h, st)
        return self.self_attention(l, h, pos, st)

    def short_conv(self, l: int, h, st: HybridState):
        """in_proj -> B | C | x; C * conv(B * x) through the conv state of layer l; out_proj."""
        c, ops, w = self.c, self.ops, self.w
        bcx = ops.linear(h, w("conv_in", l))                                  # [T, 3H]
        if c.conv_bias:
            ops.add_(bcx, w("conv_in_bias", l))
        y = ops.shortconv.gated_conv(bcx, w("conv", l), w("conv_bias", l), st.conv[self.slot[l]])   # [T, H]
        o = ops.linear(y, w("conv_out", l))
        if c.conv_bias:
            ops.add_(o, w("conv_out_bias", l))
        return o

    def self_attention(self, l: int, h, pos: np.ndarray, st: HybridState):
        """Causal GQA attention, q / k normed a head before RoPE; K / V in the state's slot of layer l."""
        c, ops, w = self.c, self.ops, self.w
        t = h.shape[0]
        q = ops.rmsnorm(ops.linear(h, w("q", l)).reshape(t, c.n_heads, c.head_dim), w("q_norm", l), c.rms_eps)
        k = ops.rmsnorm(ops.linear(h, w("k", l)).reshape(t, c.n_kv_heads, c.head_dim), w("k_norm", l), c.rms_eps)
        v = ops.linear(h, w("v", l)).reshape(t, c.n_kv_heads, c.head_dim)   # [T, Hkv, D]
        ops.rope(q, pos, self.inv_freq, c.rope.attention_factor)
        ops.rope(k, pos, self.inv_freq, c.rope.attention_factor)
        s = self.slot[l]
        ops.kv_store(st.k[s], st.v[s], int(pos[0]), k, v, self.kv_bf16)
        a = ops.attention(q, st.k[s], st.v[s], pos, c.qk_scale, 0)
        return ops.linear(a.reshape(t, c.q_dim), w("o", l))

    def route(self, l: int, h):
        """(ids [T, K], weights [T, K]): sigmoid scores chosen on score + expert_bias, their
        scores over their sum + 1e-6 where norm_topk_prob, times routed_scaling_factor."""
        c, ops = self.c, self.ops
        logits = ops.linear(h, self.w("router", l))
        bias = self.w("router_bias", l) if c.expert_bias else self.no_bias
        ids, wts = ops.router_sigmoid(logits, bias, c.top_k, 1, 1, False, 1.0)
        if c.norm_topk_prob:
            wts = wts / (wts.sum(-1, keepdims=True) + np.float32(TOPK_EPS))
        return ids, (wts * np.float32(c.routed_scale)).astype(np.float32)


Model = Lfm2MoeDecoder
Config = Lfm2MoeConfig
