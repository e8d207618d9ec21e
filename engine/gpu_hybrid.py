"""The CUDA decoder of the hybrid families (Qwen3-Next, Qwen3.5-MoE): GpuDecoder with a token
mixer per layer (Gated DeltaNet or gated attention), zero-centred RMSNorms and a sigmoid-gated
shared expert beside the routed experts. Same math as engine/models/hybrid.py (the CPU backend).

What changes against GpuDecoder, and why it keeps its decode step (graphs, streaming) as is:
- weights: the derived layouts are made once at upload (HybridWeights): norms as (1 + w) in
  float32; the DeltaNet input projections as one [q | k | v | z] matrix and one [b | a] matrix
  (Qwen3-Next's per-key-head grouping undone by permuting rows, Qwen3.5's four matrices stacked),
  so no column gather runs per token; the attention's query and gate rows split apart and stacked
  with k and v as one [q | gate | k | v] matrix (one launch projects a decode token);
  conv taps as [C, Kc]; -exp(A_log).
- run state: KV cache only for the full-attention layers; conv state [Ll, Kc-1, C] and the
  recurrent state [Ll, Nv, Dk, Dv] float32, zeroed per request (no allocation): RecurrentDecoder,
  which engine/gpu_granite_hybrid.py's Mamba-2 layers share.
- the gated delta rule: the token scan at decode (graph-captured) and for short prefill chunks,
  the chunked kernel for prefill chunks of chunked_min_t tokens and more (the same recurrence).
- the shared expert is the base decoder's (GpuDecoder._shared_expert, gated: shared_gated).
- graph capture runs every segment once for real: the recurrent state is saved before and put
  back after (RecurrentDecoder._capture), since unlike the KV cache it has no unused row to
  absorb the warm-up.
Legend: T = tokens, H = hidden, D = attention head dim, Hq / Hkv = attention heads,
Nk / Nv = DeltaNet key / value heads, Dk / Dv = their head dims, C = conv channels
(2 Nk Dk + Nv Dv), Kc = conv width, Is = shared expert intermediate, S = cached positions.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from engine.gpu import Buffers, GpuDecoder, GpuRunState, _partials
from engine.gpu import dense_keys as _base_dense_keys
from engine.gpu import run_state_bytes as _base_run_state_bytes
from engine.gpu import pick_prefill_chunk as _base_pick_prefill_chunk
from engine.models.hybrid import FULL, LINEAR, qkvz_order
from kernels_numba import gpu_attention as ga
from kernels_numba import gpu_deltanet as gdn
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm

NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")   # zero-centred: weight 1 + w
ATTN_PARTS = ("attn_q", "attn_gate", "k", "v")   # row ranges of the fused "attn_qgkv" weight


def _f32(a) -> np.ndarray:
    """A small weight as float32 (bf16 bits widened)."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return (np.ascontiguousarray(a).astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


class HybridWeights:
    """weight(key, layer) -> host array in the layout the CUDA hybrid decoder reads; keys not
    derived here pass through to the engine's weights unchanged."""

    def __init__(self, c, weight):
        self.c, self.raw = c, weight
        if c.fused_qkvz:
            self.qkvz_rows, self.ba_rows = qkvz_order(c)
        d, hq = c.head_dim, c.n_heads
        q = (np.arange(hq)[:, None] * 2 * d + np.arange(d)).ravel()   # per head: D query rows, D gate rows
        self.q_rows, self.gate_rows = q, q + d

    def __call__(self, key: str, layer: int | None = None) -> np.ndarray:
        c, raw = self.c, self.raw
        if key in NORMS:
            return np.float32(1.0) + _f32(raw(key, layer))
        if key == "attn_qgkv":                                      # [2 Hq D + 2 Hkv D, H]
            qg = np.asarray(raw("q", layer))
            return np.concatenate([qg[self.q_rows], qg[self.gate_rows], np.asarray(raw("k", layer)),
                                   np.asarray(raw("v", layer))])
        if key == "dn_qkvz":                                        # [C + Nv Dv, H]: q | k | v | z
            if c.fused_qkvz:
                return np.asarray(raw("dn_qkvz", layer))[self.qkvz_rows]
            return np.concatenate([np.asarray(raw("dn_qkv", layer)), np.asarray(raw("dn_z", layer))])
        if key == "dn_ba":                                          # [2 Nv, H]: b | a
            if c.fused_qkvz:
                return np.asarray(raw("dn_ba", layer))[self.ba_rows]
            return np.concatenate([np.asarray(raw("dn_b", layer)), np.asarray(raw("dn_a", layer))])
        if key == "dn_conv":                                        # [C, Kc]
            return _f32(raw("dn_conv", layer)).reshape(c.conv_dim, c.conv_kernel)
        if key == "dn_neg_a":                                       # [Nv] = -exp(A_log)
            return -np.exp(_f32(raw("dn_A_log", layer)))
        if key in ("dn_dt_bias", "dn_norm"):
            return _f32(raw(key, layer))
        return raw(key, layer)


def state_bytes(c, max_context: int, kv_itemsize: int = 4) -> int:
    """Device bytes of a sequence's state (GpuHybridState): KV cache of the full-attention layers
    (kv_itemsize bytes a value), float32 conv and recurrent state of the linear ones (DeltaNet's,
    or another recurrent mixer's: c.ssm_shape)."""
    ll = len(c.linear_layers)
    return (kv_itemsize * 2 * len(c.full_layers) * max_context * c.kv_dim
            + 4 * ll * ((c.conv_kernel - 1) * c.conv_dim + int(np.prod(c.ssm_shape))))


def run_state_bytes(c, t: int, max_context: int) -> int:
    """GpuDecoder's activations for t tokens plus the hybrid ones (HybridBuffers)."""
    extra = c.q_dim + 2 * c.lin_v_heads + 2 * c.value_dim + c.conv_dim   # (shared: base)
    return _base_run_state_bytes(c, t, max_context) + 4 * (t * extra + 2 * c.q_dim + 2 * c.kv_dim)


def pick_prefill_chunk(c, max_context: int, vram_bytes: float, share: float = 0.15) -> int:
    """The largest prefill chunk whose run state (the hybrid one) fits a share of the VRAM."""
    return _base_pick_prefill_chunk(c, max_context, vram_bytes, share, run_state_bytes)


class HybridBuffers(Buffers):
    """GpuDecoder's activations plus the hybrid layers' (float32)."""

    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        f = np.float32
        self.gate = cuda.device_array((t, c.q_dim), f)                      # attention gate [T, Hq D]
        self.qgkv = cuda.device_array(2 * c.q_dim + 2 * c.kv_dim, f)       # one token's q | gate | k | v
        if c.linear_layers:
            self.qkvz = cuda.device_array((t, c.conv_dim + c.value_dim), f)  # [T, C + Nv Dv]
            self.ba = cuda.device_array((t, 2 * c.lin_v_heads), f)           # [T, 2 Nv]
            self.dn = cuda.device_array((t, c.value_dim), f)                 # [T, Nv Dv]


class GpuHybridState:
    """k, v: per full-attention layer [S_max, Hkv, D] (kv_dtype: float32 or uint16 bf16 bits);
    conv [Ll, Kc-1, C]; ssm [Ll, *c.ssm_shape] float32 (DeltaNet's [Nv, Dk, Dv], Mamba-2's
    [Hm, P, N])."""

    def __init__(self, c, max_context: int, kv_dtype=np.float32):
        self.max_context = max_context
        s, f = max_context, np.float32
        self.k = [cuda.device_array((s, c.n_kv_heads, c.head_dim), kv_dtype) for _ in c.full_layers]
        self.v = [cuda.device_array((s, c.n_kv_heads, c.head_dim), kv_dtype) for _ in c.full_layers]
        ll = max(len(c.linear_layers), 1)
        self.conv = cuda.device_array((ll, c.conv_kernel - 1, c.conv_dim), f)
        self.ssm = cuda.device_array((ll, *c.ssm_shape), f)
        self.pos = 0

    def save_nbytes(self, keep: int) -> int:
        return GpuRunState.save_nbytes(self, keep) + self.conv.nbytes + self.ssm.nbytes

    def save(self, keep: int, stream) -> dict:
        """GpuRunState.save and the recurrent state, which is at pos: keep must be pos."""
        conv, ssm = self.conv.copy_to_host(stream=stream), self.ssm.copy_to_host(stream=stream)
        return dict(GpuRunState.save(self, keep, stream), conv=conv, ssm=ssm)

    def load(self, saved: dict, keep: int, stream) -> None:
        GpuRunState.load(self, saved, keep, stream)
        self.conv.copy_to_device(saved["conv"], stream=stream)
        self.ssm.copy_to_device(saved["ssm"], stream=stream)


class RecurrentDecoder(GpuDecoder):
    """GpuDecoder over a stack of attention layers and linear ones with a conv and a recurrent
    state (c.full_layers, c.linear_layers): the run state is GpuHybridState, a layer's part of
    it its slot (self.slot: its index among the layers of its kind), the conv and recurrent
    state zeroed per request and put back around graph capture. The hybrids' decoders
    (GpuHybridDecoder, gpu_granite_hybrid's) run their linear layers' mixers on it."""
    pipelines = False         # an extra token would advance the recurrent state past st.pos
    rewinds = False           # the recurrent state holds every position up to st.pos
    state_cls = GpuHybridState

    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, weight, *args, **kw)
        # each layer's index in the state of its kind
        self.slot = {l: i for kind in (c.full_layers, c.linear_layers) for i, l in enumerate(kind)}

    def _cache(self, l, st) -> tuple:
        s = self.slot[l]
        return st.k[s], st.v[s]

    def new_state(self, max_context: int):
        st = super().new_state(max_context)
        gm.zero(st.conv.reshape(-1), self.cs)
        gm.zero(st.ssm.reshape(-1), self.cs)
        return st

    def _capture(self, st):
        """GpuDecoder._capture, whose warm-up runs every segment once for real: the recurrent
        state is saved before and put back after, since unlike the KV cache it has no unused
        row to absorb the warm-up."""
        cs = self.cs
        saved = [(a, cuda.device_array_like(a)) for a in (st.conv, st.ssm)]
        for a, keep in saved:
            keep.copy_to_device(a, stream=cs)
        super()._capture(st)
        for a, keep in saved:
            a.copy_to_device(keep, stream=cs)
        cs.synchronize()


class GpuHybridDecoder(RecurrentDecoder):
    fuse_qkv = False          # the attention projections are fused here, with the gate rows
    buffers_cls = HybridBuffers

    @staticmethod
    def dense_keys(c) -> list:   # HybridWeights' keys
        return _base_dense_keys(c, attn=lambda l: (
            ("attn_qgkv", "o", "q_norm", "k_norm") if c.layer_types[l] == FULL else
            ("dn_qkvz", "dn_ba", "dn_conv", "dn_neg_a", "dn_dt_bias", "dn_norm", "dn_out")))

    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, HybridWeights(c, weight), *args, **kw)
        # prefill chunks of this many tokens or more run the chunked delta rule, shorter ones and
        # decode (T = 1, the captured graphs) the token scan; None: Dk too large for its shared arrays
        self.chunked_min_t = gdn.CH_MIN_T if c.lin_k_dim <= gdn.CH_DK else None
        qd, kv = c.q_dim, c.kv_dim
        self._attn_rows = dict(zip(ATTN_PARTS, ((0, qd), (qd, 2 * qd), (2 * qd, 2 * qd + kv),
                                                (2 * qd + kv, 2 * qd + 2 * kv))))

    def w(self, key: str, layer: int | None = None):
        r = self._attn_rows.get(key)
        if r is not None:
            return super().w("attn_qgkv", layer)[r[0]:r[1]]
        return super().w(key, layer)

    # ---- token mixers ----------------------------------------------------------------------

    def _attention(self, l, b, t, st):
        if self.c.layer_types[l] == LINEAR:
            self._deltanet(l, b, t, st)
        else:
            self._gated_attention(l, b, t, st)

    def _gated_attention(self, l, b, t, st):
        """Per-head q/k RMSNorm (1 + w), partial RoPE (inv_freq covers the rotary dims only),
        causal attention over the cache, sigmoid output gate, o projection, residual."""
        c, cs = self.c, self.cs
        d, qd, kv = c.head_dim, c.q_dim, c.kv_dim
        x, h = b.x[:t], b.h[:t]
        gd.rmsnorm(x, self.w("attn_norm", l), c.rms_eps, h, cs)
        if t == 1:   # one launch: q, gate, k, v are consecutive ranges of b.qgkv
            self._linear(self.w("attn_qgkv", l), h, b.qgkv.reshape(1, -1))
            q = b.qgkv[:qd].reshape(1, qd)
            gate = b.qgkv[qd:2 * qd].reshape(1, qd)
            k = b.qgkv[2 * qd:2 * qd + kv].reshape(1, kv)
            v = b.qgkv[2 * qd + kv:].reshape(1, kv)
        else:
            q, gate, k, v = b.q[:t], b.gate[:t], b.k[:t], b.v[:t]
            for key, y in zip(ATTN_PARTS, (q, gate, k, v)):
                self._linear(self.w(key, l), h, y)
        q3 = q.reshape(t, c.n_heads, d)
        k3 = k.reshape(t, c.n_kv_heads, d)
        v3 = v.reshape(t, c.n_kv_heads, d)
        pos = b.pos[:t]
        # norms are stored as 1 + w already; rope covers the rotary dims of inv_freq only
        kc, vc = self._cache(l, st)
        gd.qk_norm_rope(q3, k3, self.w("q_norm", l), self.w("k_norm", l), c.rms_eps, pos,
                        self.inv_freq, c.rope.attention_factor, cs, cache=(v3, kc, vc))
        att = b.att[:t]
        ga.attention(q3, kc, vc, pos, d ** -0.5, att.reshape(t, c.n_heads, d),
                     _partials(b.partials, t, c.n_heads), cs)
        gdn.sigmoid_gate(att, gate, cs)
        self._linear_add(self.w("o", l), att, b.o[:t], x)

    def _deltanet(self, l, b, t, st):
        """Fused input projections, causal conv (in place, rolling state), gated delta rule
        (gates folded in, recurrent state in place; chunked from chunked_min_t tokens), gated
        RMSNorm, out projection, residual."""
        c, cs = self.c, self.cs
        x, h = b.x[:t], b.h[:t]
        gd.rmsnorm(x, self.w("attn_norm", l), c.rms_eps, h, cs)
        qkvz, ba, o = b.qkvz[:t], b.ba[:t], b.dn[:t]
        self._linear(self.w("dn_qkvz", l), h, qkvz)
        self._linear(self.w("dn_ba", l), h, ba)
        qkv, z = qkvz[:, :c.conv_dim], qkvz[:, c.conv_dim:]      # column views [T, C], [T, Nv Dv]
        s = self.slot[l]
        gdn.conv1d_silu(qkv, self.w("dn_conv", l), st.conv[s], qkv, cs)
        chunked = self.chunked_min_t is not None and t >= self.chunked_min_t
        rule = gdn.delta_rule_chunked if chunked else gdn.delta_rule
        rule(qkv, ba, self.w("dn_neg_a", l), self.w("dn_dt_bias", l), c.lin_k_heads, st.ssm[s], o, cs)
        gdn.rmsnorm_gated(o, z, self.w("dn_norm", l), c.rms_eps, o, cs)
        self._linear(self.w("dn_out", l), o, b.o[:t])
        gd.add(x.reshape(-1), b.o[:t].reshape(-1), x.reshape(-1), cs)
