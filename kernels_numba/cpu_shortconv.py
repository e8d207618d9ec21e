"""CPU kernel of LFM2's gated short convolution (lfm2_moe's "conv" layers), and ShortConvOps over it.

Legend: T = tokens, H = hidden (the conv's channels), Kc = conv width (conv_L_cache).
All arrays are float32; the conv state is float32 [Kc-1, H] per layer and is updated in place.
The numpy oracle is reference.gated_short_conv. The hybrids' causal conv kernels
(cpu_deltanet.conv1d_silu, cpu_mamba.conv1d_bias_silu) do not compute this: theirs end in a SiLU,
LFM2's has no activation and is gated on both sides (B times its input, C times its output).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def gated_short_conv(bcx, w, bias, state, out):
    """LFM2's short conv over in_proj's output, the conv state updated in place.

    bcx [T, 3H] (B | C | x, H columns each); w [H, Kc]; bias [H] (zeros where the conv has none);
    state [Kc-1, H] the previous Kc-1 conv inputs, oldest first (zeros at start)
    -> out [T, H]: out[t, c] = C[t, c] (bias[c] + sum_j w[c, j] u[t + j, c]), u = concat(state,
    B * x) in time; the state becomes u's last Kc-1 rows.
    """
    t_len = bcx.shape[0]
    h, kc = w.shape
    ks = kc - 1
    for c in prange(h):
        for t in range(t_len):
            acc = bias[c]
            for j in range(kc):
                i = t + j                       # row of u
                u = state[i, c] if i < ks else bcx[i - ks, c] * bcx[i - ks, 2 * h + c]
                acc += w[c, j] * u
            out[t, c] = bcx[t, h + c] * acc
        for i in range(ks):                     # new state row i = u row t_len + i (read before written)
            src = t_len + i
            state[i, c] = state[src, c] if src < ks else bcx[src - ks, c] * bcx[src - ks, 2 * h + c]


class ShortConvOps:
    """LFM2's gated short conv on the CPU backend (CpuOps.shortconv). Float32 numpy arrays."""

    def gated_conv(self, bcx: np.ndarray, w: np.ndarray, bias: np.ndarray, state: np.ndarray) -> np.ndarray:
        """bcx [T, 3H], w [H, Kc], bias [H], state [Kc-1, H] (updated) -> [T, H]."""
        out = np.empty((bcx.shape[0], w.shape[0]), dtype=np.float32)
        gated_short_conv(np.ascontiguousarray(bcx, dtype=np.float32), w, bias, state, out)
        return out
