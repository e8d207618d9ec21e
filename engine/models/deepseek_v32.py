"""DeepSeek-V3.2 (V3.2-Exp, V3.2, V3.2-Speciale): DeepSeek-V3's MLA and MoE with DeepSeek Sparse
Attention (DSA). Each layer's lightning indexer scores every cached position for each query
(index_n_heads relu'd dot products of index_head_dim, weighted per token) and the attention reads
only the index_topk best; the indexer's keys (one index_head_dim row a position a layer) are
cached beside the latent rows. Up to index_topk positions the selection is every position: dense
MLA. The indexer's RoPE rotates the first qk_rope_head_dim dims in halves (the attention's comes
in interleaved pairs; GLM-5's indexer takes the attention's, engine/models/glm_moe_dsa.py, and
runs in some layers only, the others reading what it picked). Of scores equal at the
index_topk-th, the earliest positions are picked (top_positions). The cuda backend runs the same
indexer and picks on the device: engine/gpu_dsa.py."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import deepseek_v3
from engine.models.base import IndexKeys, need
from engine.models.deepseek_v3 import DeepseekV3Config, DeepseekV3Decoder, MlaState, expert_spec  # noqa: F401
from engine.models.rope import ConfigError, pairs_to_halves
from engine.names import name

INDEX_KEY_EPS = 1e-6   # the indexer key's LayerNorm (transformers' k_norm)


@dataclass(frozen=True)
class DeepseekV32Config(DeepseekV3Config):
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # the layers that run an indexer (V3.2: all); each other layer reads the positions the last
    # of them before it picked (GLM-5's "shared" layers: no indexer weights, no indexer keys)
    index_layers: tuple = ()
    # the indexer's rotary dims in interleaved pairs, as the attention's (GLM-5), or in halves
    index_rope_pairs: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekV32Config":
        c = DeepseekV3Config.from_hf(cfg)
        if not c.q_lora_rank:
            raise ConfigError(f"config.json: {c.family} without q_lora_rank; expected one (the "
                              "indexer's queries come from the low-rank query)")
        heads, dim, topk = (int(need(cfg, k)) for k in ("index_n_heads", "index_head_dim", "index_topk"))
        if min(heads, topk) < 1 or dim < c.qk_rope_dim:
            raise ConfigError(f"config.json: index_n_heads={heads}, index_topk={topk} must be "
                              f"positive and index_head_dim={dim} at least qk_rope_head_dim="
                              f"{c.qk_rope_dim}")
        return cls(**c.__dict__, index_n_heads=heads, index_head_dim=dim, index_topk=topk,
                   index_layers=tuple(range(c.n_layers)))


def indexer_spec(c: DeepseekV32Config) -> dict[str, tuple]:
    """The indexer's weights, a layer that runs one."""
    f, hd, spec = c.family, c.index_head_dim, {}
    for l in c.index_layers:
        spec[name(f, "idx_wq_b", l)] = (c.index_n_heads * hd, c.q_lora_rank)
        spec[name(f, "idx_wk", l)] = (hd, c.hidden)
        spec[name(f, "idx_k_norm", l)] = (hd,)
        spec[name(f, "idx_k_norm_bias", l)] = (hd,)
        spec[name(f, "idx_w", l)] = (c.index_n_heads, c.hidden)
    return spec


def dense_spec(c: DeepseekV32Config) -> dict[str, tuple]:
    return {**deepseek_v3.dense_spec(c), **indexer_spec(c)}


class DsaState(IndexKeys, MlaState):
    """The latent cache and the indexer's keys ik [Li, S_max, index_head_dim], Li = the layers
    that run an indexer (index_layers, in order); picked: the positions the last of them picked
    for the tokens in flight (a forward's own, never saved)."""

    def __init__(self, ops, c: DeepseekV32Config, max_context: int):
        super().__init__(ops, c, max_context)
        self.ik = np.zeros((len(c.index_layers), max_context, c.index_head_dim), np.float32)
        self.picked = None


class DeepseekV32Decoder(DeepseekV3Decoder):
    def __init__(self, c: DeepseekV32Config, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        self.index_row = {l: i for i, l in enumerate(c.index_layers)}    # layer -> its row of ik
        # interleaved rotary pairs -> halves, as self.rot; the dims past qk_rope_head_dim stay
        self.index_cols = pairs_to_halves(c.qk_rope_dim, c.index_head_dim) if c.index_rope_pairs else None

    def new_state(self, max_context: int) -> DsaState:
        return DsaState(self.ops, self.c, max_context)

    def attention(self, l: int, h, pos: np.ndarray, st: DsaState):
        q_lat, qr = self.latent(l, h, pos, st)
        if l in self.index_row:   # else the last indexer layer's picks (layer 0 runs one)
            st.picked = self.select(l, h, qr, pos, st)
        return self.out(l, self.attend(l, q_lat, pos, st))

    def attend(self, l: int, q_lat, pos: np.ndarray, st: DsaState):
        """The latent queries [T, Hq, C + R] over the positions st.picked holds for them (every
        position where it is None): the heads' outputs in the latent space, [T, Hq, C + R]."""
        picked, row = st.picked, self.cache_index(l)
        if picked is None:   # every position: dense MLA
            a = self.ops.attention(q_lat, st.k[row], st.v[row], pos, self.c.softmax_scale, 0, None)
        else:
            a = np.empty(q_lat.shape, np.float32)
            for i, keep in enumerate(picked):   # each query over its picked rows
                rows = st.k[row, keep, 0].astype(np.float32)                       # [n, C + R]
                s = (q_lat[i] @ rows.T) * np.float32(self.c.softmax_scale)      # [Hq, n]
                p = np.exp(s - s.max(-1, keepdims=True))
                a[i] = (p / p.sum(-1, keepdims=True)) @ rows
        return a

    def select(self, l: int, h, qr, pos: np.ndarray, st: DsaState):
        """Stores the tokens' indexer keys; returns each token's picked positions (ascending),
        or None where every token may read all its positions (at most index_topk of them)."""
        c, ops, w = self.c, self.ops, self.w
        t, heads, dim = h.shape[0], c.index_n_heads, c.index_head_dim
        k = ops.linear(h, w("idx_wk", l))                                   # [T, D]
        mu = k.mean(-1, keepdims=True)
        var = ((k - mu) ** 2).mean(-1, keepdims=True)
        k = ((k - mu) / np.sqrt(var + np.float32(INDEX_KEY_EPS)) * w("idx_k_norm", l)
             + w("idx_k_norm_bias", l)).astype(np.float32)[:, None]        # LayerNorm, [T, 1, D]
        rotates = l not in c.nope_layers   # (Mistral Large 4's NoPE layers: neither q nor k)
        if self.index_cols is not None:
            k = np.ascontiguousarray(k[:, :, self.index_cols])
        if rotates:
            ops.rope(k, pos, self.inv_freq, c.rope.attention_factor)
        ik = st.ik[self.index_row[l]]                                       # [S_max, D]
        ik[pos[0]:pos[0] + t] = k[:, 0]
        end = int(pos[-1]) + 1
        if end <= c.index_topk:
            return None
        q = self.index_query(l, h, qr, pos)                                 # [T, Hi, D]
        q = np.ascontiguousarray(q if self.index_cols is None else q[:, :, self.index_cols])
        if rotates:
            ops.rope(q, pos, self.inv_freq, c.rope.attention_factor)
        wt = ops.linear(h, w("idx_w", l)) * np.float32(heads ** -0.5)        # [T, Hi]
        keys = ik[:end]                                                     # [S, D]
        scores = np.maximum(np.einsum("thd,sd->ths", q, keys) * np.float32(dim ** -0.5), 0)
        score = np.einsum("th,ths->ts", wt, scores)                         # [T, S]
        picked = []
        for i in range(t):
            n = int(pos[i]) + 1
            if n <= c.index_topk:
                picked.append(np.arange(n))
            else:
                picked.append(top_positions(score[i, :n], c.index_topk))
        return picked

    def index_query(self, l: int, h, qr, pos: np.ndarray):
        """The indexer's queries [T, Hi, D] before RoPE: from the normed low-rank query qr."""
        c = self.c
        return self.ops.linear(qr, self.w("idx_wq_b", l)).reshape(h.shape[0], c.index_n_heads, c.index_head_dim)


def top_positions(score: np.ndarray, k: int) -> np.ndarray:
    """The k positions of the highest scores, ascending; of scores equal at the k-th (relu'd
    sums tie at 0 often) the earliest positions, so the cuda backend's select
    (kernels_numba/gpu_dsa.py) picks the same. score float32 [n], n > k."""
    kth = np.partition(score, score.size - k)[score.size - k]     # the k-th highest
    above = np.flatnonzero(score > kth)
    ties = np.flatnonzero(score == kth)[:k - above.size]
    return np.sort(np.concatenate([above, ties]))


Model = DeepseekV32Decoder
Config = DeepseekV32Config
