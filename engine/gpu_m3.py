"""The CUDA decoder of MiniMax-M3 (minimax_m3_vl's language model): GpuDecoder with (1 + w)
norms and gpt-oss's clamped SwiGLU without biases in every MLP. Same math as
engine/models/minimax_m3.py (the CPU backend).

What changes against GpuDecoder:
- weights: none of its own; the RMSNorms' weights come as (1 + w) in float32 from
  minimax_m3.dense_view (at load, for both backends).
- every MLP (routed experts, the shared expert, dense layers) clamped: _limit gives
  swiglu_limit, swiglu_alpha the form (gx.limited_swiglu / gm.silu_mul).
- the sparse layers run dense attention, which is their attention exactly while a query has at
  most index_topk_blocks blocks of keys: the context is capped at index_topk_blocks *
  index_block_size (engine/runtime.py context_length) and the indexer is not uploaded.
"""
from __future__ import annotations

from engine.gpu import GpuDecoder, pick_prefill_chunk, run_state_bytes  # noqa: F401


class GpuM3Decoder(GpuDecoder):
    def __init__(self, c, *args, **kw):
        super().__init__(c, *args, **kw)
        self.swiglu_alpha = float(c.swiglu_alpha)

    def _limit(self, l, shared: bool = False) -> float:
        return float(self.c.swiglu_limit)
