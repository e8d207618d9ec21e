"""The CUDA decoder of Step-3.5-Flash / Step-3.7-Flash (step3p5, step3p7): GpuDecoder with
Step's attention. Same math as engine/models/step3p5.py (the CPU backend).

What changes against GpuDecoder:
- weights: the norms as (1 + w) from step3p5.dense_view (at load, both backends); q, k, v and the
  per-head gate rows of a layer as one [Hq D + 2 Hkv D + Hq, H] matrix (one launch projects a
  decode token, attn_norm fused in).
- attention a layer: its own query heads (sliding layers may have more or fewer: buffers are
  sized for the widest layer and each layer reads a contiguous prefix), its own RoPE table and
  rotary share, scores scaled by query_pre_attn_scalar ** -0.5, then each head's output times
  sigmoid of its gate before o_proj.
- the clamped SwiGLUs of the routed experts, shared expert and dense MLPs are the base decoder's
  (GpuDecoder._limit: the config's limits / shared_limits, 0 a layer without).
Legend: T = tokens, H = hidden, D = head dim, Hq = a layer's query heads, Hkv = KV heads.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda

from engine.gpu import Buffers, GpuDecoder, _partials
from engine.gpu import dense_keys as _base_dense_keys
from engine.gpu import pick_prefill_chunk as _base_pick_prefill_chunk
from engine.gpu import run_state_bytes as _base_run_state_bytes
from kernels_numba import gpu_attention as ga
from kernels_numba import gpu_deltanet as gdn
from kernels_numba import gpu_dense as gd

PARTS = ("q", "k", "v", "g")   # row ranges of the fused "qkvg" weight


def _widest(c):
    """c with n_heads the most query heads of any layer (what the buffers hold)."""
    return dataclasses.replace(c, n_heads=max(c.layer_heads))


class StepWeights:
    """weight(key, layer) -> host array in the layout the CUDA decoder reads."""

    def __init__(self, c, weight):
        self.c, self.raw = c, weight

    def __call__(self, key: str, layer: int | None = None, *rest) -> np.ndarray:
        if key == "qkvg":
            return np.concatenate([np.asarray(self.raw(k, layer)) for k in PARTS])
        return self.raw(key, layer, *rest)


def run_state_bytes(c, t: int, max_context: int) -> int:
    """GpuDecoder's activations for t tokens at the widest layer, plus the gates (StepBuffers)."""
    w = _widest(c)
    return _base_run_state_bytes(w, t, max_context) + 4 * (t * w.n_heads + w.q_dim + 2 * c.kv_dim + w.n_heads)


def pick_prefill_chunk(c, max_context: int, vram_bytes: float, share: float = 0.15) -> int:
    return _base_pick_prefill_chunk(c, max_context, vram_bytes, share, run_state_bytes)


class StepBuffers(Buffers):
    """GpuDecoder's activations at the widest layer, plus the heads' gates."""

    def __init__(self, c, t: int, s_max: int):
        w = _widest(c)
        super().__init__(w, t, s_max)
        self.gate = cuda.device_array((t, w.n_heads), np.float32)                       # [T, Hq]
        self.qkvg = cuda.device_array(w.q_dim + 2 * w.kv_dim + w.n_heads, np.float32)   # one token's


def _rows(a, t: int, n: int):
    """The first t rows of n values of buffer a, contiguous ([T, n] for a layer narrower than a)."""
    return a.reshape(-1)[:t * n].reshape(t, n)


class GpuStepDecoder(GpuDecoder):
    fuse_qkv = False   # q | k | v | g are fused here, a layer's heads apart
    buffers_cls = StepBuffers

    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, StepWeights(c, weight), *args, **kw)
        self.freqs = [cuda.to_device(r.inv_freq()) for r in c.layer_ropes]
        self._parts = []
        for hq in c.layer_heads:
            ends = np.cumsum([hq * c.head_dim, c.kv_dim, c.kv_dim, hq])
            self._parts.append(dict(zip(PARTS, zip(np.r_[0, ends[:-1]], ends))))

    @staticmethod
    def dense_keys(c) -> list:
        return _base_dense_keys(c, attn=("qkvg", "o", "q_norm", "k_norm"))   # StepWeights' keys

    def w(self, key: str, layer: int | None = None):
        if key in PARTS:
            r0, r1 = self._parts[layer][key]
            return super().w("qkvg", layer)[int(r0):int(r1)]
        return super().w(key, layer)

    def _attention(self, l, b, t, st):
        c, cs = self.c, self.cs
        hq, d, kv = c.layer_heads[l], c.head_dim, c.kv_dim
        x = b.x[:t]
        if t == 1:   # attn_norm fused into the projection; q, k, v, g consecutive in b.qkvg
            y = b.qkvg[:hq * d + 2 * kv + hq]
            gd.linear(self.w("qkvg", l), x, y.reshape(1, -1), cs,
                      norm=(self.w("attn_norm", l), c.rms_eps, 0.0, None))
            q, k, v, gate = (y[int(r0):int(r1)].reshape(1, -1) for r0, r1 in self._parts[l].values())
        else:
            h = b.h[:t]
            gd.rmsnorm(x, self.w("attn_norm", l), c.rms_eps, h, cs)
            q, k, v, gate = _rows(b.q, t, hq * d), b.k[:t], b.v[:t], _rows(b.gate, t, hq)
            for key, out in zip(PARTS, (q, k, v, gate)):
                self._linear(self.w(key, l), h, out)
        q3 = q.reshape(t, hq, d)
        k3 = k.reshape(t, c.n_kv_heads, d)
        v3 = v.reshape(t, c.n_kv_heads, d)
        pos = b.pos[:t]
        gd.qk_norm_rope(q3, k3, self.w("q_norm", l), self.w("k_norm", l), c.rms_eps, pos,
                        self.freqs[l], c.layer_ropes[l].attention_factor, cs,
                        cache=(v3, st.k[l], st.v[l]))
        att = _rows(b.att, t, hq * d)
        ga.attention(q3, st.k[l], st.v[l], pos, c.attn_scale, att.reshape(t, hq, d),
                     _partials(b.partials, t, hq), cs, c.layer_windows[l])
        gdn.sigmoid_gate(att, gate, cs)
        self._linear_add(self.w("o", l), att, b.o[:t], x)
