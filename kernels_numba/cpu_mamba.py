"""CPU kernels of the Mamba-2 mixer (Nemotron-H's "M" layers), and MambaOps over them.

Legend: T = tokens, Hm = Mamba heads, P = head dim, G = B / C groups (head h reads group
h // (Hm / G)), N = state size, C = conv channels (x, B, C: Hm P + 2 G N), Kc = conv width,
R = rows, W = row length.
All arrays are float32; the recurrent state is float32 [Hm, P, N] per layer and is updated in place.
The numpy oracle of every kernel is in reference.py (causal_conv1d_silu with its bias,
mamba2_scan, rmsnorm_group_gated).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def conv1d_bias_silu(x, w, bias, state, out):
    """Causal depthwise conv1d plus bias, then SiLU, over a rolling window; state updated in place.

    x [T, C]; w [C, Kc]; bias [C] (zeros where the conv has none); state [Kc-1, C] the previous
    Kc-1 inputs, oldest first -> out [T, C] = silu(bias[c] + sum_j w[c, j] xe[t + j, c]),
    xe = concat(state, x) in time.
    """
    t_len, c_len = x.shape
    kc = w.shape[1]
    ks = kc - 1
    for c in prange(c_len):
        for t in range(t_len):
            acc = bias[c]
            for j in range(kc):
                i = t + j
                xv = state[i, c] if i < ks else x[i - ks, c]
                acc += w[c, j] * xv
            out[t, c] = acc / (np.float32(1.0) + np.float32(math.exp(-acc)))
        for i in range(ks):                     # new state row i = xe row t_len + i (read before written)
            src = t_len + i
            state[i, c] = state[src, c] if src < ks else x[src - ks, c]


@njit(parallel=True, cache=True)
def mamba2_scan(x, dt, b, c, neg_a, dt_bias, d, dt_min, dt_max, state, out):
    """The selective scan, token by token (prefill runs it over the whole chunk in one call).

    x [T, Hm, P]; dt [T, Hm] (before bias and softplus); b, c [T, G, N]; neg_a = -exp(A_log),
    dt_bias, d [Hm]; state [Hm, P, N] -> out [T, Hm, P]. Per token and head:
    dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max), state = state exp(dt' neg_a)
    + dt' x B^T, out = state C + d x. softplus passes x through above 20, as torch does.
    """
    t_len, hm, p = x.shape
    n = state.shape[2]
    per = hm // b.shape[1]
    for h in prange(hm):
        g = h // per
        for t in range(t_len):
            z = dt[t, h] + dt_bias[h]
            s = z if z > 20.0 else np.float32(math.log1p(math.exp(z)))
            s = min(max(s, dt_min), dt_max)
            decay = np.float32(math.exp(s * neg_a[h]))
            for i in range(p):
                xs = s * x[t, h, i]
                acc = np.float32(0.0)
                for j in range(n):
                    v = state[h, i, j] * decay + xs * b[t, g, j]
                    state[h, i, j] = v
                    acc += v * c[t, g, j]
                out[t, h, i] = acc + d[h] * x[t, h, i]


@njit(parallel=True, cache=True)
def rmsnorm_group_gated(x, z, w, group, eps, out):
    """x, z [R, W]; w [W] -> out = w * norm(x * silu(z)), the RMS norm taken over each run of
    `group` columns (gate first, then the norm: Nemotron-H's gated norm)."""
    r, width = x.shape
    for i in prange(r):
        y = np.empty(width, dtype=np.float32)
        for j in range(width):
            zz = z[i, j]
            y[j] = x[i, j] * (zz / (np.float32(1.0) + np.float32(math.exp(-zz))))
        for g0 in range(0, width, group):
            ss = np.float32(0.0)
            for j in range(g0, g0 + group):
                ss += y[j] * y[j]
            inv = np.float32(1.0 / math.sqrt(ss / group + eps))
            for j in range(g0, g0 + group):
                out[i, j] = w[j] * (y[j] * inv)


class MambaOps:
    """The Mamba-2 mixer's ops on the CPU backend (CpuOps.mamba). Float32 numpy arrays."""

    def conv1d_silu(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray, state: np.ndarray) -> np.ndarray:
        """x [T, C], w [C, Kc], bias [C], state [Kc-1, C] (updated) -> [T, C]."""
        out = np.empty(x.shape, dtype=np.float32)
        conv1d_bias_silu(np.ascontiguousarray(x), w, bias, state, out)
        return out

    def scan(self, x, dt, b, c, neg_a, dt_bias, d, dt_limit, state) -> np.ndarray:
        """x [T, Hm, P], dt [T, Hm], b, c [T, G, N], state [Hm, P, N] (updated) -> [T, Hm, P]."""
        args = [np.ascontiguousarray(a, dtype=np.float32) for a in (x, dt, b, c)]
        out = np.empty(x.shape, dtype=np.float32)
        mamba2_scan(*args, neg_a, dt_bias, d, np.float32(dt_limit[0]), np.float32(dt_limit[1]), state, out)
        return out

    def rmsnorm_group_gated(self, x: np.ndarray, z: np.ndarray, w: np.ndarray, group: int,
                            eps: float) -> np.ndarray:
        """x, z [R, W] -> w * norm(x * silu(z)) over runs of group columns, [R, W]."""
        out = np.empty(x.shape, dtype=np.float32)
        rmsnorm_group_gated(np.ascontiguousarray(x), np.ascontiguousarray(z), w, group, np.float32(eps), out)
        return out
