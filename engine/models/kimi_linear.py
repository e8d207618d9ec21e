"""Kimi-Linear (Kimi-Linear-48B-A3B): Kimi Delta Attention (KDA) layers interleaved with
DeepSeek-V3's multi-head latent attention (MLA) run without RoPE, then DeepSeek-V3's MoE (sigmoid
routing with a selection bias and groups, scaled weights, shared experts, the first layers dense).

KDA is Gated DeltaNet (engine/models/hybrid.py) with a decay a key channel instead of one a head:
q, k and v come from separate projections, each through its own short causal conv (SiLU), one
conv state of their concatenation; the log decay g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)
has Nh Dk channels; beta = sigmoid(b_proj(x)); the output is RMSNorm'd per head and gated by
sigmoid(g_b(g_a(x))). Nk = Nv = Nh heads, Dk = Dv. The MLA layers are deepseek_v3's absorbed
form over one latent row a token, with no rotation of q_pe / k_pe (the reference applies none).
Norms scale by w (not 1 + w).

Legend: T = tokens, H = hidden, Nh = KDA heads, Dk = their head dim, P = Nh Dk, Kc = conv width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import deepseek_v3
from engine.models.base import MoeConfig, MoeDecoder, expert_spec, layer_list, need  # noqa: F401 (re-exported)
from engine.models.deepseek_v3 import DeepseekV3Config, DeepseekV3Decoder
from engine.models.glm4_moe import sigmoid_moe
from engine.models.glm4_moe_lite import routed_layers
from engine.models.hybrid import FULL, LINEAR, HybridConfig, HybridState
from engine.models.rope import ConfigError, RopeConfig
from engine.names import name

_MLA = ("q", "q_a", "q_a_norm", "q_b", "q_a_bias", "kv_a", "kv_a_norm", "kv_b", "kv_a_bias", "o", "o_bias")
# Kimi's later releases (K3) in the same model_type: fields of parts the reference does not build
_LATER = ("mla_use_output_gate", "routed_expert_hidden_size", "latent_moe_use_norm", "attn_res_block_size")


def _refuse(key: str, got, want: str) -> None:
    raise ConfigError(f"config.json: {key}={got!r} is not supported for kimi_linear; expected {want}")


def _layer_types(cfg: dict, n: int) -> tuple:
    """layer_types, else linear_attn_config's kda_layers / full_attn_layers (1-based), else the
    reference's default (full attention at layers 4, 8, ... counted from 0)."""
    if cfg.get("layer_types") is not None:
        return tuple(layer_list("layer_types", cfg["layer_types"], n, (LINEAR, FULL)))
    lin = cfg.get("linear_attn_config") or {}
    if "kda_layers" in lin and "full_attn_layers" in lin:
        kda, full = list(lin["kda_layers"] or ()), list(lin["full_attn_layers"] or ())
        if sorted(kda + full) != list(range(1, n + 1)):
            raise ConfigError(f"config.json: linear_attn_config's kda_layers {kda} and full_attn_layers "
                              f"{full} must list each of the layers 1..{n} once (1-based)")
        return tuple(FULL if l + 1 in full else LINEAR for l in range(n))
    return tuple(FULL if l and l % 4 == 0 else LINEAR for l in range(n))


@dataclass(frozen=True)
class KimiLinearConfig(HybridConfig, DeepseekV3Config):
    """HybridConfig's layer kinds and linear-attention sizes (lin_k_heads = lin_v_heads = Nh,
    lin_k_dim = lin_v_dim = Dk: conv_dim is 3 P) beside DeepseekV3Config's latent attention."""

    @property
    def kda_dim(self) -> int:       # P = Nh Dk, the width of q, k, v, the decay and the gate
        return self.lin_k_heads * self.lin_k_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> "KimiLinearConfig":
        cfg = dict(cfg)
        lin = cfg.get("linear_attn_config") or {}
        for key, got, ok, want in (
                ("hidden_act", cfg.get("hidden_act", "silu"), ("silu",), "'silu'"),
                ("moe_router_activation_func", cfg.get("moe_router_activation_func"), (None, "sigmoid"),
                 "'sigmoid'"),
                ("topk_method", cfg.get("topk_method"), (None, "noaux_tc"), "'noaux_tc'"),
                ("mla_use_nope", cfg.get("mla_use_nope"), (None, True), "true (the MLA layers run without RoPE)"),
                ("moe_layer_freq", cfg.get("moe_layer_freq"), (None, 1), "1 (every layer past the dense ones routed)"),
                ("tie_word_embeddings", cfg.get("tie_word_embeddings"), (None, False),
                 "false (the reference keeps lm_head apart)"),
                ("linear_attn_config.gate_lower_bound", lin.get("gate_lower_bound"), (None,), "none"),
                ("linear_attn_config.use_full_rank_gate", lin.get("use_full_rank_gate"), (None, False), "false")):
            if got not in ok:
                _refuse(key, got, want)
        for key in _LATER:
            if cfg.get(key) not in (None, False):
                _refuse(key, cfg[key], "none (a part the reference does not build)")
        n = int(need(cfg, "num_hidden_layers"))
        types = _layer_types(cfg, n)
        heads = int(lin.get("num_heads") or cfg.get("linear_num_heads") or 32)          # the reference's defaults
        hd = int(lin.get("head_dim") or cfg.get("linear_head_dim") or 128)
        kc = int(lin.get("short_conv_kernel_size") or cfg.get("linear_conv_kernel_dim") or 4)
        if min(heads, hd, kc) < 1:
            raise ConfigError(f"config.json: linear_attn_config num_heads={heads}, head_dim={hd}, "
                              f"short_conv_kernel_size={kc} must be positive")
        # the release's field names first (transformers' attribute_map reads them under these)
        alias = {"n_routed_experts": ("num_experts", "num_local_experts"),
                 "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok"),
                 "n_shared_experts": ("num_shared_experts", "n_shared_experts"),
                 "norm_topk_prob": ("moe_renormalize", "norm_topk_prob"),
                 "n_group": ("num_expert_group", "n_group"),
                 "max_position_embeddings": ("model_max_length", "max_position_embeddings")}
        for key, names in alias.items():
            cfg[key] = next((cfg[k] for k in names if cfg.get(k) is not None), None)
        cfg["num_experts"] = int(need(cfg, "n_routed_experts"))
        cfg.setdefault("routed_scaling_factor", 2.446)   # the reference's default
        cfg.setdefault("first_k_dense_replace", 1)
        c_dim = int(need(cfg, "kv_lora_rank"))
        nope, rope = int(need(cfg, "qk_nope_head_dim")), int(need(cfg, "qk_rope_head_dim"))
        v_dim = int(need(cfg, "v_head_dim"))
        if min(c_dim, nope, rope, v_dim) < 1:
            raise ConfigError(f"config.json: kv_lora_rank={c_dim}, qk_nope_head_dim={nope}, "
                              f"qk_rope_head_dim={rope}, v_head_dim={v_dim} must be positive")
        f = MoeConfig.common_hf(dict(cfg, head_dim=rope, num_key_value_heads=None))
        f.update(sigmoid_moe(cfg, f, first_dense=1, shared=1, norm=True))
        f.update(moe_layers=routed_layers(cfg, first_dense=1), n_kv_heads=1, head_dim=c_dim + rope,
                 rope=RopeConfig.from_hf(dict(cfg, partial_rotary_factor=1.0), rope),
                 nope_layers=tuple(range(n)), tie_embeddings=False)
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        mtp = tuple((f"model.layers.{n + i}.", "the multi-token-prediction (MTP) layer") for i in range(n_mtp))
        return cls(**f, layer_types=types, lin_k_heads=heads, lin_v_heads=heads, lin_k_dim=hd, lin_v_dim=hd,
                   conv_kernel=kc, shared_gated=False, q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                   kv_lora_rank=c_dim, qk_nope_dim=nope, qk_rope_dim=rope, v_head_dim=v_dim,
                   rope_interleave=False, softmax_scale=float((nope + rope) ** -0.5), ignored_parts=mtp)


# ---- tensor spec ---------------------------------------------------------------------------

def dense_spec(c: KimiLinearConfig) -> dict[str, tuple]:
    """deepseek_v3's spec (MLA in every layer, the MoE and dense MLPs), the KDA layers' tensors
    in place of MLA's where the layer is linear."""
    f, h, p, nh, hd, kc = c.family, c.hidden, c.kda_dim, c.lin_k_heads, c.lin_k_dim, c.conv_kernel
    spec = deepseek_v3.dense_spec(c)
    for l in c.linear_layers:
        for key in _MLA:
            spec.pop(name(f, key, l), None)
        for key, shape in (("q", (p, h)), ("k", (p, h)), ("v", (p, h)), ("o", (h, p)),
                           ("kda_q_conv", (p, 1, kc)), ("kda_k_conv", (p, 1, kc)), ("kda_v_conv", (p, 1, kc)),
                           ("kda_f_a", (hd, h)), ("kda_f_b", (p, hd)), ("kda_A_log", (1, 1, nh, 1)),
                           ("kda_dt_bias", (p,)), ("kda_b", (nh, h)), ("kda_g_a", (hd, h)),
                           ("kda_g_b", (p, hd)), ("kda_norm", (hd,))):
            spec[name(f, key, l)] = shape
    return spec


# ---- run state and forward -----------------------------------------------------------------

class KimiState(HybridState):
    """Preallocated per-sequence state, float32.

    k:     [La, S_max, 1, C + R]  latent cache of the La MLA layers (v is the same array)
    conv:  [Ll, Kc-1, 3 P]        last Kc-1 conv inputs (q | k | v) of each of the Ll KDA layers
    ssm:   [Ll, Nh, Dk, Dk]       KDA recurrent state per head
    """

    def __init__(self, ops, c: KimiLinearConfig, max_context: int):
        self.max_context = max_context
        la, ll = len(c.full_layers), len(c.linear_layers)
        self.k = ops.zeros((la, max_context, 1, c.head_dim))
        self.v = self.k
        self.conv = ops.zeros((ll, c.conv_kernel - 1, c.conv_dim))
        self.ssm = ops.zeros((ll, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim))
        self.pos = 0

    def save_nbytes(self, keep: int) -> int:
        return self.k[:, :keep].nbytes + self.conv.nbytes + self.ssm.nbytes

    def save(self, keep: int) -> dict:
        """The latent rows of the first keep positions and the recurrent state (at pos: keep must be pos)."""
        return {"k": self.k[:, :keep].copy(), "conv": self.conv.copy(), "ssm": self.ssm.copy()}

    def load(self, saved: dict, keep: int) -> None:
        self.k[:, :keep] = saved["k"][:, :keep]
        self.conv[...] = saved["conv"]
        self.ssm[...] = saved["ssm"]
        self.pos = keep


class KimiLinearDecoder(DeepseekV3Decoder):
    """DeepseekV3Decoder (MLA, the MoE) whose linear layers run KDA; plain RMSNorms."""
    rewinds = False   # the KDA layers' recurrent state holds every position up to pos

    def __init__(self, c: KimiLinearConfig, ops, weights, experts, on_route=None):
        MoeDecoder.__init__(self, c, ops, weights, experts, on_route)   # deepseek_v3's derives kv_b in every layer
        self.dn = dn = ops.deltanet
        # each layer's slot in the state of its kind
        self.slot = {l: i for kind in (c.full_layers, c.linear_layers) for i, l in enumerate(kind)}
        self.rot = np.arange(c.qk_rope_dim)
        heads, nope, cd, p = c.n_heads, c.qk_nope_dim, c.kv_lora_rank, c.kda_dim
        derived = {}
        for l in c.full_layers:   # MLA's absorbed kv_b halves, as deepseek_v3
            kv_b = dn.f32(weights("kv_b", l)).reshape(heads, nope + c.v_head_dim, cd)
            derived["w_uk", l] = np.ascontiguousarray(kv_b[:, :nope, :])                      # [Hq, nope, C]
            derived["w_uv_t", l] = np.ascontiguousarray(kv_b[:, nope:, :].transpose(0, 2, 1))  # [Hq, C, V]
        for l in c.linear_layers:   # float32 once: the conv taps of q | k | v as [3 P, Kc], -exp(A_log) a channel
            derived["kda_conv", l] = np.concatenate(
                [dn.f32(weights(k, l)).reshape(p, c.conv_kernel) for k in ("kda_q_conv", "kda_k_conv", "kda_v_conv")])
            derived["kda_neg_a", l] = np.repeat(-np.exp(dn.f32(weights("kda_A_log", l)).reshape(-1)), c.lin_k_dim)
            derived["kda_dt_bias", l] = dn.f32(weights("kda_dt_bias", l))
        self.derive({k: ops.weight(v.astype(np.float32)) for k, v in derived.items()})

    def new_state(self, max_context: int) -> KimiState:
        return KimiState(self.ops, self.c, max_context)

    def cache_index(self, l: int) -> int:
        return self.slot[l]

    def attention(self, l: int, h, pos: np.ndarray, st: KimiState):
        if self.c.layer_types[l] == LINEAR:
            return self.kda(l, h, st)
        return DeepseekV3Decoder.attention(self, l, h, pos, st)

    def kda(self, l: int, h, st: KimiState):
        """Kimi Delta Attention: q, k, v projections through the causal conv (rolling state), the
        per-channel forget gate and beta, the delta rule (recurrent state), RMSNorm gated by
        sigmoid(g_b g_a h), o_proj. Prefill runs the chunked form, decode the step."""
        c, ops, dn, w = self.c, self.ops, self.dn, self.w
        t, p, nh, hd = h.shape[0], c.kda_dim, c.lin_k_heads, c.lin_k_dim
        s = self.slot[l]
        qkv = np.concatenate([ops.linear(h, w(k, l)) for k in ("q", "k", "v")], axis=1)   # [T, 3 P]
        qkv = dn.conv1d_silu(qkv, w("kda_conv", l), st.conv[s])
        f = ops.linear(ops.linear(h, w("kda_f_a", l)), w("kda_f_b", l))                  # [T, P]
        beta, g = dn.gates(ops.linear(h, w("kda_b", l)), f, w("kda_neg_a", l), w("kda_dt_bias", l))
        q, k, v = (qkv[:, i * p:(i + 1) * p].reshape(t, nh, hd) for i in range(3))        # [T, Nh, Dk]
        o = dn.delta_rule(q, k, v, g.reshape(t, nh, hd), beta, st.ssm[s], chunked=t > 1)
        o = ops.rmsnorm(o, w("kda_norm", l), c.rms_eps).reshape(t, p)
        dn.sigmoid_gate_(o, ops.linear(ops.linear(h, w("kda_g_a", l)), w("kda_g_b", l)))   # gate [T, P]
        return ops.linear(o, w("o", l))


Model = KimiLinearDecoder
Config = KimiLinearConfig
