"""The CUDA decoder of the MLA families (DeepSeek-V3 / R1, Moonlight, Kimi K2; DeepSeek-V2,
V2-Lite, Coder-V2): GpuDecoder with multi-head latent attention in its absorbed form
(kernels_numba/gpu_mla.py; the math: engine/models/deepseek_v3.py). The MoE side is the base
decoder's: V3's sigmoid routing with groups and a selection bias, V2's softmax top-k (greedy or
group-limited) times routed_scaling_factor, shared experts, the first layers dense.

What changes against GpuDecoder:
- weights: the rotary rows of q (q_proj or q_b_proj) and of kv_a_proj_with_mqa come in
  interleaved pairs; their rows are permuted once at upload into rotate-half order (evens, then
  odds), so the plain rotate-half RoPE gives the reference's dot products with no gather a token.
  kv_b stays as the checkpoint has it (bf16): the absorb kernels read its key and value halves.
- run state: one latent cache row a token a layer ([S_max, 1, C + R]; v is the same array).
- attention a layer: norm -> q (through the low-rank q_a / q_a_norm / q_b when q_lora_rank) and
  kv_a -> prep (q's rotary part into the latent query, the normed latent and rotated key into
  the cache) -> absorb_q -> MLA attention -> absorb_o -> o projection added to the residual.
Legend: T = tokens, Hq = heads, Nn = qk_nope dims, R = rotary dims, C = kv_lora_rank,
D = C + R, V = v_head_dim, Lq = q_lora_rank.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import Buffers, GpuDecoder, GpuRunState, _partials, fused_rows
from engine.gpu import dense_keys as _base_dense_keys
from engine.gpu import pick_prefill_chunk as _base_pick_prefill_chunk
from engine.gpu import run_state_bytes as _base_run_state_bytes
from engine.models.deepseek_v3 import LATENT_EPS
from engine.models.rope import pairs_to_halves
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm
from kernels_numba import gpu_mla as gml
from kernels_numba import gpu_sampling as gs


def rot_order(c) -> np.ndarray:
    """The rotary dims in rotate-half order: interleaved pairs (x0, x1), (x2, x3)... -> evens
    then odds (as the CPU decoder gathers them); identity when the checkpoint is not interleaved."""
    r = c.qk_rope_dim
    return pairs_to_halves(r) if c.rope_interleave else np.arange(r)


def _q_rows(c) -> np.ndarray:
    per = c.qk_nope_dim + c.qk_rope_dim
    head = np.concatenate([np.arange(c.qk_nope_dim), c.qk_nope_dim + rot_order(c)])
    return (np.arange(c.n_heads)[:, None] * per + head).ravel()


def _kv_a_rows(c) -> np.ndarray:
    return np.concatenate([np.arange(c.kv_lora_rank), c.kv_lora_rank + rot_order(c)])


def _extra_floats(c, t: int) -> int:
    """Float32 values of MlaBuffers beside the base Buffers, for t tokens (less v and the
    attention output, which MLA does without: at V3's shapes the latter is 128 x 576 floats a
    token)."""
    qd = c.n_heads * (c.qk_nope_dim + c.qk_rope_dim)
    return t * (c.q_lora_rank + qd + c.n_heads * (c.kv_lora_rank + c.v_head_dim) - c.q_dim - c.kv_dim) \
        + (c.q_lora_rank + c.kv_dim if fuse_qa(c) else 0)


def run_state_bytes(c, t: int, max_context: int) -> int:
    """GpuDecoder's activations for t tokens plus the MLA ones (MlaBuffers)."""
    return _base_run_state_bytes(c, t, max_context) + 4 * _extra_floats(c, t)


def pick_prefill_chunk(c, max_context: int, vram_bytes: float, share: float = 0.15) -> int:
    """The largest prefill chunk whose run state (the MLA one) fits a share of the VRAM."""
    return _base_pick_prefill_chunk(c, max_context, vram_bytes, share, run_state_bytes)


def state_bytes(c, max_context: int, kv_itemsize: int = 4) -> int:
    """Device bytes of a sequence's latent cache."""
    return kv_itemsize * c.n_layers * max_context * c.kv_dim


def fuse_qa(c) -> bool:
    """q_a and kv_a as one matrix [Lq + D, H] (rows in that order): a decode token's two
    projections of the normed input in one launch, attn_norm fused in. Not with their biases."""
    return bool(c.q_lora_rank) and not c.attention_bias


class MlaBuffers(Buffers):
    """Buffers, with q the latent query [T, Hq D] and k the kv_a output [T, D], plus the MLA
    activations (float32)."""
    separate_v = False

    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        f = np.float32
        if c.q_lora_rank:
            self.qa = cuda.device_array((t, c.q_lora_rank), f)                    # [T, Lq]
        if fuse_qa(c) and t == 1:   # (the fused projection is a decode token's only)
            self.qkva = cuda.device_array(c.q_lora_rank + c.kv_dim, f)    # one token's qa | kv
        self.qr = cuda.device_array((t, c.n_heads, c.qk_nope_dim + c.qk_rope_dim), f)
        self.lat = cuda.device_array((t, c.n_heads, c.kv_lora_rank), f)          # [T, Hq, C]
        self.ov = cuda.device_array((t, c.n_heads * c.v_head_dim), f)            # [T, Hq V]


class MlaRunState(GpuRunState):
    """The latent cache [L][S_max, 1, D] (float32 or bf16 bits); v is the same list."""

    def __init__(self, c, max_context: int, kv_dtype=np.float32):
        self.max_context = max_context
        self.k = [cuda.device_array((max_context, 1, c.head_dim), kv_dtype) for _ in range(c.n_layers)]
        self.v = self.k      # saved, loaded and zeroed once: engine.gpu.cache_arrays
        self.pos = 0


_QA_KV = ("q_a", "kv_a")


class GpuMlaDecoder(GpuDecoder):
    fuse_qkv = False
    buffers_cls = MlaBuffers
    state_cls = MlaRunState

    @staticmethod
    def dense_keys(c, extra_per_layer=()) -> list:
        attn = ["kv_a", "kv_a_norm", "kv_b", "o"] + (["q_a", "q_a_norm", "q_b"] if c.q_lora_rank else ["q"])
        if c.attention_bias:
            attn += ["kv_a_bias", "o_bias"] + (["q_a_bias"] if c.q_lora_rank else [])
        return _base_dense_keys(c, extra_per_layer, attn=attn)

    def w(self, key: str, layer: int | None = None):
        """As GpuDecoder.w; q_a and kv_a are row ranges of one matrix where fuse_qa()."""
        if key in _QA_KV and fuse_qa(self.c):
            f = super().w("qkva", layer)
            lq = self.c.q_lora_rank
            return f[:lq] if key == "q_a" else f[lq:]
        return super().w(key, layer)

    def _canon(self, key: str) -> str:
        return "qkva" if key in _QA_KV and fuse_qa(self.c) else key

    def _host_array(self, key: str, layer: int | None) -> np.ndarray:
        if key == "qkva":
            return fused_rows([(k, self._host_array(k, layer)) for k in _QA_KV], layer)
        a = super()._host_array(key, layer)
        if key in ("q", "q_b"):
            return np.ascontiguousarray(a[_q_rows(self.c)])
        if key in ("kv_a", "kv_a_bias"):
            return np.ascontiguousarray(a[_kv_a_rows(self.c)])
        return a

    def _attention(self, l, b, t, st):
        c, cs, w = self.c, self.cs, self.w
        x, h = b.x[:t], b.h[:t]
        qr = b.qr[:t]
        q2 = qr.reshape(t, -1)
        if t == 1 and fuse_qa(c):
            # a decode token (the one-token buffers, which hold qkva): attn_norm fused into the
            # one q_a | kv_a projection, q_a_norm into q_b
            lq = c.q_lora_rank
            gd.linear(w("qkva", l), x, b.qkva.reshape(1, -1), cs,
                      norm=(w("attn_norm", l), c.rms_eps, 0.0, None))
            gd.linear(w("q_b", l), b.qkva[:lq].reshape(1, lq), q2, cs,
                      norm=(w("q_a_norm", l), LATENT_EPS, 0.0, None))
            kv = b.qkva[lq:].reshape(1, c.kv_dim)
        else:
            kv = b.k[:t]                                                 # [T, D]
            self._project(l, b, t, x, h, q2, kv)
        self._attention_rest(l, b, t, st, qr, kv)

    def _project(self, l, b, t, x, h, q2, kv):
        """q2 [T, Hq (Nn + R)] and kv [T, D] from x: the norm, then each projection alone."""
        c, cs, w = self.c, self.cs, self.w
        gd.rmsnorm(x, w("attn_norm", l), c.rms_eps, h, cs)
        if c.q_lora_rank:
            qa = b.qa[:t]
            self._linear(w("q_a", l), h, qa)
            if c.attention_bias:
                gm.add_rows(qa, w("q_a_bias", l), cs)
            gd.rmsnorm(qa, w("q_a_norm", l), LATENT_EPS, qa, cs)
            self._linear(w("q_b", l), qa, q2)
        else:
            self._linear(w("q", l), h, q2)
        self._linear(w("kv_a", l), h, kv)
        if c.attention_bias:
            gm.add_rows(kv, w("kv_a_bias", l), cs)

    def _attention_rest(self, l, b, t, st, qr, kv):
        c, cs, w = self.c, self.cs, self.w
        x, hq = b.x[:t], c.n_heads
        q_lat = b.q[:t].reshape(t, hq, c.head_dim)
        pos = b.pos[:t]
        gml.prep(qr, kv, w("kv_a_norm", l), LATENT_EPS, pos, self.inv_freq,
                 c.rope.attention_factor, q_lat, st.k[l], cs)
        kv_b = w("kv_b", l)
        gml.absorb_q(qr, kv_b, q_lat, cs)
        if c.query_scale_beta:   # Mistral 4: the queries by position
            gm.query_temperature(q_lat, pos, c.query_scale_period, c.query_scale_beta, cs, shift=0.0)
        lat = b.lat[:t]
        self._latent_attention(l, b, t, st, q_lat, lat)
        ov = b.ov[:t]
        gml.absorb_o(lat, kv_b, ov.reshape(t, hq, c.v_head_dim), cs)
        self._linear_add(w("o", l), ov, b.o[:t], x)
        if c.attention_bias:
            gm.add_rows(x, w("o_bias", l), cs)

    def _latent_attention(self, l, b, t, st, q_lat, lat):
        """lat [T, Hq, C]: each head's attention over the latent rows up to its position."""
        gml.attention(q_lat, st.k[l], b.pos[:t], self.c.softmax_scale, lat,
                      _partials(b.partials, t, self.c.n_heads), self.cs)

    def _topk(self, l, rl, ids, w, slots=None):
        """V3 (and Mistral 4's softmax_grouped): the base decoder's routing. V2: the softmax
        probabilities times routed_scaling_factor (not renormed), from the topk_group groups whose
        best is highest."""
        c = self.c
        if c.routing != "softmax":
            super()._topk(l, rl, ids, w, slots)
            return
        # greedy is the one-group case (the config sets n_group = topk_group = 1)
        gs.router_sigmoid_topk(rl, None, c.n_group, c.topk_group, False, c.routed_scale, ids, w,
                               self.cs, slots=slots, softmax=True)
