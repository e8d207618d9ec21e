"""Small CUDA kernels the decoder needs beside the dense / attention / expert families:
KV-cache store at device positions, bias add, clamp, SwiGLU of a dense MLP, slot mapping,
position advance, the expert gate of a streamed token graph.

Legend: T = tokens, Hkv = kv heads, D = head dim, S = cache positions, N = a row's size.
Every launcher takes an explicit stream, allocates nothing and never syncs (graph-capturable).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint64

from .gpu_util import (SIM, cdiv, fence_system, ld4, pause, pdl_kernel, pdl_trigger, pdl_wait,
                        putter)

THREADS = 64 if SIM else 256


def _make_kv_store(BF):
    put = putter(BF)

    @cuda.jit
    def kv_store(k, v, kc, vc, pos):
        """k, v float32 [T, Hkv, D] -> kc, vc [S, Hkv, D] at rows pos[t] (device positions);
        BF: the caches hold bf16 bits (uint16), rounded to nearest even."""
        pdl_wait()
        pdl_trigger()
        i = cuda.grid(1)
        T, nh, D = k.shape
        if i < T * nh * D:
            t = i // (nh * D)
            r = i - t * nh * D
            h = r // D
            d = r - h * D
            p = pos[t]
            put(kc, p, h, d, k[t, h, d])
            put(vc, p, h, d, v[t, h, d])
    return kv_store


_kv_store = {False: pdl_kernel(_make_kv_store(False)), True: pdl_kernel(_make_kv_store(True))}


def kv_store(k, v, kc, vc, pos, stream):
    """Caches float32, or uint16 bf16 bits (the rows rounded)."""
    n = k.shape[0] * k.shape[1] * k.shape[2]
    _kv_store[kc.dtype == np.uint16][cdiv(n, THREADS), THREADS, stream](k, v, kc, vc, pos)


@pdl_kernel
@cuda.jit
def _add_rows(x, b):
    """x [T, N] += b [N]."""
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    T, N = x.shape
    if i < T * N:
        x[i // N, i % N] += b[i % N]


def add_rows(x, b, stream):
    n = x.shape[0] * x.shape[1]
    _add_rows[cdiv(n, THREADS), THREADS, stream](x, b)


@pdl_kernel
@cuda.jit
def _query_temperature(q, pos, floor_scale, attn_scale, shift):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    T, nh, D = q.shape
    if i < T * nh * D:
        t = i // (nh * D)
        s = math.log1p(math.floor((float32(pos[t]) + shift) / floor_scale)) * attn_scale + float32(1.0)
        q[t, (i // D) % nh, i % D] *= float32(s)


def query_temperature(q, pos, floor_scale, attn_scale, stream, shift=1.0):
    """q float32 [T, Hq, D] *= log1p(floor((pos[t] + shift) / floor_scale)) * attn_scale + 1 in
    place (pos int32 [T] on the device): Llama 4's NoPE layers (shift 1), Mistral 4's queries
    (shift 0); reference.query_temperature."""
    n = q.shape[0] * q.shape[1] * q.shape[2]
    _query_temperature[cdiv(n, THREADS), THREADS, stream](q, pos, float32(floor_scale), float32(attn_scale),
                                                          float32(shift))


@pdl_kernel
@cuda.jit
def _head_prefix(a, scale, out):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    T, nh, D = a.shape
    dv = out.shape[1] // nh
    if i < T * nh * dv:
        t = i // (nh * dv)
        h = (i // dv) % nh
        out[t, i % (nh * dv)] = a[t, h, i % dv] * scale


def head_prefix(a, dv, scale, out, stream):
    """out float32 [T, nh * dv] = a[:, :, :dv] * scale for a float32 [T, nh, D]: each head's
    first dv values, scaled (MiMo-V2-Flash's value heads, narrower than the cache's);
    reference.head_prefix."""
    t, nh, _ = a.shape
    if out.shape != (t, nh * dv):
        raise ValueError(f"head_prefix: out {out.shape} for {t} rows of {nh} heads of {dv}")
    _head_prefix[cdiv(t * nh * dv, THREADS), THREADS, stream](a, float32(scale), out)


@pdl_kernel
@cuda.jit
def _scale(x, s):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] *= s


def scale(x, s, stream):
    """x [n] *= s in place (pass .reshape(-1) views): AFMoE's muP embedding scale."""
    _scale[cdiv(x.shape[0], THREADS), THREADS, stream](x, float32(s))


@pdl_kernel
@cuda.jit
def _clip(x, lim):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] = min(max(x[i], -lim), lim)


def clip(x, lim, stream):
    """x [n] clamped to [-lim, lim] in place (pass .reshape(-1) views)."""
    _clip[cdiv(x.shape[0], THREADS), THREADS, stream](x, float32(lim))


@pdl_kernel
@cuda.jit
def _silu_mul(g, u, out):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    if i < out.shape[0]:
        a = g[i]
        out[i] = a / (float32(1.0) + math.exp(-a)) * u[i]


@pdl_kernel
@cuda.jit
def _silu_mul_limited(g, u, out, limit, after, alpha):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    if i < out.shape[0]:
        a = g[i]
        b = min(max(u[i], -limit), limit)
        if alpha > float32(0.0):
            a = min(a, limit)
            out[i] = (b + float32(1.0)) * a / (float32(1.0) + math.exp(-alpha * a))
        elif after:
            out[i] = min(a / (float32(1.0) + math.exp(-a)), limit) * b
        else:
            a = min(a, limit)
            out[i] = a / (float32(1.0) + math.exp(-a)) * b


def silu_mul(g, u, out, stream, limit=0.0, after=False, alpha=0.0):
    """out [n] = silu(g) * u (1-D views). limit > 0: u clipped to +-limit, and the gate clamped
    from above at limit before the SiLU (DeepSeek-V4) or its SiLU after (after: Step-3.5), or
    alpha > 0: gpt-oss's (u + 1) * g * sigmoid(alpha g) without biases (MiniMax-M3);
    reference.limited_expert's activation."""
    if limit > 0:
        _silu_mul_limited[cdiv(out.shape[0], THREADS), THREADS, stream](
            g, u, out, float32(limit), bool(after), float32(alpha))
        return
    _silu_mul[cdiv(out.shape[0], THREADS), THREADS, stream](g, u, out)


@pdl_kernel
@cuda.jit
def _relu2(x):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    if i < x.shape[0]:
        a = max(x[i], float32(0.0))
        x[i] = a * a


def relu2(x, stream):
    """x [n] = relu(x)^2 in place (1-D views): Nemotron-H's dense MLP and shared expert
    activation (reference.relu2_expert's)."""
    _relu2[cdiv(x.shape[0], THREADS), THREADS, stream](x)


@pdl_kernel
@cuda.jit
def _zero(x):
    pdl_wait()
    pdl_trigger()
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] = float32(0.0)


def zero(x, stream):
    """x [n] = 0 (pass .reshape(-1) of a contiguous array): clears state per request."""
    _zero[cdiv(x.shape[0], THREADS), THREADS, stream](x)


@pdl_kernel
@cuda.jit
def _advance(pos):
    pdl_wait()
    pdl_trigger()
    pos[0] += 1


def advance(pos, stream):
    """pos int32 [1] += 1 on the device: the next decode token's position, when the host does
    not wait for this one before launching the next (pipelined decode)."""
    _advance[1, 1, stream](pos)


REQ_SHIFT = 16   # a request word: token number << REQ_SHIFT | layer


@cuda.jit(device=True)
def _gate(slots, ids, held, stage, seq, flag, req, ids_out, layer):
    """The gate's work (one thread), after the launch's PDL wait: see expert_gate."""
    miss = False
    for k in range(slots.shape[0]):
        if slots[k] < 0:
            # expert_gather copied a block the RAM cache held into the staging slot
            if stage[k] >= 0 and held[ids[k]] >= 0:
                slots[k] = stage[k]
            else:
                miss = True
    if not miss:
        return
    K = ids.shape[0]
    for k in range(K):
        ids_out[layer, k] = ids[k]
        ids_out[layer, K + k] = slots[k]
    fence_system()                     # the ids before the request
    s = seq[0]
    req[0] = (int64(s) << REQ_SHIFT) | int64(layer)
    fence_system()
    while cuda.atomic.add(flag, layer, int32(0)) != s:   # (an atomic: no stale cached copy)
        pause()
    for k in range(slots.shape[0]):    # a slot the host left missing (it gave up on an error)
        cuda.atomic.max(slots, k, int32(0))


@pdl_kernel
@cuda.jit
def _expert_gate(slots, ids, held, stage, seq, flag, req, ids_out, layer):
    """One thread. slots int32 [K] (the router's, -1 where the expert is not in VRAM), ids
    int32 [K], held int32 [E] (the layer's row of the host RAM cache's table, -1 where a block
    is not there) and stage int32 [K] (the layer's staging slots; -1: no gather), seq int32 [1]
    (this token's number), flag int32 [L], req int64 [1] and ids_out int32 [L, 2 K] in mapped
    host memory."""
    pdl_wait()
    _gate(slots, ids, held, stage, seq, flag, req, ids_out, layer)


def expert_gate(slots, ids, held, stage, seq, flag, req, ids_out, layer: int, stream):
    """The streamed token graph's stop before a MoE layer's experts: when the router mapped
    every routed expert to a VRAM slot (slots >= 0), or expert_gather brought it into its
    staging slot, it passes; otherwise it hands the layer's ids and slots (-1: missing) to the
    host (ids_out[layer], then req = seq << REQ_SHIFT | layer, both in mapped memory: pass
    whole mapped arrays, not slices) and waits until the host, having copied the missing
    blocks in and written their slots, sets flag[layer] to seq (on its copy stream, after the
    copies)."""
    _expert_gate[1, 1, stream](slots, ids, held, stage, seq, flag, req, ids_out, int32(layer))


GATHER_BLOCKS = 2 if SIM else 8    # blocks an expert: 1 MB of reads in flight for K = 8
GATHER_UNROLL = 4                  # 16-byte loads a thread issues before its stores


@cuda.jit(device=True, inline=True)
def _gather_part(k, part, blocks, slots, ids, held, stage, pool, bank):
    """Block `part` of `blocks` copies its share of routed expert k's block from the pinned
    pool into its staging slot, where the router found no VRAM slot (or the gate of the same
    launch has already put the staging slot there) and the host RAM cache holds it."""
    s, dst = slots[k], stage[k]
    if dst < 0 or (s >= 0 and s != dst):   # (a staging slot is never an expert's VRAM slot)
        return
    h = held[ids[k]]
    if h < 0:
        return
    W = bank.shape[1]
    step = blocks * THREADS * 4 * GATHER_UNROLL
    i = (part * THREADS + cuda.threadIdx.x) * 4 * GATHER_UNROLL
    while i < W:
        a0, a1, a2, a3 = ld4(pool, h, i)
        b0, b1, b2, b3 = ld4(pool, h, i + 4)
        c0, c1, c2, c3 = ld4(pool, h, i + 8)
        d0, d1, d2, d3 = ld4(pool, h, i + 12)
        bank[dst, i], bank[dst, i + 1], bank[dst, i + 2], bank[dst, i + 3] = a0, a1, a2, a3
        bank[dst, i + 4], bank[dst, i + 5], bank[dst, i + 6], bank[dst, i + 7] = b0, b1, b2, b3
        bank[dst, i + 8], bank[dst, i + 9], bank[dst, i + 10], bank[dst, i + 11] = c0, c1, c2, c3
        bank[dst, i + 12], bank[dst, i + 13], bank[dst, i + 14], bank[dst, i + 15] = \
            d0, d1, d2, d3
        i += step


def _make_gather(BLOCKS):
    @cuda.jit
    def gather(slots, ids, held, stage, pool, bank):
        """grid K * BLOCKS, THREADS. pool uint32 [N, Wp] (the host RAM cache's pinned buffers,
        mapped), bank uint32 [S, W] (VRAM slots), W a multiple of 4 * GATHER_UNROLL."""
        pdl_wait()
        pdl_trigger()
        b = cuda.blockIdx.x
        _gather_part(b // BLOCKS, b % BLOCKS, BLOCKS, slots, ids, held, stage, pool, bank)
    return pdl_kernel(gather)


def _make_gate_gather(BLOCKS):
    @cuda.jit
    def gate_gather(slots, ids, held, stage, pool, bank, seq, flag, req, ids_out, layer, done):
        """grid K * BLOCKS + 1, THREADS: the gather's blocks, then one whose first thread is
        the gate (expert_gate's arguments), once every gather block has counted itself in
        done int32 [L] (zeros; the gate sets its entry back to 0): a request lets the host
        evict RAM blocks, so none may still be read then. Only the gather's blocks trigger the
        next launch, which thus cannot take the SMs while the gate waits on the host."""
        pdl_wait()
        b = cuda.blockIdx.x
        K = slots.shape[0]
        if b == K * BLOCKS:
            if cuda.threadIdx.x == 0:
                while cuda.atomic.add(done, layer, int32(0)) < K * BLOCKS:
                    pause()
                done[layer] = 0
                _gate(slots, ids, held, stage, seq, flag, req, ids_out, layer)
            return
        pdl_trigger()
        _gather_part(b // BLOCKS, b % BLOCKS, BLOCKS, slots, ids, held, stage, pool, bank)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            cuda.threadfence()          # this block's copies before its count
            cuda.atomic.add(done, layer, int32(1))
    return pdl_kernel(gate_gather)


_gathers = {}


def _check_gather(pool, bank):
    W = bank.shape[1]
    if W % (4 * GATHER_UNROLL) or pool.shape[1] < W:
        raise ValueError(f"expert_gather: VRAM slots of {W} words need a multiple of "
                         f"{4 * GATHER_UNROLL} words and host buffers at least as wide "
                         f"(got {pool.shape[1]})")


def _gather_kernel(make, blocks: int):
    blocks = blocks or GATHER_BLOCKS
    if (make, blocks) not in _gathers:
        _gathers[make, blocks] = make(blocks)
    return blocks, _gathers[make, blocks]


def expert_gather(slots, ids, held, stage, pool, bank, stream, blocks: int = 0):
    """Before a MoE layer's gate in the streamed token graph: each routed expert with no VRAM
    slot (slots[k] < 0) whose block the host RAM cache holds (held[ids[k]] = its pinned
    buffer) is read by the SMs straight from pinned host memory over PCIe into the staging
    slot stage[k] of bank, with no host round trip (the gate then takes that slot). slots,
    ids, stage int32 [K]; held int32 [E]; pool uint32 [N, Wp] and bank uint32 [S, W] views;
    blocks an expert (0: GATHER_BLOCKS)."""
    _check_gather(pool, bank)
    blocks, kern = _gather_kernel(_make_gather, blocks)
    kern[slots.shape[0] * blocks, THREADS, stream](slots, ids, held, stage, pool, bank)


def expert_gate_gather(slots, ids, held, stage, pool, bank, seq, flag, req, ids_out, layer: int,
                       done, stream, blocks: int = 0):
    """expert_gather and expert_gate in one launch (a MoE layer of the streamed token graph
    costs one launch for both): the gate's thread takes the staging slot of each block the
    RAM cache holds, once the other blocks have copied them, and asks the host for the rest.
    done: int32 [L] zeros, the gather blocks' count (left at zero)."""
    _check_gather(pool, bank)
    blocks, kern = _gather_kernel(_make_gate_gather, blocks)
    kern[slots.shape[0] * blocks + 1, THREADS, stream](slots, ids, held, stage, pool, bank, seq,
                                                       flag, req, ids_out, int32(layer), done)


@cuda.jit(device=True, inline=True)
def _mix64(r):
    r = (r ^ (r >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    r = (r ^ (r >> uint64(27))) * uint64(0x94D049BB133111EB)
    return r ^ (r >> uint64(31))


@pdl_kernel
@cuda.jit
def _route_uniform(ids, slots, slot_of, seq, layer, n_experts):
    """One thread: K distinct experts from a hash of (token number, layer)."""
    pdl_wait()
    pdl_trigger()
    # splitmix64 from a seed that is itself mixed: consecutive tokens' streams do not overlap
    z = _mix64((uint64(seq[0]) << uint64(20)) ^ uint64(layer))
    K = ids.shape[0]
    k = 0
    while k < K:
        z += uint64(0x9E3779B97F4A7C15)
        r = _mix64(z)
        e = int32(r % uint64(n_experts))
        dup = False
        for j in range(k):
            if ids[j] == e:
                dup = True
        if not dup:
            ids[k] = e
            slots[k] = slot_of[e]
            k += 1


def route_uniform(ids, slots, slot_of, seq, layer: int, n_experts: int, stream):
    """Benchmarks: replace a layer's routed ids (int32 [K], after the router) by K distinct
    experts drawn uniformly from a hash of the token number seq[0] and the layer, and their
    slots (int32 [K]) through slot_of (int32 [E]): routing without locality, on the device,
    so the streamed token graph runs it."""
    if n_experts < ids.shape[0]:
        raise ValueError(f"route_uniform: {ids.shape[0]} distinct experts of {n_experts}")
    _route_uniform[1, 1, stream](ids, slots, slot_of, seq, int32(layer), int32(n_experts))
