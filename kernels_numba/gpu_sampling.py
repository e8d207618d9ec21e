"""CUDA router top-k and token sampling, results written to device arrays (graph friendly).

Legend: T = tokens, E = experts, K = top-k, V = vocab.
    router_topk: logits float32 [T, E] -> ids int32 [T, K], weights float32 [T, K];
                 softmax over all E, K largest (lower index first on ties), divided by their
                 p-norm, p = norm_topk_prob: 0 / False none, 1 / True sum, 2 (DBRX's) 2-norm. One warp per token, E <= ROUTER_MAX_E. Optionally also
                 slots int32 [T, K] = slot_of[ids] (slot_of int32 [E]) in the same launch.
                 Variants (router_topk(variant=...), default ROUTER_VARIANT):
                 "base": the logits parked in shared memory, K rounds of a lane scan + warp
                         argmax (_take_best, shared with the sigmoid router: lane 0 knocks the
                         pick out of the buffer, then a barrier; lane 0 writes the pick);
                 "v2":   the logits in registers (NL = cdiv(E, 32) a lane, lane l holding
                         experts l, l + 32, ...; one compiled kernel per NL), K rounds of a
                         register scan + shuffle argmax with no shared memory or barrier; the
                         owner lane of a pick knocks it out (NaN = taken; a NaN logit counts as
                         -inf there, so every lane agrees on the pick and ids stay distinct)
                         and writes its slot (slot_of loaded with the logits); lane k keeps
                         pick k, written at the end. K <= 32 (more: base).
    argmax:      logits float32 [V] -> token int32 [1] (lowest index on ties). One block.
    sample:      logits float32 [V], params float32 [3] = (temperature, top_k, top_p),
                 u float32 [1] in [0, 1) (all device memory, so a graph serves any setting)
                 -> token int32 [1]; scratch probs float32 [V]. One block. The CPU sampler's
                 draw (cpu.sample_logits, oracle reference.sample_token): temperature <= 0 is
                 argmax; else softmax, top-k and top-p thresholds by bisection on the float bits
                 (31 passes each; probabilities are >= 0, so their bits order like their
                 values), inverse CDF with u in vocabulary order when nothing is cut, in
                 probability order (ties in index order) when top_k > 0 or top_p < 1, which
                 costs one more bisection. Ties at a threshold are all kept (the CPU sampler
                 keeps the lower indices): the same u picks the same id up to float rounding.
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, uint32

from .gpu_util import (NEG_INF, SIM, WARP, block_argmax, block_max, block_sum, cdiv,
                       float_as_uint, pdl_kernel, pdl_trigger, pdl_wait, warp_argmax, warp_max,
                       warp_sum)

ROUTER_MAX_E = 1024
ROUTER_VARIANTS = ("base", "v2")
ROUTER_VARIANT = "v2"             # router_topk()'s default
BLOCK = 64 if SIM else 1024       # argmax / sample: one block
MAX_WARPS = 32


@cuda.jit(device=True, inline=True)
def _take_best(key, E, red, red_i):
    """One selection round of the shared-memory routers (grid T, 32 threads, every thread calls
    it): (the largest of key[:E], its index, lowest on ties) to every lane, knocked out of key
    for the next round. NaN keys still give an index in range."""
    lane = cuda.threadIdx.x
    bv = NEG_INF
    bi = int32(E)
    for e in range(lane, E, WARP):
        v = key[e]
        if v > bv or bi == E:
            bv = v
            bi = e
    bv, bi = warp_argmax(bv, bi, red, red_i)
    if lane == 0:
        key[bi] = NEG_INF
    cuda.syncthreads()   # the knock-out seen by every lane before the next round's scan
    return bv, bi


def _make_router_topk(SLOTS):
    @cuda.jit(device=True, inline=True)
    def body(logits, norm, ids, weights, slot_of, slots):
        """grid T, 32 threads. SLOTS: also slots[t, k] = slot_of[ids[t, k]]."""
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
        tot2 = float32(0.0)
        for k in range(K):
            bv, bi = _take_best(buf, E, red, red_i)
            p = math.exp(bv - m) / s
            tot += p
            tot2 += p * p
            if lane == 0:
                ids[t, k] = bi
                weights[t, k] = p
                if SLOTS:
                    slots[t, k] = slot_of[bi]
        if norm == 2:
            tot = math.sqrt(tot2)
        if norm and lane == 0:
            for k in range(K):
                weights[t, k] = weights[t, k] / tot

    if SLOTS:
        @pdl_kernel
        @cuda.jit
        def router_topk_slots(logits, norm, ids, weights, slot_of, slots):
            pdl_wait()
            pdl_trigger()
            body(logits, norm, ids, weights, slot_of, slots)
        return router_topk_slots

    @pdl_kernel
    @cuda.jit
    def router_topk(logits, norm, ids, weights):
        pdl_wait()
        pdl_trigger()
        body(logits, norm, ids, weights, ids[0], ids)   # the slot arguments unused
    return router_topk


_router_topk = _make_router_topk(False)
_router_topk_slots = _make_router_topk(True)


def _make_router_topk_v2(NL, SLOTS):
    """The "v2" kernel for NL = cdiv(E, 32) logits a lane."""
    NAN = float32(math.nan)

    @cuda.jit(device=True, inline=True)
    def body(logits, norm, ids, weights, slot_of, slots):
        """grid T, 32 threads. SLOTS: also slots[t, k] = slot_of[ids[t, k]]."""
        red = cuda.shared.array(WARP, float32)        # the simulator's warp reductions only
        red_i = cuda.shared.array(WARP, int32)
        t = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        E = int32(logits.shape[1])
        K = ids.shape[1]
        key = cuda.local.array(NL, float32)           # expert i * 32 + lane; NaN: taken / none
        sl = cuda.local.array(NL, int32)              # SLOTS: its slot_of
        m = NEG_INF
        if SLOTS:                                     # the slot table is fixed: before the wait
            for i in range(NL):
                e = i * WARP + lane
                if e < E:
                    sl[i] = slot_of[e]
        pdl_wait()
        pdl_trigger()
        for i in range(NL):
            e = i * WARP + lane
            v = NAN
            if e < E:
                v = logits[t, e]
                m = max(m, v)
            key[i] = v
        m = warp_max(m, red)
        s = float32(0.0)
        for i in range(NL):
            if i * WARP + lane < E:
                v = key[i]
                s += math.exp(v - m)
                if v != v:                            # a NaN logit: selectable, as -inf
                    key[i] = NEG_INF
        s = warp_sum(s, red)
        tot = float32(0.0)
        tot2 = float32(0.0)
        my_i = int32(0)                               # lane k: pick k
        my_p = float32(0.0)
        for k in range(K):
            bv = NEG_INF
            bi = int32(E)                             # E: no candidate in this lane
            for i in range(NL):
                v = key[i]
                if v > bv or (bi == E and v == v):
                    bv = v
                    bi = int32(i * WARP + lane)       # int32: one shuffle a step, not two
            bv, bi = warp_argmax(bv, bi, red, red_i)
            p = math.exp(bv - m) / s
            tot += p
            tot2 += p * p
            for i in range(NL):
                if i * WARP + lane == bi:
                    key[i] = NAN
                    if SLOTS:
                        slots[t, k] = sl[i]
            if lane == k:
                my_i = bi
                my_p = p
        if norm == 2:
            tot = math.sqrt(tot2)
        if lane < K:
            ids[t, lane] = my_i
            weights[t, lane] = my_p / tot if norm else my_p

    if SLOTS:
        @cuda.jit
        def router_topk_v2_slots(logits, norm, ids, weights, slot_of, slots):
            body(logits, norm, ids, weights, slot_of, slots)
        return router_topk_v2_slots

    @cuda.jit
    def router_topk_v2(logits, norm, ids, weights):
        body(logits, norm, ids, weights, ids[0], ids)   # the slot arguments unused
    return router_topk_v2


_ROUTER_V2 = {}


def router_topk_v2_kernel(e: int, slots: bool):
    """The compiled-on-first-launch "v2" router kernel for e experts (with the slot table)."""
    key = (cdiv(e, WARP), bool(slots))
    if key not in _ROUTER_V2:
        _ROUTER_V2[key] = pdl_kernel(_make_router_topk_v2(*key))
    return _ROUTER_V2[key]


def router_topk(logits, norm_topk_prob, ids, weights, stream, slots=None, variant=None):
    """slots = (slot_of int32 [E], out int32 [T, K]): also out = slot_of[ids], the bank slot of
    each routed expert (the all-resident decode's slot table, without a launch of its own).
    variant: one of ROUTER_VARIANTS (default ROUTER_VARIANT); v2 with K > 32 runs base."""
    t, e = logits.shape
    k = ids.shape[1]
    if e > ROUTER_MAX_E:
        raise ValueError(f"{e} experts exceed ROUTER_MAX_E={ROUTER_MAX_E}")
    if k > e or weights.shape != ids.shape or ids.shape[0] != t:
        raise ValueError(f"router_topk: ids {ids.shape}, weights {weights.shape} for logits "
                         f"{logits.shape} (top-k <= experts)")
    variant = ROUTER_VARIANT if variant is None else variant
    if variant not in ROUTER_VARIANTS:
        raise ValueError(f"unknown router_topk variant {variant!r} (one of {ROUTER_VARIANTS})")
    v2 = variant == "v2" and k <= WARP
    norm = int32(2 if norm_topk_prob == 2 else 1 if norm_topk_prob else 0)
    if slots is None:
        kern = router_topk_v2_kernel(e, False) if v2 else _router_topk
        kern[t, WARP, stream](logits, norm, ids, weights)
        return
    slot_of, out = slots
    if slot_of.shape != (e,) or out.shape != ids.shape:
        raise ValueError(f"router_topk slots: table {slot_of.shape} for {e} experts, out "
                         f"{out.shape} for ids {ids.shape}")
    kern = router_topk_v2_kernel(e, True) if v2 else _router_topk_slots
    kern[t, WARP, stream](logits, norm, ids, weights, slot_of, out)


def _make_router_sigmoid(SLOTS, SOFTMAX=False, BIAS=True):
    @cuda.jit(device=True, inline=True)
    def body(logits, bias, n_group, topk_group, pair, norm, scale, ids, weights, slot_of, slots):
        """grid T, 32 threads. Choice keys (sigmoid + bias) in shared memory; lanes < n_group
        score their group (its two best keys summed where pair, else its best), lane 0 keeps
        the topk_group best groups, the rest are knocked out; then K rounds of lane scan + warp
        argmax as the softmax base kernel, each pick weighted by its sigmoid score. SLOTS:
        slots[t, k] = slot_of[ids]. SOFTMAX (DeepSeek-V2's group_limited_greedy, Mistral 4's
        groups, ERNIE-4.5's routing): the scores are the softmax probabilities, the keys they
        (plus the bias where BIAS: ERNIE)."""
        key = cuda.shared.array(ROUTER_MAX_E, float32)
        sig = cuda.shared.array(ROUTER_MAX_E, float32)
        gsum = cuda.shared.array(WARP, float32)
        red = cuda.shared.array(WARP, float32)
        red_i = cuda.shared.array(WARP, int32)
        t = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        E = logits.shape[1]
        K = ids.shape[1]
        if SOFTMAX:
            m = NEG_INF
            for e in range(lane, E, WARP):
                m = max(m, logits[t, e])
            m = warp_max(m, red)
            z = float32(0.0)
            for e in range(lane, E, WARP):
                z += math.exp(logits[t, e] - m)
            z = warp_sum(z, red)
            for e in range(lane, E, WARP):
                v = math.exp(logits[t, e] - m) / z
                sig[e] = v
                key[e] = v + bias[e] if BIAS else v
        else:
            for e in range(lane, E, WARP):
                v = float32(1.0) / (float32(1.0) + math.exp(-logits[t, e]))
                sig[e] = v
                key[e] = v + bias[e] if BIAS else v
        cuda.syncthreads()
        if topk_group < n_group:
            per = E // n_group
            if lane < n_group:
                b1 = NEG_INF
                b2 = NEG_INF
                for e in range(lane * per, (lane + 1) * per):
                    v = key[e]
                    if v > b1:
                        b2 = b1
                        b1 = v
                    elif v > b2:
                        b2 = v
                gsum[lane] = b1 + (b2 if per > 1 and pair != 0 else float32(0.0))
            cuda.syncthreads()
            if lane == 0:   # keep the best topk_group groups: red_i[g] = 1 (warp_argmax reuses
                for g in range(n_group):   # red_i only after the barrier below)
                    red_i[g] = 0
                for _ in range(topk_group):
                    bg = int32(-1)
                    for g in range(n_group):
                        if red_i[g] == 0 and (bg < 0 or gsum[g] > gsum[bg]):
                            bg = g
                    red_i[bg] = 1
            cuda.syncthreads()
            for e in range(lane, E, WARP):
                if red_i[e // per] == 0:
                    key[e] = NEG_INF
            cuda.syncthreads()
        tot = float32(0.0)
        for k in range(K):
            _, bi = _take_best(key, E, red, red_i)
            p = sig[bi]
            tot += p
            if lane == 0:
                ids[t, k] = bi
                weights[t, k] = p
                if SLOTS:
                    slots[t, k] = slot_of[bi]
        if lane == 0:
            for k in range(K):
                w = weights[t, k]
                if norm:
                    w = w / (tot + float32(1e-20))
                weights[t, k] = w * scale

    if SLOTS:
        @pdl_kernel
        @cuda.jit
        def router_sigmoid_slots(logits, bias, n_group, topk_group, pair, norm, scale, ids, weights,
                                 slot_of, slots):
            pdl_wait()
            pdl_trigger()
            body(logits, bias, n_group, topk_group, pair, norm, scale, ids, weights, slot_of, slots)
        return router_sigmoid_slots

    @pdl_kernel
    @cuda.jit
    def router_sigmoid(logits, bias, n_group, topk_group, pair, norm, scale, ids, weights):
        pdl_wait()
        pdl_trigger()
        body(logits, bias, n_group, topk_group, pair, norm, scale, ids, weights, ids[0], ids)
    return router_sigmoid


# (slot table, softmax scores, selection bias) -> kernel; sigmoid scores always take a bias
_ROUTER_GROUPED = {(slots, sm, b): _make_router_sigmoid(slots, sm, b) for slots in (False, True)
                   for sm, b in ((False, True), (True, False), (True, True))}


def router_sigmoid_topk(logits, bias, n_group, topk_group, norm_topk_prob, scale, ids, weights,
                        stream, slots=None, softmax=False, pair_groups=None):
    """DeepSeek-V3 / GLM-4.5 routing (reference.router_sigmoid_topk): logits float32 [T, E],
    bias float32 [E] -> ids int32 [T, K], weights float32 [T, K]; slots as router_topk.
    softmax: softmax scores instead: DeepSeek-V2's group-limited softmax with bias None
    (reference.router_group_softmax_topk), ERNIE-4.5's routing with a bias and one group
    (reference.router_softmax_bias_topk), Mistral 4's groups (reference.router_sigmoid_topk's
    softmax form). pair_groups: a group scores its two best keys summed (DeepSeek-V3, Mistral 4)
    or its best alone (DeepSeek-V2); None: the former for sigmoid scores, the latter for softmax."""
    t, e = logits.shape
    variant = (bool(softmax), bias is not None)
    if bias is None:
        if not softmax:
            raise ValueError("router_sigmoid_topk: sigmoid routing needs its selection bias")
        bias = logits[0]   # (unread)
    k = ids.shape[1]
    if e > ROUTER_MAX_E or n_group > WARP or e % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"router_sigmoid_topk: {e} experts in {n_group} groups (at most "
                         f"{ROUTER_MAX_E} experts, {WARP} groups that divide them), "
                         f"topk_group {topk_group}")
    if (k > topk_group * (e // n_group) or weights.shape != ids.shape or ids.shape[0] != t
            or bias.shape != (e,)):
        raise ValueError(f"router_sigmoid_topk: ids {ids.shape}, weights {weights.shape}, bias "
                         f"{bias.shape} for logits {logits.shape} (top-k within the kept groups)")
    pair = (not softmax) if pair_groups is None else bool(pair_groups)
    args = (logits, bias, int32(n_group), int32(topk_group), int32(pair), int32(1 if norm_topk_prob else 0),
            float32(scale), ids, weights)
    if slots is None:
        _ROUTER_GROUPED[(False,) + variant][t, WARP, stream](*args)
        return
    slot_of, out = slots
    if slot_of.shape != (e,) or out.shape != ids.shape:
        raise ValueError(f"router_sigmoid_topk slots: table {slot_of.shape} for {e} experts, "
                         f"out {out.shape} for ids {ids.shape}")
    _ROUTER_GROUPED[(True,) + variant][t, WARP, stream](*args, slot_of, out)


def _make_router_sparsemixer(SLOTS):
    @cuda.jit(device=True, inline=True)
    def body(logits, eps2, ids, weights, slot_of, slots):
        """grid T, one thread (the phimoe router has 16 experts: two short scans a pick)."""
        t = cuda.blockIdx.x
        E = logits.shape[1]
        first = int32(-1)
        for k in range(2):
            bi = int32(-1)
            bv = NEG_INF
            for e in range(E):
                v = logits[t, e]
                if e != first and (bi < 0 or v > bv):
                    bi = int32(e)
                    bv = v
            s = float32(0.0)   # the softmax over the logits near the pick (the pick's term is 1)
            for e in range(E):
                v = logits[t, e]
                if e != first and not ((bv - v) / max(abs(v), bv) > eps2):
                    s += math.exp(v - bv)
            ids[t, k] = bi
            weights[t, k] = float32(1.0) / s
            if SLOTS:
                slots[t, k] = slot_of[bi]
            first = bi

    if SLOTS:
        @pdl_kernel
        @cuda.jit
        def router_sparsemixer_slots(logits, eps2, ids, weights, slot_of, slots):
            pdl_wait()
            pdl_trigger()
            body(logits, eps2, ids, weights, slot_of, slots)
        return router_sparsemixer_slots

    @pdl_kernel
    @cuda.jit
    def router_sparsemixer(logits, eps2, ids, weights):
        pdl_wait()
        pdl_trigger()
        body(logits, eps2, ids, weights, ids[0], ids)   # the slot arguments unused
    return router_sparsemixer


_SPARSEMIXER = {slots: _make_router_sparsemixer(slots) for slots in (False, True)}


def router_sparsemixer(logits, eps, ids, weights, stream, slots=None):
    """Phi-3.5-MoE's top-2 routing (reference.router_sparsemixer): logits float32 [T, E] ->
    ids int32 [T, 2], weights float32 [T, 2]; slots as router_topk."""
    t, e = logits.shape
    if ids.shape != (t, 2) or weights.shape != ids.shape or e < 2:
        raise ValueError(f"router_sparsemixer: ids {ids.shape}, weights {weights.shape} for logits "
                         f"{logits.shape} (two picks a token)")
    args = (logits, float32(2 * eps), ids, weights)
    if slots is None:
        _SPARSEMIXER[False][t, 1, stream](*args)
        return
    slot_of, out = slots
    if slot_of.shape != (e,) or out.shape != ids.shape:
        raise ValueError(f"router_sparsemixer slots: table {slot_of.shape} for {e} experts, "
                         f"out {out.shape} for ids {ids.shape}")
    _SPARSEMIXER[True][t, 1, stream](*args, slot_of, out)


@pdl_kernel
@cuda.jit
def _argmax(logits, out):
    pdl_wait()
    pdl_trigger()
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
def _bisect(probs, target, count_mode, strict, red, wred):
    """Largest bit pattern thr with mass_at_least(thr) >= target (> target when strict; 0 when
    none) (probs >= 0)."""
    lo = uint32(0)
    hi = uint32(0x7F800000)
    while hi - lo > uint32(1):
        mid = lo + (hi - lo) // uint32(2)
        m = _mass_at_least(probs, mid, count_mode, red, wred)
        if m > target or (not strict and m == target):
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True, inline=True)
def _cut_below(probs, thr, red, wred):
    """Zero the probabilities whose bits are below thr; the kept mass, to every thread."""
    s = float32(0.0)
    for i in range(cuda.threadIdx.x, probs.shape[0], cuda.blockDim.x):
        pv = probs[i]
        if float_as_uint(pv) < thr:
            probs[i] = float32(0.0)
        else:
            s += pv
    total = block_sum(s, red, wred)
    cuda.syncthreads()
    return total


@pdl_kernel
@cuda.jit
def _sample(logits, params, u, probs, out):
    pdl_wait()
    pdl_trigger()
    red = cuda.shared.array(BLOCK, float32)
    red_i = cuda.shared.array(BLOCK, int32)
    wred = cuda.shared.array(MAX_WARPS, float32)
    wred_i = cuda.shared.array(MAX_WARPS, int32)
    seg = cuda.shared.array(BLOCK, float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[0]
    temp = params[0]
    top_k = int32(params[1])
    top_p = params[2]
    if temp <= float32(0.0):   # greedy, in the same launch: a graph serves any temperature
        bv = NEG_INF
        bi = int32(V)
        for i in range(tid, V, nt):
            v = logits[i]
            if v > bv:
                bv = v
                bi = i
        bv, bi = block_argmax(bv, bi, red, red_i, wred, wred_i)
        if tid == 0:
            out[0] = bi if bi < V else 0   # all NaN: id 0, as the CPU sampler
        return
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
        total = _cut_below(probs, _bisect(probs, float32(top_k), True, False, red, wred), red, wred)
    if top_p < float32(1.0):   # top_p <= 0 keeps the most likely, as the CPU sampler does
        need = max(top_p * total, float32(1e-30))
        total = _cut_below(probs, _bisect(probs, need, False, False, red, wred), red, wred)
    target = u[0] * total
    # The CPU sampler (cpu.sample_logits) draws in vocabulary order when nothing is cut, else in
    # probability order: there the draw lands on the probability level lvl where the mass of
    # the levels at or above it first exceeds target, and within the level in index order after
    # base = the mass above it. lvl 0 = every token in index order.
    lvl = uint32(0)
    base = float32(0.0)
    if top_k > 0 or top_p < float32(1.0):
        lvl = _bisect(probs, target, False, True, red, wred)
        if lvl == uint32(0):   # target >= total (u rounded up): the least likely kept level
            kept = _mass_at_least(probs, uint32(1), True, red, wred)
            lvl = _bisect(probs, kept, True, False, red, wred)
        base = _mass_at_least(probs, lvl + uint32(1), False, red, wred)
    # inverse CDF: contiguous segments per thread, serial walk on thread 0
    per = (V + nt - 1) // nt
    a = tid * per
    b = min(a + per, V)
    s = float32(0.0)
    for i in range(a, b):
        pv = probs[i]
        if lvl == uint32(0) or float_as_uint(pv) == lvl:
            s += pv
    seg[tid] = s
    cuda.syncthreads()
    if tid == 0:
        c = base
        tok = int32(-1)
        lastseg = int32(0)
        for w in range(nt):
            if seg[w] > 0:
                lastseg = w
            if c + seg[w] > target:
                for i in range(w * per, min(w * per + per, V)):
                    pv = probs[i]
                    if lvl == uint32(0) or float_as_uint(pv) == lvl:
                        c += pv
                    if c > target:
                        tok = i
                        break
                if tok >= 0:
                    break
            else:
                c += seg[w]
        if tok < 0:   # rounding left the target unreached: the last token that can be drawn
            tok = 0
            for i in range(lastseg * per, min(lastseg * per + per, V)):
                pv = probs[i]
                if pv > 0 and (lvl == uint32(0) or float_as_uint(pv) == lvl):
                    tok = i
        out[0] = tok


def sample(logits, params, u, probs, out, stream):
    """The CPU sampler's draw (cpu.sample_logits) on the device; temperature <= 0 is argmax."""
    _sample[1, BLOCK, stream](logits, params, u, probs, out)
