"""LongCat-Flash (LongCat-Flash-Chat, -Thinking: LongcatFlashForCausalLM): a shortcut-connected MoE.

Each of the num_layers layers holds two sublayers j = 0, 1, each an attention (DeepSeek-V3's
multi-head latent attention, engine/models/deepseek_v3.py, always with a low-rank q) and a dense
SwiGLU MLP, with pre-norms and residuals; beside them one MoE a layer, fed by the first MLP's
input (post_attention_layernorm.0's output) and added to the residual after the second MLP:

    x += attn_0(norm(x));  h = norm(x);  s = moe(h);  x += mlp_0(h)
    x += attn_1(norm(x));  x = x + mlp_1(norm(x)) + s

MLA as DeepSeek-V3's, but the query (its nope and rope parts) is scaled by sqrt(H / q_lora_rank)
and the normed latent by sqrt(H / kv_lora_rank) (transformers' mla_scale_q_lora /
mla_scale_kv_lora, always applied): both folded into the latent norms' weights at load
(dense_view), as SGLang does, so the absorbed attention runs unchanged. One latent cache row a
token a sublayer: 2 a layer.

The router: softmax over n_routed_experts + zero_expert_num logits (the classifier's weight only),
the top moe_topk chosen on score + e_score_correction_bias, weighted by their scores (not
renormalized) times routed_scaling_factor. Ids from n_routed_experts up are zero-computation
("identity") experts: such a slot adds the MoE's input times its weight and reads no weights;
only the real experts are stored in the arena (LongcatFlashMoE: identity_output).

Legend: T = tokens, H = hidden, E = real routed experts, Z = zero experts, K = top-k,
s = 2 l + j, the sublayer index of layer l's sublayer j (attention, norms and dense MLPs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models.base import MoeConfig, MoeDecoder, expert_spec, need, widened  # noqa: F401 (re-exported)
from engine.models.deepseek_v3 import DeepseekV3Config, DeepseekV3Decoder, MlaState, mla_softmax_scale
from engine.models.rope import ConfigError, RopeConfig, pairs_to_halves
from engine.names import key_of, name

# LongcatFlashConfig's defaults (LongCat-Flash-Chat's shapes), for fields config.json leaves out
DEFAULTS = dict(vocab_size=131072, hidden_size=6144, num_attention_heads=64, ffn_hidden_size=12288,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, head_dim=64,
                v_head_dim=128, moe_topk=12, n_routed_experts=512, zero_expert_num=256,
                expert_ffn_hidden_size=2048, routed_scaling_factor=6.0, rms_norm_eps=1e-5,
                max_position_embeddings=131072, rope_theta=10000000.0)
# transformers' attribute_map: the generic names config.json may use instead of the release's
ALIASES = {"n_routed_experts": "num_local_experts", "moe_topk": "num_experts_per_tok",
           "ffn_hidden_size": "intermediate_size", "expert_ffn_hidden_size": "moe_intermediate_size"}
# a sublayer's tensors: keyed "<key>.<j>" in engine/names.py, asked for by the sublayer index s
SUBLAYER = ("attn_norm", "mlp_norm", "q_a", "q_a_bias", "q_a_norm", "q_b", "kv_a", "kv_a_bias", "kv_a_norm",
            "kv_b", "o", "o_bias", "mlp_gate", "mlp_up", "mlp_down")
MTP = ("model.mtp.", "the multi-token-prediction (MTP) layer")


def _refuse(key: str, got, want: str) -> None:
    raise ConfigError(f"config.json: {key}={got!r} is not supported for longcat_flash; expected {want}")


@dataclass(frozen=True)
class LongcatFlashConfig(DeepseekV3Config):
    """DeepseekV3Config's latent attention (n_layers: the layers, 2 attention sublayers each;
    n_experts: the real routed experts E) beside the zero experts."""
    zero_experts: int = 0           # Z: router ids E .. E + Z - 1 add their input times their weight
    q_scale: float = 1.0            # sqrt(H / q_lora_rank): the query's (mla_scale_q_lora)
    kv_scale: float = 1.0           # sqrt(H / kv_lora_rank): the normed latent's (mla_scale_kv_lora)

    @property
    def kv_tensors(self) -> int:
        return 2   # one latent row a sublayer

    @property
    def router_experts(self) -> int:
        """E + Z: the router's logits."""
        return self.n_experts + self.zero_experts

    @classmethod
    def from_hf(cls, cfg: dict) -> "LongcatFlashConfig":
        cfg = dict(cfg)
        for key, alias in ALIASES.items():
            if key not in cfg and alias in cfg:
                cfg[key] = cfg[alias]
        if cfg.get("num_layers") is None and cfg.get("num_hidden_layers") is not None:
            n_sub = int(cfg["num_hidden_layers"])   # transformers: num_hidden_layers = 2 num_layers
            if n_sub % 2:
                raise ConfigError(f"config.json: num_hidden_layers={n_sub} must be even (2 sublayers a layer) "
                                  "where num_layers is absent")
            cfg["num_layers"] = n_sub // 2
        for key, got, ok, want in (
                ("zero_expert_type", cfg.get("zero_expert_type"), (None, "identity"), "'identity'"),
                ("mla_scale_q_lora", cfg.get("mla_scale_q_lora"), (None, True),
                 "true (transformers' LongcatFlashMLA always scales)"),
                ("mla_scale_kv_lora", cfg.get("mla_scale_kv_lora"), (None, True),
                 "true (transformers' LongcatFlashMLA always scales)"),
                ("router_bias", cfg.get("router_bias"), (None, False),
                 "false (the reference's router never adds the classifier's bias)"),
                ("hidden_act", cfg.get("hidden_act"), (None, "silu"), "'silu'"),
                ("attention_method", cfg.get("attention_method"), (None, "MLA"), "'MLA'")):
            if got not in ok:
                _refuse(key, got, want)
        cfg = {**DEFAULTS, **cfg}   # rope_theta's too: rope_parameters' own where it gives one
        n = int(need(cfg, "num_layers"))
        e, z = int(need(cfg, "n_routed_experts")), int(cfg.get("zero_expert_num") or 0)
        k = int(need(cfg, "moe_topk"))
        if n < 1 or e < 1 or z < 0:
            raise ConfigError(f"config.json: num_layers={n}, n_routed_experts={e} must be positive and "
                              f"zero_expert_num={z} not negative")
        if not 1 <= k <= e + z:
            raise ConfigError(f"config.json: moe_topk={k} must be in 1..{e + z} (n_routed_experts + zero_expert_num)")
        c_dim, lq = int(need(cfg, "kv_lora_rank")), int(need(cfg, "q_lora_rank"))
        nope, rope = int(need(cfg, "qk_nope_head_dim")), int(need(cfg, "qk_rope_head_dim"))
        v_dim = int(need(cfg, "v_head_dim"))
        if rope % 2 or min(c_dim, lq, nope, rope, v_dim) < 1:
            raise ConfigError(f"config.json: kv_lora_rank={c_dim}, q_lora_rank={lq}, qk_nope_head_dim={nope}, "
                              f"qk_rope_head_dim={rope} (even), v_head_dim={v_dim} must be positive")
        if int(cfg.get("qk_head_dim") or nope + rope) != nope + rope:
            raise ConfigError(f"config.json: qk_head_dim={cfg['qk_head_dim']} must be qk_nope_head_dim + "
                              f"qk_rope_head_dim = {nope + rope}")
        if int(need(cfg, "head_dim")) != rope:   # the reference's rotary frequencies are head_dim's
            raise ConfigError(f"config.json: head_dim={cfg['head_dim']} must equal qk_rope_head_dim={rope} "
                              "(the reference rotates head_dim dims)")
        f = MoeConfig.common_hf(dict(cfg, num_hidden_layers=n, num_experts=e + z, num_experts_per_tok=k,
                                     head_dim=rope, num_key_value_heads=None))
        h = f["hidden"]
        f.update(n_experts=e, n_kv_heads=1, head_dim=c_dim + rope, moe_intermediate=int(need(cfg, "expert_ffn_hidden_size")),
                 dense_intermediate=int(need(cfg, "ffn_hidden_size")), norm_topk_prob=False,
                 routing="softmax_bias", routed_scale=float(cfg["routed_scaling_factor"]),
                 rope=RopeConfig.from_hf(dict(cfg, partial_rotary_factor=1.0), rope))
        return cls(**f, q_lora_rank=lq, kv_lora_rank=c_dim, qk_nope_dim=nope, qk_rope_dim=rope, v_head_dim=v_dim,
                   rope_interleave=True, softmax_scale=mla_softmax_scale(cfg, nope + rope), ignored_parts=(MTP,),
                   zero_experts=z, q_scale=float((h / lq) ** 0.5), kv_scale=float((h / c_dim) ** 0.5))


# ---- tensor spec ---------------------------------------------------------------------------

def dense_spec(c: LongcatFlashConfig) -> dict[str, tuple]:
    f, h, heads, lq, cd, i = c.family, c.hidden, c.n_heads, c.q_lora_rank, c.kv_lora_rank, c.dense_intermediate
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,)}
    if not c.tie_embeddings:
        spec[name(f, "lm_head")] = (c.vocab_size, h)
    sub = {"attn_norm": (h,), "mlp_norm": (h,), "q_a": (lq, h), "q_a_norm": (lq,),
           "q_b": (heads * (c.qk_nope_dim + c.qk_rope_dim), lq), "kv_a": (cd + c.qk_rope_dim, h),
           "kv_a_norm": (cd,), "kv_b": (heads * (c.qk_nope_dim + c.v_head_dim), cd), "o": (h, heads * c.v_head_dim),
           "mlp_gate": (i, h), "mlp_up": (i, h), "mlp_down": (h, i)}
    if c.attention_bias:
        sub.update(q_a_bias=(lq,), kv_a_bias=(cd + c.qk_rope_dim,), o_bias=(h,))
    for l in range(c.n_layers):
        spec[name(f, "router", l)] = (c.router_experts, h)
        spec[name(f, "router_bias", l)] = (c.router_experts,)
        for j in (0, 1):
            for key, shape in sub.items():
                spec[name(f, f"{key}.{j}", l)] = shape
    return spec


_LATENT_NORMS = tuple(f"{k}.{j}" for k in ("q_a_norm", "kv_a_norm") for j in (0, 1))


def dense_view(c: LongcatFlashConfig, n: str, a):
    """The latent norms' weights times the MLA scales (float32): q_a_norm's by sqrt(H / q_lora_rank)
    (q_b is linear: the whole query scaled), kv_a_norm's by sqrt(H / kv_lora_rank); any other
    tensor as stored."""
    got = key_of(c.family, n, _LATENT_NORMS)
    if got is None:
        return a
    return widened(a) * np.float32(c.q_scale if got[0].startswith("q_a") else c.kv_scale)


# ---- run state and forward -----------------------------------------------------------------

class LongcatState(MlaState):
    """The latent cache of every attention sublayer: k [2 L, S_max, 1, C + R] (v the same array),
    sublayer s at row s."""

    def __init__(self, ops, c: LongcatFlashConfig, max_context: int):
        self.max_context = max_context
        self.k = ops.zeros((2 * c.n_layers, max_context, 1, c.head_dim))
        self.v = self.k
        self.pos = 0


class LongcatFlashDecoder(DeepseekV3Decoder):
    """DeepseekV3Decoder's latent attention on sublayer s (its weights and cache row s), two
    sublayers a layer and the shortcut MoE beside them."""

    def __init__(self, c: LongcatFlashConfig, ops, weights, experts, on_route=None):
        MoeDecoder.__init__(self, c, ops, weights, experts, on_route)   # deepseek_v3's reads kv_b by layer
        self._raw = weights
        self.rot = pairs_to_halves(c.qk_rope_dim)
        heads, nope, cd = c.n_heads, c.qk_nope_dim, c.kv_lora_rank
        derived = {}
        for s in range(2 * c.n_layers):   # MLA's absorbed kv_b halves, as deepseek_v3
            kv_b = ops.deltanet.f32(self._sublayer("kv_b", s)).reshape(heads, nope + c.v_head_dim, cd)
            derived["w_uk", s] = np.ascontiguousarray(kv_b[:, :nope, :])                      # [Hq, nope, C]
            derived["w_uv_t", s] = np.ascontiguousarray(kv_b[:, nope:, :].transpose(0, 2, 1))  # [Hq, C, V]
        self._derived = derived
        self.w = self._weight

    def _sublayer(self, key: str, s: int):
        return self._raw(f"{key}.{s % 2}", s // 2)

    def _weight(self, key: str, layer: int | None = None):
        """A sublayer's tensor (SUBLAYER keys, derived ones) by its sublayer index; the rest by layer."""
        got = self._derived.get((key, layer))
        if got is not None:
            return got
        return self._sublayer(key, layer) if key in SUBLAYER else self._raw(key, layer)

    def new_state(self, max_context: int) -> LongcatState:
        return LongcatState(self.ops, self.c, max_context)

    def layer(self, l: int, x, pos: np.ndarray, st: LongcatState) -> None:
        """Layer l on the rows x [T, H], in place: sublayers 2 l and 2 l + 1, the MoE on the first
        one's MLP input, its output added last (LongcatFlashDecoderLayer)."""
        c, ops, w = self.c, self.ops, self.w
        shortcut = None
        for s in (2 * l, 2 * l + 1):
            ops.add_(x, self.attention(s, ops.rmsnorm(x, w("attn_norm", s), c.rms_eps), pos, st))
            h = ops.rmsnorm(x, w("mlp_norm", s), c.rms_eps)
            if shortcut is None:
                shortcut = self.moe(l, h)                                  # [T, H]
            ops.add_(x, self.dense_mlp(s, h))
        ops.add_(x, shortcut)

    def moe(self, l: int, h):
        """The real experts chosen (each once over its tokens, fetched as usual) plus h times the
        weights of the zero experts chosen. on_route sees ids [T, K] with -1 at zero experts' slots
        (they read no block)."""
        c, ops = self.c, self.ops
        ids, rw = self.route(l, h)   # (base: softmax over E + Z chosen with the bias, times the scale)
        zero = ids >= c.n_experts                                          # [T, K]
        if self.on_route is not None:
            self.on_route(l, np.where(zero, -1, ids).astype(np.int32))
        out = ops.zeros(h.shape)
        real = np.unique(ids[~zero])
        for e, we in zip(real, self.experts.fetch(l, real)):
            t_idx, k_idx = np.nonzero(ids == e)
            y = self.routed_expert(l, int(e), ops.take_rows(h, t_idx), we)
            ops.scatter_add_rows(out, t_idx, y, rw[t_idx, k_idx])
        identity = np.where(zero, rw, np.float32(0)).sum(axis=1, dtype=np.float32)   # [T]
        ops.add_(out, h * identity[:, None])
        return out


Model = LongcatFlashDecoder
Config = LongcatFlashConfig
