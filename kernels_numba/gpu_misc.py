"""Small CUDA kernels the decoder needs beside the dense / attention / expert families:
KV-cache store at device positions, bias add, clamp, SwiGLU of a dense MLP, slot mapping,
position advance, the expert gate of a streamed token graph.

Legend: T = tokens, Hkv = kv heads, D = head dim, S = cache positions, N = a row's size.
Every launcher takes an explicit stream, allocates nothing and never syncs (graph-capturable).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64

from .gpu_util import (SIM, cdiv, fence_system, pause, pdl_kernel, pdl_trigger, pdl_wait,
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


def silu_mul(g, u, out, stream):
    """out [n] = silu(g) * u (1-D views)."""
    _silu_mul[cdiv(out.shape[0], THREADS), THREADS, stream](g, u, out)


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


@pdl_kernel
@cuda.jit
def _expert_gate(slots, ids, seq, flag, req, ids_out, layer):
    """One thread. slots int32 [K] (the router's, -1 where the expert is not in VRAM), ids
    int32 [K], seq int32 [1] (this token's number), flag int32 [L], req int64 [1] and ids_out
    int32 [L, K] in mapped host memory."""
    pdl_wait()
    miss = False
    for k in range(slots.shape[0]):
        if slots[k] < 0:
            miss = True
    if not miss:
        return
    for k in range(ids.shape[0]):
        ids_out[layer, k] = ids[k]
    fence_system()                     # the ids before the request
    s = seq[0]
    req[0] = (int64(s) << REQ_SHIFT) | int64(layer)
    fence_system()
    while cuda.atomic.add(flag, layer, int32(0)) != s:   # (an atomic: no stale cached copy)
        pause()
    for k in range(slots.shape[0]):    # a slot the host left missing (it gave up on an error)
        cuda.atomic.max(slots, k, int32(0))


def expert_gate(slots, ids, seq, flag, req, ids_out, layer: int, stream):
    """The streamed token graph's stop before a MoE layer's experts: when the router mapped
    every routed expert to a VRAM slot (slots >= 0) it passes; otherwise it hands the layer's
    ids to the host (ids_out[layer], then req = seq << REQ_SHIFT | layer, both in mapped
    memory: pass whole mapped arrays, not slices) and waits until the host, having copied the
    missing blocks in and written their slots, sets flag[layer] to seq (on its copy stream,
    after the copies)."""
    _expert_gate[1, 1, stream](slots, ids, seq, flag, req, ids_out, int32(layer))
