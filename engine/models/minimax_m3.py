"""MiniMax-M3 (minimax_m3_vl: the image-text wrapper's language model; the vision tower is
skipped). CPU backend.

What differs from the llama-like decoder (engine/models/base.py):
- every RMSNorm scales by 1 + w (q / k norms a head, the indexer's too): dense_view gives both
  backends the norms' weights as 1 + w at load;
- MoE: sigmoid scores, top-k of scores + bias, the chosen scores normalized, the routed sum
  times routed_scaling_factor; a shared expert; dense layers by mlp_layer_types; every MLP with
  gpt-oss's clamped SwiGLU ((u + 1) * g * sigmoid(alpha g), g <= limit, |u| <= limit; no biases);
- sparse layers (layer_types "minimax_m3_sparse"): a lightning indexer (index_n_heads heads, one
  a KV head, and one key row a position, normed and rotated as the attention's) scores every
  cached key; the scores max-pooled over blocks of index_block_size keys; each KV head's queries
  read the index_topk_blocks best blocks (the query's own index_local_blocks always among them).
  While a query has at most index_topk_blocks blocks, that is every key: dense attention.
The rotary share: rope_parameters' partial_rotary_factor as transformers reads it, else
config.json's rotary_dim (transformers' MiniMax-M3 code ignores rotary_dim; MiniMax-M2's reads it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import IndexKeys, MoeConfig, MoeDecoder, RunState, layer_list, need, text_config
from engine.models.rope import ConfigError, declared_partial
from engine.names import name

SPARSE = "minimax_m3_sparse"
NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm", "idx_q_norm", "idx_k_norm")


@dataclass(frozen=True)
class MinimaxM3Config(MoeConfig):
    sparse_layers: tuple = ()
    idx_heads: int = 0
    idx_dim: int = 0
    block_size: int = 0
    block_topk: int = 0
    block_local: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "MinimaxM3Config":
        cfg = text_config(cfg, "minimax_m3_vl", "MiniMaxM3SparseForConditionalGeneration",
                          inherited=("eos_token_id", "bos_token_id", "tie_word_embeddings"))
        cfg.setdefault("num_experts", need(cfg, "num_local_experts"))
        cfg.setdefault("rms_norm_eps", 1e-6)
        head_dim = int(cfg.get("head_dim") or 128)
        if declared_partial(cfg) is None and cfg.get("rotary_dim"):
            cfg["partial_rotary_factor"] = int(cfg["rotary_dim"]) / head_dim
        n = int(need(cfg, "num_hidden_layers"))
        sparse_cfg = cfg.get("sparse_attention_config") or {}
        types = cfg.get("layer_types")
        if types is None and "sparse_attention_freq" in sparse_cfg:
            types = [SPARSE if x else "full_attention" for x in sparse_cfg["sparse_attention_freq"]]
        types = layer_list("layer_types", types or ["full_attention"] * n, n, ("full_attention", SPARSE))
        mlp = cfg.get("mlp_layer_types")
        if mlp is None and cfg.get("moe_layer_freq") is not None:
            mlp = ["sparse" if x else "dense" for x in cfg["moe_layer_freq"]]
        mlp = layer_list("mlp_layer_types", mlp or ["sparse"] * n, n, ("sparse", "dense"))
        index = {k: sparse_cfg.get(old, cfg.get(k, default)) for k, old, default in (
            ("index_n_heads", "sparse_num_index_heads", 4), ("index_head_dim", "sparse_index_dim", 128),
            ("index_block_size", "sparse_block_size", 128), ("index_topk_blocks", "sparse_topk_blocks", 16),
            ("index_local_blocks", "sparse_local_block", 1))}
        f = MoeConfig.common_hf(cfg)
        sparse = tuple(l for l, t in enumerate(types) if t == SPARSE)
        if sparse and int(index["index_n_heads"]) != f["n_kv_heads"]:
            raise ConfigError(f"config.json: index_n_heads={index['index_n_heads']} must equal "
                              f"num_key_value_heads={f['n_kv_heads']} (a block choice a KV head)")
        if sparse and int(index["index_head_dim"]) < f["rope"].rotary_dim:
            raise ConfigError(f"config.json: index_head_dim={index['index_head_dim']} must be at least "
                              f"the rotary dims ({f['rope'].rotary_dim})")
        if sparse and min(int(index["index_block_size"]), int(index["index_topk_blocks"])) < 1:
            raise ConfigError("config.json: index_block_size and index_topk_blocks must be positive")
        f.update(moe_layers=tuple(l for l, t in enumerate(mlp) if t == "sparse"), routing="sigmoid",
                 norm_topk_prob=True, n_group=1, topk_group=1,
                 routed_scale=float(cfg.get("routed_scaling_factor", 2.0)),
                 shared_intermediate=int(cfg.get("shared_intermediate_size", 3072)),
                 dense_intermediate=int(cfg.get("dense_intermediate_size", 12288)), qk_norm="head")
        n_mtp = int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_modules") or 0)
        ignored = (("vision_tower.", "the vision tower"), ("multi_modal_projector.", "the vision projector"),
                   ("patch_merge_mlp.", "the vision patch merger"))
        ignored += tuple((f"language_model.model.layers.{n + i}.", "the multi-token-prediction (MTP) layers")
                         for i in range(n_mtp))
        return cls(**f, moe_intermediate=int(need(cfg, "intermediate_size")), sparse_layers=sparse,
                   idx_heads=int(index["index_n_heads"]), idx_dim=int(index["index_head_dim"]),
                   block_size=int(index["index_block_size"]), block_topk=int(index["index_topk_blocks"]),
                   block_local=int(index["index_local_blocks"]),
                   swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), ignored_parts=ignored)


def dense_spec(c: MinimaxM3Config) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    f, h, di = c.family, c.hidden, c.idx_dim
    for l in c.sparse_layers:
        spec[name(f, "idx_q", l)] = (c.idx_heads * di, h)
        spec[name(f, "idx_k", l)] = (di, h)
        spec[name(f, "idx_q_norm", l)] = (di,)
        spec[name(f, "idx_k_norm", l)] = (di,)
    return spec


expert_spec = base.expert_spec


def dense_view(c: MinimaxM3Config, n: str, a: np.ndarray) -> np.ndarray:
    """Checkpoint tensor n as both backends read it: an RMSNorm's weight (NORMS) as 1 + w."""
    return base.one_plus_view(c.family, n, a, NORMS)


class M3State(IndexKeys, RunState):
    """The KV cache and the indexer's key rows ik [Ls, S_max, Di] of the sparse layers."""

    def __init__(self, ops, c: MinimaxM3Config, max_context: int):
        super().__init__(ops, c, max_context)
        self.ik = np.zeros((len(c.sparse_layers), max_context, c.idx_dim), np.float32)


class MinimaxM3Decoder(MoeDecoder):
    def __init__(self, c: MinimaxM3Config, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        self.index_row = {l: i for i, l in enumerate(c.sparse_layers)}
        self._no_bias: dict = {}   # intermediate size -> zero (gate, up, down) biases

    def new_state(self, max_context: int) -> M3State:
        return M3State(self.ops, self.c, max_context)

    # ---- MLPs: gpt-oss's clamped SwiGLU without biases -----------------------------------------

    def _clamped(self, x, weights, inter: int):
        zero = self._no_bias.get(inter)
        if zero is None:
            zero = self._no_bias[inter] = (np.zeros(inter, np.float32), np.zeros(inter, np.float32),
                                           np.zeros(self.c.hidden, np.float32))
        return self.ops.expert_clamped(x, weights, zero, self.c.swiglu_alpha, self.c.swiglu_limit)

    def routed_expert(self, l: int, e: int, x, we):
        return self._clamped(x, we, self.c.moe_intermediate)

    def shared_expert(self, l: int, h):
        w = self.w
        return self._clamped(h, (w("shared_gate", l), w("shared_up", l), w("shared_down", l)),
                             self.c.shared_intermediate)

    def dense_mlp(self, l: int, h):
        w = self.w
        return self._clamped(h, (w("mlp_gate", l), w("mlp_up", l), w("mlp_down", l)), self.c.dense_intermediate)

    # ---- attention ---------------------------------------------------------------------------------

    def attention(self, l: int, h, pos: np.ndarray, st: M3State):
        if l not in self.index_row:
            return super().attention(l, h, pos, st)
        c, ops, w = self.c, self.ops, self.w
        t, d, kv = h.shape[0], c.head_dim, c.n_kv_heads
        q = ops.rmsnorm(ops.linear(h, w("q", l)).reshape(t, c.n_heads, d), w("q_norm", l), c.rms_eps)
        k = ops.rmsnorm(ops.linear(h, w("k", l)).reshape(t, kv, d), w("k_norm", l), c.rms_eps)
        v = ops.linear(h, w("v", l)).reshape(t, kv, d)
        ops.rope(q, pos, self.inv_freq, c.rope.attention_factor)
        ops.rope(k, pos, self.inv_freq, c.rope.attention_factor)
        ops.kv_store(st.k[l], st.v[l], int(pos[0]), k, v, self.kv_bf16)
        iq = ops.rmsnorm(ops.linear(h, w("idx_q", l)).reshape(t, c.idx_heads, c.idx_dim),
                         w("idx_q_norm", l), c.rms_eps)
        ik = ops.rmsnorm(ops.linear(h, w("idx_k", l)).reshape(t, 1, c.idx_dim), w("idx_k_norm", l), c.rms_eps)
        ops.rope(iq, pos, self.inv_freq, c.rope.attention_factor)
        ops.rope(ik, pos, self.inv_freq, c.rope.attention_factor)
        keys = st.ik[self.index_row[l]]
        keys[pos[0]:pos[0] + t] = ik[:, 0]
        end = int(pos[-1]) + 1
        b = c.block_size
        n_blocks = -(-end // b)
        if n_blocks <= c.block_topk:   # every block picked: dense causal attention
            a = ops.attention(q, st.k[l], st.v[l], pos, d ** -0.5, 0, None)
            return ops.linear(a.reshape(t, c.q_dim), w("o", l))
        scores = np.einsum("thd,sd->ths", iq, keys[:end])                   # [T, Hi, S]
        scores = np.where(np.arange(end)[None, None, :] > pos[:, None, None], -np.inf, scores)
        pad = np.full((t, c.idx_heads, n_blocks * b - end), -np.inf, np.float32)
        blocks = np.concatenate([scores, pad], -1).reshape(t, c.idx_heads, n_blocks, b).max(-1)
        for j in range(c.block_local):   # the query's own blocks always win a slot
            blocks[np.arange(t), :, np.maximum(pos // b - j, 0)] = np.inf
        rep, scale = c.n_heads // kv, np.float32(d ** -0.5)
        out = np.empty((t, c.n_heads, d), np.float32)
        for i, p in enumerate(pos):
            for g in range(kv):
                row = blocks[i, g]
                top = np.argsort(-row, kind="stable")[:c.block_topk]
                top = top[row[top] > -np.inf]
                cols = (top[:, None] * b + np.arange(b)[None, :]).ravel()
                cols = np.sort(cols[cols <= p])
                kr, vr = st.k[l, cols, g], st.v[l, cols, g]                      # [n, D]
                s = (q[i, g * rep:(g + 1) * rep] @ kr.T) * scale              # [rep, n]
                e = np.exp(s - s.max(-1, keepdims=True))
                out[i, g * rep:(g + 1) * rep] = (e / e.sum(-1, keepdims=True)) @ vr
        return ops.linear(out.reshape(t, c.q_dim), w("o", l))


Model = MinimaxM3Decoder
Config = MinimaxM3Config
