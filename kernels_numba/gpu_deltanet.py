"""CUDA kernels of the hybrid (Gated DeltaNet + gated attention) families.

Legend: T = tokens, Nk / Nv = DeltaNet key / value heads (value head h reads key head h // (Nv/Nk)),
Dk / Dv = their head dims, C = conv channels (q | k | v of every head: 2 Nk Dk + Nv Dv),
Kc = conv kernel width, N = a row's length, G = gate groups per row.
Activations and the recurrent state are float32; 2-D inputs may be column slices of a wider
buffer (a fused projection's output), so kernels index them [t, column] and never reshape.
Every launcher takes an explicit stream, allocates nothing and never syncs (graph-capturable).
The numpy oracle of each kernel is in reference.py (causal_conv1d_silu, deltanet_gates,
gated_delta_rule, rmsnorm_gated, sigmoid_gate).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32

from .gpu_util import SIM, WARP, block_sum, cdiv, silu, warp_sum

THREADS = 64 if SIM else 256        # elementwise kernels, conv (one thread per channel)
NORM_THREADS = 64 if SIM else 128   # rmsnorm_gated: one warp per (token, head) row
MAX_KC = 8                          # conv width held in registers
DN_COLS = 8 if SIM else 32          # delta rule: state columns (Dv) per block, one per lane
DN_SPLIT = 4 if SIM else 8          # delta rule: threads sharing a column, each Dk / DN_SPLIT rows
DN_THREADS = DN_COLS * DN_SPLIT     # a multiple of 32 (block_sum, also under the simulator)
MAX_DK = 256
DN_ROWS = MAX_DK // DN_SPLIT        # state rows a thread holds, at most
L2_EPS = 1e-6                       # q/k L2 normalization, as cpu_deltanet (the FLA library's form)


# ---- causal depthwise conv1d + SiLU, rolling state --------------------------------------------

@cuda.jit
def _conv1d_silu(x, w, state, out):
    """x [T, C] -> out [T, C] (out may be x); w [C, Kc]; state [Kc-1, C] in/out, oldest first.

    One thread per channel walks the T tokens with the window in registers, so each input is
    read before its output overwrites it."""
    win = cuda.local.array(MAX_KC, float32)
    c = cuda.grid(1)
    T, C = x.shape
    kc = w.shape[1]
    ks = kc - 1
    if c < C:
        for i in range(ks):
            win[i] = state[i, c]
        for t in range(T):
            win[ks] = x[t, c]
            acc = float32(0.0)
            for j in range(kc):
                acc += w[c, j] * win[j]
            out[t, c] = silu(acc)
            for j in range(ks):
                win[j] = win[j + 1]
        for i in range(ks):
            state[i, c] = win[i]


def conv1d_silu(x, w, state, out, stream):
    kc = w.shape[1]
    if not 2 <= kc <= MAX_KC:
        raise ValueError(f"conv kernel width {kc} outside 2..{MAX_KC}")
    _conv1d_silu[cdiv(x.shape[1], THREADS), THREADS, stream](x, w, state, out)


# ---- gates ------------------------------------------------------------------------------------

@cuda.jit(device=True, inline=True)
def _gate_vals(bv, av, neg_a, dt_bias):
    """(beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)); softplus passes x through
    above 20, as torch does."""
    beta = float32(1.0) / (float32(1.0) + math.exp(-bv))
    z = av + dt_bias
    sp = z if z > float32(20.0) else float32(math.log1p(math.exp(z)))
    return beta, neg_a * sp


@cuda.jit
def _gates(b, a, neg_a, dt_bias, beta, g):
    i = cuda.grid(1)
    T, nv = b.shape
    if i < T * nv:
        t = i // nv
        h = i - t * nv
        bt, gt = _gate_vals(b[t, h], a[t, h], neg_a[h], dt_bias[h])
        beta[t, h] = bt
        g[t, h] = gt


def gates(b, a, neg_a, dt_bias, beta, g, stream):
    """b, a [T, Nv]; neg_a = -exp(A_log), dt_bias [Nv] -> beta, g [T, Nv]. The decoder folds
    this into the delta-rule kernel; kept apart for tests and the per-op benchmark."""
    n = b.shape[0] * b.shape[1]
    _gates[cdiv(n, THREADS), THREADS, stream](b, a, neg_a, dt_bias, beta, g)


# ---- gated delta rule -------------------------------------------------------------------------

@cuda.jit
def _delta_rule(qkv, ba, neg_a, dt_bias, nk, state, out):
    """qkv [T, C] (the conv output: q [Nk Dk] | k [Nk Dk] | v [Nv Dv] per token);
    ba [T, 2 Nv] (b | a, the gate inputs); state [Nv, Dk, Dv] in/out; out [T, Nv Dv].

    grid (Nv, cdiv(Dv, DN_COLS)), DN_THREADS threads: lane `col` owns state column j, and the
    DN_SPLIT threads of a column hold rows i = r * DN_SPLIT + p in registers for all T tokens.
    Per token: S *= exp(g); S += k (x) beta (v - k^T S); o = q^T S (q, k L2-normalized, q
    scaled by Dk^-0.5). Column sums over the split go through shared memory."""
    qs = cuda.shared.array(MAX_DK, float32)
    ks = cuda.shared.array(MAX_DK, float32)
    part = cuda.shared.array(DN_THREADS, float32)
    red = cuda.shared.array(DN_THREADS, float32)
    wred = cuda.shared.array(32, float32)
    h = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    col = tid % DN_COLS
    p = tid // DN_COLS
    nv, dk, dv = state.shape
    T = qkv.shape[0]
    j = cuda.blockIdx.y * DN_COLS + col
    live = j < dv
    jj = min(j, dv - 1)
    kh = h // (nv // nk)
    kd = nk * dk
    q0 = kh * dk
    k0 = kd + kh * dk
    v0 = 2 * kd + h * dv
    rpt = (dk + DN_SPLIT - 1) // DN_SPLIT
    scale = float32(1.0) / math.sqrt(float32(dk))
    s = cuda.local.array(DN_ROWS, float32)
    for r in range(DN_ROWS):
        i = r * DN_SPLIT + p
        if r < rpt and i < dk:
            s[r] = state[h, i, jj]
    for t in range(T):
        qq = float32(0.0)
        kk = float32(0.0)
        for i in range(tid, dk, DN_THREADS):
            qv = qkv[t, q0 + i]
            kv = qkv[t, k0 + i]
            qs[i] = qv
            ks[i] = kv
            qq += qv * qv
            kk += kv * kv
        qq = block_sum(qq, red, wred)      # its barriers also publish qs / ks
        kk = block_sum(kk, red, wred)
        qinv = scale / math.sqrt(qq + float32(L2_EPS))
        kinv = float32(1.0) / math.sqrt(kk + float32(L2_EPS))
        bt, gt = _gate_vals(ba[t, h], ba[t, nv + h], neg_a[h], dt_bias[h])
        decay = math.exp(gt)
        m = float32(0.0)
        for r in range(DN_ROWS):
            i = r * DN_SPLIT + p
            if r < rpt and i < dk:
                s[r] *= decay
                m += s[r] * ks[i]
        part[tid] = m
        cuda.syncthreads()
        mem = float32(0.0)
        for pp in range(DN_SPLIT):
            mem += part[pp * DN_COLS + col]
        delta = (qkv[t, v0 + jj] - mem * kinv) * bt * kinv    # the k of S += k (x) delta, normalized
        cuda.syncthreads()                                    # part is read before it is rewritten
        o = float32(0.0)
        for r in range(DN_ROWS):
            i = r * DN_SPLIT + p
            if r < rpt and i < dk:
                s[r] += ks[i] * delta
                o += s[r] * qs[i]
        part[tid] = o
        cuda.syncthreads()
        if p == 0 and live:
            acc = float32(0.0)
            for pp in range(DN_SPLIT):
                acc += part[pp * DN_COLS + col]
            out[t, h * dv + j] = acc * qinv
        cuda.syncthreads()                                    # before the next token's qs / ks / part
    if live:
        for r in range(DN_ROWS):
            i = r * DN_SPLIT + p
            if r < rpt and i < dk:
                state[h, i, j] = s[r]


def delta_rule(qkv, ba, neg_a, dt_bias, nk, state, out, stream):
    """The gated delta rule over T tokens in one launch (decode T = 1; prefill runs the exact
    recurrent form, the state staying in registers across tokens).

    qkv [T, C] conv output, ba [T, 2 Nv], neg_a / dt_bias [Nv], nk = Nk, state [Nv, Dk, Dv]
    (updated) -> out [T, Nv Dv]. Gates computed inside (see gates())."""
    nv, dk, dv = state.shape
    if dk > MAX_DK:
        raise ValueError(f"DeltaNet key head dim {dk} exceeds MAX_DK={MAX_DK}")
    _delta_rule[(nv, cdiv(dv, DN_COLS)), DN_THREADS, stream](qkv, ba, neg_a, dt_bias, int32(nk),
                                                             state, out)


# ---- gated RMSNorm, sigmoid gates, zero fill --------------------------------------------------

@cuda.jit
def _rmsnorm_gated(x, z, w, eps, out):
    """x, z [T, G N] (G heads of N) -> out [T, G N] = w * x / rms(x) * silu(z) per head;
    one warp per (token, head)."""
    red = cuda.shared.array(NORM_THREADS, float32)
    tid = cuda.threadIdx.x
    lane = tid % WARP
    r0 = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + tid // WARP
    T = x.shape[0]
    n = w.shape[0]
    gr = x.shape[1] // n
    rows = T * gr
    r = min(r0, rows - 1)
    t = r // gr
    base = (r - t * gr) * n
    ss = float32(0.0)
    for i in range(lane, n, WARP):
        v = x[t, base + i]
        ss += v * v
    ss = warp_sum(ss, red)
    inv = float32(1.0) / math.sqrt(ss / float32(n) + eps)
    if r0 < rows:
        for i in range(lane, n, WARP):
            out[t, base + i] = w[i] * (x[t, base + i] * inv) * silu(z[t, base + i])


def rmsnorm_gated(x, z, w, eps, out, stream):
    """x, z [T, G N], w [N] -> out [T, G N] (out may be x)."""
    rows = x.shape[0] * (x.shape[1] // w.shape[0])
    _rmsnorm_gated[cdiv(rows, NORM_THREADS // WARP), NORM_THREADS, stream](x, z, w, float32(eps), out)


@cuda.jit
def _sigmoid_gate(x, gate):
    i = cuda.grid(1)
    T, n = x.shape
    if i < T * n:
        t = i // n
        j = i - t * n
        per = n // gate.shape[1]
        x[t, j] *= float32(1.0) / (float32(1.0) + math.exp(-gate[t, j // per]))


def sigmoid_gate(x, gate, stream):
    """x [T, N] *= sigmoid(gate [T, G]) in place, each gate column over N/G consecutive columns
    (G = N: the attention output gate; G = 1: the shared expert's gate)."""
    n = x.shape[0] * x.shape[1]
    _sigmoid_gate[cdiv(n, THREADS), THREADS, stream](x, gate)
