"""The MoE decoder shared by the llama-like families (attention + routed SwiGLU experts).

A family file supplies a config dataclass (from_hf) and its flags; this module supplies the
tensor spec and the forward pass, written against backend ops only: no files, no threads.
Legend: T = tokens, H = hidden, D = head dim, Hq / Hkv = heads, E = experts, K = top-k.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.models.rope import ConfigError, RopeConfig, pair_rows
from engine.names import expert_names, key_of, name


def need(cfg: dict, *keys):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise ConfigError(f"config.json: missing field {' / '.join(keys)}")


def text_config(cfg: dict, family: str, wrapper: str, inherited=("eos_token_id",)) -> dict:
    """An image-text wrapper's language model fields (its text_config) as family's config, with
    the wrapper's values of `inherited` where the text config has none."""
    if not isinstance(cfg.get("text_config"), dict):
        raise ConfigError(f"config.json: {family} without text_config; expected the image-text "
                          f"wrapper's config ({wrapper})")
    text = {**cfg["text_config"], "model_type": family}
    for key in inherited:
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def layer_list(field: str, got, n: int, allowed) -> list:
    """A per-layer list of config.json's `field` (got: its value, defaults applied) as a list:
    n entries, each one of `allowed`; else a ConfigError naming the field and what it expects."""
    want = f"config.json: {field} must give each of the {n} layers one of {', '.join(map(str, allowed))}"
    if not isinstance(got, (list, tuple)) or len(got) != n:
        raise ConfigError(f"{want}; got {got!r}, not a list" if not isinstance(got, (list, tuple)) else
                          f"{want}; got {len(got)} entries: {list(got)}")
    bad = next((l for l, v in enumerate(got) if v not in allowed), None)
    if bad is not None:
        raise ConfigError(f"{want}; got {got[bad]!r} at layer {bad}: {list(got)}")
    return list(got)


def uniform(cfg: dict, key: str, default=None):
    """config.json's `key` given as one value or as a list of one value a layer (all equal): that
    value (default where absent); a list whose entries differ is a ConfigError (the family runs
    one value for every layer)."""
    v = cfg.get(key, default)
    if isinstance(v, (list, tuple)):
        if not v:
            raise ConfigError(f"config.json: {key} is an empty list; expected one value, or one a layer")
        if any(x != v[0] for x in v):
            raise ConfigError(f"config.json: {key} {list(v)} differs between layers; {cfg.get('model_type')} "
                              "runs one value for every layer")
        v = v[0]
    return v


@dataclass(frozen=True)
class MoeConfig:
    """What a llama-like MoE decoder needs; family files build it in from_hf()."""

    family: str
    vocab_size: int
    hidden: int                     # H
    n_layers: int
    n_heads: int                    # Hq
    n_kv_heads: int                 # Hkv
    head_dim: int                   # D
    n_experts: int                  # E
    top_k: int                      # K
    moe_intermediate: int           # I of each routed expert
    norm_topk_prob: bool            # renormalize the top-k routing weights to sum 1
    rms_eps: float
    rope: RopeConfig
    tie_embeddings: bool
    max_position: int
    dense_intermediate: int = 0     # I of dense MLP layers (layers not in moe_layers)
    qk_norm: str = "none"           # none | head (RMSNorm per head, D) | full (over all heads)
                                    #   | head_after_rope (per head, on the rotated rows: Hunyuan)
    clip_qkv: float = 0.0           # clamp q, k, v to +-clip_qkv after projection (0 = off)
    attention_bias: bool = False
    sliding_window: int = 0         # 0 = full causal attention
    moe_layers: tuple = ()          # indices of layers with routed experts
    routing: str = "softmax"        # softmax | softmax_bias (ERNIE-4.5: softmax scores chosen with
                                    #   a bias) | sigmoid_input (Llama 4: the top-k logits' sigmoids
                                    #   scale each expert's input, not its output)
                                    #   | sigmoid (DeepSeek-V3 / GLM-4.5: sigmoid scores,
    n_group: int = 1                #   a selection bias, the best topk_group of n_group groups,
    topk_group: int = 1             #   weights times routed_scale) | softmax_grouped (Mistral 4:
                                    #   sigmoid's with softmax scores and no bias)
    routed_scale: float = 1.0
    shared_intermediate: int = 0    # I of the shared expert(s) beside the routed ones (0 = none)
    shared_gated: bool = False      # its output times sigmoid(h . shared_expert_gate)
    rope_pairs: bool = False        # rotary dims in interleaved pairs (q / k rows reordered: rope.pair_rows)
    layer_windows: tuple = ()       # per layer: its sliding window, 0 = full (else sliding_window for all)
    nope_layers: tuple = ()         # layers whose q / k are not rotated (NoPE)
    score_scale: float = 0.0        # the attention scores' scale, 0: head_dim ** -0.5 (Granite's attention_multiplier)
    eos_token_ids: tuple = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qk_scale(self) -> float:
        """What the attention scores q . k are multiplied by."""
        return self.score_scale or self.head_dim ** -0.5

    @property
    def expert_hidden(self) -> int:
        """Rows a routed expert reads and writes: H (Nemotron-H's latent MoE: its latent size)."""
        return self.hidden

    @property
    def gated_experts(self) -> bool:
        """Whether routed experts have a gate projection (the arena's layout: loader/layout.py)."""
        return True

    @property
    def kv_tensors(self) -> int:
        """Cache rows a token writes a layer, kv_dim values each: K and V (MLA: one latent row)."""
        return 2

    @staticmethod
    def common_hf(cfg: dict) -> dict:
        """Fields every llama-like family reads the same way."""
        hidden = int(need(cfg, "hidden_size"))
        n_heads = int(need(cfg, "num_attention_heads"))
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        n_experts = int(need(cfg, "num_experts", "num_local_experts"))
        top_k = int(need(cfg, "num_experts_per_tok"))
        if not 1 <= top_k <= n_experts:
            raise ConfigError(f"config.json: num_experts_per_tok={top_k} must be in 1..{n_experts}")
        n_heads_kv = int(cfg.get("num_key_value_heads") or n_heads)
        if n_heads % n_heads_kv:
            raise ConfigError(f"config.json: num_attention_heads={n_heads} is not a multiple of "
                              f"num_key_value_heads={n_heads_kv}")
        eos = cfg.get("eos_token_id")
        n_layers = int(need(cfg, "num_hidden_layers"))
        return dict(
            family=cfg["model_type"], vocab_size=int(need(cfg, "vocab_size")), hidden=hidden,
            n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads_kv, head_dim=head_dim,
            n_experts=n_experts, top_k=top_k, rms_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope=RopeConfig.from_hf(cfg, head_dim),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position=int(cfg.get("max_position_embeddings") or 4096),
            attention_bias=bool(cfg.get("attention_bias", False)),
            moe_layers=tuple(range(n_layers)),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            raw=cfg)


def one_plus_view(family: str, n: str, a: np.ndarray, norms) -> np.ndarray:
    """A family's dense_view for RMSNorms stored as offsets (the norm scales by 1 + w): the weight
    of a key in norms as 1 + w in float32 (bf16 widened exactly); any other tensor as stored."""
    if key_of(family, n, norms) is None:
        return a
    return widened(a) + np.float32(1)


def widened(a) -> np.ndarray:
    """A stored weight in float32 (bf16, held as uint16, widened exactly)."""
    a = np.asarray(a)
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)


# ---- tensor spec ---------------------------------------------------------------------------

def dense_spec(c: MoeConfig) -> dict[str, tuple]:
    """Every non-expert tensor the model reads, with its shape: the completeness contract."""
    f, h = c.family, c.hidden
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,)}
    if not c.tie_embeddings:
        spec[name(f, "lm_head")] = (c.vocab_size, h)
    for l in range(c.n_layers):
        spec[name(f, "attn_norm", l)] = (h,)
        spec[name(f, "mlp_norm", l)] = (h,)
        spec[name(f, "q", l)] = (c.q_dim, h)
        spec[name(f, "k", l)] = (c.kv_dim, h)
        spec[name(f, "v", l)] = (c.kv_dim, h)
        spec[name(f, "o", l)] = (h, c.q_dim)
        if c.attention_bias:
            spec[name(f, "q_bias", l)] = (c.q_dim,)
            spec[name(f, "k_bias", l)] = (c.kv_dim,)
            spec[name(f, "v_bias", l)] = (c.kv_dim,)
        if c.qk_norm in ("head", "head_after_rope"):
            spec[name(f, "q_norm", l)] = (c.head_dim,)
            spec[name(f, "k_norm", l)] = (c.head_dim,)
        elif c.qk_norm == "full":
            spec[name(f, "q_norm", l)] = (c.q_dim,)
            spec[name(f, "k_norm", l)] = (c.kv_dim,)
        if l in c.moe_layers:
            spec[name(f, "router", l)] = (c.n_experts, h)
            if c.routing == "sigmoid":
                spec[name(f, "router_bias", l)] = (c.n_experts,)
            if c.shared_intermediate:
                spec[name(f, "shared_gate", l)] = (c.shared_intermediate, h)
                spec[name(f, "shared_up", l)] = (c.shared_intermediate, h)
                spec[name(f, "shared_down", l)] = (h, c.shared_intermediate)
                if c.shared_gated:
                    spec[name(f, "shared_expert_gate", l)] = (1, h)
        else:
            spec[name(f, "mlp_gate", l)] = (c.dense_intermediate, h)
            spec[name(f, "mlp_up", l)] = (c.dense_intermediate, h)
            spec[name(f, "mlp_down", l)] = (h, c.dense_intermediate)
    return spec


def expert_spec(c: MoeConfig) -> dict[str, tuple]:
    spec = {}
    i, h = c.moe_intermediate, c.hidden
    for l in c.moe_layers:
        for e in range(c.n_experts):
            g, u, d = expert_names(c.family, l, e)
            spec[g], spec[u], spec[d] = (i, h), (i, h), (h, i)
    return spec


# ---- run state and forward -----------------------------------------------------------------

class RunState:
    """Preallocated per-sequence state: the KV cache. k, v: [L, S_max, Hkv, D] float32."""

    def __init__(self, ops, c: MoeConfig, max_context: int):
        self.max_context = max_context
        self.k = ops.zeros((c.n_layers, max_context, c.n_kv_heads, c.head_dim))
        self.v = ops.zeros((c.n_layers, max_context, c.n_kv_heads, c.head_dim))
        self.pos = 0   # positions filled so far

    def copy_into(self, dst, keep: int) -> None:
        """dst (a larger state of the same model) takes this one's first keep positions."""
        dst.k[:, :keep] = self.k[:, :keep]
        dst.v[:, :keep] = self.v[:, :keep]
        dst.pos = keep

    def save_nbytes(self, keep: int) -> int:
        """What save(keep) would copy, in bytes."""
        return self.k[:, :keep].nbytes + self.v[:, :keep].nbytes

    def save(self, keep: int) -> dict:
        """A copy of what the first keep positions left, for load()."""
        return {"k": self.k[:, :keep].copy(), "v": self.v[:, :keep].copy()}

    def load(self, saved: dict, keep: int) -> None:
        """Take the first keep positions of a save()."""
        self.k[:, :keep] = saved["k"][:, :keep]
        self.v[:, :keep] = saved["v"][:, :keep]
        self.pos = keep


class IndexKeys:
    """Mixed into a run state whose indexer caches a key row a position (DeepSeek-V3.2's DSA,
    MiniMax-M3): ik [indexed layers, S_max, dim], copied, saved and loaded with the rest."""
    ik: np.ndarray

    def copy_into(self, dst, keep: int) -> None:
        super().copy_into(dst, keep)
        dst.ik[:, :keep] = self.ik[:, :keep]

    def save_nbytes(self, keep: int) -> int:
        return super().save_nbytes(keep) + self.ik[:, :keep].nbytes

    def save(self, keep: int) -> dict:
        return {**super().save(keep), "ik": self.ik[:, :keep].copy()}

    def load(self, saved: dict, keep: int) -> None:
        super().load(saved, keep)
        self.ik[:, :keep] = saved["ik"][:, :keep]


def resumable(st, keep: int, rewinds: bool) -> bool:
    """Whether state st can serve a sequence whose first keep positions are st's: keep is
    within what st holds, and below st.pos only where the state is the KV cache alone (a
    recurrent state cannot go back)."""
    return st is not None and 0 <= keep <= st.pos and (rewinds or keep == st.pos)


def check_room(st, n: int) -> None:
    """Refuse n more tokens that would overrun a run state (CPU or GPU) of max_context rows."""
    if st.pos + n > st.max_context:
        raise ValueError(f"context full: {st.pos} + {n} tokens exceed the {st.max_context}-token "
                         "context (raise --max-context)")


class MoeDecoder:
    """Forward pass over backend ops. `weights(key, layer)` gives dense weights as the backend
    holds them; `experts.fetch(layer, ids)` gives routed experts' weights (the engine resolves
    them across memory tiers); `on_route(layer, ids)` observes routing (traces, profiles)."""
    kv_bf16 = False   # K and V rounded to bfloat16 as stored (the engine's kv_cache="bf16")
    rewinds = True    # a state may go back to an earlier position (its KV rows past it unused)

    def __init__(self, c: MoeConfig, ops, weights, experts, on_route=None):
        self.c, self.ops, self.w, self.experts = c, ops, weights, experts
        self.on_route = on_route
        self.inv_freq = c.rope.inv_freq()
        # interleaved rotary pairs: q / k columns gathered into rotate-half order after their
        # projections (rope.pair_rows on an index; no copy of the weights)
        self.q_cols = pair_rows(c, "q", np.arange(c.q_dim)) if c.rope_pairs else None
        self.k_cols = pair_rows(c, "k", np.arange(c.kv_dim)) if c.rope_pairs else None


    def derive(self, derived: dict) -> None:
        """Weights computed once at load, {(key, layer): array} (float32 layouts, absorbed
        products), which self.w serves from now on ahead of the checkpoint's."""
        self._derived, self._raw, self.w = derived, self.w, self._derived_or_raw

    def _derived_or_raw(self, key: str, layer: int | None = None):
        got = self._derived.get((key, layer))
        return self._raw(key, layer) if got is None else got
    def new_state(self, max_context: int) -> RunState:
        return RunState(self.ops, self.c, max_context)

    def resume_state(self, st, max_context: int, keep: int):
        """A state of max_context positions whose first keep are st's (st itself when it is
        large enough, else a new one they are copied into), or None where st cannot give them
        (resumable()): the prompt's shared prefix is not computed again."""
        if not resumable(st, keep, self.rewinds):
            return None
        if st.max_context >= max_context:
            st.pos = keep
            return st
        new = self.new_state(max_context)
        st.copy_into(new, keep)
        return new

    def save_state(self, st, keep: int) -> dict:
        """A host copy of what st's first keep positions left (engine/prefix.py)."""
        return st.save(keep)

    def restore_state(self, saved: dict, max_context: int, keep: int):
        """A state of max_context positions holding the first keep of a save_state() (all of it
        where the state cannot go back)."""
        st = self.new_state(max_context)
        st.load(saved, keep)
        return st

    def forward(self, ids: np.ndarray, st: RunState, all_logits: bool = False):
        """ids int [T] at positions st.pos.. -> logits [T, V] (all_logits) or [1, V] (last)."""
        t = len(ids)
        check_room(st, t)
        pos = np.arange(st.pos, st.pos + t, dtype=np.int32)
        x = self.embed(ids)                                              # [T, H]
        for l in range(self.c.n_layers):
            self.layer(l, x, pos, st)
        st.pos += t
        return self.head(x if all_logits else x[t - 1:])

    def embed(self, ids: np.ndarray):
        """The embedding rows of ids, [T, H]."""
        return self.ops.embed(self.w("embed"), ids)

    def layer(self, l: int, x, pos: np.ndarray, st: RunState) -> None:
        """Decoder layer l on the rows x [T, H], in place: x += attention(attn_norm(x)), then
        x += mlp(mlp_norm(x))."""
        c, ops, w = self.c, self.ops, self.w
        ops.add_(x, self.attention(l, ops.rmsnorm(x, w("attn_norm", l), c.rms_eps), pos, st))
        ops.add_(x, self.mlp(l, ops.rmsnorm(x, w("mlp_norm", l), c.rms_eps)))

    def mlp(self, l: int, h):
        """Layer l's MLP on h: its experts (routed and shared) or its dense MLP."""
        return self.moe(l, h) if l in self.c.moe_layers else self.dense_mlp(l, h)

    def head(self, x):
        """Logits [N, V] of the rows x [N, H]: the final norm, then lm_head (embed when tied)."""
        c, w = self.c, self.w
        return self.ops.linear(self.ops.rmsnorm(x, w("final_norm"), c.rms_eps),
                               w("embed") if c.tie_embeddings else w("lm_head"))

    def attention(self, l: int, h, pos: np.ndarray, st: RunState):
        c, ops, w = self.c, self.ops, self.w
        t = h.shape[0]
        q, k, v = self.qkv(l, h)
        if c.attention_bias:
            ops.add_(q, w("q_bias", l))
            ops.add_(k, w("k_bias", l))
            ops.add_(v, w("v_bias", l))
        if self.q_cols is not None:
            q, k = np.ascontiguousarray(q[:, self.q_cols]), np.ascontiguousarray(k[:, self.k_cols])
        if c.qk_norm == "full":
            q, k = ops.rmsnorm(q, w("q_norm", l), c.rms_eps), ops.rmsnorm(k, w("k_norm", l), c.rms_eps)
        if c.clip_qkv:
            for a in (q, k, v):
                ops.clip_(a, c.clip_qkv)
        q = q.reshape(t, c.n_heads, c.head_dim)                           # [T, Hq, D]
        k = k.reshape(t, c.n_kv_heads, c.head_dim)                        # [T, Hkv, D]
        v = v.reshape(t, c.n_kv_heads, c.head_dim)
        if c.qk_norm == "head":
            q, k = ops.rmsnorm(q, w("q_norm", l), c.rms_eps), ops.rmsnorm(k, w("k_norm", l), c.rms_eps)
        if l not in c.nope_layers:
            ops.rope(q, pos, self.inv_freq, c.rope.attention_factor)
            ops.rope(k, pos, self.inv_freq, c.rope.attention_factor)
        if c.qk_norm == "head_after_rope":
            q, k = ops.rmsnorm(q, w("q_norm", l), c.rms_eps), ops.rmsnorm(k, w("k_norm", l), c.rms_eps)
        ops.kv_store(st.k[l], st.v[l], int(pos[0]), k, v, self.kv_bf16)
        a = ops.attention(q, st.k[l], st.v[l], pos, c.qk_scale, self.window(l),
                          self.sinks(l))
        return ops.linear(self.gated(l, h, a.reshape(t, c.q_dim)), w("o", l))

    def qkv(self, l: int, h):
        """Layer l's q [T, Hq D], k and v [T, Hkv D] of the normed rows h, before any bias (a
        family with one fused projection splits it: DBRX's)."""
        w = self.w
        return self.ops.linear(h, w("q", l)), self.ops.linear(h, w("k", l)), self.ops.linear(h, w("v", l))

    def gated(self, l: int, h, a):
        """The heads' output a [T, Hq D] before o_proj, of the attention's input h (a family's
        output gate: AFMoE's)."""
        return a

    def window(self, l: int) -> int:
        """Layer l's sliding window (0: full attention)."""
        return self.c.layer_windows[l] if self.c.layer_windows else self.c.sliding_window

    def sinks(self, l: int):
        """Layer l's attention-sink logits [Hq], or None."""
        return None

    def dense_mlp(self, l: int, h):
        return self.ops.expert(h, (self.w("mlp_gate", l), self.w("mlp_up", l), self.w("mlp_down", l)))

    def moe(self, l: int, h):
        """Routed experts: each expert runs once over all the tokens routed to it; then the
        shared expert, if any."""
        c, ops = self.c, self.ops
        ids, rw = self.route(l, h)
        if self.on_route is not None:
            self.on_route(l, ids)
        uniq = np.unique(ids)
        out = ops.zeros(h.shape)
        scaled = c.routing == "sigmoid_input"
        for e, we in zip(uniq, self.experts.fetch(l, uniq)):
            t_idx, k_idx = np.nonzero(ids == e)
            x, wts = ops.take_rows(h, t_idx), rw[t_idx, k_idx]
            if scaled:   # Llama 4: the weight scales the expert's input, the output adds as is
                x, wts = x * wts[:, None], np.ones_like(wts)
            y = self.routed_expert(l, int(e), x, we)
            ops.scatter_add_rows(out, t_idx, y, wts)
        if c.shared_intermediate:
            ops.add_(out, self.shared_expert(l, h))
        return out

    def route(self, l: int, h):
        """(ids [T, K], weights [T, K]) of layer l's router on h."""
        c, ops, w = self.c, self.ops, self.w
        logits = ops.linear(h, w("router", l))
        if c.routing == "sigmoid":
            return ops.router_sigmoid(logits, w("router_bias", l), c.top_k, c.n_group,
                                      c.topk_group, c.norm_topk_prob, c.routed_scale)
        if c.routing == "sigmoid_input":   # Llama 4: the top-k logits, their sigmoids
            ids = np.argsort(-logits, axis=-1, kind="stable")[:, :c.top_k].astype(np.int32)
            z = np.take_along_axis(np.asarray(logits, np.float32), ids, -1)
            return ids, (np.float32(1) / (np.float32(1) + np.exp(-z))).astype(np.float32)
        if c.routing == "softmax_grouped":   # Mistral 4: softmax scores in groups, no bias
            return ops.router_sigmoid(logits, np.zeros(c.n_experts, np.float32), c.top_k, c.n_group,
                                      c.topk_group, c.norm_topk_prob, c.routed_scale, softmax=True)
        if c.routing == "softmax_bias":   # ERNIE-4.5: softmax scores chosen with a bias
            return ops.router_sigmoid(logits, w("router_bias", l), c.top_k, 1, 1,
                                      c.norm_topk_prob, c.routed_scale, softmax=True)
        return ops.router(logits, c.top_k, c.norm_topk_prob)

    def routed_expert(self, l: int, e: int, x, we):
        """Routed expert e of layer l (weights we) on the rows x routed to it."""
        return self.ops.expert(x, we)

    def shared_expert(self, l: int, h):
        """The shared expert beside the routed ones, sigmoid-gated when c.shared_gated."""
        w, ops = self.w, self.ops
        sh = ops.expert(h, (w("shared_gate", l), w("shared_up", l), w("shared_down", l)))
        if self.c.shared_gated:
            ops.deltanet.sigmoid_gate_(sh, ops.linear(h, w("shared_expert_gate", l)))  # gate [T, 1]
        return sh
