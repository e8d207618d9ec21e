"""DeepSeek-V3 (DeepSeek-V3 / R1, Moonlight and the other DeepseekV3ForCausalLM checkpoints):
multi-head latent attention (MLA) with DeepSeek-V3's MoE (sigmoid routing with a selection bias
and groups, scaled weights, shared experts, the first layers dense, engine/models/glm4_moe.py).

MLA runs in its absorbed form: a token's cache row is its normed latent c (kv_lora_rank) and its
rotated shared key k_pe (qk_rope_head_dim), one row for all heads (576 values at V3's shapes,
not 2 x 128 heads x 192). Each head's query is taken into the latent space through the key half
of kv_b_proj (q_abs = W_uk^T q_nope), so attention is multi-query attention with D = C + R over
the rows [c, k_pe], whose first C output values, taken out through the value half of kv_b_proj
(W_uv), are the head's output. The same sums as the reference's expanded keys and values, in
another order. Rotary dims come interleaved in pairs (rope_interleave): q_pe and k_pe are
gathered into halves (evens, odds) after their projections, so a rotate-half rope gives the same
dot products.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, RunState, expert_spec, need  # noqa: F401
from engine.models.glm4_moe import sigmoid_moe, with_experts
from engine.models.rope import ConfigError, RopeConfig, pairs_to_halves, rope_params
from engine.names import name

# the latent norms (q_a, kv_a) take RMSNorm's default eps in transformers and in DeepSeek's own
# code, whatever rms_norm_eps says (GLM-4.7-Flash: 1e-5)
LATENT_EPS = 1e-6
_ATTN = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm")


def mla_softmax_scale(cfg: dict, qk_dim: int) -> float:
    """What MLA's scores q . k are multiplied by: qk_dim ** -0.5, times YaRN's mscale squared
    where the rope scaling has mscale_all_dim (the reference's yarn_apply_mscale)."""
    scale = qk_dim ** -0.5
    params = rope_params(cfg)
    m_all = params.get("mscale_all_dim")
    if params.get("rope_type", params.get("type", "default")) != "default" and m_all:
        factor = float(params["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(m_all) * np.log(factor) + 1.0
        scale *= m * m
    return float(scale)


@dataclass(frozen=True)
class DeepseekV3Config(MoeConfig):
    # the cache row is one latent "head" (n_kv_heads 1) of head_dim = kv_lora_rank + qk_rope_dim
    q_lora_rank: int = 0            # 0: q_proj straight from the hidden state
    kv_lora_rank: int = 0           # C
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0            # R
    v_head_dim: int = 0
    rope_interleave: bool = True
    softmax_scale: float = 1.0
    query_scale_beta: float = 0.0   # Mistral 4: each query times 1 + beta ln(1 + floor(pos / period))
    query_scale_period: int = 0     #   (Llama 4's scaling past the pretraining context); 0: none
    ignored_parts: tuple = ()

    @property
    def kv_tensors(self) -> int:
        return 1   # K and V are the same latent row

    def mla(self, l: int) -> tuple:
        """Layer l's latent attention shapes (heads, q_lora_rank, kv_lora_rank, qk_nope, qk_rope,
        v_head_dim): the config's in every layer (dots.3's sliding layers have their own)."""
        return (self.n_heads, self.q_lora_rank, self.kv_lora_rank, self.qk_nope_dim, self.qk_rope_dim,
                self.v_head_dim)

    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekV3Config":
        cfg = with_experts(cfg)
        for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if cfg.get(key) not in (None, ok):
                raise ConfigError(f"config.json: {key} {cfg[key]!r} is not supported for "
                                  f"{cfg['model_type']}; expected {ok!r}")
        c_dim = int(need(cfg, "kv_lora_rank"))
        nope, rope = int(need(cfg, "qk_nope_head_dim")), int(need(cfg, "qk_rope_head_dim"))
        v_dim = int(need(cfg, "v_head_dim"))
        if rope % 2 or min(c_dim, nope, rope, v_dim) < 1:
            raise ConfigError(f"config.json: kv_lora_rank={c_dim}, qk_nope_head_dim={nope}, "
                              f"qk_rope_head_dim={rope} (even), v_head_dim={v_dim} must be positive")
        f = MoeConfig.common_hf(dict(cfg, head_dim=rope, num_key_value_heads=None))
        f.update(sigmoid_moe(cfg, f, first_dense=3, shared=1, norm=True))   # the reference's defaults
        f["rope"] = RopeConfig.from_hf(dict(cfg, partial_rotary_factor=1.0), rope)
        f.update(n_kv_heads=1, head_dim=c_dim + rope)
        scale = mla_softmax_scale(cfg, nope + rope)
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        mtp = tuple((f"model.layers.{f['n_layers'] + i}.",
                     "the multi-token-prediction (MTP) layer") for i in range(n_mtp))
        return cls(**f, q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=c_dim,
                   qk_nope_dim=nope, qk_rope_dim=rope, v_head_dim=v_dim,
                   rope_interleave=bool(cfg.get("rope_interleave", True)),
                   softmax_scale=float(scale), ignored_parts=mtp)


def dense_spec(c: DeepseekV3Config) -> dict[str, tuple]:
    f, h = c.family, c.hidden
    spec = base.dense_spec(c)
    for l in range(c.n_layers):
        for key in _ATTN:
            spec.pop(name(f, key, l), None)
        heads, lq, cd, nope, rope, v = c.mla(l)
        if lq:
            spec[name(f, "q_a", l)] = (lq, h)
            spec[name(f, "q_a_norm", l)] = (lq,)
            spec[name(f, "q_b", l)] = (heads * (nope + rope), lq)
            if c.attention_bias:
                spec[name(f, "q_a_bias", l)] = (lq,)
        else:
            spec[name(f, "q", l)] = (heads * (nope + rope), h)
        spec[name(f, "kv_a", l)] = (cd + rope, h)
        spec[name(f, "kv_a_norm", l)] = (cd,)
        spec[name(f, "kv_b", l)] = (heads * (nope + v), cd)
        spec[name(f, "o", l)] = (h, heads * v)
        if c.attention_bias:
            spec[name(f, "kv_a_bias", l)] = (cd + rope,)
            spec[name(f, "o_bias", l)] = (h,)
    return spec


def query_scales(c: DeepseekV3Config, pos: np.ndarray) -> np.ndarray:
    """Mistral 4's query scale at each position, 1 + beta ln(1 + floor(pos / period)) (float32,
    as the reference computes it)."""
    p = np.asarray(pos, np.float32)
    return (np.float32(1) + np.float32(c.query_scale_beta)
            * np.log1p(np.floor(p / np.float32(c.query_scale_period)))).astype(np.float32)


class MlaState(RunState):
    """The latent cache: k [L, S_max, 1, C + R]; v is the same array (attention reads its first
    C values as the value row)."""

    def __init__(self, ops, c: DeepseekV3Config, max_context: int):
        self.max_context = max_context
        self.k = ops.zeros((c.n_layers, max_context, 1, c.head_dim))
        self.v = self.k
        self.pos = 0

    def save_nbytes(self, keep: int) -> int:
        return self.k[:, :keep].nbytes

    def save(self, keep: int) -> dict:
        return {"k": self.k[:, :keep].copy()}

    def load(self, saved: dict, keep: int) -> None:
        self.k[:, :keep] = saved["k"][:, :keep]
        self.pos = keep


class DeepseekV3Decoder(MoeDecoder):
    def __init__(self, c: DeepseekV3Config, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        rope = c.qk_rope_dim
        f32 = ops.deltanet.f32
        # interleaved rotary pairs (x0, x1), (x2, x3)... -> halves (x0, x2, ...), (x1, x3, ...)
        self.rot = pairs_to_halves(rope) if c.rope_interleave else np.arange(rope)
        derived = {}
        for l in range(c.n_layers):
            # [Hq, nope + V, C]; nope = qk_nope_head_dim, but in Mistral Large 4's NoPE layers
            # qk_nope_head_dim + qk_rope_head_dim (a head's key all from the latent)
            heads, _, cd, _, _, v = c.mla(l)
            kv_b = f32(weights("kv_b", l)).reshape(heads, -1, cd)
            nope = kv_b.shape[1] - v
            derived["w_uk", l] = np.ascontiguousarray(kv_b[:, :nope, :])                 # [Hq, nope, C]
            derived["w_uv_t", l] = np.ascontiguousarray(kv_b[:, nope:, :].transpose(0, 2, 1))  # [Hq, C, V]
        self.derive(derived)

    def new_state(self, max_context: int) -> MlaState:
        return MlaState(self.ops, self.c, max_context)

    def attention(self, l: int, h, pos: np.ndarray, st: MlaState):
        q_lat, _ = self.latent(l, h, pos, st)
        if self.c.query_scale_beta:
            q_lat *= query_scales(self.c, pos)[:, None, None]
        s = self.cache_index(l)
        a = self.ops.attention(q_lat, st.k[s], st.v[s], pos, self.c.softmax_scale, self.window(l), None)
        return self.out(l, a)

    def cache_index(self, l: int) -> int:
        """Layer l's index in the state's latent cache (a hybrid caches its MLA layers alone)."""
        return l

    def latent(self, l: int, h, pos: np.ndarray, st: MlaState):
        """The queries in the latent space [T, Hq, C + R], the tokens' rows stored in st; and the
        normed low-rank query (None without q_lora_rank)."""
        c, ops, w = self.c, self.ops, self.w
        t, heads, nope, cd = h.shape[0], c.n_heads, c.qk_nope_dim, c.kv_lora_rank
        qr = None
        if c.q_lora_rank:
            qa = ops.linear(h, w("q_a", l))
            if c.attention_bias:
                ops.add_(qa, w("q_a_bias", l))
            qr = ops.rmsnorm(qa, w("q_a_norm", l), LATENT_EPS)
            q = ops.linear(qr, w("q_b", l))
        else:
            q = ops.linear(h, w("q", l))
        q = q.reshape(t, heads, nope + c.qk_rope_dim)
        kv = ops.linear(h, w("kv_a", l))                                  # [T, C + R]
        if c.attention_bias:
            ops.add_(kv, w("kv_a_bias", l))
        q_pe = np.ascontiguousarray(q[:, :, nope + self.rot])
        k_pe = np.ascontiguousarray(kv[:, None, cd + self.rot])
        if l not in c.nope_layers:
            ops.rope(q_pe, pos, self.inv_freq, c.rope.attention_factor)
            ops.rope(k_pe, pos, self.inv_freq, c.rope.attention_factor)
        row = np.concatenate([ops.rmsnorm(kv[:, :cd], w("kv_a_norm", l), LATENT_EPS)[:, None],
                              k_pe], axis=-1)                             # [T, 1, C + R]
        q_lat = np.concatenate([ops.per_head_linear(q[:, :, :nope], w("w_uk", l)), q_pe],
                               axis=-1)                                   # [T, Hq, C + R]
        s = self.cache_index(l)
        ops.kv_store(st.k[s], st.v[s], int(pos[0]), row, row, self.kv_bf16)
        return q_lat, qr

    def out(self, l: int, a):
        """Attention over the latent rows [T, Hq, C + R] -> the layer's output [T, H]."""
        c, ops, w = self.c, self.ops, self.w
        t, heads, cd = a.shape[0], c.n_heads, c.kv_lora_rank
        o = ops.per_head_linear(a[:, :, :cd], w("w_uv_t", l))             # [T, Hq, V]
        o = ops.linear(o.reshape(t, heads * c.v_head_dim), w("o", l))
        if c.attention_bias:
            ops.add_(o, w("o_bias", l))
        return o


Model = DeepseekV3Decoder
Config = DeepseekV3Config
