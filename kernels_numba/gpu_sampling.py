"""CUDA router top-k and token sampling, results written to device arrays (graph friendly).

Legend: T = tokens, E = experts, K = top-k, V = vocab.
    router_topk: logits float32 [T, E] -> ids int32 [T, K], weights float32 [T, K];
                 softmax over all E, K largest (lower index first on ties), renormalized when
                 norm_topk_prob. One warp per token, E <= ROUTER_MAX_E.
    argmax:      logits float32 [V] -> token int32 [1] (lowest index on ties). One block.
    sample:      logits float32 [V], params float32 [3] = (temperature > 0, top_k, top_p),
                 u float32 [1] in [0, 1) (all device memory, so a graph serves any setting)
                 -> token int32 [1]; scratch probs float32 [V]. One block: softmax, top-k and
                 top-p thresholds by bisection on the float bits (31 passes each; probabilities
                 are >= 0, so their bits order like their values), inverse-CDF draw in index
                 order as reference.sample_from does. Ties at a threshold are all kept
                 (reference.sample_probs keeps the lower indices).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from .gpu_util import (NEG_INF, SIM, WARP, block_argmax, block_max, block_sum, float_as_uint,
                       warp_argmax, warp_max, warp_sum)

ROUTER_MAX_E = 1024
BLOCK = 64 if SIM else 1024       # argmax / sample: one block
MAX_WARPS = 32


@cuda.jit
def _router_topk(logits, norm, ids, weights):
    """grid T, 32 threads."""
    buf = cuda.shared.array(ROUTER_MAX_E, float32)
    red = cuda.shared.array(WARP, float32)
    red_i = cuda.shared.array(WARP, int32)
    t = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    E = logits.shape[1]
    K = ids.shape[1]
    m = NEG_INF
    for e in range(lane, E, WARP):
        v = logits[t, e]
        buf[e] = v
        m = max(m, v)
    m = warp_max(m, red)
    s = float32(0.0)
    for e in range(lane, E, WARP):
        s += math.exp(buf[e] - m)
    s = warp_sum(s, red)
    tot = float32(0.0)
    for k in range(K):
        bv = NEG_INF
        bi = int32(E)
        for e in range(lane, E, WARP):
            v = buf[e]
            if v > bv or bi == E:   # NaN logits still give an id in range
                bv = v
                bi = e
        bv, bi = warp_argmax(bv, bi, red, red_i)
        p = math.exp(bv - m) / s
        tot += p
        if lane == 0:
            ids[t, k] = bi
            weights[t, k] = p
            buf[bi] = NEG_INF
        cuda.syncthreads()
    if norm and lane == 0:
        for k in range(K):
            weights[t, k] = weights[t, k] / tot


def router_topk(logits, norm_topk_prob, ids, weights, stream):
    t, e = logits.shape
    if e > ROUTER_MAX_E:
        raise ValueError(f"{e} experts exceed ROUTER_MAX_E={ROUTER_MAX_E}")
    _router_topk[t, WARP, stream](logits, int32(1 if norm_topk_prob else 0), ids, weights)


@cuda.jit
def _argmax(logits, out):
    red = cuda.shared.array(BLOCK, float32)
    red_i = cuda.shared.array(BLOCK, int32)
    wred = cuda.shared.array(MAX_WARPS, float32)
    wred_i = cuda.shared.array(MAX_WARPS, int32)
    V = logits.shape[0]
    bv = NEG_INF
    bi = int32(V)
    for i in range(cuda.threadIdx.x, V, cuda.blockDim.x):
        v = logits[i]
        if v > bv:
            bv = v
            bi = i
    bv, bi = block_argmax(bv, bi, red, red_i, wred, wred_i)
    if cuda.threadIdx.x == 0:
        out[0] = bi


def argmax(logits, out, stream):
    _argmax[1, BLOCK, stream](logits, out)


@cuda.jit(device=True, inline=True)
def _mass_at_least(probs, thr, count_mode, red, wred):
    """sum over i of (1 or probs[i]) where bits(probs[i]) >= thr."""
    s = float32(0.0)
    for i in range(cuda.threadIdx.x, probs.shape[0], cuda.blockDim.x):
        pv = probs[i]
        if float_as_uint(pv) >= thr:
            s += float32(1.0) if count_mode else pv
    return block_sum(s, red, wred)


@cuda.jit(device=True, inline=True)
def _bisect(probs, target, count_mode, red, wred):
    """Largest bit pattern thr with mass_at_least(thr) >= target (probs >= 0)."""
    lo = uint32(0)
    hi = uint32(0x7F800000)
    while hi - lo > uint32(1):
        mid = lo + (hi - lo) // uint32(2)
        if _mass_at_least(probs, mid, count_mode, red, wred) >= target:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit
def _sample(logits, params, u, probs, out):
    red = cuda.shared.array(BLOCK, float32)
    wred = cuda.shared.array(MAX_WARPS, float32)
    seg = cuda.shared.array(BLOCK, float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[0]
    temp = params[0]
    top_k = int32(params[1])
    top_p = params[2]
    m = NEG_INF
    for i in range(tid, V, nt):
        m = max(m, logits[i] / temp)
    m = block_max(m, red, wred)
    s = float32(0.0)
    for i in range(tid, V, nt):
        e = math.exp(logits[i] / temp - m)
        probs[i] = e
        s += e
    total = block_sum(s, red, wred)
    cuda.syncthreads()
    if top_k > 0 and top_k < V:
        thr = _bisect(probs, float32(top_k), True, red, wred)
        s = float32(0.0)
        for i in range(tid, V, nt):
            pv = probs[i]
            if float_as_uint(pv) < thr:
                probs[i] = float32(0.0)
            else:
                s += pv
        total = block_sum(s, red, wred)
        cuda.syncthreads()
    if top_p < float32(1.0):
        thr = _bisect(probs, top_p * total, False, red, wred)
        s = float32(0.0)
        for i in range(tid, V, nt):
            pv = probs[i]
            if float_as_uint(pv) < thr:
                probs[i] = float32(0.0)
            else:
                s += pv
        total = block_sum(s, red, wred)
        cuda.syncthreads()
    # inverse CDF in index order: contiguous segments per thread, serial prefix on thread 0
    per = (V + nt - 1) // nt
    a = tid * per
    b = min(a + per, V)
    s = float32(0.0)
    for i in range(a, b):
        s += probs[i]
    seg[tid] = s
    cuda.syncthreads()
    if tid == 0:
        target = u[0] * total
        c = float32(0.0)
        tok = int32(-1)
        last = int32(0)
        for w in range(nt):
            if tok < 0 and c + seg[w] > target:
                a2 = w * per
                b2 = min(a2 + per, V)
                for i in range(a2, b2):
                    c += probs[i]
                    if probs[i] > 0:
                        last = i
                    if c > target:
                        tok = i
                        break
            elif tok < 0:
                c += seg[w]
                if seg[w] > 0:
                    for i in range(w * per, min(w * per + per, V)):
                        if probs[i] > 0:
                            last = i
        if tok < 0:
            tok = last
        out[0] = tok


def sample(logits, params, u, probs, out, stream):
    """Temperature / top-k / top-p draw; greedy (temperature 0) is argmax()."""
    _sample[1, BLOCK, stream](logits, params, u, probs, out)
