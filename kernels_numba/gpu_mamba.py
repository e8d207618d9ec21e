"""CUDA kernels of the Mamba-2 mixer (Granite 4.0 hybrid's mamba layers, Nemotron-H's "M").

Legend: T = tokens, Hm = Mamba heads, P = head dim, I = Hm P, G = B / C groups (head h reads
group h // (Hm / G)), N = state size, C = conv channels (x [I] | B [G N] | C [G N]: I + 2 G N),
Kc = conv width, W = a row's width.
Activations and the recurrent state are float32; 2-D inputs may be column slices of the in_proj
output [T, I + C + Hm] (z | xBC | dt), so kernels index them [t, column] and never reshape.
Every launcher takes an explicit stream, allocates nothing and never syncs (graph-capturable).
The numpy oracle of each kernel is in reference.py (causal_conv1d_silu with its bias,
mamba2_scan, rmsnorm_group_gated); the CPU backend's kernels are cpu_mamba.py's.
Gated DeltaNet's gated norm (gpu_deltanet.rmsnorm_gated) is not this one: it norms x, then
multiplies by silu(z), with one weight a head; Mamba-2's gates first, norms x silu(z) over
groups of I / G columns, and has a weight a column.
"""
from __future__ import annotations

import math

from numba import cuda, float32

from .gpu_util import SIM, WARP, block_sum, cdiv, pdl_kernel, pdl_trigger, pdl_wait, silu, warp_sum

THREADS = 64 if SIM else 256        # conv: one thread per channel
MAX_KC = 8                          # conv width held in registers
SCAN_WARPS = 2 if SIM else 4        # scan: state rows (h, p) a block, a warp a row
SCAN_THREADS = SCAN_WARPS * WARP
MAX_N = 256                         # the largest state size: N / 32 values a lane in registers
SCAN_REGS = MAX_N // WARP
NORM_THREADS = 64 if SIM else 256   # gated group norm: a block per (token, group) row


# ---- causal depthwise conv1d + bias + SiLU, rolling state -------------------------------------

@pdl_kernel
@cuda.jit
def _conv1d_bias_silu(x, w, bias, state, out):
    """x [T, C] -> out [T, C] = silu(bias + causal conv) (out may be x); w [C, Kc]; bias [C];
    state [Kc-1, C] in/out, oldest first.

    One thread per channel walks the T tokens with the window in registers, so each input is
    read before its output overwrites it (decode: T = 1; a prefill chunk: the same loop)."""
    pdl_wait()
    pdl_trigger()
    win = cuda.local.array(MAX_KC, float32)
    c = cuda.grid(1)
    T, C = x.shape
    kc = w.shape[1]
    ks = kc - 1
    if c < C:
        for i in range(ks):
            win[i] = state[i, c]
        bc = bias[c]
        for t in range(T):
            win[ks] = x[t, c]
            acc = bc
            for j in range(kc):
                acc += w[c, j] * win[j]
            out[t, c] = silu(acc)
            for j in range(ks):
                win[j] = win[j + 1]
        for i in range(ks):
            state[i, c] = win[i]


def conv1d_silu(x, w, bias, state, out, stream):
    """x [T, C] (a column slice: the xBC columns), w [C, Kc], bias [C] (zeros where the conv has
    none), state [Kc-1, C] (updated) -> out [T, C] (out may be x)."""
    kc = w.shape[1]
    if not 2 <= kc <= MAX_KC:
        raise ValueError(f"conv kernel width {kc} outside 2..{MAX_KC}")
    _conv1d_bias_silu[cdiv(x.shape[1], THREADS), THREADS, stream](x, w, bias, state, out)


# ---- selective scan ---------------------------------------------------------------------------

@pdl_kernel
@cuda.jit
def _scan(xbc, dt, neg_a, dt_bias, d, state, out):
    """xbc [T, C] (the conv output: x [Hm P] | B [G N] | C [G N] per token); dt [T, Hm] (before
    bias and softplus); neg_a = -exp(A_log), dt_bias, d [Hm]; state [Hm, P, N] in/out;
    out [T, Hm P].

    grid (Hm, cdiv(P, SCAN_WARPS)), SCAN_THREADS threads: warp w owns state row (h, p), lane l
    its columns l, l + 32, ... in registers for all T tokens. Per token: dt' = softplus(dt +
    dt_bias) (x passed through above 20, as torch), S = S exp(dt' neg_a) + dt' x B^T,
    out = S C + D x, the sum over N a warp reduction. A prefill chunk runs token by token inside
    the kernel, the state staying in registers: correctness first (Mamba-2's chunked form, as the
    delta rule's, would take the tokens of a chunk at once)."""
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(SCAN_THREADS, float32)
    s = cuda.local.array(SCAN_REGS, float32)
    h = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    i = cuda.blockIdx.y * SCAN_WARPS + tid // WARP
    hm, p, n = state.shape
    T = xbc.shape[0]
    live = i < p
    ii = min(i, p - 1)     # a row past P computes row P - 1's (uniform warp sums) and writes nothing
    inner = hm * p
    groups = (xbc.shape[1] - inner) // (2 * n)
    g = h // (hm // groups)
    b0 = inner + g * n
    c0 = inner + groups * n + g * n
    xi = h * p + ii
    for r in range(SCAN_REGS):
        j = lane + r * WARP
        if j < n:
            s[r] = state[h, ii, j]
    na = neg_a[h]
    db = dt_bias[h]
    dh = d[h]
    for t in range(T):
        z = dt[t, h] + db
        sp = z if z > float32(20.0) else float32(math.log1p(math.exp(z)))
        decay = float32(math.exp(sp * na))
        xv = xbc[t, xi]
        xs = sp * xv
        acc = float32(0.0)
        for r in range(SCAN_REGS):
            j = lane + r * WARP
            if j < n:
                v = s[r] * decay + xs * xbc[t, b0 + j]
                s[r] = v
                acc += v * xbc[t, c0 + j]
        acc = warp_sum(acc, red)
        if lane == 0 and live:
            out[t, xi] = acc + dh * xv
    if live:
        for r in range(SCAN_REGS):
            j = lane + r * WARP
            if j < n:
                state[h, i, j] = s[r]


def scan(xbc, dt, neg_a, dt_bias, d, state, out, stream):
    """The selective scan over T tokens in one launch (decode T = 1, the graph-captured step).

    xbc [T, C] conv output (columns x | B | C), dt [T, Hm] raw, neg_a / dt_bias / d [Hm],
    state [Hm, P, N] (updated) -> out [T, Hm P]. No dt clamp: the configs refuse a
    time_step_limit other than [0, inf]."""
    hm, p, n = state.shape
    if n > MAX_N:
        raise ValueError(f"Mamba state size {n} exceeds MAX_N={MAX_N}")
    groups, rest = divmod(xbc.shape[1] - hm * p, 2 * n)
    if rest or groups < 1 or hm % groups:
        raise ValueError(f"scan: {xbc.shape[1]} conv channels are not Hm P + 2 G N with Hm={hm}, "
                         f"P={p}, N={n} and G dividing Hm")
    _scan[(hm, cdiv(p, SCAN_WARPS)), SCAN_THREADS, stream](xbc, dt, neg_a, dt_bias, d, state, out)


# ---- gated group RMSNorm ----------------------------------------------------------------------

@pdl_kernel
@cuda.jit
def _rmsnorm_group_gated(x, z, w, group, eps, out):
    """x, z [T, W]; w [W] -> out [T, W] = w * rmsnorm(x * silu(z)) over each run of `group`
    columns (gate first, then the norm). One block per (token, group) row; out may be x (each
    thread reads its columns again before it writes them)."""
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(NORM_THREADS, float32)
    wred = cuda.shared.array(32, float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    width = x.shape[1]
    gr = width // group
    t = cuda.blockIdx.x // gr
    base = (cuda.blockIdx.x - t * gr) * group
    ss = float32(0.0)
    for i in range(tid, group, nt):
        y = x[t, base + i] * silu(z[t, base + i])
        ss += y * y
    ss = block_sum(ss, red, wred)
    inv = float32(1.0) / math.sqrt(ss / float32(group) + eps)
    for i in range(tid, group, nt):
        y = x[t, base + i] * silu(z[t, base + i])
        out[t, base + i] = w[base + i] * (y * inv)


def rmsnorm_group_gated(x, z, w, group: int, eps, out, stream):
    """x [T, W], z [T, W] (a column slice: the in_proj's z), w [W] -> out [T, W] (may be x)."""
    t, width = x.shape
    if width % group:
        raise ValueError(f"gated norm: width {width} is not a multiple of the group {group}")
    _rmsnorm_group_gated[t * (width // group), NORM_THREADS, stream](x, z, w, group, float32(eps), out)
