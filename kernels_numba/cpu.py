"""The CPU backend: numba @njit kernels and the op set model code calls.

Legend: T = tokens, H = hidden, D = head dim, Hq / Hkv = query / key-value heads, S = cached
positions, E = experts, K = top-k, I = expert intermediate, V = vocab, N = output rows.
Weights are float32 or bfloat16 bits (uint16); activations are float32.
Expert blocks are uint8 arrays laid out as loader/layout.py documents; kernels get the layout
as an int64 array [gate_q, gate_s, up_q, up_s, down_q, down_s, H, I, Hp, Ip].
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kernels_numba import reference
from kernels_numba.cpu_deltanet import DeltaNetOps
from kernels_numba.cpu_mamba import MambaOps
from kernels_numba.cpu_shortconv import ShortConvOps

# ---- number formats --------------------------------------------------------------------------

@njit(inline="always")
def _bf16(bits):
    # bfloat16 bits -> float32: the high half of an IEEE float32
    return np.uint32(bits) << np.uint32(16)


@njit(cache=True, nogil=True)
def bf16_to_f32_array(bits):
    out = np.empty(bits.shape, dtype=np.float32)
    ob = out.reshape(-1).view(np.uint32)
    ib = bits.reshape(-1)
    for i in range(ib.shape[0]):
        ob[i] = np.uint32(ib[i]) << np.uint32(16)
    return out


# ---- dense kernels ---------------------------------------------------------------------------
# The reductions may be reassociated and contracted (fastmath "reassoc", "contract", not the
# flags that assume no NaN / inf): LLVM then splits a dot product over SIMD lanes and several
# accumulators instead of one dependent add a term. The matvecs ran 3-20x faster on the CPU
# machine (docs/PERF.md) and stay closer to numpy's pairwise sums (2.7e-7 vs 9.3e-7 relative).
FM = {"reassoc", "contract"}


@njit(parallel=True, cache=True, nogil=True, fastmath=FM)
def matvec_f32(w, x, out):
    """w [N, K] f32, x [K] f32 -> out [N]."""
    n, k = w.shape
    for i in prange(n):
        acc = np.float32(0.0)
        for j in range(k):
            acc += w[i, j] * x[j]
        out[i] = acc


@njit(parallel=True, cache=True, nogil=True, fastmath=FM)
def matvec_bf16(w, x, out):
    """w [N, K] uint16 (bf16 bits), x [K] f32 -> out [N]."""
    n, k = w.shape
    for i in prange(n):
        acc = np.float32(0.0)
        row = w[i]
        for j in range(k):
            acc += np.uint32(np.uint32(row[j]) << np.uint32(16)).view(np.float32) * x[j]
        out[i] = acc


@njit(parallel=True, cache=True, nogil=True, fastmath=FM)
def gemm_bf16(x, w, out):
    """x [T, K] f32, w [N, K] uint16 (bf16 bits) -> out [T, N]; one pass over each weight row.
    Rows go four at a time (decoded once into float32), so each x value loaded serves four
    sums: 2-6x the one-row loop on the CPU machine (prefill's projections, docs/PERF.md)."""
    t, k = x.shape
    n = w.shape[0]
    for b in prange((n + 3) // 4):
        r0 = b * 4
        nr = min(4, n - r0)
        rows = np.zeros((4, k), dtype=np.float32)   # rows past n stay zero
        for r in range(nr):
            for j in range(k):
                rows[r, j] = np.uint32(np.uint32(w[r0 + r, j]) << np.uint32(16)).view(np.float32)
        for tt in range(t):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for j in range(k):
                xv = x[tt, j]
                a0 += rows[0, j] * xv
                a1 += rows[1, j] * xv
                a2 += rows[2, j] * xv
                a3 += rows[3, j] * xv
            out[tt, r0] = a0
            if nr > 1:
                out[tt, r0 + 1] = a1
            if nr > 2:
                out[tt, r0 + 2] = a2
            if nr > 3:
                out[tt, r0 + 3] = a3


@njit(parallel=True, cache=True, nogil=True)
def rmsnorm_rows(x, w, eps, out):
    """x [R, N] f32, w [N] f32 -> out [R, N]: each row normalized (rows = tokens or heads)."""
    r, n = x.shape
    for i in prange(r):
        ss = 0.0
        for j in range(n):
            ss += np.float64(x[i, j]) * x[i, j]
        inv = np.float32(1.0 / math.sqrt(ss / n + eps))
        for j in range(n):
            out[i, j] = w[j] * (x[i, j] * inv)


@njit(parallel=True, cache=True, nogil=True)
def rope_inplace(x, positions, inv_freq, scaling):
    """x [T, nH, D] f32 rotated in place (rotate-half) on its first 2*len(inv_freq) dims."""
    t, nh, d = x.shape
    r2 = inv_freq.shape[0]
    for ti in prange(t):
        p = np.float32(positions[ti])
        for f in range(r2):
            ang = p * inv_freq[f]
            c = np.float32(math.cos(ang)) * np.float32(scaling)
            s = np.float32(math.sin(ang)) * np.float32(scaling)
            for h in range(nh):
                a = x[ti, h, f]
                b = x[ti, h, f + r2]
                x[ti, h, f] = a * c - b * s
                x[ti, h, f + r2] = b * c + a * s


@njit(parallel=True, cache=True, nogil=True, fastmath=FM)
def attention_gqa(q, kc, vc, q_pos, scale, window, sinks, out):
    """Causal GQA over a KV cache.

    q [T, Hq, D]; kc, vc [S_max, Hkv, D] (row j = position j); q_pos int [T];
    key j is seen when j <= q_pos[t] and (window == 0 or q_pos[t] - j < window) -> out [T, Hq, D].
    sinks f32 [Hq] or [0] (none): a logit per head that joins the softmax's denominator only.
    """
    t, hq, d = q.shape
    hkv = kc.shape[1]
    group = hq // hkv
    for idx in prange(t * hq):
        ti = idx // hq
        h = idx % hq
        kv = h // group
        p = q_pos[ti]
        lo = 0
        if window > 0:
            lo = max(0, p - window + 1)
        n = p + 1 - lo
        sc = np.empty(n, dtype=np.float32)
        m = -np.inf
        for j in range(n):
            acc = np.float32(0.0)
            for e in range(d):
                acc += q[ti, h, e] * kc[lo + j, kv, e]
            acc *= scale
            sc[j] = acc
            if acc > m:
                m = acc
        tot = np.float32(0.0)
        if sinks.shape[0] > 0:
            if sinks[h] > m:
                m = sinks[h]
            tot += math.exp(sinks[h] - m)
        for j in range(n):
            sc[j] = math.exp(sc[j] - m)
            tot += sc[j]
        for e in range(d):
            out[ti, h, e] = 0.0
        for j in range(n):
            pj = sc[j] / tot
            for e in range(d):
                out[ti, h, e] += pj * vc[lo + j, kv, e]


@njit(cache=True, nogil=True)
def _softmax_row(x, out):
    """out [E] = softmax(x [E]) in float32, the max subtracted first."""
    m = x[0]
    for j in range(x.shape[0]):
        if x[j] > m:
            m = x[j]
    tot = np.float32(0.0)
    for j in range(x.shape[0]):
        out[j] = math.exp(x[j] - m)
        tot += out[j]
    for j in range(x.shape[0]):
        out[j] /= tot


@njit(cache=True, nogil=True)
def router_topk(logits, k, norm, ids, weights):
    """logits [T, E] f32 -> ids int32 [T, K], weights f32 [T, K].

    softmax in float32 over all experts, the k largest (lower index first on ties), divided
    by their p-norm, p = norm: 0 none, 1 their sum (renormalized), 2 their 2-norm
    (reference.router_topk).
    """
    t, e = logits.shape
    for ti in range(t):
        p = np.empty(e, dtype=np.float32)
        _softmax_row(logits[ti], p)
        taken = np.zeros(e, dtype=np.bool_)
        s = np.float32(0.0)
        s2 = np.float32(0.0)
        for kk in range(k):
            best = -1
            for j in range(e):
                if not taken[j] and (best < 0 or p[j] > p[best]):
                    best = j
            taken[best] = True
            ids[ti, kk] = best
            weights[ti, kk] = p[best]
            s += p[best]
            s2 += p[best] * p[best]
        if norm == 2:
            s = np.float32(np.sqrt(s2))
        if norm:
            for kk in range(k):
                weights[ti, kk] /= s


@njit(cache=True, nogil=True)
def router_sigmoid_topk(logits, bias, k, n_group, topk_group, norm, scale, ids, weights,
                        softmax=False):
    """logits [T, E] f32, bias [E] f32 -> ids int32 [T, K], weights f32 [T, K]: sigmoid scores,
    chosen on score + bias within the topk_group best of n_group groups (a group's worth: its
    two best choice scores summed), the k largest (lower index first on ties); weights the
    scores, renormalized (sum + 1e-20) when norm, times scale. reference.router_sigmoid_topk.
    softmax: softmax scores (ERNIE-4.5, one group: reference.router_softmax_bias_topk)."""
    t, e = logits.shape
    per = e // n_group
    for ti in range(t):
        sc = np.empty(e, dtype=np.float32)
        ch = np.empty(e, dtype=np.float32)
        if softmax:
            _softmax_row(logits[ti], sc)
        else:
            for j in range(e):
                sc[j] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-logits[ti, j])))
        for j in range(e):
            ch[j] = sc[j] + bias[j]
        allowed = np.ones(e, dtype=np.bool_)
        if topk_group < n_group:
            gsum = np.empty(n_group, dtype=np.float32)
            for g in range(n_group):
                b1 = np.float32(-np.inf)
                b2 = np.float32(-np.inf)
                for j in range(g * per, (g + 1) * per):
                    if ch[j] > b1:
                        b2 = b1
                        b1 = ch[j]
                    elif ch[j] > b2:
                        b2 = ch[j]
                gsum[g] = b1 + (b2 if per > 1 else np.float32(0.0))
            gtaken = np.zeros(n_group, dtype=np.bool_)
            for kk in range(topk_group):
                best = -1
                for g in range(n_group):
                    if not gtaken[g] and (best < 0 or gsum[g] > gsum[best]):
                        best = g
                gtaken[best] = True
            for j in range(e):
                allowed[j] = gtaken[j // per]
        taken = np.zeros(e, dtype=np.bool_)
        tot = np.float32(0.0)
        for kk in range(k):
            best = -1
            for j in range(e):
                if allowed[j] and not taken[j] and (best < 0 or ch[j] > ch[best]):
                    best = j
            taken[best] = True
            ids[ti, kk] = best
            weights[ti, kk] = sc[best]
            tot += sc[best]
        for kk in range(k):
            if norm:
                weights[ti, kk] /= tot + np.float32(1e-20)
            weights[ti, kk] *= np.float32(scale)


# ---- expert kernels (quantized blocks) -------------------------------------------------------

@njit(inline="always")
def _e4m3(b):
    """An E4M3 byte as float32 from its bits (no table gather, so a row's loop vectorizes):
    exponent field E > 0: 2^(E - 7) (1 + M / 8) is f32 exponent E + 120 over the same 3 mantissa
    bits; E = 0: M 2^-9; S.1111.111: NaN."""
    u = np.uint32(b)
    em = u & np.uint32(0x7F)
    if em >= 8:
        f = np.uint32((em << np.uint32(20)) + np.uint32(120 << 23)).view(np.float32)
    else:
        f = np.float32(em) * np.float32(2.0 ** -9)
    if em == 0x7F:
        f = np.float32(np.nan)
    return -f if u & np.uint32(0x80) else f


@njit(inline="always")
def _e2m1(c):
    """An E2M1 code (4 bits) as float32 from its bits: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    m = np.uint32(c) & np.uint32(7)
    if m >= 2:
        f = np.uint32((m << np.uint32(22)) + np.uint32(126 << 23)).view(np.float32)
    else:
        f = np.float32(m) * np.float32(0.5)
    return -f if np.uint32(c) & np.uint32(8) else f


# Every row loop below reads its row through a slice (a view): indexing the block itself with
# a computed offset makes numba test each index for wraparound, which stops LLVM vectorizing
# the loop (the E4M3 row dot 10x, the E2M1 one 6x slower on the CPU machine); and values are
# decoded from their bits (_e2m1, _e4m3), not gathered from a table, for the same reason.

@njit(inline="always")
def _decode_row(fmt, block, q_off, s_off, gscale, r, k, kp, buf, tmp):
    """Row r of one of a block's matrices -> buf[:k] float32 (buf holds kp; padded columns
    decode to 0), its scales applied. fmt 2 NVFP4 (row stride kp/2 bytes, a scale each 16
    values; tmp: f32 scratch [kp]), 1 FP8 (a float32 scale a row), 0 bf16. A row is decoded
    once for all the tokens that use it."""
    if fmt == 2:
        qr = block[q_off + r * (kp // 2):q_off + (r + 1) * (kp // 2)]
        sr = block[s_off + r * (kp // 16):s_off + (r + 1) * (kp // 16)]
        nb = kp // 2
        lo, hi = tmp[:nb], tmp[nb:kp]   # even and odd values apart first: both loops vectorize
        for j in range(nb):
            lo[j] = _e2m1(qr[j] & 0xF)
            hi[j] = _e2m1(qr[j] >> 4)
        for g in range(kp // 16):
            sc = _e4m3(sr[g]) * gscale
            for b in range(8):
                buf[g * 16 + 2 * b] = lo[g * 8 + b] * sc
                buf[g * 16 + 2 * b + 1] = hi[g * 8 + b] * sc
    elif fmt == 1:
        qr = block[q_off + r * k:q_off + (r + 1) * k]
        sc = block[s_off + 4 * r:s_off + 4 * r + 4].view(np.float32)[0]
        for j in range(k):
            buf[j] = _e4m3(qr[j]) * sc
    else:
        # the row's bytes seen as uint16 (little-endian bf16 bits)
        row = block[q_off + 2 * r * k:q_off + 2 * (r + 1) * k].view(np.uint16)
        for j in range(k):
            buf[j] = np.uint32(np.uint32(row[j]) << np.uint32(16)).view(np.float32)


@njit(inline="always")
def _rows_nvfp4(block, q_off, s_off, gscale, r, kp, x, k, pairs):
    """dot(row r of an NVFP4 matrix, x[:k]); row stride kp/2 bytes, kp/16 scales. pairs: f32
    scratch [kp / 2]: each byte's two products first (one vectorized pass), then the sums of
    16 under their scale."""
    qr = block[q_off + r * (kp // 2):q_off + (r + 1) * (kp // 2)]
    sr = block[s_off + r * (kp // 16):s_off + (r + 1) * (kp // 16)]
    full = k // 2   # bytes whose two values both lie within x
    for j in range(full):
        pairs[j] = _e2m1(qr[j] & 0xF) * x[2 * j] + _e2m1(qr[j] >> 4) * x[2 * j + 1]
    for j in range(full, kp // 2):   # a padded row's tail: an odd k's last value, then zeros
        pairs[j] = _e2m1(qr[j] & 0xF) * x[2 * j] if 2 * j < k else np.float32(0.0)
    acc = np.float32(0.0)
    for g in range(kp // 16):
        part = np.float32(0.0)
        for b in range(8):
            part += pairs[g * 8 + b]
        acc += part * _e4m3(sr[g])
    return acc * gscale


@njit(inline="always")
def _rows_fp8(block, q_off, s_off, r, k, x):
    qr = block[q_off + r * k:q_off + (r + 1) * k]
    acc = np.float32(0.0)
    for j in range(k):
        acc += _e4m3(qr[j]) * x[j]
    return acc * block[s_off + 4 * r:s_off + 4 * r + 4].view(np.float32)[0]


@njit(inline="always")
def _rows_bf16(block, q_off, r, k, x):
    # the row's bytes seen as uint16 (little-endian bf16 bits)
    row = block[q_off + 2 * r * k:q_off + 2 * (r + 1) * k].view(np.uint16)
    acc = np.float32(0.0)
    for j in range(k):
        acc += np.uint32(np.uint32(row[j]) << np.uint32(16)).view(np.float32) * x[j]
    return acc


@njit(inline="always")
def _row_dot(fmt, block, q_off, s_off, gscale, r, k, kp, x, pairs):
    if fmt == 2:
        return _rows_nvfp4(block, q_off, s_off, gscale, r, kp, x, k, pairs)
    if fmt == 1:
        return _rows_fp8(block, q_off, s_off, r, k, x)
    return _rows_bf16(block, q_off, r, k, x)


ROWS_A_TASK = 16   # rows a parallel task decodes (its scratch rows are allocated once a task)
RELU2 = 4          # expert_block_mlp's mode for an ungated block: no gate rows are read


@njit(inline="always")
def _glu(clamped, g, u, alpha, limit):
    """The expert's activation of one gate / up pair: SwiGLU; clamped 1 (True): gpt-oss's form
    (the gate clamped from above, up to +-limit, (u + 1) * g * sigmoid(alpha g)); 2: DeepSeek-V4's
    (the same clamps, then SwiGLU); 3: Step-3.5's (SiLU of the gate, then the same clamps);
    RELU2: an ungated expert's relu(u)^2 (Nemotron-H; g unused)."""
    if not clamped:
        return g / (np.float32(1.0) + math.exp(-g)) * u
    if clamped == RELU2:
        r = max(u, np.float32(0.0))
        return r * r
    if clamped == 3:
        return min(g / (np.float32(1.0) + math.exp(-g)), limit) * min(max(u, -limit), limit)
    g = min(g, limit)
    u = min(max(u, -limit), limit)
    if clamped == 2:
        return g / (np.float32(1.0) + math.exp(-g)) * u
    return (u + np.float32(1.0)) * g / (np.float32(1.0) + math.exp(-alpha * g))


@njit(parallel=True, cache=True, nogil=True, fastmath=FM)
def expert_block_mlp(fmt, block, lay, x, out, clamped, bias, alpha, limit):
    """One expert from its block over tokens: x [T, H] f32 -> out [T, H] f32.

    fmt: 0 bf16, 1 fp8, 2 nvfp4; lay int64 [10] (see module doc). clamped: _glu's mode (0
    SwiGLU, 1 gpt-oss's with alpha and limit, 2 DeepSeek-V4's with limit, 3 Step-3.5's, RELU2 an
    ungated block's relu^2 of up); bias f32 [2I + H] (gate, up, down biases) or empty. One token:
    each row is dotted with it as it is read (_row_dot), rows in tasks of ROWS_A_TASK, each with
    its scratch. More: rows are decoded once into float32 scratch rows and summed with 4 tokens
    at a time (_sums4x4; decoding a row for one token made bf16 2.2x and fp8 1.3x slower on the
    CPU machine)."""
    h, i_dim, hp, ip = lay[6], lay[7], lay[8], lay[9]
    gs = block[0:12].view(np.float32)
    t = x.shape[0]
    biased = bias.shape[0] > 0
    alpha, limit = np.float32(alpha), np.float32(limit)
    if t == 1:
        act = np.empty((1, i_dim), dtype=np.float32)
        for c in prange((i_dim + ROWS_A_TASK - 1) // ROWS_A_TASK):
            pairs = np.empty(hp // 2, dtype=np.float32)
            for idx in range(c * ROWS_A_TASK, min((c + 1) * ROWS_A_TASK, i_dim)):
                g = np.float32(0.0) if clamped == RELU2 else \
                    _row_dot(fmt, block, lay[0], lay[1], gs[0], idx, h, hp, x[0], pairs)
                u = _row_dot(fmt, block, lay[2], lay[3], gs[1], idx, h, hp, x[0], pairs)
                if biased:
                    g += bias[idx]
                    u += bias[i_dim + idx]
                act[0, idx] = _glu(clamped, g, u, alpha, limit)
        for c in prange((h + ROWS_A_TASK - 1) // ROWS_A_TASK):
            pairs = np.empty(ip // 2, dtype=np.float32)
            for r in range(c * ROWS_A_TASK, min((c + 1) * ROWS_A_TASK, h)):
                o = _row_dot(fmt, block, lay[4], lay[5], gs[2], r, i_dim, ip, act[0], pairs)
                out[0, r] = o + bias[2 * i_dim + r] if biased else o
        return
    # Two or more tokens: rows decoded once into float32 scratch rows, then 4 tokens x 4 rows
    # of sums at a time (gate: 2 rows beside their 2 up rows), so each value loaded serves four
    # products. Tokens padded to a multiple of 4 with zero rows (their sums are dropped).
    tp = (t + 3) // 4 * 4
    xp = np.zeros((tp, hp), dtype=np.float32)
    xp[:t, :h] = x
    actp = np.zeros((tp, ip), dtype=np.float32)
    for c in prange((i_dim + 1) // 2):
        r0 = 2 * c
        nr = min(2, i_dim - r0)
        w = np.zeros((4, hp), dtype=np.float32)   # gate r0, gate r0 + 1, up r0, up r0 + 1
        tmp = np.empty(hp, dtype=np.float32)
        for r in range(nr):
            if clamped != RELU2:   # an ungated block has no gate rows: theirs stay zero
                _decode_row(fmt, block, lay[0], lay[1], gs[0], r0 + r, h, hp, w[r], tmp)
            _decode_row(fmt, block, lay[2], lay[3], gs[1], r0 + r, h, hp, w[2 + r], tmp)
        for t0 in range(0, tp, 4):
            s = _sums4x4(w, xp, t0, hp)
            for r in range(nr):
                gb = bias[r0 + r] if biased else np.float32(0.0)
                ub = bias[i_dim + r0 + r] if biased else np.float32(0.0)
                for q in range(4):
                    actp[t0 + q, r0 + r] = _glu(clamped, s[r, q] + gb, s[2 + r, q] + ub,
                                                alpha, limit)
    for c in prange((h + 3) // 4):
        r0 = 4 * c
        nr = min(4, h - r0)
        w = np.zeros((4, ip), dtype=np.float32)
        tmp = np.empty(ip, dtype=np.float32)
        for r in range(nr):
            _decode_row(fmt, block, lay[4], lay[5], gs[2], r0 + r, i_dim, ip, w[r], tmp)
        for t0 in range(0, tp, 4):
            s = _sums4x4(w, actp, t0, ip)
            for r in range(nr):
                db = bias[2 * i_dim + r0 + r] if biased else np.float32(0.0)
                for q in range(min(4, t - t0)):
                    out[t0 + q, r0 + r] = s[r, q] + db


@njit(inline="always", fastmath=FM)
def _sums4x4(w, x, t0, k):
    """[4, 4] f32: dot(w[r, :k], x[t0 + q, :k]) for 4 rows r and 4 tokens q, in one pass."""
    x0, x1, x2, x3 = x[t0], x[t0 + 1], x[t0 + 2], x[t0 + 3]
    w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for j in range(k):
        v0, v1, v2, v3 = x0[j], x1[j], x2[j], x3[j]
        a00 += w0[j] * v0
        a01 += w0[j] * v1
        a02 += w0[j] * v2
        a03 += w0[j] * v3
        a10 += w1[j] * v0
        a11 += w1[j] * v1
        a12 += w1[j] * v2
        a13 += w1[j] * v3
        a20 += w2[j] * v0
        a21 += w2[j] * v1
        a22 += w2[j] * v2
        a23 += w2[j] * v3
        a30 += w3[j] * v0
        a31 += w3[j] * v1
        a32 += w3[j] * v2
        a33 += w3[j] * v3
    s = np.empty((4, 4), dtype=np.float32)
    s[0, 0], s[0, 1], s[0, 2], s[0, 3] = a00, a01, a02, a03
    s[1, 0], s[1, 1], s[1, 2], s[1, 3] = a10, a11, a12, a13
    s[2, 0], s[2, 1], s[2, 2], s[2, 3] = a20, a21, a22, a23
    s[3, 0], s[3, 1], s[3, 2], s[3, 3] = a30, a31, a32, a33
    return s


# ---- sampling --------------------------------------------------------------------------------

SAMPLE_BUCKETS = 256   # tokens binned by (max - logit) / temperature in steps of 1/4


@njit(cache=True, nogil=True)
def sample_logits(logits, temperature, top_k, top_p, u):
    """logits [V] f32 -> token id. temperature <= 0 is greedy; u in [0, 1) drives the draw.

    Same distribution as reference.sample_probs, drawn by inverse CDF: in vocabulary order when
    nothing is cut (top_k 0, top_p 1), else in probability order, where only the most likely
    tokens that can matter are sorted: one pass bins every token by its
    probability, and the bins are taken from the top until they hold top_k tokens or the mass the
    draw needs (a full sort of a 150k vocabulary costs tens of milliseconds a token).
    """
    v = logits.shape[0]
    best = 0
    for j in range(v):
        if logits[j] > logits[best]:
            best = j
    if temperature <= 0.0:
        return best
    m = np.float64(logits[best])
    if top_k <= 0 and top_p >= 1.0:
        # nothing is cut: any fixed order gives the same distribution, and vocabulary order
        # needs no sort (a flat distribution would otherwise sort most of the vocabulary)
        e = np.empty(v, dtype=np.float64)   # each exp once (they are most of the cost)
        tot = 0.0
        for j in range(v):
            e[j] = math.exp((np.float64(logits[j]) - m) / temperature)
            tot += e[j]
        target = u * tot
        c = 0.0
        for j in range(v):
            c += e[j]
            if c > target:
                return j
        return v - 1
    nb = SAMPLE_BUCKETS
    bmass = np.zeros(nb, dtype=np.float64)
    bcount = np.zeros(nb, dtype=np.int64)
    tot = 0.0
    for j in range(v):
        z = (m - np.float64(logits[j])) / temperature
        b = min(int(z * 4.0), nb - 1)
        e = math.exp(-z)
        bmass[b] += e
        bcount[b] += 1
        tot += e
    # mass the draw may reach: the nucleus (top_p) or the inverse-CDF point (u)
    need = (top_p if top_p < 1.0 else u) * tot
    k = v if top_k <= 0 else min(top_k, v)
    cnt = 0
    mass = 0.0
    last = nb - 1
    for b in range(nb):
        cnt += bcount[b]
        mass += bmass[b]
        if cnt >= k or (top_k <= 0 and mass > need * (1.0 + 1e-9)):
            last = b
            break
    if top_k <= 0 and last < nb - 1:
        last += 1    # one bin of slack against rounding in the running sums
    cand = np.empty(bcount[:last + 1].sum(), dtype=np.int64)
    nc = 0
    for j in range(v):
        z = (m - np.float64(logits[j])) / temperature
        if min(int(z * 4.0), nb - 1) <= last:
            cand[nc] = j
            nc += 1
    order = cand[np.argsort(-logits[cand], kind="mergesort")]
    n = nc if top_k <= 0 else min(k, nc)
    p = np.empty(n, dtype=np.float64)
    ptot = 0.0
    for i in range(n):
        p[i] = math.exp((np.float64(logits[order[i]]) - m) / temperature)
        ptot += p[i]
    if top_k <= 0:
        ptot = tot          # the candidates are a prefix; the rest of the vocabulary adds mass
    if top_p < 1.0:
        c = 0.0
        cut = n
        for i in range(n):
            c += p[i] / ptot
            if c >= top_p:
                cut = i + 1
                break
        n = cut
        ptot = 0.0
        for i in range(n):
            ptot += p[i]
    target = u * ptot
    c = 0.0
    for i in range(n):
        c += p[i]
        if c > target:
            return order[i]
    return order[n - 1]


# ---- the op set ------------------------------------------------------------------------------

FMT_CODE = {"bf16": 0, "fp8": 1, "nvfp4": 2}
_NO_SINKS = np.zeros(0, dtype=np.float32)
_NO_BIAS = np.zeros(0, dtype=np.float32)


def _is_block(weights) -> bool:
    """(fmt, block, layout): an expert as its arena block, not dense (gate, up, down)."""
    return len(weights) == 3 and isinstance(weights[0], str)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even, NaN kept), as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32)
    out = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
           & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(x), x, out)


class CpuOps:
    """The CPU backend's ops over numpy arrays. Model code calls these, never the kernels."""

    name = "cpu"
    deltanet = DeltaNetOps()    # the hybrid families' ops (Gated DeltaNet, gated norms and outputs)
    mamba = MambaOps()          # Nemotron-H's Mamba-2 mixer (conv with bias, selective scan, group norm)
    shortconv = ShortConvOps()  # LFM2's gated short conv (B * x through a causal conv, times C)

    def weight(self, a: np.ndarray) -> np.ndarray:
        """A dense weight as the backend keeps it: float32, or bf16 bits for matrices. A vector
        stored as one row ([1, N]: ERNIE-4.5's selection bias) is a vector."""
        if a.dtype == np.uint16 and a.size == a.shape[-1]:
            return bf16_to_f32_array(np.ascontiguousarray(a).reshape(-1)).reshape(a.shape)
        if a.dtype == np.uint16:
            return np.ascontiguousarray(a)
        return np.ascontiguousarray(a, dtype=np.float32)

    def zeros(self, shape) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    def add_(self, x: np.ndarray, y: np.ndarray) -> None:
        """x += y (y broadcast over leading axes)."""
        x += y

    def clip_(self, x: np.ndarray, limit: float) -> None:
        np.clip(x, -limit, limit, out=x)

    def kv_store(self, kc, vc, start: int, k, v, bf16: bool = False) -> None:
        """Write k, v [T, Hkv, D] into cache rows start..start+T-1; bf16: rounded to bfloat16
        values first (as the cuda backend's bf16 cache stores them)."""
        kc[start:start + k.shape[0]] = round_bf16(k) if bf16 else k
        vc[start:start + v.shape[0]] = round_bf16(v) if bf16 else v

    def take_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x[rows])

    def per_head_linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x [T, H, A] f32, w [H, A, B] f32 -> [T, H, B]: each head's rows times its own matrix
        (numpy's batched matmul, a BLAS call a head)."""
        return np.ascontiguousarray(np.matmul(x.transpose(1, 0, 2), w).transpose(1, 0, 2))

    def scatter_add_rows(self, out: np.ndarray, rows: np.ndarray, y: np.ndarray, scale: np.ndarray):
        """out[rows[i]] += scale[i] * y[i]. A row may repeat (a token routed to one expert twice:
        DeepSeek-V4's hash tables do not forbid it): each adds."""
        if len(np.unique(rows)) == len(rows):
            out[rows] += y * scale[:, None]
        else:
            np.add.at(out, rows, y * scale[:, None])

    def embed(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        rows = table[ids]
        return bf16_to_f32_array(rows) if rows.dtype == np.uint16 else rows.astype(np.float32)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x [T, K] f32, w [N, K] -> [T, N] f32."""
        t = x.shape[0]
        out = np.empty((t, w.shape[0]), dtype=np.float32)
        if w.dtype == np.uint16:
            if t == 1:
                matvec_bf16(w, x[0], out[0])
            else:
                gemm_bf16(np.ascontiguousarray(x), w, out)
        elif t == 1:
            matvec_f32(w, x[0], out[0])
        else:
            np.matmul(x, w.T, out=out)
        return out

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """Normalizes the last axis of x (any leading shape)."""
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        rmsnorm_rows(flat, w, eps, out)
        return out.reshape(x.shape)

    def layernorm(self, x: np.ndarray, w: np.ndarray, eps: float, bias=None) -> np.ndarray:
        """LayerNorm of the last axis of x, in float32, times w, plus bias where given
        (reference.layernorm without bias)."""
        x = np.asarray(x, np.float32)
        x = x - x.mean(-1, keepdims=True)
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * w
        return (y if bias is None else y + bias).astype(np.float32)

    def rope(self, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scaling: float):
        rope_inplace(x, positions, inv_freq, scaling)
        return x

    def attention(self, q, kc, vc, q_pos, scale, window=0, sinks=None):
        """sinks: f32 [Hq] attention-sink logits (gpt-oss), or None."""
        out = np.empty(q.shape, dtype=np.float32)
        sk = _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
        attention_gqa(q, kc, vc, q_pos, np.float32(scale), window, sk, out)
        return out

    def router(self, logits: np.ndarray, k: int, norm: int):
        """softmax top-k; norm: the weights over their p-norm, 0 / False none, 1 / True sum, 2."""
        t = logits.shape[0]
        ids = np.empty((t, k), dtype=np.int32)
        w = np.empty((t, k), dtype=np.float32)
        router_topk(np.ascontiguousarray(logits, dtype=np.float32), k, int(norm), ids, w)
        return ids, w

    def router_sparsemixer(self, logits: np.ndarray, eps: float):
        """Phi-3.5-MoE's top-2 routing (two numpy passes over [T, E]: no kernel of its own)."""
        return reference.router_sparsemixer(logits, eps)

    def router_sigmoid(self, logits: np.ndarray, bias: np.ndarray, k: int, n_group: int,
                       topk_group: int, norm: bool, scale: float, softmax: bool = False):
        t = logits.shape[0]
        ids = np.empty((t, k), dtype=np.int32)
        w = np.empty((t, k), dtype=np.float32)
        router_sigmoid_topk(np.ascontiguousarray(logits, dtype=np.float32),
                            np.ascontiguousarray(bias, dtype=np.float32).reshape(-1), k, n_group,
                            topk_group, norm, scale, ids, w, softmax)
        return ids, w

    def expert(self, x: np.ndarray, weights) -> np.ndarray:
        """One SwiGLU expert over its tokens: x [n, H] -> [n, H].

        weights is (gate, up, down) dense arrays, or (fmt, block uint8, layout int64 [10]).
        """
        if _is_block(weights):
            return self._block_mlp(x, weights, False, _NO_BIAS, 0.0, 0.0)
        gate, up, down = weights
        g = self.linear(x, gate)
        u = self.linear(x, up)
        a = g / (1.0 + np.exp(-g)) * u
        return self.linear(a.astype(np.float32), down)

    def expert_relu2(self, x: np.ndarray, weights) -> np.ndarray:
        """An ungated expert over its tokens, down(relu(up x)^2): x [n, H] -> [n, H]. weights
        (None or absent gate, up, down) dense, or an ungated (fmt, block, layout).
        reference.relu2_expert."""
        if _is_block(weights):
            return self._block_mlp(x, weights, RELU2, _NO_BIAS, 0.0, 0.0)
        up, down = weights[-2:]
        r = np.maximum(self.linear(x, up), np.float32(0.0))
        return self.linear(r * r, down)

    @staticmethod
    def _block_mlp(x, weights, clamped, bias, alpha, limit):
        fmt, block, lay = weights
        out = np.empty(x.shape, dtype=np.float32)
        expert_block_mlp(FMT_CODE[fmt], block, lay, np.ascontiguousarray(x, dtype=np.float32),
                         out, clamped, bias, alpha, limit)
        return out

    def expert_limited(self, x: np.ndarray, weights, limit: float, after: bool = False) -> np.ndarray:
        """DeepSeek-V4's expert over its tokens: SwiGLU of the gate clamped above at limit and
        the up projection to +-limit; after: Step-3.5's, the gate's SiLU clamped instead.
        weights as expert()'s."""
        if _is_block(weights):
            return self._block_mlp(x, weights, 3 if after else 2, _NO_BIAS, 0.0, limit)
        gate, up, down = weights
        lim = np.float32(limit)
        g, u = self.linear(x, gate), np.clip(self.linear(x, up), -lim, lim)
        if after:
            a = np.minimum(g / (np.float32(1.0) + np.exp(-g)), lim) * u
        else:
            g = np.minimum(g, lim)
            a = g / (np.float32(1.0) + np.exp(-g)) * u
        return self.linear(a.astype(np.float32), down)

    def expert_clamped(self, x: np.ndarray, weights, biases, alpha: float, limit: float):
        """gpt-oss's expert over its tokens: x [n, H] -> [n, H]. weights (gate, up, down) dense,
        or (fmt, block, layout) as expert() takes; biases f32 (gate [I], up [I], down [H]).
        reference.gpt_oss_expert."""
        if _is_block(weights):
            bias = np.concatenate([np.asarray(b, dtype=np.float32).reshape(-1) for b in biases])
            return self._block_mlp(x, weights, True, bias, alpha, limit)
        gate, up, down = weights
        g = self.linear(x, gate)
        g += biases[0]
        np.minimum(g, np.float32(limit), out=g)   # the gate is clamped from above only
        u = self.linear(x, up)
        u += biases[1]
        np.clip(u, -limit, limit, out=u)
        with np.errstate(over="ignore"):   # exp of a very negative gate: inf, the product 0
            a = (u + np.float32(1.0)) * g / (np.float32(1.0) + np.exp(np.float32(-alpha) * g))
        out = self.linear(a.astype(np.float32), down)
        out += biases[2]
        return out

    def sample(self, logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
        return int(sample_logits(np.ascontiguousarray(logits, dtype=np.float32),
                                 float(temperature), int(top_k), float(top_p), float(u)))
