"""The CUDA decoder of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): GpuMlaDecoder with the
lightning indexer on the device (kernels_numba/gpu_dsa.py; the math and the picks:
engine/models/deepseek_v32.py), so the context is not capped at index_topk.

What changes against GpuMlaDecoder:
- weights: the indexer's (wq_b, wk, k_norm's weight and bias, weights_proj) of each layer that
  runs one. GLM-5's indexer rotates interleaved pairs: the rows of wq_b (a head at a time), of
  wk and of k_norm's weight and bias are permuted once at upload into rotate-half order (the CPU
  backend's index_cols: the same dot products), so the plain rotate-half RoPE serves both.
- run state: beside the latent cache, the indexer's keys ik [Li][S_max, Di] float32 (Li = the
  layers that run an indexer, in order), saved and loaded with it.
- a layer that runs an indexer, after its projections: the indexer's q from the normed q
  latent, its key and head weights from the normed input (a decode token's norms fused into
  the projections again, as its q_a | kv_a's); index_prep; then, SCORE_ROWS tokens at a time
  (one row for a decode token), index_scores and index_select -> sel [T, K], vpos [T]. Every
  layer's attention reads its query's rows sel[t, :vpos[t] + 1] (a shared layer of GLM-5: the
  last indexing layer's, still in the buffers): gpu_mla.attention(sel=...). Up to K positions
  that is every row in order, the dense attention's sums.
Legend: as engine/gpu_mla.py; Hi = indexer heads, Di = index_head_dim, K = index_topk.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import _partials
from engine.gpu import pick_prefill_chunk as _base_pick_prefill_chunk
from engine.gpu_mla import GpuMlaDecoder, MlaBuffers, MlaRunState, fuse_qa
from engine.gpu_mla import run_state_bytes as _mla_run_state_bytes
from engine.gpu_mla import state_bytes as _mla_state_bytes
from engine.models.deepseek_v3 import LATENT_EPS
from engine.models.deepseek_v32 import INDEX_KEY_EPS
from engine.models.rope import pairs_to_halves
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_dsa as gdsa
from kernels_numba import gpu_misc as gm
from kernels_numba import gpu_mla as gml

INDEXER = ("idx_wq_b", "idx_wk", "idx_k_norm", "idx_k_norm_bias", "idx_w")   # an indexing layer's weights
SCORE_ROWS = 64   # a prefill chunk's tokens scored at once: the score buffer is [SCORE_ROWS, S_max]


def _extra_floats(c, t: int, s_max: int) -> int:
    """Values (4 bytes each) of DsaBuffers beside MlaBuffers, for t tokens."""
    hi, d = c.index_n_heads, c.index_head_dim
    return t * (hi * d + d + hi + c.index_topk + 1) + min(t, SCORE_ROWS) * s_max


def run_state_bytes(c, t: int, max_context: int) -> int:
    """The MLA activations for t tokens plus the indexer's (a chunk's and a decode token's)."""
    return _mla_run_state_bytes(c, t, max_context) + 4 * (_extra_floats(c, t, max_context)
                                                          + _extra_floats(c, 1, max_context))


def pick_prefill_chunk(c, max_context: int, vram_bytes: float, share: float = 0.15) -> int:
    """The largest prefill chunk whose run state (the DSA one) fits a share of the VRAM."""
    return _base_pick_prefill_chunk(c, max_context, vram_bytes, share, run_state_bytes)


def state_bytes(c, max_context: int, kv_itemsize: int = 4) -> int:
    """Device bytes of a sequence's latent cache and its indexer keys (float32)."""
    return _mla_state_bytes(c, max_context, kv_itemsize) + 4 * len(c.index_layers) * max_context * c.index_head_dim


class DsaBuffers(MlaBuffers):
    """MlaBuffers plus the indexer's activations and picks."""

    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        f = np.float32
        self.iq = cuda.device_array((t, c.index_n_heads, c.index_head_dim), f)    # queries [T, Hi, Di]
        self.ikey = cuda.device_array((t, c.index_head_dim), f)                  # wk's output [T, Di]
        self.iw = cuda.device_array((t, c.index_n_heads), f)                     # head weights [T, Hi]
        self.score = cuda.device_array((min(t, SCORE_ROWS), s_max), f)           # [<= SCORE_ROWS, S_max]
        self.sel = cuda.device_array((t, c.index_topk), np.int32)               # picks [T, K]
        self.vpos = cuda.device_array(t, np.int32)                              # picks - 1 [T]


class DsaRunState(MlaRunState):
    """The latent cache and the indexer keys ik [Li][S_max, Di] float32."""

    def __init__(self, c, max_context: int, kv_dtype=np.float32):
        super().__init__(c, max_context, kv_dtype)
        self.ik = [cuda.device_array((max_context, c.index_head_dim), np.float32) for _ in c.index_layers]

    def save_nbytes(self, keep: int) -> int:
        return super().save_nbytes(keep) + sum(a.nbytes // a.shape[0] * keep for a in self.ik)

    def save(self, keep: int, stream) -> dict:
        out = super().save(keep, stream)
        out["ik"] = [a[:keep].copy_to_host(stream=stream) for a in self.ik]
        stream.synchronize()
        return out

    def load(self, saved: dict, keep: int, stream) -> None:
        super().load(saved, keep, stream)
        for a, h in zip(self.ik, saved["ik"]):
            a[:keep].copy_to_device(np.ascontiguousarray(h[:keep]), stream=stream)


class GpuDsaDecoder(GpuMlaDecoder):
    buffers_cls = DsaBuffers
    state_cls = DsaRunState

    @staticmethod
    def dense_keys(c) -> list:
        return GpuMlaDecoder.dense_keys(c, lambda l: INDEXER if l in c.index_layers else ())

    def __init__(self, c, *args, **kw):
        super().__init__(c, *args, **kw)
        self.index_row = {l: i for i, l in enumerate(c.index_layers)}   # layer -> its ik
        # GLM-5: the indexer's rotary pairs -> halves (deepseek_v32's index_cols)
        self.index_cols = pairs_to_halves(c.qk_rope_dim, c.index_head_dim) if c.index_rope_pairs else None

    def _host_array(self, key: str, layer: int | None) -> np.ndarray:
        a = super()._host_array(key, layer)
        if self.index_cols is None or key not in INDEXER or key == "idx_w":
            return a
        rows = self.index_cols
        if key == "idx_wq_b":   # [Hi Di, Lq]: each head's rows
            d = self.c.index_head_dim
            rows = (np.arange(self.c.index_n_heads)[:, None] * d + rows).ravel()
        return np.ascontiguousarray(a[rows])

    def new_state(self, max_context: int):
        fresh = self.state is None or self.state.max_context < max_context
        st = super().new_state(max_context)
        if fresh:   # (the graph warm-up scores every row)
            for a in st.ik:
                gm.zero(a.reshape(-1), self.cs)
        return st

    def _attention_rest(self, l, b, t, st, qr, kv):
        if l in self.index_row:
            self._indexer(l, b, t, st)
        super()._attention_rest(l, b, t, st, qr, kv)

    def _indexer(self, l, b, t, st):
        """Layer l's indexer keys of the tokens into st; each token's picks into b.sel, b.vpos."""
        c, cs, w = self.c, self.cs, self.w
        x, pos = b.x[:t], b.pos[:t]
        iq, ikey, iw = b.iq[:t], b.ikey[:t], b.iw[:t]
        if t == 1 and fuse_qa(c):   # (_attention's decode path: no normed rows were kept)
            lq = c.q_lora_rank
            gd.linear(w("idx_wq_b", l), b.qkva[:lq].reshape(1, lq), iq.reshape(1, -1), cs,
                      norm=(w("q_a_norm", l), LATENT_EPS, 0.0, None))
            hn = (w("attn_norm", l), c.rms_eps, 0.0, None)
            gd.linear(w("idx_wk", l), x, ikey, cs, norm=hn)
            gd.linear(w("idx_w", l), x, iw, cs, norm=hn)
        else:   # _project left the normed input in b.h and the normed q latent in b.qa
            self._linear(w("idx_wq_b", l), b.qa[:t], iq.reshape(t, -1))
            self._linear(w("idx_wk", l), b.h[:t], ikey)
            self._linear(w("idx_w", l), b.h[:t], iw)
        ik = st.ik[self.index_row[l]]
        gdsa.index_prep(iq, ikey, w("idx_k_norm", l), w("idx_k_norm_bias", l), INDEX_KEY_EPS, pos,
                        self.inv_freq, c.rope.attention_factor, ik, cs)
        for r0 in range(0, t, SCORE_ROWS):
            r1 = min(r0 + SCORE_ROWS, t)
            score = b.score[:r1 - r0]
            gdsa.index_scores(iq[r0:r1], iw[r0:r1], ik, pos[r0:r1], c.index_head_dim ** -0.5,
                              c.index_n_heads ** -0.5, c.index_topk, score, cs)
            gdsa.index_select(score, pos[r0:r1], c.index_topk, b.sel[r0:r1], b.vpos[r0:r1], cs)

    def _latent_attention(self, l, b, t, st, q_lat, lat):
        """Each head's attention over its query's picked rows (the last indexing layer's)."""
        gml.attention(q_lat, st.k[l], b.vpos[:t], self.c.softmax_scale, lat,
                      _partials(b.partials, t, self.c.n_heads), self.cs, sel=b.sel[:t])
