"""CPU kernels of the hybrid (Gated DeltaNet or Kimi Delta Attention + attention) families, and DeltaNetOps over them.

Legend: T = tokens, Nk / Nv = DeltaNet key / value heads (value head h reads key head h // (Nv/Nk)),
Dk / Dv = their head dims, C = conv channels (q, k, v of every head: 2 Nk Dk + Nv Dv),
Kc = conv kernel width, R = rows, N = row length, G = gate groups per row.
All arrays are float32; the recurrent state is float32 [Nv, Dk, Dv] per layer and is updated in place.
The numpy oracle of every kernel is in reference.py (causal_conv1d_silu, deltanet_gates,
gated_delta_rule, rmsnorm_gated, sigmoid_gate); Kimi Delta Attention's (kda_*) is gated_delta_rule
with a decay a key channel.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

CHUNK = 64          # prefill chunk of the gated delta rule (the reference's chunk_size)
L2_EPS = 1e-6       # q/k L2 normalization: x / sqrt(sum x^2 + eps), as the FLA library does


@njit(parallel=True, cache=True)
def conv1d_silu(x, w, state, out):
    """Causal depthwise conv1d + SiLU over a rolling window, state updated in place.

    x [T, C]; w [C, Kc]; state [Kc-1, C] the previous Kc-1 inputs, oldest first (zeros at start)
    -> out [T, C]: out[t, c] = silu(sum_j w[c, j] * xe[t + j, c]), xe = concat(state, x) in time.
    """
    t_len, c_len = x.shape
    kc = w.shape[1]
    ks = kc - 1
    for c in prange(c_len):
        for t in range(t_len):
            acc = np.float32(0.0)
            for j in range(kc):
                i = t + j                       # row of xe
                xv = state[i, c] if i < ks else x[i - ks, c]
                acc += w[c, j] * xv
            out[t, c] = acc / (np.float32(1.0) + np.float32(math.exp(-acc)))
        for i in range(ks):                     # new state row i = xe row t_len + i (read before written)
            src = t_len + i
            state[i, c] = state[src, c] if src < ks else x[src - ks, c]


@njit(parallel=True, cache=True)
def deltanet_gates(b, a, neg_a, dt_bias, beta, g):
    """b [T, Nv]; a [T, N]; neg_a = -exp(A_log), dt_bias [N]
    -> beta = sigmoid(b) [T, Nv], g = neg_a * softplus(a + dt_bias) [T, N].

    g is the log decay of the state per token (<= 0): N = Nv decays (Gated DeltaNet, one a head)
    or Nv Dk (KDA, one a key channel). softplus passes x through above 20, as torch does.
    """
    t_len, nv = b.shape
    n = a.shape[1]
    for t in prange(t_len):
        for h in range(nv):
            beta[t, h] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-b[t, h])))
        for j in range(n):
            z = a[t, j] + dt_bias[j]
            sp = z if z > 20.0 else np.float32(math.log1p(math.exp(z)))
            g[t, j] = neg_a[j] * sp


@njit(inline="always")
def _l2n(src, dst, scale):
    """dst = src / sqrt(sum src^2 + eps) * scale (one head vector)."""
    ss = np.float32(0.0)
    for i in range(src.shape[0]):
        ss += src[i] * src[i]
    inv = np.float32(1.0 / math.sqrt(ss + L2_EPS)) * scale
    for i in range(src.shape[0]):
        dst[i] = src[i] * inv


@njit(parallel=True, cache=True)
def gated_delta_recurrent(q, k, v, g, beta, state, out):
    """The gated delta rule token by token (decode).

    q, k [T, Nk, Dk] (raw: L2-normalized here, q also scaled by Dk^-0.5); v [T, Nv, Dv];
    g, beta [T, Nv]; state [Nv, Dk, Dv] in/out -> out [T, Nv, Dv]. Per token and value head:
    S *= exp(g); S += k (x) beta (v - k^T S); o = q^T S.
    """
    t_len, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    rep = nv // nk
    scale = np.float32(1.0 / math.sqrt(dk))
    for h in prange(nv):
        kh = h // rep
        s = state[h]
        qn = np.empty(dk, dtype=np.float32)
        kn = np.empty(dk, dtype=np.float32)
        delta = np.empty(dv, dtype=np.float32)
        for t in range(t_len):
            _l2n(q[t, kh], qn, scale)
            _l2n(k[t, kh], kn, np.float32(1.0))
            decay = np.float32(math.exp(g[t, h]))
            bt = beta[t, h]
            for j in range(dv):
                delta[j] = 0.0
            for i in range(dk):
                for j in range(dv):
                    s[i, j] *= decay
                    delta[j] += s[i, j] * kn[i]
            for j in range(dv):
                delta[j] = (v[t, h, j] - delta[j]) * bt
            for j in range(dv):
                out[t, h, j] = 0.0
            for i in range(dk):
                for j in range(dv):
                    s[i, j] += kn[i] * delta[j]
                    out[t, h, j] += s[i, j] * qn[i]


@njit(parallel=True, cache=True)
def gated_delta_chunked(q, k, v, g, beta, state, out, chunk):
    """The gated delta rule over chunks of `chunk` tokens (prefill); same contract as the recurrent form.

    Within a chunk (n tokens, cumulative log decay c_i): the UT transform solves
    (I + strictly_lower(beta_i k_i.k_j e^(c_i - c_j))) [U | W] = [beta v | beta k e^c] by forward
    substitution; then v' = U - W S, o_i = e^(c_i) q_i S + sum_(j<=i) q_i.k_j e^(c_i - c_j) v'_j,
    S = e^(c_n) S + sum_i e^(c_n - c_i) k_i (x) v'_i.
    """
    t_len, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    rep = nv // nk
    scale = np.float32(1.0 / math.sqrt(dk))
    for h in prange(nv):
        kh = h // rep
        s = state[h]
        qn = np.empty((chunk, dk), dtype=np.float32)
        kn = np.empty((chunk, dk), dtype=np.float32)
        u = np.empty((chunk, dv), dtype=np.float32)     # U, then v'
        wk = np.empty((chunk, dk), dtype=np.float32)    # W
        a = np.empty((chunk, chunk), dtype=np.float32)
        gc = np.empty(chunk, dtype=np.float32)
        for c0 in range(0, t_len, chunk):
            n = min(chunk, t_len - c0)
            acc = np.float32(0.0)
            for i in range(n):
                _l2n(q[c0 + i, kh], qn[i], scale)
                _l2n(k[c0 + i, kh], kn[i], np.float32(1.0))
                acc += g[c0 + i, h]
                gc[i] = acc
            for i in range(n):
                bt = beta[c0 + i, h]
                for j in range(i):
                    d = np.float32(0.0)
                    for e in range(dk):
                        d += kn[i, e] * kn[j, e]
                    a[i, j] = bt * d * np.float32(math.exp(gc[i] - gc[j]))
                eg = np.float32(math.exp(gc[i]))
                for e in range(dv):
                    u[i, e] = v[c0 + i, h, e] * bt
                for e in range(dk):
                    wk[i, e] = kn[i, e] * bt * eg
                for j in range(i):                      # forward substitution, rows j < i done
                    aij = a[i, j]
                    for e in range(dv):
                        u[i, e] -= aij * u[j, e]
                    for e in range(dk):
                        wk[i, e] -= aij * wk[j, e]
            for i in range(n):                          # v' = U - W S
                for e in range(dv):
                    d = np.float32(0.0)
                    for r in range(dk):
                        d += wk[i, r] * s[r, e]
                    u[i, e] -= d
            for i in range(n):                          # outputs: inter-chunk read + intra-chunk attention
                eg = np.float32(math.exp(gc[i]))
                for e in range(dv):
                    d = np.float32(0.0)
                    for r in range(dk):
                        d += qn[i, r] * s[r, e]
                    out[c0 + i, h, e] = d * eg
                for j in range(i + 1):
                    d = np.float32(0.0)
                    for r in range(dk):
                        d += qn[i, r] * kn[j, r]
                    p = d * np.float32(math.exp(gc[i] - gc[j]))
                    for e in range(dv):
                        out[c0 + i, h, e] += p * u[j, e]
            last = gc[n - 1]
            el = np.float32(math.exp(last))
            for r in range(dk):
                for e in range(dv):
                    s[r, e] *= el
            for i in range(n):
                f = np.float32(math.exp(last - gc[i]))
                for r in range(dk):
                    kr = kn[i, r] * f
                    for e in range(dv):
                        s[r, e] += kr * u[i, e]


@njit(parallel=True, cache=True)
def kda_recurrent(q, k, v, g, beta, state, out):
    """Kimi Delta Attention token by token (decode): gated_delta_recurrent with a decay a key
    channel. g [T, Nv, Dk]; the rest as there. Per token and value head:
    S[i, :] *= exp(g[i]); S += k (x) beta (v - k^T S); o = q^T S.
    """
    t_len, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    rep = nv // nk
    scale = np.float32(1.0 / math.sqrt(dk))
    for h in prange(nv):
        kh = h // rep
        s = state[h]
        qn = np.empty(dk, dtype=np.float32)
        kn = np.empty(dk, dtype=np.float32)
        delta = np.empty(dv, dtype=np.float32)
        for t in range(t_len):
            _l2n(q[t, kh], qn, scale)
            _l2n(k[t, kh], kn, np.float32(1.0))
            bt = beta[t, h]
            for j in range(dv):
                delta[j] = 0.0
            for i in range(dk):
                decay = np.float32(math.exp(g[t, h, i]))
                for j in range(dv):
                    s[i, j] *= decay
                    delta[j] += s[i, j] * kn[i]
            for j in range(dv):
                delta[j] = (v[t, h, j] - delta[j]) * bt
            for j in range(dv):
                out[t, h, j] = 0.0
            for i in range(dk):
                for j in range(dv):
                    s[i, j] += kn[i] * delta[j]
                    out[t, h, j] += s[i, j] * qn[i]


@njit(parallel=True, cache=True)
def kda_chunked(q, k, v, g, beta, state, out, chunk):
    """Kimi Delta Attention over chunks of `chunk` tokens (prefill); kda_recurrent's contract.

    gated_delta_chunked with c_i a vector (the cumulative log decay of each key channel): every
    e^(c_i - c_j) moves inside the dot products over Dk (A and the intra-chunk scores share it),
    W = beta k e^(c), the read q_i e^(c_i) S and the state's decay row by row.
    """
    t_len, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    rep = nv // nk
    scale = np.float32(1.0 / math.sqrt(dk))
    for h in prange(nv):
        kh = h // rep
        s = state[h]
        qn = np.empty((chunk, dk), dtype=np.float32)
        kn = np.empty((chunk, dk), dtype=np.float32)
        u = np.empty((chunk, dv), dtype=np.float32)     # U, then v'
        wk = np.empty((chunk, dk), dtype=np.float32)    # W
        a = np.empty((chunk, chunk), dtype=np.float32)
        p = np.empty((chunk, chunk), dtype=np.float32)  # intra-chunk scores q_i . k_j e^(c_i - c_j)
        gc = np.empty((chunk, dk), dtype=np.float32)
        acc = np.empty(dk, dtype=np.float32)
        for c0 in range(0, t_len, chunk):
            n = min(chunk, t_len - c0)
            for e in range(dk):
                acc[e] = 0.0
            for i in range(n):
                _l2n(q[c0 + i, kh], qn[i], scale)
                _l2n(k[c0 + i, kh], kn[i], np.float32(1.0))
                for e in range(dk):
                    acc[e] += g[c0 + i, h, e]
                    gc[i, e] = acc[e]
            for i in range(n):
                for j in range(i + 1):
                    da = np.float32(0.0)
                    dp = np.float32(0.0)
                    for e in range(dk):
                        f = kn[j, e] * np.float32(math.exp(gc[i, e] - gc[j, e]))
                        da += kn[i, e] * f
                        dp += qn[i, e] * f
                    a[i, j] = da
                    p[i, j] = dp
            for i in range(n):
                bt = beta[c0 + i, h]
                for e in range(dv):
                    u[i, e] = v[c0 + i, h, e] * bt
                for e in range(dk):
                    wk[i, e] = kn[i, e] * bt * np.float32(math.exp(gc[i, e]))
                for j in range(i):                      # forward substitution, rows j < i done
                    aij = bt * a[i, j]
                    for e in range(dv):
                        u[i, e] -= aij * u[j, e]
                    for e in range(dk):
                        wk[i, e] -= aij * wk[j, e]
            for i in range(n):                          # v' = U - W S
                for e in range(dv):
                    d = np.float32(0.0)
                    for r in range(dk):
                        d += wk[i, r] * s[r, e]
                    u[i, e] -= d
            for i in range(n):                          # outputs: inter-chunk read + intra-chunk attention
                for e in range(dv):
                    out[c0 + i, h, e] = 0.0
                for r in range(dk):
                    qr = qn[i, r] * np.float32(math.exp(gc[i, r]))
                    for e in range(dv):
                        out[c0 + i, h, e] += qr * s[r, e]
                for j in range(i + 1):
                    pij = p[i, j]
                    for e in range(dv):
                        out[c0 + i, h, e] += pij * u[j, e]
            for r in range(dk):
                el = np.float32(math.exp(gc[n - 1, r]))
                for e in range(dv):
                    s[r, e] *= el
            for i in range(n):
                for r in range(dk):
                    kr = kn[i, r] * np.float32(math.exp(gc[n - 1, r] - gc[i, r]))
                    for e in range(dv):
                        s[r, e] += kr * u[i, e]


@njit(parallel=True, cache=True)
def rmsnorm_gated(x, z, w, eps, out):
    """x, z [R, N]; w [N] -> out [R, N] = w * x / sqrt(mean x^2 + eps) * silu(z) (norm, then gate)."""
    r, n = x.shape
    for i in prange(r):
        ss = np.float32(0.0)
        for j in range(n):
            ss += x[i, j] * x[i, j]
        inv = np.float32(1.0 / math.sqrt(ss / n + eps))
        for j in range(n):
            zz = z[i, j]
            out[i, j] = w[j] * (x[i, j] * inv) * (zz / (np.float32(1.0) + np.float32(math.exp(-zz))))


@njit(parallel=True, cache=True)
def sigmoid_gate_inplace(x, gate):
    """x [T, N] *= sigmoid(gate [T, G]); gate column c covers x columns c*N/G .. (c+1)*N/G - 1."""
    t_len, n = x.shape
    per = n // gate.shape[1]
    for t in prange(t_len):
        for j in range(n):
            x[t, j] *= np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-gate[t, j // per])))


class DeltaNetOps:
    """The hybrid families' ops on the CPU backend (CpuOps.deltanet). Float32 numpy arrays."""

    def f32(self, a: np.ndarray) -> np.ndarray:
        """A small weight as a float32 host array (bf16 bits widened): conv taps, A_log, norms."""
        if a.dtype == np.uint16:
            return (np.ascontiguousarray(a).astype(np.uint32) << 16).view(np.float32)
        return np.ascontiguousarray(a, dtype=np.float32)

    def take_cols(self, x: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """x [T, N] -> x[:, cols] (contiguous): re-lays fused projections out per kind."""
        return np.ascontiguousarray(x[:, cols])

    def conv1d_silu(self, x: np.ndarray, w: np.ndarray, state: np.ndarray) -> np.ndarray:
        """x [T, C], w [C, Kc], state [Kc-1, C] (updated) -> [T, C]."""
        out = np.empty(x.shape, dtype=np.float32)
        conv1d_silu(np.ascontiguousarray(x), w, state, out)
        return out

    def gates(self, b: np.ndarray, a: np.ndarray, neg_a: np.ndarray, dt_bias: np.ndarray):
        """b [T, Nv], a [T, N] (N: Nv, or Nv Dk for KDA's decay a key channel) -> (beta [T, Nv], g [T, N])."""
        beta = np.empty(b.shape, dtype=np.float32)
        g = np.empty(a.shape, dtype=np.float32)
        deltanet_gates(np.ascontiguousarray(b), np.ascontiguousarray(a), neg_a, dt_bias, beta, g)
        return beta, g

    def delta_rule(self, q, k, v, g, beta, state, chunked: bool) -> np.ndarray:
        """q, k [T, Nk, Dk]; v [T, Nv, Dv]; beta [T, Nv]; g [T, Nv] (Gated DeltaNet: a decay a
        head) or [T, Nv, Dk] (Kimi Delta Attention: a decay a key channel); state [Nv, Dk, Dv]
        (updated) -> [T, Nv, Dv].

        chunked: the chunk-parallel form (prefill); else token by token (decode). Same result.
        """
        args = [np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v, g, beta)]
        out = np.empty(v.shape, dtype=np.float32)
        if g.ndim == 3:
            if chunked:
                kda_chunked(*args, state, out, CHUNK)
            else:
                kda_recurrent(*args, state, out)
        elif chunked:
            gated_delta_chunked(*args, state, out, CHUNK)
        else:
            gated_delta_recurrent(*args, state, out)
        return out

    def rmsnorm_gated(self, x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """Normalizes the last axis of x, then gates by silu(z); any leading shape."""
        n = x.shape[-1]
        xf = np.ascontiguousarray(x).reshape(-1, n)
        out = np.empty_like(xf)
        rmsnorm_gated(xf, np.ascontiguousarray(z).reshape(-1, n), w, np.float32(eps), out)
        return out.reshape(x.shape)

    def sigmoid_gate_(self, x: np.ndarray, gate: np.ndarray) -> None:
        """x [T, N] *= sigmoid(gate [T, G]) in place, each gate over N/G consecutive columns."""
        sigmoid_gate_inplace(x, np.ascontiguousarray(gate))
