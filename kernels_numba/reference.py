"""numpy oracles: the plain, obviously-right version of every op the backends implement.

Tests compare each CPU and CUDA kernel against these on fresh random inputs. Everything here
computes in float64 unless noted and returns float32 where the kernels do.
Legend: T = tokens, H = hidden, D = head dim, Hq / Hkv = query / key-value heads,
S = cached sequence length, E = experts, K = top-k, I = expert intermediate, V = vocab.
"""
from __future__ import annotations

import numpy as np

# ---- number formats ------------------------------------------------------------------------

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 value (ties to the even mantissa), as float32: of the two
    bfloat16 neighbours (the bits truncated toward zero, and one bf16 step further out, in
    float64 so that past the largest finite one the step is 2^128: infinity) the closer one."""
    x = np.asarray(x, dtype=np.float32)
    lo_bits = x.view(np.uint32) & np.uint32(0xFFFF0000)
    lo32 = lo_bits.view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        step = np.spacing(np.abs(lo32)).astype(np.float64) * 65536.0   # a bf16 ulp
        lo = lo32.astype(np.float64)
        hi = lo + np.copysign(step, lo)
        d_lo, d_hi = np.abs(x - lo), np.abs(hi - x)
        even_lo = (lo_bits >> np.uint32(16)) % 2 == 0
        take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ~even_lo)
        out = np.where(take_hi, hi, lo).astype(np.float32)   # 2^128 -> inf
    return np.where(np.isnan(x) | np.isinf(x), x, out)


def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint8 FP8 E4M3 (FN: no infinities, 0x7f / 0xff are NaN) -> float32."""
    b = bits.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((exp == 0xF) & (man == 0x7), np.nan, val)
    return (sign * val).astype(np.float32)


def nvfp4_dequant(q: np.ndarray, s: np.ndarray, global_scale: float, k: int) -> np.ndarray:
    """q uint8 [R, Kp/2], s uint8 [R, Kp/16] -> float32 [R, k]."""
    lo = E2M1_VALUES[q & 0xF]
    hi = E2M1_VALUES[q >> 4]
    vals = np.empty((q.shape[0], q.shape[1] * 2), dtype=np.float64)
    vals[:, 0::2] = lo
    vals[:, 1::2] = hi
    scales = np.repeat(e4m3_to_f32(s).astype(np.float64), 16, axis=1)
    return (vals * scales * float(global_scale))[:, :k].astype(np.float32)


def fp8_dequant(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q uint8 [R, K] E4M3, s float32 [R] -> float32 [R, K]."""
    return (e4m3_to_f32(q).astype(np.float64) * s.astype(np.float64)[:, None]).astype(np.float32)


# ---- dense ops -----------------------------------------------------------------------------

def embed(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """ids int [T], table [V, H] -> [T, H] float32."""
    return table[ids].astype(np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., N], w [N] -> [..., N]; normalizes the last axis (per head for q/k norm)."""
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * r * w.astype(np.float64)).astype(np.float32)


def query_temperature(q: np.ndarray, pos: np.ndarray, floor_scale: float, attn_scale: float,
                      shift: float = 1.0) -> np.ndarray:
    """q [T, Hq, D] * (log1p(floor((pos + shift) / floor_scale)) * attn_scale + 1), a scale a
    position: Llama 4's NoPE-layer queries (shift 1), Mistral 4's (shift 0)."""
    s = np.log1p(np.floor((pos.astype(np.float64) + shift) / floor_scale)) * attn_scale + 1.0
    return (q.astype(np.float64) * s[:, None, None]).astype(np.float32)


def head_prefix(a: np.ndarray, dv: int, scale: float) -> np.ndarray:
    """a [T, nh, D] -> [T, nh * dv]: each head's first dv values times scale."""
    return (a[:, :, :dv].astype(np.float64) * scale).reshape(a.shape[0], -1).astype(np.float32)


def layernorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., N], w [N] -> (x - mean) / sqrt(var + eps) * w over the last axis (no bias)."""
    x64 = x.astype(np.float64)
    x64 = x64 - x64.mean(axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * r * w.astype(np.float64)).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
         attention_scaling: float = 1.0) -> np.ndarray:
    """Rotate-half RoPE on the first 2*len(inv_freq) dims of each head.

    x [T, nH, D], positions int [T], inv_freq [R/2] -> [T, nH, D]; dims past R pass unchanged.
    """
    r2 = inv_freq.shape[0]
    ang = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]  # [T, R/2]
    cos = (np.cos(ang) * attention_scaling)[:, None, :]
    sin = (np.sin(ang) * attention_scaling)[:, None, :]
    x64 = x.astype(np.float64)
    out = x64.copy()
    x1, x2 = x64[..., :r2], x64[..., r2:2 * r2]
    out[..., :r2] = x1 * cos - x2 * sin
    out[..., r2:2 * r2] = x2 * cos + x1 * sin
    return out.astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: float,
              window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal grouped-query attention.

    q [T, Hq, D]; k, v [S, Hkv, D] (cache rows 0..S-1 hold positions 0..S-1);
    q_pos int [T]: the position of each query; key j is seen when j <= q_pos
    (and q_pos - j < window when window > 0; with window < 0, chunked attention: j in the
    query's chunk of -window positions, j >= q_pos - q_pos % -window) -> [T, Hq, D].
    sinks [Hq] (gpt-oss): one more logit per head in the softmax, with no value row.
    """
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    out = np.zeros((t, hq, d), dtype=np.float64)
    j = np.arange(s)
    for ti in range(t):
        seen = j <= q_pos[ti]
        if window > 0:
            seen &= (q_pos[ti] - j) < window
        elif window < 0:
            seen &= j >= q_pos[ti] - q_pos[ti] % -window
        for h in range(hq):
            kv = h // group
            sc = (k[seen, kv].astype(np.float64) @ q[ti, h].astype(np.float64)) * scale
            sink = -np.inf if sinks is None else float(sinks[h])
            mx = max(sc.max(), sink)
            p = np.exp(sc - mx)
            p /= p.sum() + np.exp(sink - mx)
            out[ti, h] = p @ v[seen, kv].astype(np.float64)
    return out.astype(np.float32)


def attention_picked(q: np.ndarray, rows: np.ndarray, picked, scale: float) -> np.ndarray:
    """Multi-query attention of each query over its own rows (DeepSeek Sparse Attention's MLA):
    q [T, Hq, D], rows [S, 1, D], picked: T int arrays of row numbers -> [T, Hq, D]."""
    out = np.empty(q.shape, np.float32)
    for t, keep in enumerate(picked):
        r = rows[np.asarray(keep)]
        out[t] = attention(q[t:t + 1], r, r, np.array([len(keep) - 1]), scale)[0]
    return out


def index_keys(k: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, positions: np.ndarray,
               inv_freq: np.ndarray, scaling: float = 1.0) -> np.ndarray:
    """The DSA indexer's key rows: LayerNorm with bias, then rotate-half RoPE on the first
    2 * len(inv_freq) dims. k [T, D] (the wk projection), w, b [D] -> [T, D]."""
    x64 = k.astype(np.float64)
    x64 = x64 - x64.mean(axis=-1, keepdims=True)
    ln = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w + b
    return rope(ln[:, None].astype(np.float32), positions, inv_freq, scaling)[:, 0]


def index_scores(q: np.ndarray, wt: np.ndarray, keys: np.ndarray, positions: np.ndarray,
                 q_scale: float, w_scale: float) -> np.ndarray:
    """The DSA indexer's scores: score[t, j] = sum_h wt[t, h] w_scale relu(q_scale q[t, h] .
    keys[j]) for j <= positions[t], -inf past it. q [T, Hi, D], wt [T, Hi], keys [S, D] -> [T, S]."""
    dots = np.einsum("thd,sd->ths", q.astype(np.float64), keys.astype(np.float64)) * q_scale
    s = np.einsum("th,ths->ts", wt.astype(np.float64) * w_scale, np.maximum(dots, 0.0))
    s[np.arange(keys.shape[0])[None, :] > positions[:, None]] = -np.inf
    return s


def index_select(scores: np.ndarray, positions: np.ndarray, k: int) -> list:
    """Each query's picked positions, ascending: every j <= positions[t] while there are at most
    k of them, else the k highest scores[t, j], ties (0 equal to -0) to the earlier position."""
    out = []
    for t, p in enumerate(positions):
        s = np.asarray(scores[t, :p + 1], np.float64)
        out.append(np.arange(p + 1) if p + 1 <= k else np.sort(np.argsort(-s, kind="stable")[:k]))
    return out


def mla_absorb_q(q_nope: np.ndarray, kv_b: np.ndarray) -> np.ndarray:
    """MLA: each head's query into the latent space through the key half of kv_b.
    q_nope [T, Hq, Nn], kv_b [Hq (Nn + V), C] (float32 or bf16 bits) -> [T, Hq, C]."""
    t, hq, nope = q_nope.shape
    w = (bf16_to_f32(kv_b) if kv_b.dtype == np.uint16 else kv_b).astype(np.float64)
    w = w.reshape(hq, -1, w.shape[1])[:, :nope]                          # [Hq, Nn, C]
    return np.einsum("thn,hnc->thc", q_nope.astype(np.float64), w).astype(np.float32)


def mla_absorb_o(a: np.ndarray, kv_b: np.ndarray, v_dim: int) -> np.ndarray:
    """MLA: each head's latent attention output through the value half of kv_b.
    a [T, Hq, C], kv_b [Hq (Nn + V), C] -> [T, Hq, V]."""
    t, hq, _ = a.shape
    w = (bf16_to_f32(kv_b) if kv_b.dtype == np.uint16 else kv_b).astype(np.float64)
    w = w.reshape(hq, -1, w.shape[1])[:, -v_dim:]                        # [Hq, V, C]
    return np.einsum("thc,hvc->thv", a.astype(np.float64), w).astype(np.float32)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K], w [N, K] (float32, or uint16 bfloat16 bits) -> [T, N] float32."""
    wf = bf16_to_f32(w) if w.dtype == np.uint16 else w
    return (x.astype(np.float64) @ wf.astype(np.float64).T).astype(np.float32)


def router_topk(logits: np.ndarray, k: int, norm_topk_prob: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, E] -> (ids int32 [T, K], weights float32 [T, K]).

    softmax over all experts, the k largest probabilities (larger first, lower index first on
    ties), divided by their p-norm with p = norm_topk_prob: 0 / False none, 1 / True their sum
    (renormalized to sum 1), 2 their 2-norm (DBRX's moe_normalize_expert_weights).
    """
    l64 = logits.astype(np.float64)
    p = np.exp(l64 - l64.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=-1)
    if norm_topk_prob == 2:
        w = w / np.sqrt((w * w).sum(axis=-1, keepdims=True))
    elif norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w.astype(np.float32)


def router_sparsemixer(logits: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Phi-3.5-MoE's sparsemixer at inference, top-2, in float32 as its reference computes:
    logits [T, E] -> (ids int32 [T, 2], weights float32 [T, 2]). Pick the best logit m (lower
    index first on ties), weigh it by its softmax over the logits s with (m - s) / max(|s|, m)
    <= 2 eps; then the same for the best of the rest (the first pick out of its softmax)."""
    s = np.asarray(logits, np.float32)
    rows = np.arange(s.shape[0])
    ids, wts = [], []
    masked = s
    for _ in range(2):
        e = np.argmax(masked, -1)
        top = masked[rows, e][:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            far = (top - s) / np.maximum(np.abs(s), top) > np.float32(2 * eps)
        g = np.exp(np.where(far, np.float32(-np.inf), masked) - top)
        wts.append((g[rows, e] / g.sum(-1)).astype(np.float32))
        ids.append(e)
        masked = masked.copy()
        masked[rows, e] = -np.inf
    return np.stack(ids, -1).astype(np.int32), np.stack(wts, -1)


def router_sigmoid_topk(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int,
                        topk_group: int, norm_topk_prob: bool,
                        scale: float, softmax: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 / GLM-4.5 routing: logits [T, E] -> (ids int32 [T, K], weights float32 [T, K]).

    scores = sigmoid(logits); experts are chosen on scores + bias (larger first, lower index
    first on ties) within the topk_group of n_group equal groups whose two best choice scores
    sum highest; the weights are the chosen experts' scores without the bias, renormalized
    (sum + 1e-20) when norm_topk_prob, times scale. softmax: the scores are softmax(logits)
    (Mistral 4's routing, with a zero bias).
    """
    x = logits.astype(np.float64)
    if softmax:
        s = np.exp(x - x.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
    else:
        s = 1.0 / (1.0 + np.exp(-x))
    c = s + bias.astype(np.float64)
    t, e = c.shape
    per = e // n_group
    grouped = np.sort(c.reshape(t, n_group, per), axis=-1)[..., -min(2, per):].sum(-1)
    keep = np.argsort(-grouped, axis=-1, kind="stable")[:, :topk_group]
    allowed = np.zeros((t, n_group), bool)
    np.put_along_axis(allowed, keep, True, axis=-1)
    c = np.where(np.repeat(allowed, per, axis=1), c, -np.inf)
    ids = np.argsort(-c, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(s, ids, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, (w * scale).astype(np.float32)


def router_softmax_bias_topk(logits: np.ndarray, bias: np.ndarray, k: int,
                             norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """ERNIE-4.5's routing: p = softmax(logits); experts chosen on p + bias (larger first,
    lower index first on ties); the weights are their p, renormalized (sum + 1e-20) when
    norm_topk_prob -> (ids int32 [T, K], weights float32 [T, K])."""
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-(p + bias.astype(np.float64)), axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, w.astype(np.float32)


def router_group_softmax_topk(logits: np.ndarray, k: int, n_group: int, topk_group: int,
                              scale: float) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V2's group_limited_greedy: p = softmax(logits); the topk_group of n_group equal
    groups whose best p is highest are kept; the k largest p among them (lower index first on
    ties) -> (ids int32 [T, K], weights p * scale float32 [T, K]), not renormalized."""
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    t, e = p.shape
    per = e // n_group
    keep = np.argsort(-p.reshape(t, n_group, per).max(-1), axis=-1, kind="stable")[:, :topk_group]
    allowed = np.zeros((t, n_group), bool)
    np.put_along_axis(allowed, keep, True, axis=-1)
    c = np.where(np.repeat(allowed, per, axis=1), p, -np.inf)
    ids = np.argsort(-c, axis=-1, kind="stable")[:, :k].astype(np.int32)
    return ids, (np.take_along_axis(p, ids, axis=-1) * scale).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu_expert(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """x [T, H]; gate, up [I, H]; down [H, I] (float) -> [T, H] float32."""
    x64 = x.astype(np.float64)
    g = x64 @ gate.astype(np.float64).T
    u = x64 @ up.astype(np.float64).T
    return ((silu(g) * u) @ down.astype(np.float64).T).astype(np.float32)


def relu2_expert(x: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """An ungated expert (Nemotron-H): x [T, H], up [I, H], down [H, I] -> down(relu(up x)^2) [T, H]."""
    u = np.maximum(x.astype(np.float64) @ up.astype(np.float64).T, 0.0)
    return ((u * u) @ down.astype(np.float64).T).astype(np.float32)


def gpt_oss_expert(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                   gate_b: np.ndarray, up_b: np.ndarray, down_b: np.ndarray, alpha: float,
                   limit: float) -> np.ndarray:
    """gpt-oss's clamped SwiGLU: x [T, H]; gate, up [I, H]; down [H, I]; biases [I], [I], [H].
    g = min(x gate^T + gate_b, limit), u = clip(x up^T + up_b, +-limit),
    out = ((u + 1) * g * sigmoid(alpha g)) down^T + down_b -> [T, H] float32."""
    x64 = x.astype(np.float64)
    g = np.minimum(x64 @ gate.astype(np.float64).T + gate_b, limit)
    u = np.clip(x64 @ up.astype(np.float64).T + up_b, -limit, limit)
    a = (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    return (a @ down.astype(np.float64).T + down_b.astype(np.float64)).astype(np.float32)


def limited_expert(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                   limit: float, after: bool = False, alpha: float = 0.0) -> np.ndarray:
    """DeepSeek-V4's SwiGLU: g = min(x gate^T, limit), u = clip(x up^T, +-limit),
    out = (g * sigmoid(g) * u) down^T -> [T, H] float32; after (Step-3.5's): out =
    (min(silu(x gate^T), limit) * u) down^T; alpha > 0 (MiniMax-M3's, gpt_oss_expert without
    biases): out = ((u + 1) * g * sigmoid(alpha g)) down^T."""
    x64 = x.astype(np.float64)
    g = x64 @ gate.astype(np.float64).T
    u = np.clip(x64 @ up.astype(np.float64).T, -limit, limit)
    if alpha > 0:
        g = np.minimum(g, limit)
        a = (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    elif after:
        a = np.minimum(g / (1.0 + np.exp(-g)), limit) * u
    else:
        g = np.minimum(g, limit)
        a = g / (1.0 + np.exp(-g)) * u
    return (a @ down.astype(np.float64).T).astype(np.float32)


def moe(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts) -> np.ndarray:
    """x [T, H]; ids, weights [T, K]; experts[e] = (gate, up, down) float -> [T, H] float32."""
    out = np.zeros(x.shape, dtype=np.float64)
    for t in range(x.shape[0]):
        for kk in range(ids.shape[1]):
            g, u, d = experts[int(ids[t, kk])]
            out[t] += float(weights[t, kk]) * swiglu_expert(x[t:t + 1], g, u, d)[0]
    return out.astype(np.float32)


# ---- sampling ------------------------------------------------------------------------------

def sample_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """logits [V] -> the distribution sampling draws from, float64 [V].

    temperature scales logits; top_k keeps the k most likely (0 = all); top_p keeps the
    smallest most-likely prefix whose mass reaches top_p (1.0 = all). Greedy is temperature 0.
    """
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones(p.shape[0], dtype=bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        ps = p[order]
        ps = ps / ps[keep[order]].sum()
        csum = np.cumsum(np.where(keep[order], ps, 0.0))
        cut = int(np.searchsorted(csum, top_p)) + 1  # smallest prefix with mass >= top_p
        keep[order[cut:]] = False
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the first id whose cumulative probability exceeds u in [0, 1)."""
    c = np.cumsum(probs)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), probs.shape[0] - 1))


def sample_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The engine's draw (cpu.sample_logits, gpu_sampling.sample): argmax at temperature <= 0;
    else inverse CDF over sample_probs with u, in vocabulary order when nothing is cut (top_k 0,
    top_p 1), in probability order (ties: lower id first) when something is."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = sample_probs(logits, temperature, top_k, top_p)
    if top_k <= 0 and top_p >= 1.0:
        return sample_from(p, u)
    order = np.argsort(-p, kind="stable")[:np.count_nonzero(p)]
    return int(order[sample_from(p[order], u)])


# ---- hybrid families: Gated DeltaNet and gated attention ------------------------------------
# Legend: Nk / Nv = DeltaNet key / value heads, Dk / Dv = their head dims, C = conv channels,
# Kc = conv kernel width. Value head h reads key head h // (Nv / Nk).

def causal_conv1d_silu(x: np.ndarray, w: np.ndarray, state: np.ndarray,
                       bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x [T, C], w [C, Kc], state [Kc-1, C] (previous inputs, oldest first), bias [C] or None
    -> (silu(causal depthwise conv + bias) [T, C], new state [Kc-1, C])."""
    ks = w.shape[1] - 1
    xe = np.concatenate([state, x]).astype(np.float64)            # [Kc-1+T, C]
    t = x.shape[0]
    out = np.stack([(xe[i:i + ks + 1] * w.T.astype(np.float64)).sum(0) for i in range(t)])
    if bias is not None:
        out = out + bias.astype(np.float64)
    return silu(out).astype(np.float32), xe[t:].astype(np.float32)


def mamba2_scan(x, dt, b, c, a_log, dt_bias, d, dt_limit, state) -> tuple[np.ndarray, np.ndarray]:
    """Mamba-2's selective scan, token by token. x [T, Hm, P]; dt [T, Hm] (raw); b, c [T, G, N];
    A_log, dt_bias, D [Hm]; state [Hm, P, N] -> (out [T, Hm, P], new state): dt' =
    clamp(softplus(dt + dt_bias), *dt_limit), state = state exp(-exp(A_log) dt') + dt' x B^T,
    out = state C + D x; head h reads group h // (Hm / G)."""
    per = x.shape[1] // b.shape[1]
    b64 = np.repeat(b.astype(np.float64), per, axis=1)           # [T, Hm, N]
    c64 = np.repeat(c.astype(np.float64), per, axis=1)
    z = dt.astype(np.float64) + dt_bias.astype(np.float64)
    s = np.clip(np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0)))), *dt_limit)
    a = -np.exp(a_log.astype(np.float64))
    st = state.astype(np.float64)
    out = np.empty(x.shape, dtype=np.float64)
    for t in range(x.shape[0]):
        xt = x[t].astype(np.float64)                              # [Hm, P]
        st = st * np.exp(s[t] * a)[:, None, None] + (s[t][:, None] * xt)[:, :, None] * b64[t][:, None, :]
        out[t] = np.einsum("hpn,hn->hp", st, c64[t]) + d.astype(np.float64)[:, None] * xt
    return out.astype(np.float32), st.astype(np.float32)


def rmsnorm_group_gated(x: np.ndarray, z: np.ndarray, w: np.ndarray, group: int, eps: float) -> np.ndarray:
    """x, z [R, W], w [W] -> w * rmsnorm(x * silu(z)) taken over each run of group columns."""
    y = x.astype(np.float64) * silu(z.astype(np.float64))
    g = y.reshape(y.shape[0], -1, group)
    g = g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + eps)
    return (w.astype(np.float64) * g.reshape(y.shape)).astype(np.float32)


def gated_short_conv(bcx: np.ndarray, w: np.ndarray, bias: np.ndarray | None,
                     state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LFM2's gated short conv (H channels): bcx [T, 3H] = B | C | x; w [H, Kc]; bias [H] or None;
    state [Kc-1, H] (previous conv inputs, oldest first) -> (C * (causal depthwise conv of B * x,
    plus bias) [T, H], new state [Kc-1, H]: the last Kc-1 conv inputs)."""
    h, kc = w.shape
    b, c, x = (bcx[:, i * h:(i + 1) * h].astype(np.float64) for i in range(3))
    u = np.concatenate([state.astype(np.float64), b * x])         # [Kc-1+T, H]
    t = bcx.shape[0]
    conv = np.stack([(u[i:i + kc] * w.T.astype(np.float64)).sum(0) for i in range(t)])
    if bias is not None:
        conv = conv + bias.astype(np.float64)
    return (c * conv).astype(np.float32), u[t:].astype(np.float32)


def deltanet_gates(b: np.ndarray, a: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray):
    """b [T, Nv]; a [T, N]; A_log, dt_bias [N] -> (beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)).
    N = Nv (Gated DeltaNet), or Nv Dk (KDA: A_log repeated over each head's Dk channels)."""
    z = a.astype(np.float64) + dt_bias.astype(np.float64)
    sp = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))
    beta = 1.0 / (1.0 + np.exp(-b.astype(np.float64)))
    return beta.astype(np.float32), (-np.exp(a_log.astype(np.float64)) * sp).astype(np.float32)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (the FLA library's form), float64."""
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).sum(-1, keepdims=True) + eps)


def gated_delta_rule(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, token by token, in float64.

    q, k [T, Nk, Dk] (L2-normalized here; q also scaled by Dk^-0.5); v [T, Nv, Dv]; beta [T, Nv];
    g [T, Nv] (a decay a head) or [T, Nv, Dk] (Kimi Delta Attention: a decay a key channel, row i
    of S times exp(g[..., i])); state [Nv, Dk, Dv] -> (out [T, Nv, Dv], new state). Per token and
    value head: S <- exp(g) S;  S <- S + k (x) beta (v - k^T S);  o = q^T S.
    """
    t, nk, dk = q.shape
    nv = v.shape[1]
    rep = nv // nk
    qn = np.repeat(l2norm(q), rep, axis=1) / np.sqrt(dk)
    kn = np.repeat(l2norm(k), rep, axis=1)
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, dtype=np.float64)
    for i in range(t):
        decay = np.exp(g[i].astype(np.float64))
        s *= decay[:, :, None] if g.ndim == 3 else decay[:, None, None]
        mem = np.einsum("hkv,hk->hv", s, kn[i])
        delta = (v[i] - mem) * beta[i].astype(np.float64)[:, None]
        s += kn[i][:, :, None] * delta[:, None, :]
        out[i] = np.einsum("hkv,hk->hv", s, qn[i])
    return out.astype(np.float32), s.astype(np.float32)


def rmsnorm_gated(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x, z [..., N], w [N] -> w * x / sqrt(mean(x^2) + eps) * silu(z)."""
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (w.astype(np.float64) * x64 * r * silu(z.astype(np.float64))).astype(np.float32)


def sigmoid_gate(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """x [T, N] * sigmoid(gate [T, G]), each gate column over N/G consecutive columns of x."""
    per = x.shape[1] // gate.shape[1]
    gg = np.repeat(gate.astype(np.float64), per, axis=1)
    return (x.astype(np.float64) / (1.0 + np.exp(-gg))).astype(np.float32)
