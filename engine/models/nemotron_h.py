"""Nemotron-H (NVIDIA-Nemotron-3-Nano-30B-A3B, -Super): a stack of single-mixer blocks, each
x += mixer(rmsnorm(x)), the mixer one of
- "M" linear_attention: a Mamba-2 mixer. in_proj -> z [I] | xBC [C] | dt [Hm]; xBC through a
  causal depthwise conv (with bias) and SiLU -> x [Hm, P], B, C [G, N]; the selective scan
  (A = -exp(A_log), dt' = softplus(dt + dt_bias) clamped to time_step_limit, D skip); then
  w * rmsnorm(y * silu(z)) over n_groups runs of I / G columns (gate first); out_proj;
- "*" full_attention: causal GQA attention without RoPE (nor any position encoding);
- "E" moe: DeepSeek-V3's sigmoid routing (selection bias, groups, routed_scaling_factor) over
  ungated experts down(relu(up x)^2), a shared expert of the same form beside them; Super
  projects the experts' input to moe_latent_size and their sum back (fc1 / fc2_latent_proj);
- "-" mlp: a dense down(relu(up x)^2).
Then the final norm (norm_f) and lm_head. CPU backend.

The layer pattern comes from layers_block_type (a list; "mamba" / "attention" are the older
names of linear_attention / full_attention) or, in released configs, hybrid_override_pattern
("M-M*E..."). The multi-token-prediction layers (mtp.*) of releases with num_nextn_predict_layers
are left unread: decoding does not use them.

Legend: T = tokens, H = hidden, Hm = Mamba heads, P = their head dim, I = Hm P, G = B / C groups,
N = state size, C = conv channels (I + 2 G N), Kc = conv width, L = latent size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.models.base import MoeConfig, MoeDecoder, layer_list, need
from engine.models.hybrid import FULL, LINEAR, HybridState
from engine.models.rope import ConfigError
from engine.names import name

MOE, MLP = "moe", "mlp"
KINDS = (LINEAR, FULL, MOE, MLP)
PATTERN = {"M": LINEAR, "*": FULL, "E": MOE, "-": MLP}   # hybrid_override_pattern's letters
LEGACY = {"mamba": LINEAR, "attention": FULL}            # older layers_block_type names
MTP = ("mtp.", "the multi-token-prediction (MTP) layers")
# config.json's older names of the Mamba fields (the reference reads both, the older one first)
ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv",
           "time_step_limit": "mamba_dt_limit", "use_conv_bias": "mamba_conv_bias"}


def _field(cfg: dict, key: str, default=None):
    v = cfg.get(ALIASES[key]) if key in ALIASES else None
    if v is None:
        v = cfg.get(key)
    return default if v is None else v


def _float(v) -> float:
    """A config number; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def layer_kinds(cfg: dict) -> tuple:
    """Each layer's mixer kind (KINDS) from layers_block_type or hybrid_override_pattern."""
    types = cfg.get("layers_block_type")
    if types is None:
        pattern = cfg.get("hybrid_override_pattern")
        if pattern is None:   # the reference's default pattern
            return (LINEAR, MOE, FULL, MLP)
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(PATTERN):
            raise ConfigError(f"config.json: hybrid_override_pattern must be a string of "
                              f"{', '.join(PATTERN)} (one a layer); got {pattern!r}")
        return tuple(PATTERN[ch] for ch in pattern)
    if not isinstance(types, (list, tuple)) or not types:
        raise ConfigError(f"config.json: layers_block_type must list each layer's kind, one of "
                          f"{', '.join(KINDS)}; got {types!r}")
    types = [LEGACY.get(t, t) for t in types]
    return tuple(layer_list("layers_block_type", types, len(types), KINDS))


@dataclass(frozen=True)
class NemotronHConfig(MoeConfig):
    kinds: tuple = ()               # per layer: one of KINDS
    mamba_heads: int = 0            # Hm
    mamba_head_dim: int = 0         # P
    n_groups: int = 0               # G (B / C groups, and the gated norm's groups)
    ssm_state: int = 0              # N
    conv_kernel: int = 0            # Kc
    conv_bias: bool = True
    dt_limit: tuple = (0.0, math.inf)   # dt' clamped to it
    latent: int = 0                 # L, the experts' width (0: they read H)
    ignored_parts: tuple = ()

    @property
    def mamba_inner(self) -> int:   # I
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:      # C
        return self.mamba_inner + 2 * self.n_groups * self.ssm_state

    @property
    def ssm_shape(self) -> tuple:   # one Mamba layer's recurrent state: (Hm, P, N)
        return (self.mamba_heads, self.mamba_head_dim, self.ssm_state)

    @property
    def full_layers(self) -> tuple:
        return tuple(l for l, k in enumerate(self.kinds) if k == FULL)

    @property
    def linear_layers(self) -> tuple:
        return tuple(l for l, k in enumerate(self.kinds) if k == LINEAR)

    @property
    def expert_hidden(self) -> int:
        return self.latent or self.hidden

    @property
    def gated_experts(self) -> bool:
        return False

    @classmethod
    def from_hf(cls, cfg: dict) -> "NemotronHConfig":
        kinds = layer_kinds(cfg)
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if cfg.get(key, want) != want:
                raise ConfigError(f"config.json: {key}={cfg[key]!r} is not supported ({want} only)")
        for key in ("use_bias", "mlp_bias"):   # Mamba in / out_proj biases; MLP and expert biases
            if cfg.get(key):
                raise ConfigError(f"config.json: {key}=true is not supported (false, as released)")
        # the fields common_hf reads under their Nemotron-H names; no RoPE is applied (its
        # parameters, if any, are not read)
        base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "partial_rotary_factor")}
        base.update(num_hidden_layers=len(kinds), rms_norm_eps=cfg.get("layer_norm_epsilon") or 1e-5,
                    num_local_experts=need(cfg, "n_routed_experts") if MOE in kinds else 1)
        # the reference's defaults where config.json has no value (not hidden / heads, nor Hq)
        base.setdefault("head_dim", 128)
        base.setdefault("num_key_value_heads", 8)
        if MOE not in kinds:
            base["num_experts_per_tok"] = 1
        f = MoeConfig.common_hf(base)
        n_experts = f["n_experts"]
        n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if n_experts % n_group or not 1 <= topk_group <= n_group:
            raise ConfigError(f"config.json: n_group={n_group} must divide n_routed_experts={n_experts} "
                              f"and topk_group={topk_group} be in 1..{n_group}")
        hm, groups = int(_field(cfg, "mamba_num_heads", 128)), int(_field(cfg, "n_groups", 8))
        if LINEAR in kinds and hm % groups:
            raise ConfigError(f"config.json: mamba_num_heads={hm} is not a multiple of n_groups={groups}")
        limit = _field(cfg, "time_step_limit", (0.0, math.inf))
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise ConfigError(f"config.json: time_step_limit must be [min, max]; got {limit!r}")
        limit = (_float(limit[0]), _float(limit[1]))
        if limit != (0.0, math.inf):
            # the reference clamps dt in its chunked (prefill) scan but not in its one-token
            # step, so a clamp that bites has no single reference to match
            raise ConfigError(f"config.json: time_step_limit={list(limit)} is not supported "
                              "([0.0, Infinity] only, as released)")
        latent = int(cfg.get("moe_latent_size") or 0)
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        # attention_bias and sliding_window are not read: the reference's attention has no
        # biases and masks causally whatever they say.
        # tie_word_embeddings is not read either: the reference never ties lm_head to the
        # embedding (its _tied_weights_keys is empty), so lm_head is always its own tensor
        f.update(attention_bias=False, tie_embeddings=False, moe_layers=tuple(l for l, k in enumerate(kinds) if k == MOE))
        return cls(**f, kinds=kinds,
                   moe_intermediate=int(need(cfg, "moe_intermediate_size")) if MOE in kinds else 0,
                   dense_intermediate=int(need(cfg, "intermediate_size")) if MLP in kinds else 0,
                   # one shared MLP beside the experts whatever n_shared_experts says, as the reference
                   shared_intermediate=int(_field(cfg, "moe_shared_expert_intermediate_size", 7688)),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), routing="sigmoid",
                   n_group=n_group, topk_group=topk_group,
                   routed_scale=float(cfg.get("routed_scaling_factor") or 1.0),
                   nope_layers=tuple(range(len(kinds))),
                   mamba_heads=hm, mamba_head_dim=int(_field(cfg, "mamba_head_dim", 64)), n_groups=groups,
                   ssm_state=int(_field(cfg, "ssm_state_size", 128)),
                   conv_kernel=int(_field(cfg, "conv_kernel", 4)),
                   conv_bias=bool(_field(cfg, "use_conv_bias", True)), dt_limit=limit, latent=latent,
                   ignored_parts=(MTP,) if n_mtp else ())


def mamba_spec(c, l: int) -> dict[str, tuple]:
    """Layer l's Mamba-2 mixer tensors with their shapes (Nemotron-H's, Granite 4.0 hybrid's)."""
    f, h, hm, inner = c.family, c.hidden, c.mamba_heads, c.mamba_inner
    spec = {name(f, "m_in", l): (inner + c.conv_dim + hm, h), name(f, "m_conv", l): (c.conv_dim, 1, c.conv_kernel)}
    if c.conv_bias:
        spec[name(f, "m_conv_bias", l)] = (c.conv_dim,)
    for key in ("m_A_log", "m_D", "m_dt_bias"):
        spec[name(f, key, l)] = (hm,)
    spec[name(f, "m_norm", l)] = (inner,)
    spec[name(f, "m_out", l)] = (h, inner)
    return spec


def dense_spec(c: NemotronHConfig) -> dict[str, tuple]:
    """Every non-expert tensor the model reads, with its shape: the completeness contract."""
    f, h = c.family, c.hidden
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,)}
    if not c.tie_embeddings:
        spec[name(f, "lm_head")] = (c.vocab_size, h)
    for l, kind in enumerate(c.kinds):
        spec[name(f, "norm", l)] = (h,)
        if kind == LINEAR:
            spec.update(mamba_spec(c, l))
        elif kind == FULL:
            spec[name(f, "q", l)] = (c.q_dim, h)
            spec[name(f, "k", l)] = (c.kv_dim, h)
            spec[name(f, "v", l)] = (c.kv_dim, h)
            spec[name(f, "o", l)] = (h, c.q_dim)
        elif kind == MOE:
            spec[name(f, "router", l)] = (c.n_experts, h)
            spec[name(f, "router_bias", l)] = (c.n_experts,)
            if c.shared_intermediate:
                spec[name(f, "shared_up", l)] = (c.shared_intermediate, h)
                spec[name(f, "shared_down", l)] = (h, c.shared_intermediate)
            if c.latent:
                spec[name(f, "latent_in", l)] = (c.latent, h)
                spec[name(f, "latent_out", l)] = (h, c.latent)
        else:
            spec[name(f, "mlp_up", l)] = (c.dense_intermediate, h)
            spec[name(f, "mlp_down", l)] = (h, c.dense_intermediate)
    return spec


def expert_spec(c: NemotronHConfig) -> dict[str, tuple]:
    spec, i, h = {}, c.moe_intermediate, c.expert_hidden
    for l in c.moe_layers:
        for e in range(c.n_experts):
            spec[name(c.family, "expert_up", l, e)] = (i, h)
            spec[name(c.family, "expert_down", l, e)] = (h, i)
    return spec


class NemotronHDecoder(MoeDecoder):
    """MoeDecoder over Nemotron-H's single-mixer blocks; the run state is the hybrids'
    (hybrid.HybridState: KV rows of the attention layers, conv and scan state of the Mamba ones)."""
    rewinds = False   # the Mamba layers' recurrent state holds every position up to pos

    def __init__(self, c: NemotronHConfig, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        self.mb = ops.mamba
        self.slot = {l: i for kind in (c.full_layers, c.linear_layers) for i, l in enumerate(kind)}
        # Derived weights, float32 once: conv taps as [C, Kc] with their bias (zeros without),
        # -exp(A_log), dt_bias, D and the gated norm. self.w serves them ahead of the raw ones.
        f32 = ops.deltanet.f32
        derived = {}
        for l in c.linear_layers:
            derived["m_conv", l] = f32(weights("m_conv", l)).reshape(c.conv_dim, c.conv_kernel)
            derived["m_conv_bias", l] = f32(weights("m_conv_bias", l)) if c.conv_bias else \
                np.zeros(c.conv_dim, np.float32)
            derived["m_neg_a", l] = -np.exp(f32(weights("m_A_log", l)))
            for key in ("m_dt_bias", "m_D", "m_norm"):
                derived[key, l] = f32(weights(key, l))
        self.derive({k: ops.weight(np.ascontiguousarray(v, np.float32)) for k, v in derived.items()})

    def new_state(self, max_context: int) -> HybridState:
        return HybridState(self.ops, self.c, max_context)

    def layer(self, l: int, x, pos: np.ndarray, st: HybridState) -> None:
        """Block l on the rows x [T, H], in place: x += mixer(norm(x))."""
        c, ops = self.c, self.ops
        h = ops.rmsnorm(x, self.w("norm", l), c.rms_eps)
        kind = c.kinds[l]
        if kind == LINEAR:
            y = self.mamba(l, h, st)
        elif kind == FULL:
            y = self.attention(l, h, pos, st)
        elif kind == MOE:
            y = self.moe(l, h)
        else:
            y = self.relu2_mlp(h, self.w("mlp_up", l), self.w("mlp_down", l))
        ops.add_(x, y)

    def attention(self, l: int, h, pos: np.ndarray, st: HybridState):
        """Causal GQA attention, no position encoding; K / V in the state's slot of layer l."""
        c, ops, w = self.c, self.ops, self.w
        t = h.shape[0]
        q = ops.linear(h, w("q", l)).reshape(t, c.n_heads, c.head_dim)      # [T, Hq, D]
        k = ops.linear(h, w("k", l)).reshape(t, c.n_kv_heads, c.head_dim)   # [T, Hkv, D]
        v = ops.linear(h, w("v", l)).reshape(t, c.n_kv_heads, c.head_dim)
        s = self.slot[l]
        ops.kv_store(st.k[s], st.v[s], int(pos[0]), k, v, self.kv_bf16)
        a = ops.attention(q, st.k[s], st.v[s], pos, c.head_dim ** -0.5, 0)
        return ops.linear(a.reshape(t, c.q_dim), w("o", l))

    def mamba(self, l: int, h, st: HybridState):
        """The Mamba-2 mixer: projections, causal conv (rolling state), selective scan (recurrent
        state; a prefill chunk in one call), gated group norm, output projection."""
        c, ops, mb, w = self.c, self.ops, self.mb, self.w
        t, inner, cd, gn = h.shape[0], c.mamba_inner, c.conv_dim, c.n_groups * c.ssm_state
        p = ops.linear(h, w("m_in", l))                                   # [T, I + C + Hm]
        z, xbc, dt = p[:, :inner], p[:, inner:inner + cd], p[:, inner + cd:]
        s = self.slot[l]
        xbc = mb.conv1d_silu(xbc, w("m_conv", l), w("m_conv_bias", l), st.conv[s])   # [T, C]
        x = xbc[:, :inner].reshape(t, c.mamba_heads, c.mamba_head_dim)    # [T, Hm, P]
        b = xbc[:, inner:inner + gn].reshape(t, c.n_groups, c.ssm_state)  # [T, G, N]
        cm = xbc[:, inner + gn:].reshape(t, c.n_groups, c.ssm_state)
        y = mb.scan(x, dt, b, cm, w("m_neg_a", l), w("m_dt_bias", l), w("m_D", l), c.dt_limit, st.ssm[s])
        y = mb.rmsnorm_group_gated(y.reshape(t, inner), z, w("m_norm", l), inner // c.n_groups, c.rms_eps)
        return ops.linear(y, w("m_out", l))

    def relu2_mlp(self, h, up, down):
        return self.ops.expert_relu2(h, (up, down))

    def moe(self, l: int, h):
        """Routed ungated experts on h (through the latent projection where there is one), then
        the shared expert on h."""
        c, ops, w = self.c, self.ops, self.w
        ids, rw = self.route(l, h)
        if self.on_route is not None:
            self.on_route(l, ids)
        xl = ops.linear(h, w("latent_in", l)) if c.latent else h          # [T, L] or [T, H]
        out = ops.zeros(xl.shape)
        uniq = np.unique(ids)
        for e, we in zip(uniq, self.experts.fetch(l, uniq)):
            t_idx, k_idx = np.nonzero(ids == e)
            y = ops.expert_relu2(ops.take_rows(xl, t_idx), we)
            ops.scatter_add_rows(out, t_idx, y, rw[t_idx, k_idx])
        if c.latent:
            out = ops.linear(out, w("latent_out", l))
        if c.shared_intermediate:
            ops.add_(out, self.relu2_mlp(h, w("shared_up", l), w("shared_down", l)))
        return out


Model = NemotronHDecoder
Config = NemotronHConfig
