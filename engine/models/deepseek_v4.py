"""DeepSeek-V4 (V4-Flash, V4-Pro): a new attention and residual around DeepSeek's MoE. CPU backend.

- Residual: hc_mult parallel streams X [T, n, H] (manifold-constrained hyper-connections). Before
  each block, a projection of the flattened, normed streams gives pre [n], post [n] and comb
  [n, n] (Sinkhorn-normalized): the block reads sum_i pre_i X_i; after it,
  X'_k = post_k y + sum_j comb[j, k] X_j. A last projection (hc_head) collapses the streams
  before the final norm.
- Attention: one key row a token a layer, also the value (K = V), normed and rotated; queries
  through a low-rank q (q_a, q_a_norm, q_b) and a weightless RMSNorm a head; sinks a head; the
  rotary part of the output rotated back at the query's position; the output projected in
  o_groups groups (o_a) and then mixed (o_b). A query sees the last sliding_window rows and, in
  a compressed layer, entries that each pool a window of compress_rate tokens
  (sum_j softmax_j(Z_j + ape_j) * C_j, channel by channel, normed, rotated at the window's first
  position; entry w is seen from position (w + 1) * m - 1 on):
  - heavily compressed (HCA, m = 128): every closed window's entry;
  - compressed sparse (CSA, m = 4): each entry pools window w's second half-projection and
    window w - 1's first (2m slots); an indexer (its own compressor at index_head_dim, queries
    from the low-rank q) picks index_topk of them a query.
- Rotary dims: the last qk_rope_head_dim of a head, in interleaved pairs; theta rope_theta in
  sliding layers, compress_rope_theta (with any YaRN, its attention factor 1) in compressed
  layers, their compressors and indexers.
- MoE in every layer: scores sqrt(softplus(logits)); the first layers route by a fixed table of
  the token id (hash_moe), the others by top-k of scores + bias; weights the chosen scores
  normalized, times routed_scaling_factor; one shared expert; SwiGLU with the gate clamped
  above and the up projection on both sides at swiglu_limit.
Names: the released checkpoint's (layers.{l}.attn.wq_a.weight...); its FP8 layers and MXFP4
experts are dequantized by the loader (loader/checkpoint.py). Legend: n = hc_mult,
D = head_dim, R = rotary dims, m = compress rate, Di = index_head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, RunState, check_room, need
from engine.models.rope import ConfigError, RopeConfig, rope_params
from engine.names import name

# The release's prompt format (its encoding/encoding_dsv4.py; the release has no Jinja template):
# the system text straight after BOS; a run of user, developer and tool-result messages as one
# user turn (joined by blank lines), then the assistant's prefix with <think> (thinking:
# chat_template_kwargs enable_thinking, the last turn only) or </think>; earlier turns' reasoning
# dropped. Tool definitions and calls (its DSML) are not rendered: refused.
_U = ("user", "developer", "tool")
CHAT_TEMPLATE = (
    "{%- if tools -%}{{ raise_exception('deepseek_v4: tool definitions are not rendered by the "
    "built-in chat template') }}{%- endif -%}"
    "{%- set thinking = enable_thinking | default(false) -%}"
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] in " + repr(_U) + " -%}{%- set ns.last = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    "{%- for m in messages -%}"
    "{%- set prev = messages[loop.index0 - 1]['role'] if not loop.first else none -%}"
    "{%- set next = messages[loop.index0 + 1]['role'] if not loop.last else none -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] }}"
    "{%- elif m['role'] in " + repr(_U) + " -%}"
    "{{ '\n\n' if prev in " + repr(_U) + " else '<\uff5cUser\uff5c>' }}"
    "{{ '<tool_result>' + m['content'] + '</tool_result>' if m['role'] == 'tool' else m['content'] }}"
    "{%- if next not in " + repr(_U) + " and (next is not none or add_generation_prompt) -%}"
    "{{ '<\uff5cAssistant\uff5c>' + ('<think>' if thinking and loop.index0 == ns.last else '</think>') }}"
    "{%- endif -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if thinking and loop.index0 > ns.last -%}{{ (m.get('reasoning_content') or '') + '</think>' }}"
    "{%- endif -%}"
    "{{ m['content'] + '<\uff5cend\u2581of\u2581sentence\uff5c>' }}"
    "{%- else -%}{{ raise_exception('deepseek_v4: a message of role ' + m['role'] + ' (expected "
    "system, user, developer, tool or assistant)') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}     # legacy compress_ratios: the released configs'


def _get(cfg: dict, key: str, default):
    """config.json's value, or transformers' default where it has none."""
    return default if cfg.get(key) is None else cfg[key]


@dataclass(frozen=True)
class DeepseekV4Config(MoeConfig):
    q_lora_rank: int = 0
    o_groups: int = 1
    o_lora_rank: int = 0
    layer_types: tuple = ()         # per layer: SLIDING, CSA or HCA
    hash_layers: tuple = ()         # the layers routed by the token id's table
    rates: tuple = ()               # per layer: its compress rate m (0: sliding)
    csa_heads: int = 0              # the indexer's heads, dims and picks (CSA layers)
    csa_dim: int = 0
    csa_topk: int = 0
    compress_rope: RopeConfig = None
    hc_mult: int = 1
    hc_iters: int = 1
    hc_eps: float = 1e-6
    swiglu_limit: float = 0.0
    int_tensors: tuple = ()         # tensors stored as integers (the hash layers' tables)
    ignored_parts: tuple = ()

    chat_template = CHAT_TEMPLATE   # where the folder has none (a class attribute, not a field)

    @property
    def kv_tensors(self) -> int:
        return 1

    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekV4Config":
        cfg = dict(cfg)
        cfg.setdefault("num_key_value_heads", 1)
        cfg.setdefault("num_experts", cfg.get("n_routed_experts"))
        n = int(need(cfg, "num_hidden_layers"))
        head_dim = int(need(cfg, "head_dim"))
        rd = cfg.get("qk_rope_head_dim")
        partial = cfg.get("partial_rotary_factor") or (rd / head_dim if rd else 64 / 512)
        rd = int(head_dim * partial)
        if rd % 2 or not 0 < rd <= head_dim:
            raise ConfigError(f"config.json: qk_rope_head_dim {rd} must be even and in 1..{head_dim}")
        params = cfg.get("rope_parameters") or {}
        nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
        main = params["main"] if nested else {"rope_type": "default",
                                               "rope_theta": cfg.get("rope_theta", 10000.0)}
        if nested:
            comp = dict(params["compress"])
        else:
            comp = {k: v for k, v in rope_params(cfg).items() if k not in ("main", "compress")}
            comp["rope_theta"] = cfg.get("compress_rope_theta", 160000.0)
        comp.setdefault("rope_type", comp.pop("type", "default"))
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)   # V4 leaves cos and sin unscaled
        base_cfg = {"max_position_embeddings": cfg.get("max_position_embeddings", 1048576),
                    "partial_rotary_factor": partial}
        f = MoeConfig.common_hf({**cfg, "rope_parameters": {**main, "partial_rotary_factor": partial},
                                 "rope_scaling": None})
        if f["rope"].kind != "default":
            raise ConfigError(f"config.json: rope_parameters.main type {f['rope'].kind!r}; expected "
                              "default (V4 scales the compressed layers' rotary only)")
        compress = RopeConfig.from_hf({**base_cfg, "rope_parameters": comp}, head_dim)
        if f["n_kv_heads"] != 1:
            raise ConfigError(f"config.json: num_key_value_heads={f['n_kv_heads']}; expected 1 "
                              "(one key row, also the value)")
        rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
        if cfg.get("compress_rate_csa") is not None:
            rates[CSA] = int(cfg["compress_rate_csa"])
        if cfg.get("compress_rate_hca") is not None:
            rates[HCA] = int(cfg["compress_rate_hca"])
        types = cfg.get("layer_types")
        field = "layer_types"
        if types is None and cfg.get("compress_ratios") is not None:
            field, ratios = "compress_ratios", list(cfg["compress_ratios"])
            by_rate = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
            bad = [r for r in ratios if r not in by_rate]
            if bad:
                raise ConfigError(f"config.json: compress_ratios has {bad[0]!r}; expected 0, "
                                  f"{rates[CSA]} or {rates[HCA]}")
            types = [by_rate[r] for r in ratios]
        if types is None:   # transformers' default: two HCA layers, then CSA and HCA alternating
            types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        types = list(types)[:n] if field == "compress_ratios" else list(types)
        if len(types) != n or any(t not in (SLIDING, CSA, HCA) for t in types):
            raise ConfigError(f"config.json: {field} must give each of the {n} layers one of "
                              f"{SLIDING}, {CSA}, {HCA}; got {types}")
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = cfg.get("num_hash_layers")
            n_hash = 3 if n_hash is None else int(n_hash)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        if len(mlp_types) != n or any(t not in ("hash_moe", "moe") for t in mlp_types):
            raise ConfigError(f"config.json: mlp_layer_types must give each of the {n} layers "
                              f"hash_moe or moe; got {mlp_types}")
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise ConfigError(f"config.json: scoring_func {scoring!r} is not supported for "
                              "deepseek_v4; expected sqrtsoftplus")
        groups, heads = int(cfg.get("o_groups") or 8), f["n_heads"]
        if heads * head_dim % groups:
            raise ConfigError(f"config.json: o_groups={groups} does not divide "
                              f"num_attention_heads * head_dim = {heads * head_dim}")
        has_csa = CSA in types
        idx_dim = int(cfg.get("index_head_dim") or 128)
        if has_csa and idx_dim < rd:
            raise ConfigError(f"config.json: index_head_dim={idx_dim} must be at least "
                              f"qk_rope_head_dim={rd}")
        hash_layers = tuple(l for l, t in enumerate(mlp_types) if t == "hash_moe")
        f.update(moe_layers=tuple(range(n)), routing="sqrtsoftplus",
                 routed_scale=float(_get(cfg, "routed_scaling_factor", 1.5)),
                 shared_intermediate=int(need(cfg, "moe_intermediate_size")),
                 rms_eps=float(cfg.get("rms_norm_eps") or 1e-6))
        return cls(**f, moe_intermediate=int(need(cfg, "moe_intermediate_size")), norm_topk_prob=True,
                   q_lora_rank=int(need(cfg, "q_lora_rank")), o_groups=groups,
                   o_lora_rank=int(need(cfg, "o_lora_rank")), layer_types=tuple(types),
                   hash_layers=hash_layers,
                   rates=tuple(0 if t == SLIDING else rates[t] for t in types),
                   csa_heads=int(cfg.get("index_n_heads") or 64), csa_dim=idx_dim,
                   csa_topk=int(cfg.get("index_topk") or 512), compress_rope=compress,
                   hc_mult=int(cfg.get("hc_mult") or 4), hc_iters=int(cfg.get("hc_sinkhorn_iters") or 20),
                   hc_eps=float(cfg.get("hc_eps") or 1e-6),
                   swiglu_limit=float(_get(cfg, "swiglu_limit", 10.0)),
                   sliding_window=int(cfg.get("sliding_window") or 128),
                   int_tensors=tuple(name(f["family"], "hash", l) for l in hash_layers),
                   ignored_parts=(("mtp.", "the multi-token-prediction (MTP) layers"),)
                   if cfg.get("num_nextn_predict_layers") else ())


def dense_spec(c: DeepseekV4Config) -> dict[str, tuple]:
    fam, h, n, d = c.family, c.hidden, c.hc_mult, c.head_dim
    mix = (2 + n) * n
    spec = {name(fam, "embed"): (c.vocab_size, h), name(fam, "final_norm"): (h,),
            name(fam, "hc_head_fn"): (n, n * h), name(fam, "hc_head_base"): (n,),
            name(fam, "hc_head_scale"): (1,)}
    if not c.tie_embeddings:
        spec[name(fam, "lm_head")] = (c.vocab_size, h)
    for l in range(c.n_layers):
        s = {"attn_norm": (h,), "mlp_norm": (h,), "q_a": (c.q_lora_rank, h),
             "q_a_norm": (c.q_lora_rank,), "q_b": (c.n_heads * d, c.q_lora_rank), "kv": (d, h),
             "kv_norm": (d,), "o_a": (c.o_groups * c.o_lora_rank, c.n_heads * d // c.o_groups),
             "o_b": (h, c.o_groups * c.o_lora_rank), "sinks": (c.n_heads,),
             "router": (c.n_experts, h), "shared_gate": (c.shared_intermediate, h),
             "shared_up": (c.shared_intermediate, h), "shared_down": (h, c.shared_intermediate)}
        for part in ("attn", "ffn"):
            s.update({f"hc_{part}_fn": (mix, n * h), f"hc_{part}_base": (mix,), f"hc_{part}_scale": (3,)})
        s.update({"hash": (c.vocab_size, c.top_k)} if l in c.hash_layers else {"router_bias": (c.n_experts,)})
        m, kind = c.rates[l], c.layer_types[l]
        if kind != SLIDING:
            w = 2 * d if kind == CSA else d   # CSA: two half-projections a token
            s.update(cmp_kv=(w, h), cmp_gate=(w, h), cmp_ape=(m, w), cmp_norm=(d,))
        if kind == CSA:
            di = c.csa_dim
            s.update(idx_kv=(2 * di, h), idx_gate=(2 * di, h), idx_ape=(m, 2 * di), idx_norm=(di,),
                     idx_q=(c.csa_heads * di, c.q_lora_rank), idx_w=(c.csa_heads, h))
        spec.update({name(fam, k, l): shape for k, shape in s.items()})
    return spec


expert_spec = base.expert_spec   # gate, up, down per expert


# ---- the math, float32 numpy -----------------------------------------------------------------

def rope_tail(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, sign: float = 1.0) -> np.ndarray:
    """x [T, ..., D] with its last 2 * len(inv_freq) dims rotated in interleaved pairs at the
    positions pos [T] (sign -1: rotated back); a new array."""
    r = 2 * len(inv_freq)
    ang = pos.astype(np.float32)[:, None] * inv_freq[None, :]                 # [T, R / 2]
    shape = (len(pos),) + (1,) * (x.ndim - 2) + (r // 2,)
    cos, sin = np.cos(ang).reshape(shape), (np.float32(sign) * np.sin(ang)).reshape(shape)
    out = np.array(x, dtype=np.float32)
    ev, od = x[..., x.shape[-1] - r::2], x[..., x.shape[-1] - r + 1::2]
    out[..., x.shape[-1] - r::2] = ev * cos - od * sin
    out[..., x.shape[-1] - r + 1::2] = od * cos + ev * sin
    return out


def rms(x: np.ndarray, eps: float, w=None) -> np.ndarray:
    x = x.astype(np.float32)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    return y if w is None else y * w


def sigmoid(x):
    return np.float32(1) / (np.float32(1) + np.exp(-x))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


class V4State(RunState):
    """k [L, W, D]: each layer's key (= value) rows of the last W = sliding_window positions
    (position p at row p % W). A compressed layer's entries [S_max // m + 1, D] (and a CSA
    layer's indexer's [.., Di]) and the projections of its last 2m tokens (rows at position
    % 2m: a CSA entry pools two windows), from which each window's entry is made as it closes.
    Rows are overwritten as the state moves on, so it cannot go back (rewinds False)."""

    def __init__(self, ops, c: DeepseekV4Config, max_context: int):
        self.max_context, self.pos = max_context, 0
        self.k = np.zeros((c.n_layers, c.sliding_window, c.head_dim), np.float32)
        self.v = self.k
        self.rates = {}
        self.parts: dict = {}   # (layer, "cmp" | "idx") -> {"entries", "kv", "gate"}
        for l, (kind, m) in enumerate(zip(c.layer_types, c.rates)):
            if kind == SLIDING:
                continue
            for part, dim in (("cmp", c.head_dim), ("idx", c.csa_dim)):
                if part == "idx" and kind != CSA:
                    continue
                w = 2 * dim if kind == CSA else dim
                self.rates[f"{l}.{part}.entries"] = m
                self.parts[l, part] = {"entries": np.zeros((max_context // m + 1, dim), np.float32),
                                       "kv": np.zeros((2 * m, w), np.float32),
                                       "gate": np.zeros((2 * m, w), np.float32)}

    def arrays(self, keep: int | None = None):
        """(name, array) of everything the state holds; keep: the entries up to position keep."""
        yield "k", self.k
        for (l, part), d in sorted(self.parts.items()):
            for key, a in d.items():
                name = f"{l}.{part}.{key}"
                yield name, a if keep is None or key != "entries" else a[:keep // self.rates[name]]

    def copy_into(self, dst, keep: int) -> None:
        for (_, a), (_, b) in zip(self.arrays(keep), dst.arrays()):
            b[:len(a)] = a
        dst.pos = keep

    def save_nbytes(self, keep: int) -> int:
        return sum(a.nbytes for _, a in self.arrays(keep))

    def save(self, keep: int) -> dict:
        return {key: a.copy() for key, a in self.arrays(keep)}

    def load(self, saved: dict, keep: int) -> None:
        for key, a in self.arrays():
            a[:len(saved[key])] = saved[key]
        self.pos = keep


class DeepseekV4Decoder(MoeDecoder):
    rewinds = False

    def __init__(self, c: DeepseekV4Config, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        self.main_freq = c.rope.inv_freq()
        self.comp_freq = c.compress_rope.inv_freq()
        self._ids = None   # the tokens of the forward in flight (hash routing)

    def new_state(self, max_context: int) -> V4State:
        return V4State(self.ops, self.c, max_context)

    def f32(self, key: str, layer: int | None = None) -> np.ndarray:
        a = self.w(key, layer)
        return self.ops.deltanet.f32(a) if a.dtype == np.uint16 else np.asarray(a, np.float32)

    def forward(self, ids: np.ndarray, st: V4State, all_logits: bool = False):
        c, ops = self.c, self.ops
        t = len(ids)
        check_room(st, t)
        pos = np.arange(st.pos, st.pos + t, dtype=np.int32)
        self._ids = np.asarray(ids)
        e = ops.embed(self.w("embed"), ids)                                  # [T, H]
        x = np.repeat(e[:, None, :], c.hc_mult, axis=1)                       # [T, n, H]
        for l in range(c.n_layers):
            post, comb, h = self.hyper(x, "attn", l)
            y = self.attention(l, ops.rmsnorm(h, self.w("attn_norm", l), c.rms_eps), pos, st)
            x = self.mix(x, post, comb, y)
            post, comb, h = self.hyper(x, "ffn", l)
            y = self.moe(l, ops.rmsnorm(h, self.w("mlp_norm", l), c.rms_eps))
            x = self.mix(x, post, comb, y)
        st.pos += t
        if not all_logits:
            x = x[t - 1:]
        flat = rms(x.reshape(len(x), -1), c.rms_eps)
        pre = sigmoid(flat @ self.f32("hc_head_fn").T * self.f32("hc_head_scale")
                      + self.f32("hc_head_base")) + np.float32(c.hc_eps)
        h = (pre[:, :, None] * x).sum(1)
        h = ops.rmsnorm(h, self.w("final_norm"), c.rms_eps)
        return ops.linear(h, self.w("embed") if c.tie_embeddings else self.w("lm_head"))

    def hyper(self, x, part: str, l: int):
        """(post [T, n], comb [T, n, n], the block's input [T, H]) of the streams x [T, n, H]."""
        c = self.c
        n, eps = c.hc_mult, np.float32(c.hc_eps)
        f = rms(x.reshape(len(x), -1), c.rms_eps) @ self.f32(f"hc_{part}_fn", l).T   # [T, (2 + n) n]
        s, b = self.f32(f"hc_{part}_scale", l), self.f32(f"hc_{part}_base", l)
        pre = sigmoid(f[:, :n] * s[0] + b[:n]) + eps
        post = 2 * sigmoid(f[:, n:2 * n] * s[1] + b[n:2 * n])
        comb = softmax(f[:, 2 * n:].reshape(-1, n, n) * s[2] + b[2 * n:].reshape(n, n)) + eps
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
        for _ in range(c.hc_iters - 1):   # Sinkhorn: rows, then columns
            comb = comb / (comb.sum(-1, keepdims=True) + eps)
            comb = comb / (comb.sum(-2, keepdims=True) + eps)
        return post, comb, (pre[:, :, None] * x).sum(1)

    @staticmethod
    def mix(x, post, comb, y):
        """X'_k = post_k y + sum_j comb[j, k] X_j."""
        return post[:, :, None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", comb, x)

    # ---- attention ---------------------------------------------------------------------------

    def attention(self, l: int, h, pos: np.ndarray, st: V4State):
        c, ops, w = self.c, self.ops, self.w
        t, heads, d = len(h), c.n_heads, c.head_dim
        kind = c.layer_types[l]
        freq = self.main_freq if kind == SLIDING else self.comp_freq
        qr = ops.rmsnorm(ops.linear(h, w("q_a", l)), w("q_a_norm", l), c.rms_eps)
        q = rms(ops.linear(qr, w("q_b", l)).reshape(t, heads, d), c.rms_eps)
        q = rope_tail(q, pos, freq)
        kv = rope_tail(ops.rmsnorm(ops.linear(h, w("kv", l)), w("kv_norm", l), c.rms_eps), pos, freq)
        if self.kv_bf16:   # stored rounded, as the other families' bf16 caches
            ops.kv_store(kv, kv, 0, kv, kv, True)
        entries, seen = None, None
        if kind != SLIDING:
            entries = self.compress(l, "cmp", h, pos, st)
            m = c.rates[l]
            ready = (pos + 1) // m                                            # [T] entries seen
            seen = np.arange(len(entries))[None, :] < ready[:, None]          # [T, n_entries]
            if kind == CSA:
                seen &= self.index(l, h, qr, pos, st, ready)
        # the window: the ring's rows before this forward, then its own
        win, p0 = c.sliding_window, int(pos[0])
        base = max(0, p0 - win + 1)
        rows = np.concatenate([st.k[l, np.arange(base, p0) % win], kv])      # positions base..
        sinks = self.f32("sinks", l)
        out = np.empty((t, heads, d), np.float32)
        for i, p in enumerate(pos):
            keys = rows[max(0, int(p) - win + 1) - base:int(p) + 1 - base]
            if entries is not None:
                keys = np.concatenate([keys, entries[seen[i]]])
            s = (q[i] @ keys.T) * np.float32(d ** -0.5)                      # [Hq, S]
            mx = np.maximum(s.max(-1), sinks)[:, None]
            e = np.exp(s - mx)
            out[i] = (e / (e.sum(-1, keepdims=True) + np.exp(sinks[:, None] - mx))) @ keys
        keep = pos[-min(t, win):]
        st.k[l, keep % win] = kv[-len(keep):]
        out = rope_tail(out, pos, freq, -1.0)                                 # the value's rotation undone
        g, r = c.o_groups, c.o_lora_rank   # o_a: a [r, Hq D / g] block a group
        out, wa = out.reshape(t, g, -1), w("o_a", l)
        y = np.concatenate([ops.linear(np.ascontiguousarray(out[:, j]), wa[j * r:(j + 1) * r])
                            for j in range(g)], axis=-1)
        return ops.linear(y, w("o_b", l))

    def compress(self, l: int, part: str, h, pos: np.ndarray, st: V4State) -> np.ndarray:
        """Stores the tokens' projections, closes each window they complete; returns the
        entries made so far (every window closed at the last token)."""
        c, ops, w = self.c, self.ops, self.w
        kind, m = c.layer_types[l], c.rates[l]
        buf = st.parts[l, part]
        dim = c.head_dim if part == "cmp" else c.csa_dim
        kv, gate = ops.linear(h, w(f"{part}_kv", l)), ops.linear(h, w(f"{part}_gate", l))
        ape = self.f32(f"{part}_ape", l)
        norm = w(f"{part}_norm", l)
        for i, p in enumerate(pos):
            p = int(p)
            buf["kv"][p % (2 * m)] = kv[i]
            buf["gate"][p % (2 * m)] = gate[i] + ape[p % m]
            if (p + 1) % m:
                continue
            win = (p + 1) // m - 1                                            # the window closing
            rows = (np.arange(win * m, (win + 1) * m)) % (2 * m)
            if kind == CSA:   # this window's second half-projection, the last one's first
                cv, cg = buf["kv"][rows, dim:], buf["gate"][rows, dim:]
                if win:
                    prev = (np.arange((win - 1) * m, win * m)) % (2 * m)
                    cv = np.concatenate([buf["kv"][prev, :dim], cv])
                    cg = np.concatenate([buf["gate"][prev, :dim], cg])
            else:
                cv, cg = buf["kv"][rows], buf["gate"][rows]
            e = ops.rmsnorm((softmax(cg, axis=0) * cv).sum(0)[None], norm, c.rms_eps)
            buf["entries"][win] = rope_tail(e, np.array([win * m]), self.comp_freq)[0]
        return buf["entries"][:(int(pos[-1]) + 1) // m]

    def index(self, l: int, h, qr, pos: np.ndarray, st: V4State, ready: np.ndarray) -> np.ndarray:
        """[T, n_entries] True where the indexer picks an entry for the query (the best csa_topk of
        those it has seen)."""
        c, ops, w = self.c, self.ops, self.w
        keys = self.compress(l, "idx", h, pos, st)                           # [N, Di]
        t, heads, di = len(h), c.csa_heads, c.csa_dim
        q = rope_tail(ops.linear(qr, w("idx_q", l)).reshape(t, heads, di), pos, self.comp_freq)
        wt = ops.linear(h, w("idx_w", l)) * np.float32(heads ** -0.5)          # [T, Hi]
        score = np.einsum("th,ths->ts", wt,
                          np.maximum(np.einsum("thd,sd->ths", q, keys), 0) * np.float32(di ** -0.5))
        picked = np.zeros(score.shape, bool)
        for i in range(t):
            n = int(ready[i])
            if n <= c.csa_topk:
                picked[i, :n] = True
            else:
                picked[i, np.argpartition(-score[i, :n], c.csa_topk - 1)[:c.csa_topk]] = True
        return picked

    # ---- MoE -----------------------------------------------------------------------------------

    def route(self, l: int, h):
        c = self.c
        logits = self.ops.linear(h, self.w("router", l))
        scores = np.sqrt(np.logaddexp(np.float32(0), logits)).astype(np.float32)   # sqrt(softplus)
        if l in c.hash_layers:
            ids = self.w("hash", l)[self._ids].astype(np.int64)
        else:
            biased = scores + self.f32("router_bias", l)
            ids = np.argsort(-biased, axis=-1, kind="stable")[:, :c.top_k]
        wt = np.take_along_axis(scores, ids, -1)
        wt = wt / (wt.sum(-1, keepdims=True) + np.float32(1e-20)) * np.float32(c.routed_scale)
        return ids, wt.astype(np.float32)

    def limited(self, x, we):
        lim = self.c.swiglu_limit
        return self.ops.expert_limited(x, we, lim) if lim > 0 else self.ops.expert(x, we)

    def routed_expert(self, l: int, e: int, x, we):
        return self.limited(x, we)

    def shared_expert(self, l: int, h):   # clamped as the routed ones (transformers does)
        w = self.w
        return self.limited(h, (w("shared_gate", l), w("shared_up", l), w("shared_down", l)))


Model = DeepseekV4Decoder
Config = DeepseekV4Config
