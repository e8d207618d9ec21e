"""The CUDA decoder of FlexOlmo (flex_olmo): PostNormDecoder with OLMo-2's norm placement. Same math as
engine/models/flex_olmo.py (the CPU backend).

What changes against PostNormDecoder (whose outputs are normed before their adds, MoE layers
through their own buffer):
- nothing is normed before attention or the MLP, so the buffers' "normed input" b.h is the
  residual stream b.x itself (no copy: q / k / v, the router and the experts read x).
Legend: T = tokens, H = hidden.
"""
from __future__ import annotations


from engine.gpu import PostNormBuffers, PostNormDecoder, pick_prefill_chunk  # noqa: F401
from engine.gpu import dense_keys as _base_dense_keys
from engine.gpu import run_state_bytes as _base_run_state_bytes
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_misc as gm


def run_state_bytes(c, t: int, max_context: int) -> int:
    """GpuDecoder's activations for t tokens plus the MoE output (FlexOlmoBuffers)."""
    return _base_run_state_bytes(c, t, max_context) + 4 * t * c.hidden


class FlexOlmoBuffers(PostNormBuffers):
    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        self.h = self.x                                            # the layers' input is x, unnormed


class GpuFlexOlmoDecoder(PostNormDecoder):
    buffers_cls = FlexOlmoBuffers

    @staticmethod
    def dense_keys(c) -> list:
        keys = _base_dense_keys(c, extra_per_layer=("post_attn_norm", "post_mlp_norm"))
        return [k for k in keys if k[0] not in ("attn_norm", "mlp_norm")]   # nothing normed before

    def _qkv(self, l, b, t, fuse_norm: bool = True):
        c, x = self.c, b.x[:t]
        if t == 1 and self.fuse_qkv:   # q, k, v of one token are consecutive ranges of b.qkv
            gd.linear(self.w("qkv", l), x, b.qkv.reshape(1, -1), self.cs)
            return (b.qkv[:c.q_dim].reshape(1, c.q_dim),
                    b.qkv[c.q_dim:c.q_dim + c.kv_dim].reshape(1, c.kv_dim),
                    b.qkv[c.q_dim + c.kv_dim:].reshape(1, c.kv_dim))
        q, k, v = b.q[:t], b.k[:t], b.v[:t]
        for key, y in (("q", q), ("k", k), ("v", v)):
            self._linear(self.w(key, l), x, y)
        return q, k, v

    def _mlp_in(self, l, b, t):
        return b.x[:t]

    def _norm_router(self, l, b, t):
        """The router on x itself (no norm to fuse into its matvec); b.mo zeroed."""
        self._linear(self.w("router", l), b.x[:t], b.rl[:t])
        gm.zero(b.mo[:t].reshape(-1), self.cs)
