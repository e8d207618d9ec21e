"""Mistral Large 4 (mistral_large4, MistralLarge4ForConditionalGeneration): the image-text
wrapper's language model on text; the vision encoder, the projector (patch merger, adapter) and
the multi-token-prediction draft head (mtp_dspark) are left unread. CPU backend: GLM-5's sparse
attention (engine/models/deepseek_v32.py: MLA absorbed, an indexer in the layers indexer_types
calls full, the others reading the last one's picks) with Mistral Small 4's routing.

What differs from glm_moe_dsa and mistral4, as transformers' modeling_mistral_large4:
- no low-rank q: q_proj from the hidden state; the indexer's queries from the hidden state too,
  through a LayerNorm with bias (q_input_norm, eps 1e-6) and wq_b;
- every query (the attention's, all its dims after RoPE, and the indexer's before it) times
  scale[h] * ln(pos + 1) + bias[h], learned a head (ssmax_scaling s / b, the indexer's its own);
- LeRoPE: RoPE's inverse frequencies times exp(alpha), learned (lerope.alpha), one for all layers;
  rotary dims in interleaved pairs in the attention and the indexer alike;
- NoPE layers (no_rope_layers 0; by default every fourth): no RoPE in attention or indexer, and
  the query's rotary dims join its nope dims against the latent (kv_a gives the latent alone,
  kv_b a key of qk_nope + qk_rope dims); their cache rows carry zeros where the rotated key sits;
- cross-layer KV sharing: a layer whose kv_source_layers entry names an earlier layer has no
  kv_a / kv_a_norm and reads that layer's latent rows with its own kv_b (the indexer's keys stay
  its own where it runs one); the cache holds rows for the layers that make their own;
- the latent norm takes rms_norm_eps (1e-5 by default), not DeepSeek's fixed 1e-6;
- routing: softmax scores in DeepSeek-V3's groups without a bias, always renormalized, times
  routed_scaling_factor; a shared expert of moe_intermediate_size x n_shared_experts; dense layers
  by mlp_layer_types (the first by default);
- the logits soft-capped: cap * tanh(logits / cap), cap = final_logit_softcapping (30);
- the wrapper's tie_word_embeddings rules (the text config's is not read);
- transformers' defaults where config.json leaves a field out: YaRN (factor 2048 over 512
  positions, theta 10000, attention_factor 1), index_topk 2048, 128-dim indexer heads, 32 of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models.base import expert_spec, text_config  # noqa: F401
from engine.models.deepseek_v3 import DeepseekV3Config
from engine.models.deepseek_v32 import DeepseekV32Config, DeepseekV32Decoder, DsaState
from engine.models.glm4_moe_lite import routed_layers
from engine.models.glm_moe_dsa import _int_field, indexer_types
from engine.models.rope import ConfigError, declared_partial, rope_params
from engine.names import name

IGNORED = (("vision_encoder.", "the vision encoder"), ("patch_merger.", "the image projector"),
           ("pre_mm_projector_norm.", "the image projector"), ("vision_language_adapter.", "the image projector"),
           ("mtp_dspark.", "the multi-token-prediction draft head"))
# transformers' MistralLarge4TextConfig defaults where config.json leaves a field out (or null)
DEFAULTS = dict(first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.0, rms_norm_eps=1e-5,
                n_group=1, topk_group=1, index_topk=2048, index_head_dim=128, index_n_heads=32,
                final_logit_softcapping=30.0)
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0, "original_max_position_embeddings": 512,
                "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}
INDEX_EPS = 1e-6   # the indexer's LayerNorms (q_input_norm, k_norm)


def rope_flags(cfg: dict, n: int) -> list:
    """no_rope_layers (1: the layer rotates, 0: NoPE), its first n entries; else every
    no_rope_layer_interval-th layer NoPE (4 by default), as the reference derives it."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = _int_field(cfg, "no_rope_layer_interval", 4)
        if every < 1:
            raise ConfigError(f"config.json: no_rope_layer_interval={every} must be positive")
        return [int((l + 1) % every != 0) for l in range(n)]
    if not isinstance(flags, (list, tuple)) or len(flags) < n or any(v not in (0, 1) for v in flags[:n]):
        raise ConfigError(f"config.json: no_rope_layers must give each of the {n} layers 1 (RoPE) or 0 "
                          f"(NoPE); got {flags!r}")
    return [int(v) for v in flags[:n]]


def kv_sources(cfg: dict, n: int, nope: tuple) -> tuple:
    """Each layer's kv_source_layers entry (itself by default), checked as the reference checks
    it (an earlier layer that makes its own rows), and refused where the reference would read
    another layer's rows: it hands them on by kind (RoPE or NoPE), the last layer of that kind
    that others read before this one."""
    src = cfg.get("kv_source_layers")
    if src is None:
        return tuple(range(n))
    if not isinstance(src, (list, tuple)) or len(src) != n or \
            any(isinstance(s, bool) or not isinstance(s, int) for s in src):
        raise ConfigError(f"config.json: kv_source_layers must give each of the {n} layers a layer "
                          f"index; got {src!r}")
    for l, s in enumerate(src):
        if not 0 <= s <= l or src[s] != s:
            raise ConfigError(f"config.json: kv_source_layers has {s} at layer {l}; expected an earlier "
                              "layer that makes its own latent rows (or the layer itself)")
    stores = {s for l, s in enumerate(src) if s != l}
    for l, s in enumerate(src):
        if s == l:
            continue
        kind = l in nope
        if (s in nope) != kind:
            raise ConfigError(f"config.json: kv_source_layers makes layer {l} ({'NoPE' if kind else 'RoPE'}) "
                              f"read layer {s}'s latent rows ({'RoPE' if kind else 'NoPE'}); the reference "
                              "hands rows on between layers of one kind only")
        later = [p for p in sorted(stores) if s < p < l and (p in nope) == kind]
        if later:
            raise ConfigError(f"config.json: kv_source_layers makes layer {l} read layer {s}'s latent rows, "
                              f"but the reference gives it layer {later[-1]}'s (the last of its kind shared "
                              "before it)")
    return tuple(src)


@dataclass(frozen=True)
class MistralLarge4Config(DeepseekV32Config):
    kv_sources: tuple = ()        # per layer: the layer whose latent rows it reads (itself: its own)
    logit_softcap: float = 0.0    # the logits as cap * tanh(logits / cap)

    @property
    def cache_layers(self) -> tuple:
        """The layers that make their own latent rows, in order: the cache's rows."""
        return tuple(l for l, s in enumerate(self.kv_sources) if s == l)

    @classmethod
    def from_hf(cls, cfg: dict) -> "MistralLarge4Config":
        text = text_config(cfg, "mistral_large4", "MistralLarge4ForConditionalGeneration",
                           ("eos_token_id", "bos_token_id"))
        text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings") or False)   # the wrapper's
        params = rope_params(text) or dict(DEFAULT_ROPE)
        for key in ("scoring_func", "topk_method", "rope_scaling"):   # (the reference reads neither
            text.pop(key, None)                                       # scoring_func nor topk_method)
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {text['hidden_act']!r} is not supported; "
                              "mistral_large4 runs silu")
        for key, v in DEFAULTS.items():
            if text.get(key) is None:
                text[key] = v
        partial = declared_partial({**text, "rope_parameters": params})
        if partial not in (None, 1.0):
            raise ConfigError(f"config.json: partial_rotary_factor {partial} is not supported for "
                              "mistral_large4; qk_rope_head_dim dims all rotate")
        cap = float(text["final_logit_softcapping"])
        if cap <= 0:
            raise ConfigError(f"config.json: final_logit_softcapping={cap} must be positive (the reference "
                              "divides the logits by it)")
        moe, types = routed_layers(text, first_dense=1), indexer_types(text)
        # no low-rank q (q_proj); the routing renormalized always
        text.update(rope_parameters=params, q_lora_rank=None, first_k_dense_replace=0, norm_topk_prob=True)
        c = DeepseekV3Config.from_hf(text)
        heads, dim, topk = (int(text[k]) for k in ("index_n_heads", "index_head_dim", "index_topk"))
        if min(heads, topk) < 1 or dim < c.qk_rope_dim:
            raise ConfigError(f"config.json: index_n_heads={heads}, index_topk={topk} must be positive and "
                              f"index_head_dim={dim} at least qk_rope_head_dim={c.qk_rope_dim}")
        flags = rope_flags(text, c.n_layers)
        nope = tuple(l for l, f in enumerate(flags) if not f)
        return cls(**{**c.__dict__, "raw": cfg, "moe_layers": moe, "routing": "softmax_grouped",
                      "rope_interleave": True, "nope_layers": nope, "ignored_parts": IGNORED},
                   index_n_heads=heads, index_head_dim=dim, index_topk=topk, index_rope_pairs=True,
                   index_layers=tuple(l for l, t in enumerate(types) if t == "full"),
                   kv_sources=kv_sources(text, c.n_layers, nope), logit_softcap=cap)


def dense_spec(c: MistralLarge4Config) -> dict[str, tuple]:
    """Every non-expert tensor, with its shape: a NoPE layer's kv_a gives the latent alone and its
    kv_b a key of qk_nope + qk_rope dims; a layer that reads another's rows has no kv_a."""
    f, h, heads, cd, r = c.family, c.hidden, c.n_heads, c.kv_lora_rank, c.qk_rope_dim
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,), name(f, "rope_alpha"): (r // 2,)}
    if not c.tie_embeddings:
        spec[name(f, "lm_head")] = (c.vocab_size, h)
    for l in range(c.n_layers):
        rot = 0 if l in c.nope_layers else r
        spec[name(f, "attn_norm", l)] = (h,)
        spec[name(f, "mlp_norm", l)] = (h,)
        spec[name(f, "q", l)] = (heads * (c.qk_nope_dim + r), h)
        spec[name(f, "q_scale", l)] = spec[name(f, "q_scale_bias", l)] = (heads,)
        if c.kv_sources[l] == l:
            spec[name(f, "kv_a", l)] = (cd + rot, h)
            spec[name(f, "kv_a_norm", l)] = (cd,)
            if c.attention_bias:
                spec[name(f, "kv_a_bias", l)] = (cd + rot,)
        spec[name(f, "kv_b", l)] = (heads * (c.qk_nope_dim + r - rot + c.v_head_dim), cd)
        spec[name(f, "o", l)] = (h, heads * c.v_head_dim)
        if c.attention_bias:
            spec[name(f, "o_bias", l)] = (h,)
        if l in c.index_layers:
            hi, d = c.index_n_heads, c.index_head_dim
            spec[name(f, "idx_q_norm", l)] = spec[name(f, "idx_q_norm_bias", l)] = (h,)
            spec[name(f, "idx_wq_b", l)] = (hi * d, h)
            spec[name(f, "idx_q_scale", l)] = spec[name(f, "idx_q_scale_bias", l)] = (hi,)
            spec[name(f, "idx_wk", l)] = (d, h)
            spec[name(f, "idx_k_norm", l)] = spec[name(f, "idx_k_norm_bias", l)] = (d,)
            spec[name(f, "idx_w", l)] = (hi, h)
        if l in c.moe_layers:
            spec[name(f, "router", l)] = (c.n_experts, h)
            for key, shape in (("shared_gate", (c.shared_intermediate, h)), ("shared_up", (c.shared_intermediate, h)),
                               ("shared_down", (h, c.shared_intermediate))):
                spec[name(f, key, l)] = shape
        else:
            for key, shape in (("mlp_gate", (c.dense_intermediate, h)), ("mlp_up", (c.dense_intermediate, h)),
                               ("mlp_down", (h, c.dense_intermediate))):
                spec[name(f, key, l)] = shape
    return spec


class Large4State(DsaState):
    """The latent cache k [Lc, S_max, 1, C + R] of the Lc layers that make their own rows
    (c.cache_layers; a NoPE layer's rows zero past C), v the same array; the indexer's keys ik
    [Li, S_max, index_head_dim] of the layers that run one."""

    def __init__(self, ops, c: MistralLarge4Config, max_context: int):
        self.max_context = max_context
        self.k = self.v = ops.zeros((len(c.cache_layers), max_context, 1, c.head_dim))
        self.ik = np.zeros((len(c.index_layers), max_context, c.index_head_dim), np.float32)
        self.picked = None
        self.pos = 0


class MistralLarge4Decoder(DeepseekV32Decoder):
    def __init__(self, c: MistralLarge4Config, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        alpha = ops.deltanet.f32(weights("rope_alpha"))                    # [R / 2]
        self.inv_freq = (self.inv_freq * np.exp(alpha)).astype(np.float32)   # LeRoPE
        own = {l: i for i, l in enumerate(c.cache_layers)}
        self.cache_row = [own[s] for s in c.kv_sources]                     # layer -> its row of k

    def new_state(self, max_context: int) -> Large4State:
        return Large4State(self.ops, self.c, max_context)

    def cache_index(self, l: int) -> int:
        return self.cache_row[l]

    def scales(self, l: int, pos: np.ndarray, key: str) -> np.ndarray:
        """The queries' factors [T, heads] at pos: scale[h] ln(pos + 1) + bias[h] (float32, as the
        reference computes them); key: q_scale (attention) or idx_q_scale (the indexer)."""
        log_pos = np.log(np.asarray(pos, np.float32) + np.float32(1))
        return (self.w(key, l)[None, :] * log_pos[:, None] + self.w(key + "_bias", l)[None, :]).astype(np.float32)

    def latent(self, l: int, h, pos: np.ndarray, st: Large4State):
        """The queries in the latent space [T, Hq, C + R], scaled; the tokens' rows stored in st
        where layer l makes its own. No low-rank query (None)."""
        c, ops, w = self.c, self.ops, self.w
        t, heads, cd, r = h.shape[0], c.n_heads, c.kv_lora_rank, c.qk_rope_dim
        rotates = l not in c.nope_layers
        nope = c.qk_nope_dim + (0 if rotates else r)     # the query's dims against the latent
        q = ops.linear(h, w("q", l)).reshape(t, heads, c.qk_nope_dim + r)
        q_pe = np.zeros((t, heads, r), np.float32)
        if rotates:
            q_pe = np.ascontiguousarray(q[:, :, nope + self.rot])
            ops.rope(q_pe, pos, self.inv_freq, c.rope.attention_factor)
        if c.kv_sources[l] == l:
            kv = ops.linear(h, w("kv_a", l))                              # [T, C + R] (NoPE: [T, C])
            if c.attention_bias:
                ops.add_(kv, w("kv_a_bias", l))
            k_pe = np.zeros((t, 1, r), np.float32)
            if rotates:
                k_pe = np.ascontiguousarray(kv[:, None, cd + self.rot])
                ops.rope(k_pe, pos, self.inv_freq, c.rope.attention_factor)
            row = np.concatenate([ops.rmsnorm(kv[:, :cd], w("kv_a_norm", l), c.rms_eps)[:, None], k_pe],
                                 axis=-1)                                 # [T, 1, C + R]
            s = self.cache_index(l)
            ops.kv_store(st.k[s], st.v[s], int(pos[0]), row, row, self.kv_bf16)
        q_lat = np.concatenate([ops.per_head_linear(q[:, :, :nope], w("w_uk", l)), q_pe], axis=-1)
        q_lat *= self.scales(l, pos, "q_scale")[:, :, None]
        return q_lat, None

    def index_query(self, l: int, h, qr, pos: np.ndarray):
        """The indexer's queries [T, Hi, D] before RoPE: LayerNorm(h) through wq_b, scaled."""
        c, ops, w = self.c, self.ops, self.w
        x = ops.layernorm(h, w("idx_q_norm", l), INDEX_EPS, w("idx_q_norm_bias", l))
        q = ops.linear(x, w("idx_wq_b", l)).reshape(h.shape[0], c.index_n_heads, c.index_head_dim)
        return q * self.scales(l, pos, "idx_q_scale")[:, :, None]

    def head(self, x):
        cap = np.float32(self.c.logit_softcap)
        return (np.tanh(np.asarray(super().head(x), np.float32) / cap) * cap).astype(np.float32)


Model = MistralLarge4Decoder
Config = MistralLarge4Config
