"""The CUDA decoder of MiniMax-M3 (minimax_m3_vl's language model): GpuDecoder with (1 + w)
norms and gpt-oss's clamped SwiGLU without biases in every MLP. Same math as
engine/models/minimax_m3.py (the CPU backend).

What changes against GpuDecoder:
- weights: the RMSNorms (the layers', the per-head q / k norms, the final one) as (1 + w) in
  float32, made once at upload (M3Weights).
- every MLP (routed experts, the shared expert, dense layers) clamped: _limit gives
  swiglu_limit, swiglu_alpha the form (gx.limited_swiglu / gm.silu_mul).
- the sparse layers run dense attention, which is their attention exactly while a query has at
  most index_topk_blocks blocks of keys: the context is capped at index_topk_blocks *
  index_block_size (engine/runtime.py context_length) and the indexer is not uploaded.
"""
from __future__ import annotations

import numpy as np

from engine.gpu import GpuDecoder, as_f32, pick_prefill_chunk, run_state_bytes  # noqa: F401
from engine.models.minimax_m3 import NORMS


class M3Weights:
    """weight(key, layer) -> host array: the checkpoint's, the norms as 1 + w."""

    def __init__(self, weight):
        self.raw = weight

    def __call__(self, key: str, layer: int | None = None, *rest) -> np.ndarray:
        if key in NORMS:
            return np.float32(1.0) + as_f32(self.raw(key, layer))
        return self.raw(key, layer, *rest)


class GpuM3Decoder(GpuDecoder):
    def __init__(self, c, weight, *args, **kw):
        super().__init__(c, M3Weights(weight), *args, **kw)
        self.swiglu_alpha = float(c.swiglu_alpha)

    def _limit(self, l, shared: bool = False) -> float:
        return float(self.c.swiglu_limit)
