"""The hybrid MoE decoder of Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet (linear attention) layers
interleaved with gated full-attention layers, each followed by routed experts plus a gated shared
expert. Written against backend ops (`ops` and its `ops.deltanet`), like base.MoeDecoder, which it
extends: the routed experts, the dense MLP, the residual stream and the LM head are base's.

Legend: T = tokens, H = hidden, D = attention head dim, Hq / Hkv = attention heads,
Nk / Nv = DeltaNet key / value heads (value head h reads key head h // (Nv / Nk)), Dk / Dv = their
head dims, C = conv channels (2 Nk Dk + Nv Dv), Kc = conv width, S = cached positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models.base import MoeConfig, MoeDecoder, RunState, expert_spec, need  # noqa: F401 (re-exported)
from engine.models.rope import ConfigError
from engine.names import name

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridConfig(MoeConfig):
    layer_types: tuple = ()         # per layer: LINEAR (Gated DeltaNet) or FULL (gated attention)
    lin_k_heads: int = 0            # Nk
    lin_v_heads: int = 0            # Nv, a multiple of Nk
    lin_k_dim: int = 0              # Dk
    lin_v_dim: int = 0              # Dv
    conv_kernel: int = 0            # Kc: causal depthwise conv over the q, k, v channels
    shared_gated: bool = True       # the shared expert's sigmoid gate (base.MoeConfig)
    fused_qkvz: bool = False        # Qwen3-Next: in_proj_qkvz / in_proj_ba grouped per key head
    ignored_parts: tuple = ()       # ((tensor-name prefix, what it is), ...): checkpoint parts not loaded

    @property
    def key_dim(self) -> int:       # Nk Dk
        return self.lin_k_heads * self.lin_k_dim

    @property
    def value_dim(self) -> int:     # Nv Dv
        return self.lin_v_heads * self.lin_v_dim

    @property
    def conv_dim(self) -> int:      # C
        return 2 * self.key_dim + self.value_dim

    @property
    def ssm_shape(self) -> tuple:   # one DeltaNet layer's recurrent state: (Nv, Dk, Dv)
        return (self.lin_v_heads, self.lin_k_dim, self.lin_v_dim)

    @property
    def full_layers(self) -> tuple:
        return tuple(l for l, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple:
        return tuple(l for l, t in enumerate(self.layer_types) if t == LINEAR)

    @staticmethod
    def hybrid_hf(cfg: dict) -> dict:
        """Fields both families read the same way from a (text) config.json dict."""
        cfg = dict(cfg)
        params = cfg.get("rope_parameters") or {}
        if "partial_rotary_factor" not in params and "partial_rotary_factor" not in cfg:
            cfg["partial_rotary_factor"] = 0.25     # the reference's default for these families
        f = MoeConfig.common_hf(cfg)
        if cfg.get("attention_bias"):
            raise ConfigError(f"config.json: attention_bias=true is not supported for {f['family']}")
        n = f["n_layers"]
        types = cfg.get("layer_types")
        if types is None:
            every = int(cfg.get("full_attention_interval") or 4)
            types = [FULL if (l + 1) % every == 0 else LINEAR for l in range(n)]
        types = tuple(types)
        if len(types) != n or set(types) - {LINEAR, FULL}:
            raise ConfigError(f"config.json: layer_types must list {n} entries of {LINEAR!r} / {FULL!r}, "
                              f"got {list(types)}")
        nk, nv = int(need(cfg, "linear_num_key_heads")), int(need(cfg, "linear_num_value_heads"))
        if nv % nk:
            raise ConfigError(f"config.json: linear_num_value_heads={nv} is not a multiple of "
                              f"linear_num_key_heads={nk}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act={act!r} is not supported (silu only)")
        f.update(layer_types=types, lin_k_heads=nk, lin_v_heads=nv,
                 lin_k_dim=int(need(cfg, "linear_key_head_dim")),
                 lin_v_dim=int(need(cfg, "linear_value_head_dim")),
                 conv_kernel=int(need(cfg, "linear_conv_kernel_dim")),
                 moe_intermediate=int(need(cfg, "moe_intermediate_size")),
                 shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0))
        return f


# ---- tensor spec ---------------------------------------------------------------------------

def dense_spec(c: HybridConfig) -> dict[str, tuple]:
    """Every non-expert tensor the model reads, with its shape: the completeness contract."""
    f, h = c.family, c.hidden
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,)}
    if not c.tie_embeddings:
        spec[name(f, "lm_head")] = (c.vocab_size, h)
    nv, kd, vd = c.lin_v_heads, c.key_dim, c.value_dim
    for l in range(c.n_layers):
        spec[name(f, "attn_norm", l)] = (h,)
        spec[name(f, "mlp_norm", l)] = (h,)
        if c.layer_types[l] == FULL:
            spec[name(f, "q", l)] = (2 * c.q_dim, h)          # per head: D query rows, then D gate rows
            spec[name(f, "k", l)] = (c.kv_dim, h)
            spec[name(f, "v", l)] = (c.kv_dim, h)
            spec[name(f, "o", l)] = (h, c.q_dim)
            spec[name(f, "q_norm", l)] = (c.head_dim,)
            spec[name(f, "k_norm", l)] = (c.head_dim,)
        else:
            if c.fused_qkvz:
                spec[name(f, "dn_qkvz", l)] = (2 * kd + 2 * vd, h)
                spec[name(f, "dn_ba", l)] = (2 * nv, h)
            else:
                spec[name(f, "dn_qkv", l)] = (c.conv_dim, h)
                spec[name(f, "dn_z", l)] = (vd, h)
                spec[name(f, "dn_b", l)] = (nv, h)
                spec[name(f, "dn_a", l)] = (nv, h)
            spec[name(f, "dn_conv", l)] = (c.conv_dim, 1, c.conv_kernel)
            spec[name(f, "dn_A_log", l)] = (nv,)
            spec[name(f, "dn_dt_bias", l)] = (nv,)
            spec[name(f, "dn_norm", l)] = (c.lin_v_dim,)
            spec[name(f, "dn_out", l)] = (h, vd)
        if l in c.moe_layers:
            spec[name(f, "router", l)] = (c.n_experts, h)
            if c.shared_intermediate:
                spec[name(f, "shared_gate", l)] = (c.shared_intermediate, h)
                spec[name(f, "shared_up", l)] = (c.shared_intermediate, h)
                spec[name(f, "shared_down", l)] = (h, c.shared_intermediate)
                spec[name(f, "shared_expert_gate", l)] = (1, h)
        else:
            spec[name(f, "mlp_gate", l)] = (c.dense_intermediate, h)
            spec[name(f, "mlp_up", l)] = (c.dense_intermediate, h)
            spec[name(f, "mlp_down", l)] = (h, c.dense_intermediate)
    return spec


def qkvz_order(c: HybridConfig) -> tuple[np.ndarray, np.ndarray]:
    """Column orders that turn Qwen3-Next's fused projections into the separate layout.

    in_proj_qkvz rows per key head g: q_g [Dk], k_g [Dk], v of its Nv/Nk value heads, z of the same;
    in_proj_ba rows per key head: b of its value heads, then a. Returns (qkvz_cols, ba_cols) so that
    out[:, qkvz_cols] = [q (Nk Dk) | k (Nk Dk) | v (Nv Dv) | z (Nv Dv)] and out[:, ba_cols] = [b | a].
    """
    nk, dk, r, dv = c.lin_k_heads, c.lin_k_dim, c.lin_v_heads // c.lin_k_heads, c.lin_v_dim
    per = 2 * dk + 2 * r * dv
    g = np.arange(nk)[:, None] * per
    q = g + np.arange(dk)
    k = g + dk + np.arange(dk)
    v = g + 2 * dk + np.arange(r * dv)
    z = g + 2 * dk + r * dv + np.arange(r * dv)
    qkvz = np.concatenate([q.ravel(), k.ravel(), v.ravel(), z.ravel()])
    gb = np.arange(nk)[:, None] * 2 * r
    ba = np.concatenate([(gb + np.arange(r)).ravel(), (gb + r + np.arange(r)).ravel()])
    return qkvz.astype(np.int64), ba.astype(np.int64)


# ---- run state and forward -----------------------------------------------------------------

class HybridState:
    """Preallocated per-sequence state, float32.

    k, v:  [La, S_max, Hkv, D]  KV cache of the La full-attention layers
    conv:  [Ll, Kc-1, C]        last Kc-1 conv inputs of each of the Ll DeltaNet layers, oldest first
    ssm:   [Ll, Nv, Dk, Dv]     DeltaNet recurrent state per value head (c.ssm_shape: another
                                recurrent mixer's, e.g. Nemotron-H's Mamba-2 [Hm, P, N])
    """

    def __init__(self, ops, c: HybridConfig, max_context: int):
        self.max_context = max_context
        la, ll = len(c.full_layers), len(c.linear_layers)
        self.k = ops.zeros((la, max_context, c.n_kv_heads, c.head_dim))
        self.v = ops.zeros((la, max_context, c.n_kv_heads, c.head_dim))
        self.conv = ops.zeros((ll, c.conv_kernel - 1, c.conv_dim))
        self.ssm = ops.zeros((ll, *c.ssm_shape))
        self.pos = 0   # positions filled so far

    def copy_into(self, dst, keep: int) -> None:
        """RunState.copy_into and the recurrent state, which is at pos: keep must be pos."""
        RunState.copy_into(self, dst, keep)
        dst.conv[...] = self.conv
        dst.ssm[...] = self.ssm

    def save_nbytes(self, keep: int) -> int:
        return RunState.save_nbytes(self, keep) + self.conv.nbytes + self.ssm.nbytes

    def save(self, keep: int) -> dict:
        """RunState.save and the recurrent state, which is at pos: keep must be pos."""
        return dict(RunState.save(self, keep), conv=self.conv.copy(), ssm=self.ssm.copy())

    def load(self, saved: dict, keep: int) -> None:
        RunState.load(self, saved, keep)
        self.conv[...] = saved["conv"]
        self.ssm[...] = saved["ssm"]


class HybridDecoder(MoeDecoder):
    """MoeDecoder with a per-layer token mixer (Gated DeltaNet or gated attention), zero-centred
    RMSNorms (weight 1 + w) and a sigmoid-gated shared expert beside the routed experts."""
    rewinds = False   # the DeltaNet layers' recurrent state holds every position up to pos

    def __init__(self, c: HybridConfig, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        self.dn = ops.deltanet
        # each layer's slot in the state of its kind
        self.slot = {l: i for kind in (c.full_layers, c.linear_layers) for i, l in enumerate(kind)}
        if c.fused_qkvz:
            self.qkvz_cols, self.ba_cols = qkvz_order(c)
        # Derived weights, computed once in float32 as the reference does: norms as (1 + w); the
        # conv taps as [C, Kc]; dn_neg_a = -exp(A_log). self.w serves them by key, ahead of the raw ones.
        derived = {("final_norm", None): np.float32(1.0) + self.dn.f32(weights("final_norm"))}
        for l in range(c.n_layers):
            norms = ("attn_norm", "mlp_norm") + (("q_norm", "k_norm") if c.layer_types[l] == FULL else ())
            for key in norms:
                derived[key, l] = np.float32(1.0) + self.dn.f32(weights(key, l))
            if c.layer_types[l] == LINEAR:
                derived["dn_conv", l] = self.dn.f32(weights("dn_conv", l)).reshape(c.conv_dim, c.conv_kernel)
                derived["dn_neg_a", l] = -np.exp(self.dn.f32(weights("dn_A_log", l)))   # -exp(A_log)
                derived["dn_dt_bias", l] = self.dn.f32(weights("dn_dt_bias", l))
                derived["dn_norm", l] = self.dn.f32(weights("dn_norm", l))
        self.derive({k: ops.weight(v.astype(np.float32)) for k, v in derived.items()})

    def new_state(self, max_context: int) -> HybridState:
        return HybridState(self.ops, self.c, max_context)

    # MoeDecoder.forward calls attention() for every layer's token mixer
    def attention(self, l: int, h, pos: np.ndarray, st: HybridState):
        if self.c.layer_types[l] == LINEAR:
            return self.deltanet(l, h, st)
        return self.gated_attention(l, h, pos, st)

    def gated_attention(self, l: int, h, pos: np.ndarray, st: HybridState):
        """Full causal attention with per-head q/k RMSNorm, partial RoPE and a sigmoid output gate."""
        c, ops, w = self.c, self.ops, self.w
        t, d = h.shape[0], c.head_dim
        qg = ops.linear(h, w("q", l)).reshape(t, c.n_heads, 2 * d)       # [T, Hq, 2D]: query | gate
        gate = qg[:, :, d:].reshape(t, c.q_dim)                           # [T, Hq D]
        q = ops.rmsnorm(qg[:, :, :d], w("q_norm", l), c.rms_eps)         # [T, Hq, D]
        k = ops.rmsnorm(ops.linear(h, w("k", l)).reshape(t, c.n_kv_heads, d), w("k_norm", l), c.rms_eps)
        v = ops.linear(h, w("v", l)).reshape(t, c.n_kv_heads, d)         # [T, Hkv, D]
        ops.rope(q, pos, self.inv_freq, c.rope.attention_factor)
        ops.rope(k, pos, self.inv_freq, c.rope.attention_factor)
        s = self.slot[l]
        ops.kv_store(st.k[s], st.v[s], int(pos[0]), k, v, self.kv_bf16)
        a = ops.attention(q, st.k[s], st.v[s], pos, d ** -0.5, 0).reshape(t, c.q_dim)
        self.dn.sigmoid_gate_(a, gate)
        return ops.linear(a, w("o", l))

    def deltanet(self, l: int, h, st: HybridState):
        """Gated DeltaNet: projections, causal conv (rolling state), gated delta rule (recurrent
        state), gated RMSNorm, output projection. Prefill runs the chunked form, decode the step."""
        c, ops, dn, w = self.c, self.ops, self.dn, self.w
        t, kd, vd, nv = h.shape[0], c.key_dim, c.value_dim, c.lin_v_heads
        if c.fused_qkvz:
            qkvz = dn.take_cols(ops.linear(h, w("dn_qkvz", l)), self.qkvz_cols)   # [T, C + Nv Dv]
            qkv, z = qkvz[:, :c.conv_dim], qkvz[:, c.conv_dim:]
            ba = dn.take_cols(ops.linear(h, w("dn_ba", l)), self.ba_cols)         # [T, 2 Nv]
            b, a = ba[:, :nv], ba[:, nv:]
        else:
            qkv, z = ops.linear(h, w("dn_qkv", l)), ops.linear(h, w("dn_z", l))
            b, a = ops.linear(h, w("dn_b", l)), ops.linear(h, w("dn_a", l))
        s = self.slot[l]
        qkv = dn.conv1d_silu(qkv, w("dn_conv", l), st.conv[s])                   # [T, C]
        beta, g = dn.gates(b, a, w("dn_neg_a", l), w("dn_dt_bias", l))           # [T, Nv] each
        q = qkv[:, :kd].reshape(t, c.lin_k_heads, c.lin_k_dim)                   # [T, Nk, Dk]
        k = qkv[:, kd:2 * kd].reshape(t, c.lin_k_heads, c.lin_k_dim)
        v = qkv[:, 2 * kd:].reshape(t, nv, c.lin_v_dim)                          # [T, Nv, Dv]
        o = dn.delta_rule(q, k, v, g, beta, st.ssm[s], chunked=t > 1)            # [T, Nv, Dv]
        o = dn.rmsnorm_gated(o, z.reshape(t, nv, c.lin_v_dim), w("dn_norm", l), c.rms_eps)
        return ops.linear(o.reshape(t, vd), w("dn_out", l))

