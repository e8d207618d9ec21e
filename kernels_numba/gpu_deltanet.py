"""CUDA kernels of the hybrid (Gated DeltaNet + gated attention) families.

Legend: T = tokens, Nk / Nv = DeltaNet key / value heads (value head h reads key head h // (Nv/Nk)),
Dk / Dv = their head dims, C = conv channels (q | k | v of every head: 2 Nk Dk + Nv Dv),
Kc = conv kernel width, N = a row's length, G = gate groups per row, Tc = tokens per chunk of
the chunked delta rule (CH_T).
Activations and the recurrent state are float32; 2-D inputs may be column slices of a wider
buffer (a fused projection's output), so kernels index them [t, column] and never reshape.
Every launcher takes an explicit stream, allocates nothing and never syncs (graph-capturable).
The numpy oracle of each kernel is in reference.py (causal_conv1d_silu, deltanet_gates,
gated_delta_rule, rmsnorm_gated, sigmoid_gate).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32

from .gpu_util import (SIM, WARP, block_sum, cdiv, pdl_kernel, pdl_trigger, pdl_wait, silu,
                        warp_sum, warp_sync)

THREADS = 64 if SIM else 256        # elementwise kernels, conv (one thread per channel)
NORM_THREADS = 64 if SIM else 128   # rmsnorm_gated: one warp per (token, head) row
MAX_KC = 8                          # conv width held in registers
DN_COLS = 8 if SIM else 32          # delta rule: state columns (Dv) per block, one per lane
DN_SPLIT = 4 if SIM else 8          # delta rule: threads sharing a column, each Dk / DN_SPLIT rows
DN_THREADS = DN_COLS * DN_SPLIT     # a multiple of 32 (block_sum, also under the simulator)
MAX_DK = 256
DN_ROWS = MAX_DK // DN_SPLIT        # state rows a thread holds, at most
L2_EPS = 1e-6                       # q/k L2 normalization, as cpu_deltanet (the FLA library's form)
# chunked delta rule (prefill): a chunk's q / k rows, its Tc x Tc matrix and the block's state
# columns in shared memory (48 KB at Dk = 128: the cap without an opt-in)
CH_T = 8 if SIM else 32             # Tc: at most a warp (the triangular solve puts a row on a lane)
CH_COLS = 4 if SIM else 16          # state columns (Dv) per block, two per warp in the solve
CH_THREADS = 64 if SIM else 256
CH_DK = 32 if SIM else 128          # the largest Dk the chunked kernel takes (its shared arrays)
CH_KS = CH_DK + 1                   # q / k row stride, odd: lanes on different rows, different banks
CH_KOFF = CH_T * CH_KS + 16         # k rows start 16 banks off the q rows: q row r, k row r apart
CH_KQ = CH_KOFF + CH_T * CH_KS
CH_SP = CH_THREADS // CH_COLS       # threads sharing a state column, each CH_ROWS rows
CH_ROWS = CH_DK // CH_SP
CH_RED = CH_THREADS if SIM else 1   # warp_sum scratch: only the simulator's path reads it
CH_MIN_T = 2 * CH_T                 # the decoder runs the chunked kernel from here (not yet measured)
CH_LAUNCH_BOUNDS = (CH_THREADS, 2)  # 2 blocks an SM (<= 128 registers): Nv = 32 is 256 blocks, one wave
assert CH_T <= WARP and CH_T % 2 == 0
assert CH_COLS == 2 * (CH_THREADS // WARP)
assert (CH_T // 2) ** 2 <= CH_THREADS and CH_COLS * (CH_T // 2) <= CH_THREADS   # a tile, a pair a thread
assert (2 * CH_T) % (CH_THREADS // WARP) == 0   # as many rows a warp: uniform barriers in warp_sum
assert CH_DK % CH_SP == 0


# ---- causal depthwise conv1d + SiLU, rolling state --------------------------------------------

@pdl_kernel
@cuda.jit
def _conv1d_silu(x, w, state, out):
    """x [T, C] -> out [T, C] (out may be x); w [C, Kc]; state [Kc-1, C] in/out, oldest first.

    One thread per channel walks the T tokens with the window in registers, so each input is
    read before its output overwrites it."""
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


@cuda.jit(device=True, inline=True)
def _head_cols(h, nv, nk, dk, dv):
    """First columns of value head h's q, k and v in a conv output row [q | k | v of every head]:
    it reads key head h // (Nv / Nk), as the reference maps them."""
    kh = h // (nv // nk)
    kd = nk * dk
    return kh * dk, kd + kh * dk, 2 * kd + h * dv


@pdl_kernel
@cuda.jit
def _gates(b, a, neg_a, dt_bias, beta, g):
    pdl_wait()
    pdl_trigger()
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

@pdl_kernel
@cuda.jit
def _delta_rule(qkv, ba, neg_a, dt_bias, nk, state, out):
    """qkv [T, C] (the conv output: q [Nk Dk] | k [Nk Dk] | v [Nv Dv] per token);
    ba [T, 2 Nv] (b | a, the gate inputs); state [Nv, Dk, Dv] in/out; out [T, Nv Dv].

    grid (Nv, cdiv(Dv, DN_COLS)), DN_THREADS threads: lane `col` owns state column j, and the
    DN_SPLIT threads of a column hold rows i = r * DN_SPLIT + p in registers for all T tokens.
    Per token: S *= exp(g); S += k (x) beta (v - k^T S); o = q^T S (q, k L2-normalized, q
    scaled by Dk^-0.5). Column sums over the split go through shared memory."""
    pdl_wait()
    pdl_trigger()
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
    q0, k0, v0 = _head_cols(h, nv, nk, dk, dv)
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


@cuda.jit(device=True, inline=True)
def _decayed(d, r, c, gc, bt):
    """Entry (r, c) of the chunk matrix from its dot product d: on and below the diagonal
    P[r, c] = e^(gc_r - gc_c) q_r.k_c, above it A[c, r] = beta_c e^(gc_c - gc_r) k_c.k_r."""
    if c <= r:
        return d * math.exp(gc[r] - gc[c])
    return d * bt[c] * math.exp(gc[c] - gc[r])


_ch_jit = cuda.jit if SIM else cuda.jit(launch_bounds=CH_LAUNCH_BOUNDS)


@_ch_jit
def _delta_rule_chunked(qkv, ba, neg_a, dt_bias, nk, state, out):
    """Same arguments as _delta_rule; the chunked (WY) form of the same recurrence.

    grid (Nv, cdiv(Dv, CH_COLS)), CH_THREADS threads. Per chunk of n <= Tc tokens, gc_t the
    cumulative log decay from the chunk start, S the state there:
      m [Tc, Tc]: P[t, j] = e^(gc_t - gc_j) q_t.k_j on and below the diagonal, the strictly lower
        A[i, j] = beta_i e^(gc_i - gc_j) k_i.k_j stored transposed above it (2x2 tiles a thread)
      u [Tc, cols]: beta_t (v_t - e^(gc_t) k_t S), then v' = (I + A)^-1 u by forward substitution
        (a warp per two columns, a lane per row): the W of the WY form folded into the right side,
        so the block needs only its own columns of v, v' and S
      o_t = e^(gc_t) q_t S + sum_(j<=t) P[t, j] v'_j;   S <- e^(gc_n) S + sum_t e^(gc_n - gc_t) k_t (x) v'_t
    Every block normalizes the chunk's full q / k rows and builds m itself (the Dv split is exact:
    the solve acts on rows). Rows t >= n are zero (beta 0), so a partial chunk needs no masks."""
    kq = cuda.shared.array(CH_KQ, float32)              # q rows | pad | k rows, [Tc, CH_KS] each
    m = cuda.shared.array((CH_T, CH_T), float32)
    u = cuda.shared.array((CH_T, CH_COLS), float32)
    ss = cuda.shared.array((CH_DK, CH_COLS), float32)   # S at the chunk start
    gl = cuda.shared.array(CH_T, float32)               # g_t
    gc = cuda.shared.array(CH_T, float32)               # gc_t (gc_n past the last token)
    bt = cuda.shared.array(CH_T, float32)               # beta_t (0 past the last token)
    fl = cuda.shared.array(CH_T, float32)               # e^(gc_n - gc_t)
    red = cuda.shared.array(CH_RED, float32)
    sreg = cuda.local.array(CH_ROWS, float32)           # the state update's accumulators
    h = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    nv, dk, dv = state.shape
    T = qkv.shape[0]
    q0, k0, v0 = _head_cols(h, nv, nk, dk, dv)
    j0 = cuda.blockIdx.y * CH_COLS
    scale = float32(1.0) / math.sqrt(float32(dk))
    # the state: thread (sp, sc) updates column j0 + sc, rows sp + r CH_SP (a column past Dv
    # repeats the last one and is never written; rows past Dk stay zero)
    sc = tid % CH_COLS
    sp = tid // CH_COLS
    sj = min(j0 + sc, dv - 1)
    for r in range(CH_ROWS):
        i = sp + r * CH_SP
        ss[i, sc] = state[h, i, sj] if i < dk else float32(0.0)
    # products: thread (pt, pc) holds tokens pt and Tc-1-pt (as much intra-chunk work each) of
    # column j0 + pc; the chunk matrix: thread tid the 2x2 tile (ti, tj)
    pc = tid % CH_COLS
    pt = tid // CH_COLS
    pt1 = CH_T - 1 - pt
    pj = j0 + pc
    pjc = min(pj, dv - 1)
    ti = tid // (CH_T // 2)
    tj = tid % (CH_T // 2)
    for c0 in range(0, T, CH_T):
        n = min(CH_T, T - c0)
        # q / k rows, a warp a row: L2-normalized in place (q also scaled by Dk^-0.5)
        for row in range(warp, 2 * CH_T, CH_THREADS // WARP):
            isk = row >= CH_T
            t = row - CH_T if isk else row
            base = CH_KOFF + t * CH_KS if isk else t * CH_KS
            col = k0 if isk else q0
            tt = c0 + min(t, n - 1)
            ssq = float32(0.0)
            for e in range(lane, dk, WARP):
                x = qkv[tt, col + e] if t < n else float32(0.0)
                kq[base + e] = x
                ssq += x * x
            ssq = warp_sum(ssq, red)
            inv = float32(1.0) / math.sqrt(ssq + float32(L2_EPS))
            if not isk:
                inv *= scale
            for e in range(lane, dk, WARP):
                kq[base + e] *= inv
        if tid < CH_T:
            b, g = float32(0.0), float32(0.0)
            if tid < n:
                b, g = _gate_vals(ba[c0 + tid, h], ba[c0 + tid, nv + h], neg_a[h], dt_bias[h])
            bt[tid] = b
            gl[tid] = g
        cuda.syncthreads()
        if tid < CH_T:
            acc = float32(0.0)
            tot = float32(0.0)
            for j in range(CH_T):
                tot += gl[j]
                if j == tid:
                    acc = tot
            gc[tid] = acc
            fl[tid] = math.exp(tot - acc)
        cuda.syncthreads()
        if tid < (CH_T // 2) ** 2:
            # tile rows r0, r0+1 x columns c1, c1+1: a on / below the diagonal (P: q rows), k
            # rows above it (A transposed, symmetric in k); the diagonal tile's (r0, r0+1) is A
            r0 = 2 * ti
            c1 = 2 * tj
            lower = tj <= ti
            diag = tj == ti
            a0 = r0 * CH_KS if lower else CH_KOFF + r0 * CH_KS
            b0 = CH_KOFF + c1 * CH_KS
            d00 = float32(0.0)
            d01 = float32(0.0)
            d10 = float32(0.0)
            d11 = float32(0.0)
            for e in range(dk):
                x0 = kq[a0 + e]
                x1 = kq[a0 + CH_KS + e]
                y0 = kq[b0 + e]
                y1 = kq[b0 + CH_KS + e]
                d00 += x0 * y0
                d10 += x1 * y0
                d11 += x1 * y1
                d01 += (y0 if diag else x0) * y1
            m[r0, c1] = _decayed(d00, r0, c1, gc, bt)
            m[r0, c1 + 1] = _decayed(d01, r0, c1 + 1, gc, bt)
            m[r0 + 1, c1] = _decayed(d10, r0 + 1, c1, gc, bt)
            m[r0 + 1, c1 + 1] = _decayed(d11, r0 + 1, c1 + 1, gc, bt)
        o0 = float32(0.0)
        o1 = float32(0.0)
        if pt < CH_T // 2:
            # k S and q S of tokens pt, pt1 against the chunk-start state
            ka = float32(0.0)
            kb = float32(0.0)
            for e in range(dk):
                sv = ss[e, pc]
                ka += kq[CH_KOFF + pt * CH_KS + e] * sv
                kb += kq[CH_KOFF + pt1 * CH_KS + e] * sv
                o0 += kq[pt * CH_KS + e] * sv
                o1 += kq[pt1 * CH_KS + e] * sv
            e0 = math.exp(gc[pt])
            e1 = math.exp(gc[pt1])
            o0 *= e0
            o1 *= e1
            u[pt, pc] = bt[pt] * (qkv[c0 + min(pt, n - 1), v0 + pjc] - e0 * ka)
            u[pt1, pc] = bt[pt1] * (qkv[c0 + min(pt1, n - 1), v0 + pjc] - e1 * kb)
        cuda.syncthreads()
        # forward substitution, columns 2 warp and 2 warp + 1: lane i keeps row i, final once
        # the rows above it are; it publishes it at step i
        ca = 2 * warp
        ua = float32(0.0)
        ub = float32(0.0)
        if lane < CH_T:
            ua = u[lane, ca]
            ub = u[lane, ca + 1]
        for j in range(n):
            if lane == j:
                u[j, ca] = ua
                u[j, ca + 1] = ub
            warp_sync()
            if j < lane and lane < n:
                aij = m[j, lane]
                ua -= aij * u[j, ca]
                ub -= aij * u[j, ca + 1]
        cuda.syncthreads()
        if pt < CH_T // 2:
            for j in range(pt + 1):
                o0 += m[pt, j] * u[j, pc]
            for j in range(pt1 + 1):
                o1 += m[pt1, j] * u[j, pc]
            if pj < dv:
                if pt < n:
                    out[c0 + pt, h * dv + pj] = o0
                if pt1 < n:
                    out[c0 + pt1, h * dv + pj] = o1
        # S only in shared memory between chunks: in registers too it spilled at 128 (2 blocks an SM)
        dl = math.exp(gc[CH_T - 1])
        for r in range(CH_ROWS):
            sreg[r] = ss[sp + r * CH_SP, sc] * dl
        for t in range(n):
            w = fl[t] * u[t, sc]
            for r in range(CH_ROWS):
                i = sp + r * CH_SP
                if i < dk:
                    sreg[r] += kq[CH_KOFF + t * CH_KS + i] * w
        for r in range(CH_ROWS):
            ss[sp + r * CH_SP, sc] = sreg[r]
        cuda.syncthreads()                      # before the next chunk's rows, gates and ss reads
    if j0 + sc < dv:
        for r in range(CH_ROWS):
            i = sp + r * CH_SP
            if i < dk:
                state[h, i, j0 + sc] = ss[i, sc]


def delta_rule_chunked(qkv, ba, neg_a, dt_bias, nk, state, out, stream):
    """delta_rule's contract, run chunk-parallel (prefill): CH_T tokens a chunk, one state update
    per chunk instead of per token; needs Dk <= CH_DK. No scratch: a block's working set is in
    shared memory (48 KB at Dk = 128)."""
    nv, dk, dv = state.shape
    if dk > CH_DK:
        raise ValueError(f"DeltaNet key head dim {dk} exceeds CH_DK={CH_DK} (the chunked kernel)")
    _delta_rule_chunked[(nv, cdiv(dv, CH_COLS)), CH_THREADS, stream](qkv, ba, neg_a, dt_bias,
                                                                     int32(nk), state, out)


# ---- gated RMSNorm, sigmoid gates, zero fill --------------------------------------------------

@pdl_kernel
@cuda.jit
def _rmsnorm_gated(x, z, w, eps, out):
    """x, z [T, G N] (G heads of N) -> out [T, G N] = w * x / rms(x) * silu(z) per head;
    one warp per (token, head)."""
    pdl_wait()
    pdl_trigger()
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


@pdl_kernel
@cuda.jit
def _sigmoid_gate(x, gate):
    pdl_wait()
    pdl_trigger()
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
