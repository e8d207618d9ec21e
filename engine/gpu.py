"""The CUDA decoder for the llama-like MoE families: dense weights resident in VRAM, routed
experts through the VRAM tier (engine/residency.py), kernels from kernels_numba/gpu_*.

Same interface as engine.models.base.MoeDecoder (new_state, forward, on_route), so the runtime
drives it unchanged. All buffers are preallocated: the run state holds the KV cache, the
activations for one token and for a prefill chunk, and the position in device memory.
Per MoE layer at decode: dense work -> router top-k on the device -> ids to the host ->
resolve slots (copies on the copy stream) -> one expert launch pair through the slot table.
Streamed decode with graphs runs a token as one graph instead (DEVICE_RESOLVE): the router maps
the ids to slots through a device table, and only a layer that routes to an expert not in VRAM
stops for the host (gm.expert_gate; _serve_token).
Legend: T = tokens, H = hidden, D = head dim, Hq / Hkv = heads, E = experts, K = top-k,
I = expert intermediate, V = vocab, A = T * K assignments.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import numpy as np
from numba import cuda

from engine.models.base import check_room, resumable
from engine.models.rope import pair_rows
from kernels_numba import gpu_attention as ga
from kernels_numba import gpu_deltanet as gdn
from kernels_numba import gpu_dense as gd
from kernels_numba import gpu_experts as gx
from kernels_numba import gpu_misc as gm
from kernels_numba import gpu_sampling as gs

PREFILL_CHUNKS = (2048, 1024, 512, 256)   # tokens per prefill pass, largest that fits first: a
                                          # prompt up to one chunk reads each expert once per layer
GEMM_MIN_T = 8           # below this many tokens the matvec kernel beats the tiled GEMM
# streamed decode as one graph a token, the host serving only the layers that miss VRAM
# (MOE_STREAM_DEVICE_RESOLVE=0: a graph segment a layer, every layer's ids through the host)
DEVICE_RESOLVE = os.environ.get("MOE_STREAM_DEVICE_RESOLVE", "1") != "0"
# the streamed token graph reads RAM hits from pinned host memory itself (gm.expert_gather).
# Off by default: on the H200 (docs/PERF.md, fourteenth session) it made uniform routing 10 %
# faster (no host round trip a layer) but the SMs' PCIe reads reach about 29 GB/s against the
# copy engine's 55, and its launch a layer cost the model's own routing (96 % VRAM hits) 3-5 %
DEVICE_GATHER = os.environ.get("MOE_STREAM_DEVICE_GATHER", "0") == "1"
GATHER_BLOCKS = int(os.environ.get("MOE_STREAM_GATHER_BLOCKS", "0"))   # blocks an expert (0: the kernel's)
# the gather and the gate in one launch (gm.expert_gate_gather), with the gather: it cost the
# model's own routing nothing on the H100 (docs/PERF.md, twenty-ninth session)
GATE_FOLD = os.environ.get("MOE_STREAM_GATE_FOLD", "0") == "1"
# a served layer's slot-table changes (its evictions and placements) as one copy of the table
# behind its block copies, not two cuMemsetD32Async a block between them (each a driver call and
# a stop of the copy stream). Safe while the graph stands at the layer's gate: no later gate
# reads the table before the flag, which follows the copy. Not yet timed on a GPU (2026-12-07):
# off until it is
TABLE_BATCH = os.environ.get("MOE_STREAM_TABLE_BATCH", "0") == "1"
SERVE_TIMEOUT_S = 120.0  # a token graph that neither finishes nor asks for blocks this long


def clamped(c) -> bool:
    """gpt-oss: biased experts with a clamped SwiGLU (gx.expert_mlp_clamped: act holds the
    gate and up sums, 2A rows), q / k / v / o biases, attention sinks, a biased router and
    per-layer sliding windows."""
    from engine.models.gpt_oss import GptOssConfig
    return isinstance(c, GptOssConfig)


def raw_act(c) -> bool:
    """The experts' act scratch holds the RAW gate and up sums, [2A, I]: gpt-oss's clamped
    SwiGLU, clamps without biases (GpuDecoder._limit: Step-3.5's limits, MiniMax-M3's
    swiglu_limit), Llama 4's routing weights on the experts' inputs (gx.scaled_swiglu), or
    ungated experts (Nemotron-H's relu^2: the up sums twice, gx.expert_mlp_relu2)."""
    return (getattr(c, "swiglu_limit", None) is not None or any(getattr(c, "limits", ()))
            or c.routing == "sigmoid_input" or not c.gated_experts)


def dense_keys(c, extra_per_layer=(), attn=None) -> list:
    """(engine key, layer) of every dense weight a CUDA decoder uploads (GpuDecoder.upload_all):
    embed, final_norm, lm_head unless tied; a layer's norms, its attention weights, the family's
    extra_per_layer, then its router (bias, shared expert) or dense MLP. attn: a layer's attention
    weights where the family derives its own (default: q / k / v / o and what the config adds:
    biases, q / k norms, gpt-oss's sinks). attn and extra_per_layer: keys, or a function of the
    layer giving them. The config-given keys must be the family's names (engine/names.py)."""
    from engine.models.cohere2_moe import Cohere2MoeConfig
    from engine.names import NAMES
    oss = clamped(c)   # gpt-oss: o bias, sinks, router bias
    parallel = isinstance(c, Cohere2MoeConfig)   # one norm a layer (engine/gpu_cohere.py)
    glob = [("embed", None), ("final_norm", None)] + ([] if c.tie_embeddings else [("lm_head", None)])
    norms = ["attn_norm"] + ([] if parallel else ["mlp_norm"])
    named = [k for k, _ in glob] + norms
    if attn is None:
        attn = ["q", "k", "v", "o"]
        if c.attention_bias:
            attn += ["q_bias", "k_bias", "v_bias"] + (["o_bias"] if oss else [])
        if c.qk_norm != "none":
            attn += ["q_norm", "k_norm"]
        attn += ["sinks"] if oss else []
        named += attn
    moe = ["router"] + (["router_bias"] if c.routing in ("sigmoid", "softmax_bias") or oss else []) + \
        (["shared_gate", "shared_up", "shared_down"] if c.shared_intermediate else []) + \
        (["shared_expert_gate"] if c.shared_intermediate and c.shared_gated else [])
    mlp = ["mlp_gate", "mlp_up", "mlp_down"]
    named += (moe if c.moe_layers else []) + (mlp if len(c.moe_layers) < c.n_layers else [])
    assert all(k in NAMES[c.family] for k in named), [k for k in named if k not in NAMES[c.family]]
    keys = list(glob)
    for l in range(c.n_layers):
        per = norms + list(attn(l) if callable(attn) else attn)
        per += list(extra_per_layer(l) if callable(extra_per_layer) else extra_per_layer)
        per += moe if l in c.moe_layers else mlp
        keys += [(k, l) for k in per]
    if oss:   # the per-expert biases as one [E, 2I + H] array a layer (GpuDecoder._host_array)
        keys += [("expert_bias", l) for l in c.moe_layers]
    return keys


def run_state_bytes(c, t: int, max_context: int) -> int:
    """Device bytes of the activations for a prefill chunk of t tokens (Buffers below), the
    logits and the device sampler's scratch: what the planner reserves beside the KV cache."""
    from kernels_numba.gpu_attention import num_splits
    # attention scratch: a chunk of t queries gets t times fewer pieces than one decode query
    # (alloc_partials), and the one-token buffers of the decode graphs are kept beside it
    pieces = t * num_splits(max_context, t=t) + num_splits(max_context)
    dense_mlp = 2 * c.dense_intermediate if len(c.moe_layers) < c.n_layers else 0
    return 4 * (t * (5 * c.hidden + 2 * c.q_dim + 2 * c.kv_dim + c.n_experts
                     + 2 * c.shared_intermediate + 1 + dense_mlp)
                + t * c.top_k * (c.moe_intermediate * (2 if raw_act(c) else 1) + c.hidden)
                + c.vocab_size * 2
                + c.n_heads * pieces * (c.head_dim + 2))


def pick_prefill_chunk(c, max_context: int, vram_bytes: float, share: float = 0.15,
                       state_bytes=None) -> int:
    """The largest prefill chunk whose run state (state_bytes, default run_state_bytes) stays
    within a share of the VRAM budget."""
    state_bytes = state_bytes or run_state_bytes
    for t in PREFILL_CHUNKS:
        t = min(t, max_context)
        if state_bytes(c, t, max_context) <= share * vram_bytes:
            return t
    return min(PREFILL_CHUNKS[-1], max_context)


class Buffers:
    """Activations for up to T tokens (float32 unless said)."""
    separate_v = True   # v, the attention output and the fused q | k | v (MLA has none of them)

    def __init__(self, c, t: int, s_max: int):
        f = np.float32
        self.t = t
        self.x = cuda.device_array((t, c.hidden), f)             # residual stream [T, H]
        self.h = cuda.device_array((t, c.hidden), f)             # normed input [T, H]
        self.q = cuda.device_array((t, c.q_dim), f)              # [T, Hq*D]
        self.k = cuda.device_array((t, c.kv_dim), f)
        if self.separate_v:
            self.v = cuda.device_array((t, c.kv_dim), f)
            self.att = cuda.device_array((t, c.q_dim), f)
            self.qkv = cuda.device_array(c.q_dim + 2 * c.kv_dim, f)   # one decode token's q | k | v
        self.o = cuda.device_array((t, c.hidden), f)
        self.rl = cuda.device_array((t, c.n_experts), f)         # router logits [T, E]
        self.ids = cuda.device_array((t, c.top_k), np.int32)     # [T, K]
        self.w = cuda.device_array((t, c.top_k), f)
        a = t * c.top_k
        # [A, I]; raw_act [2A, I]: the gate and up sums, then the activation in rows < A
        self.act = cuda.device_array(((2 if raw_act(c) else 1) * a, c.moe_intermediate), f)
        self.y = cuda.device_array((a, c.hidden), f)              # [A, H]
        self.pos = cuda.device_array(t, np.int32)
        self.tok = cuda.device_array(t, np.int32)
        self.partials = ga.alloc_partials(t, c.n_heads, c.head_dim, s_max)
        if c.dense_intermediate and len(c.moe_layers) < c.n_layers:
            self.g = cuda.device_array((t, c.dense_intermediate), f)
            self.u = cuda.device_array((t, c.dense_intermediate), f)
        if c.shared_intermediate:
            self.sg = cuda.device_array((t, c.shared_intermediate), f)     # [T, Is]
            self.su = cuda.device_array((t, c.shared_intermediate), f)
            if c.shared_gated:
                self.sgate = cuda.device_array((t, 1), f)                  # [T, 1]
        # host staging (pinned): ids and weights back from the device, slot tables out
        self.ids_h = cuda.pinned_array((t, c.top_k), np.int32)
        self.w_h = cuda.pinned_array((t, c.top_k), f)
        self.tok_h = cuda.pinned_array(t, np.int32)
        self.pos_h = cuda.pinned_array(t, np.int32)


def cache_arrays(st) -> list:
    """A run state's cache arrays, each once (MLA's v is its k)."""
    return st.k if st.v is st.k else st.k + st.v


class GpuRunState:
    """KV cache [L][S_max, Hkv, D] in VRAM (float32, or uint16 bf16 bits: kv_dtype), and the
    filled length."""

    def __init__(self, c, max_context: int, kv_dtype=np.float32):
        self.max_context = max_context
        self.k = [cuda.device_array((max_context, c.n_kv_heads, c.head_dim), kv_dtype)
                  for _ in range(c.n_layers)]
        self.v = [cuda.device_array((max_context, c.n_kv_heads, c.head_dim), kv_dtype)
                  for _ in range(c.n_layers)]
        self.pos = 0

    def save_nbytes(self, keep: int) -> int:
        return sum(a.nbytes // a.shape[0] * keep for a in cache_arrays(self))

    def save(self, keep: int, stream) -> dict:
        """Host copies of the first keep cache rows of every layer, for load()."""
        out = {"rows": [a[:keep].copy_to_host(stream=stream) for a in cache_arrays(self)]}
        stream.synchronize()
        return out

    def load(self, saved: dict, keep: int, stream) -> None:
        """Take the first keep rows of a save() (copies queued on stream, before its kernels)."""
        for a, h in zip(cache_arrays(self), saved["rows"]):
            a[:keep].copy_to_device(np.ascontiguousarray(h[:keep]), stream=stream)
        self.pos = keep


_QKV = ("q", "k", "v")
EXPERT_BIASES = ("expert_gate_bias", "expert_up_bias", "expert_down_bias")


def fused_rows(parts, layer) -> np.ndarray:
    """(name, array) row blocks stacked into one matrix (a fused projection): they must agree
    in dtype and in everything past the rows, else the fused launch would read them wrong."""
    n0, arrays = parts[0][0], [np.asarray(a) for _, a in parts]
    for (n, _), a in zip(parts[1:], arrays[1:]):
        if a.dtype != arrays[0].dtype or a.shape[1:] != arrays[0].shape[1:]:
            raise ValueError(f"layer {layer}: {n} ({a.dtype}, rows of {a.shape[1:]}) cannot be "
                             f"fused with {n0} ({arrays[0].dtype}, rows of {arrays[0].shape[1:]})")
    return np.ascontiguousarray(np.concatenate(arrays))


def _widened(a) -> np.ndarray:
    """A weight as the device takes it: bf16 vectors (1-D, or one row) widened to float32, the
    rest as is."""
    a = np.asarray(a)
    return as_f32(a) if a.dtype == np.uint16 and a.size == a.shape[-1] else a


def as_f32(a) -> np.ndarray:
    """A host weight in float32 (bf16 bits widened exactly)."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


def embed_on_host(c) -> bool:
    """An untied embedding table is only gathered from (one row a token): it stays in host RAM."""
    return not c.tie_embeddings


class GpuDecoder:
    fuse_qkv = True   # families whose q / k / v are plain projections of the normed input
    swiglu_alpha = 0.0  # the clamped SwiGLUs' form (_limit): 0 Step-3.5's, else gpt-oss's (M3)
    pipelines = True  # decode_stream: an extra token's KV row past st.pos is harmless
    rewinds = True    # resume_state may set pos back (the state is the KV cache alone)
    buffers_cls = Buffers       # run-state classes: engine/gpu_hybrid.py extends them
    state_cls = GpuRunState
    dense_keys = staticmethod(dense_keys)   # what upload_all takes (c -> keys): a family's own added

    def __init__(self, c, weight, experts_host, plan, layout, on_route=None, prefill_batch: int = 32,
                 max_context: int = 4096, use_graphs: bool = True, speculate: bool = False,
                 prefill_chunk: int = 512, kv_dtype=np.float32):
        """weight(key, layer) -> host array; experts_host: get/contains over expert blocks;
        kv_dtype: the KV cache's, float32 or uint16 (bf16 bits)."""
        self.max_context = max_context
        self.kv_dtype = kv_dtype
        self.prefill_chunk = prefill_chunk
        self.use_graphs = use_graphs
        self._graphs = None
        from engine.residency import VramResidency
        self.c = c
        self.embed_on_host = embed_on_host(c)
        self.on_route = on_route
        self.cs = cuda.stream()
        self.xs = cuda.stream()
        self.plan = plan
        self.fmt = layout.fmt
        gx.check_layout(self.fmt, layout.as_array(), c.top_k)
        self.lay_h = gx.kernel_layout(layout)   # (an ungated layout's gate sections: its up's)
        self.lay = cuda.to_device(self.lay_h)
        self._w = {}
        self._weight = weight
        self.inv_freq = cuda.to_device(c.rope.inv_freq())
        # NoPE layers (K-EXAONE's full ones): RoPE by zero angles, the identity, in the same launch
        self.no_freq = cuda.to_device(np.zeros_like(c.rope.inv_freq())) if c.nope_layers else None
        self.res = VramResidency(plan.vram_slots, layout.block_bytes, experts_host, self.xs, self.cs)
        from engine.residency import h2d_copier
        streamed = plan.dense_streamed
        self._dslot = {l: i % 2 for i, l in enumerate(streamed)}             # layer -> slot
        self._dnext = {l: streamed[(i + 1) % len(streamed)] for i, l in enumerate(streamed)}
        self._dslots = [cuda.device_array((1, plan.dense_slot_bytes), np.uint8)
                        for _ in range(2)] if streamed else []
        self._dcopy = [h2d_copier(d, self.xs) for d in self._dslots]
        self._dfree = [cuda.event() for _ in self._dslots]
        for e in self._dfree:
            e.record(self.cs)
        self._dready_evt = {l: cuda.event() for l in streamed}
        self._dready: dict = {}     # layer -> event of its copy in flight or landed, not yet used
        self._dpack: dict = {}      # layer -> (pinned uint8 host buffer, {key: (offset, shape, dtype)})
        self.views = gx.bank_views(self.res.bank)
        self.prefill_batch = prefill_batch
        self.slots_h = cuda.pinned_array((c.n_layers, c.top_k), np.int32)
        self.slots_h[:] = 0
        self.slots_d = cuda.to_device(np.zeros((c.n_layers, c.top_k), np.int32))   # slot 0 is valid
        self.ids_all_h = cuda.pinned_array((c.n_layers, c.top_k), np.int32)       # decode routing
        self.ids_all_d = cuda.device_array((c.n_layers, c.top_k), np.int32)   # all-resident routing
        self.spec_h = cuda.pinned_array((c.n_layers, c.top_k), np.int32)          # predicted routing
        # off by default: on the H200 run of 2026-11-30 decode with it was slower (13.8 vs 51.6
        # tok/s at --vram-gb 8 --ram-gb 32) at 0.77 accuracy, cause not yet isolated; since then
        # the compute stream waits only for predicted copies it reads, and copies pause while
        # predictions miss (VramResidency.spec_useful); --speculate turns it on
        self.speculate = speculate
        self.route_override = None   # benchmarks: replace routing (host side) to force streaming
        self.device_route = None     # benchmarks: "uniform" replaces routing on the device
        # per MoE layer: (dense done, copies done) events, timing the H2D stall of streamed decode
        self._events = {l: (cuda.event(), cuda.event()) for l in c.moe_layers}
        self._moe_rows = np.asarray(c.moe_layers, np.int64)   # the MoE layers' rows of ids_all_h
        self._moe_row_of = {l: i for i, l in enumerate(c.moe_layers)}
        moe = list(c.moe_layers)
        self.next_moe = {l: (moe[i + 1] if i + 1 < len(moe) else None) for i, l in enumerate(moe)}
        self.slot_of_d = None   # int32 [L, E] device slot table (-1: not in VRAM, streamed)
        self._all_loaded = False  # every expert placed in its own slot (_resident_all)
        self.device_resolve = DEVICE_RESOLVE
        self.device_gather = DEVICE_GATHER
        self._route_captured = None
        self._stage_dirty = False
        self._stage_h = None    # int32 [L, K] staging slots of the gathered blocks (two banks)
        self._devres = False    # the captured graphs are the streamed one-graph kind
        self.rl_spec = cuda.device_array((1, c.n_experts), np.float32)
        self.ids_spec = cuda.device_array((1, c.top_k), np.int32)
        self.w_spec = cuda.device_array((1, c.top_k), np.float32)
        self.one = Buffers(c, 1, 1)   # placeholder until a state fixes S_max
        # Llama 4: its routing chooses without a bias (router_sigmoid_topk's zero one), and the
        # experts' down projections add with weight 1 (the weights went into their inputs)
        scaled = c.routing == "sigmoid_input"
        self.zero_bias = cuda.to_device(np.zeros(c.n_experts, np.float32)) if scaled else None
        self.ones = cuda.to_device(np.ones(c.top_k, np.float32)) if scaled else None   # (graphs read it)
        self.ones_a = self.ones   # a prefill chunk's assignments' (grows; graphs never read it)
        self.chunk = None
        self.state = None
        self.logits_d = None
        self.logits_h = None
        # device sampling (forward_sample, decode_stream): the setting and the draw go in through
        # pinned memory and one copy inside the graph, so a graph serves any setting; only the id
        # comes back. Two slots: a pipelined token's are written while the one before is in flight
        self.samp_h = cuda.pinned_array((2, 4), np.float32)   # [slot] (temp, top_k, top_p, u)
        self.samp_h[:] = (0.0, 0.0, 1.0, 0.0)                 # greedy for the graph warm-up
        self.samp_d = cuda.device_array(4, np.float32)
        self.probs_d = cuda.device_array(c.vocab_size, np.float32)   # sampler scratch [V]
        self.tok_out_h = cuda.pinned_array(2, np.int32)       # [slot] the sampled id
        self._sampled = [cuda.event() for _ in range(2)]      # [slot] its id has landed

    def w(self, key: str, layer: int | None = None):
        """Dense weight on the device (uploaded on first use; 1-D weights as float32). q, k and v
        are row ranges of one fused [Hq D + 2 Hkv D, H] matrix: one launch projects a decode token."""
        if self.fuse_qkv and key in _QKV:
            qkv = self.w("qkv", layer)
            r0 = {"q": 0, "k": self.c.q_dim, "v": self.c.q_dim + self.c.kv_dim}[key]
            return qkv[r0:r0 + (self.c.q_dim if key == "q" else self.c.kv_dim)]
        k = (key, layer)
        d = self._w.get(k)
        if d is None and layer in self._dslot:
            d = self._w[k] = self._dense_view(key, layer)
        if d is None:
            a = self._host_array(key, layer)
            if key == "embed" and self.embed_on_host:
                # a token reads one row: the table stays in mapped host memory, read over PCIe
                # by the embed kernel, and its VRAM goes to hot experts
                d = cuda.mapped_array(a.shape, a.dtype)
                d[...] = a
                self._w[k] = d
                return d
            d = self._w[k] = cuda.to_device(np.ascontiguousarray(a), stream=self.cs)
        return d

    def _canon(self, key: str) -> str:
        """The device weight that holds key's rows (a fused matrix, or key itself)."""
        return "qkv" if self.fuse_qkv and key in _QKV else key

    def _host_array(self, key: str, layer: int | None) -> np.ndarray:
        """The host array behind a device weight (q | k | v fused, 1-D bf16 widened)."""
        if key == "qkv":
            a = fused_rows([(x, pair_rows(self.c, x, self._weight(x, layer))) for x in _QKV], layer)
        elif key == "expert_bias":   # gpt-oss: [E, 2I + H] (gate | up | down), rows by expert id
            a = np.stack([np.concatenate([_widened(self._weight(k, layer, e))
                                          for k in EXPERT_BIASES])
                          for e in range(self.c.n_experts)])
        else:
            a = _widened(pair_rows(self.c, key, self._weight(key, layer)))
        return np.ascontiguousarray(a)

    def upload_all(self, keys) -> None:
        """Every dense weight to the device, but the layers the plan streams: theirs are packed
        into one pinned host buffer per layer, copied into a device slot before the layer runs."""
        packs: dict = {}
        for key, layer in keys:
            if layer in self._dslot:
                packs.setdefault(layer, dict.fromkeys(()))[self._canon(key)] = None
            else:
                self.w(key, layer)
        for layer, ks in packs.items():
            self._pack_layer(layer, list(ks))
        self.cs.synchronize()

    # ---- dense layers streamed from host RAM (when the plan cannot keep them in VRAM) ---------
    # Two device slots alternate between the streamed layers; a layer's weights are copied into
    # its slot on the copy stream once the slot's previous layer has finished, while the layer
    # before computes, and the compute stream waits for the copy (_dense_begin / _dense_end).

    def _pack_layer(self, layer: int, keys: list) -> None:
        arrays = [(k, self._host_array(k, layer)) for k in keys]
        meta, off = {}, 0
        for k, a in arrays:
            meta[k] = (off, a.shape, a.dtype)
            off += (a.nbytes + 255) // 256 * 256
        cap = self._dslots[0].shape[1]
        if off > cap:
            raise RuntimeError(f"layer {layer}: its dense weights take {off} bytes, more than the "
                               f"planned dense slot of {cap} bytes")
        host = cuda.pinned_array(off, np.uint8)
        for k, a in arrays:
            o = meta[k][0]
            host[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
        self._dpack[layer] = (host, meta)

    def _dense_view(self, key: str, layer: int):
        host, meta = self._dpack[layer]
        if key not in meta:
            raise KeyError(f"dense weight {key!r} of streamed layer {layer} was not packed")
        off, shape, dtype = meta[key]
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self._dslots[self._dslot[layer]][0, off:off + n].view(dtype).reshape(shape)

    def _dense_fetch(self, layer: int) -> None:
        s = self._dslot[layer]
        self._dfree[s].wait(self.xs)      # the slot's previous layer has finished with it
        host = self._dpack[layer][0]
        self._dcopy[s](0, host, host.nbytes)
        evt = self._dready_evt[layer]
        evt.record(self.xs)
        self._dready[layer] = evt
        self.res.stats.h2d_bytes += host.nbytes
        self.res.stats.dense_h2d_bytes += host.nbytes

    def _dense_begin(self, layer: int) -> None:
        if layer not in self._dslot:
            return
        if layer not in self._dready:
            self._dense_fetch(layer)
        self._dready.pop(layer).wait(self.cs)

    def _dense_end(self, layer: int) -> None:
        """After the layer's launches: free its slot, start copying the next streamed layer."""
        if layer not in self._dslot:
            return
        self._dfree[self._dslot[layer]].record(self.cs)
        nxt = self._dnext[layer]
        if nxt not in self._dready:
            self._dense_fetch(nxt)

    # ---- state ---------------------------------------------------------------------------------

    def new_state(self, max_context: int) -> GpuRunState:
        """Reuses the preallocated state when it is large enough (nothing allocated per request)."""
        if self.state is None or self.state.max_context < max_context:
            self.state = self.state_cls(self.c, max(max_context, self.max_context), self.kv_dtype)
            # the graph warm-up reads cache rows no token wrote: garbage there (NaN) would
            # send the router's ids out of range
            for a in cache_arrays(self.state):
                gm.zero(a.reshape(-1), self.cs)
            self.one = self.buffers_cls(self.c, 1, self.state.max_context)
            self.chunk = None
            self._drop_graphs()
        self.state.pos = 0
        return self.state

    def resume_state(self, st, max_context: int, keep: int):
        """As MoeDecoder.resume_state, on the one preallocated state (its rows past keep are
        written again before any kernel reads them: attention reads up to the query's position)."""
        if st is not self.state or st.max_context < max_context or \
                not resumable(st, keep, self.rewinds):
            return None
        st.pos = keep
        return st

    def save_state(self, st, keep: int) -> dict:
        """As MoeDecoder.save_state: host copies of the state's first keep rows."""
        return st.save(keep, self.cs) if keep else {"rows": []}

    def restore_state(self, saved: dict, max_context: int, keep: int):
        """As MoeDecoder.restore_state, into the one preallocated state."""
        st = self.new_state(max_context)
        if keep:
            st.load(saved, keep, self.cs)
        return st

    def _buffers(self, t: int) -> Buffers:
        if t == 1:
            return self.one
        if self.chunk is None or self.chunk.t < t:
            self.chunk = self.buffers_cls(self.c, max(t, 16), self.state.max_context)
        return self.chunk

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, ids, st: GpuRunState, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(ids)
        check_room(st, len(ids))
        outs = []
        step = self.prefill_chunk
        for s in range(0, len(ids), step):
            part = ids[s:s + step]
            last = s + step >= len(ids)
            r = self._forward_chunk(part, st, all_logits, last)
            if r is not None:
                outs.append(r)
        return np.concatenate(outs, axis=0)

    def forward_sample(self, tid: int, st: GpuRunState, temperature: float, top_k: int,
                       top_p: float, u: float) -> int:
        """One decode token, sampled on the device: 4 bytes come back instead of the logits, and
        the host sorts nothing. The draw of CpuOps.sample with the same u (gpu_sampling.sample),
        up to float32 rounding at thresholds."""
        check_room(st, 1)
        self.samp_h[0] = (temperature, top_k, top_p, u)
        if self.use_graphs:
            return self._decode_graphed(int(tid), st, sample=True)
        return self._forward_chunk(np.array([tid]), st, False, True, sample=True)

    def can_pipeline(self) -> bool:
        """Whether decode_stream may run: one graph a token (every expert resident, routing on
        the device), nobody reading each token's routing on the host, and a state that an
        unused extra token leaves valid (a KV row past st.pos; not a recurrent state)."""
        return (self.pipelines and self.use_graphs and self.on_route is None
                and self.plan.all_resident)

    def decode_stream(self, tid: int, st: GpuRunState, temperature: float, top_k: int,
                      top_p: float, draw, n: int):
        """Yields the n ids after tid, sampled on the device, pipelined: token i + 1's graph is
        launched before token i's id is read (the sampler writes the id into the device token
        buffer the embedding reads, and advances the device position), so the host's work
        between tokens overlaps the GPU's. draw() -> u in [0, 1), called once per launched token
        in order (the runtime's rng.random()). st.pos counts the tokens whose ids were read;
        ending early (a stop id, the caller gone) leaves one more token's KV row written past
        st.pos, which the next forward overwrites. Without graphs (use_graphs False, the
        simulator) the same segments launch one by one."""
        check_room(st, n)
        c, cs, b = self.c, self.cs, self.one
        if not self._resident_all():
            raise RuntimeError("decode_stream needs every expert resident")
        if self.use_graphs:
            if self._graphs is None:
                self._capture(st)
            g = self._graphs

            def run(key):
                g[key].launch(cs)
        else:
            segs = self._segments(st)

            def run(key):
                segs[key](cs)

        def launch(i):
            k = i % 2   # slot k was last used by token i - 2, whose id was read
            self.samp_h[k] = (temperature, top_k, top_p, draw())
            run("token")
            run(("sample", k))
            self._sampled[k].record(cs)

        b.tok_h[0], b.pos_h[0] = tid, st.pos
        try:
            run("feed")
            if n > 0:
                launch(0)
            for i in range(n):
                if i + 1 < n:
                    launch(i + 1)
                self._sampled[i % 2].synchronize()
                st.pos += 1
                self.res.stats.vram_hits += len(c.moe_layers) * c.top_k
                yield int(self.tok_out_h[i % 2])
        finally:
            cs.synchronize()   # nothing in flight still reads the pinned slots

    def _forward_chunk(self, ids, st, all_logits, last, sample=False):
        c, cs = self.c, self.cs
        t = len(ids)
        if t == 1 and self.use_graphs and not all_logits:
            return self._decode_graphed(int(ids[0]), st, sample)
        b = self._buffers(t)
        b.tok_h[:t] = ids
        b.pos_h[:t] = np.arange(st.pos, st.pos + t, dtype=np.int32)
        tok, pos = b.tok[:t], b.pos[:t]
        tok.copy_to_device(b.tok_h[:t], stream=cs)
        pos.copy_to_device(b.pos_h[:t], stream=cs)
        x = b.x[:t]
        self._embed(tok, x)
        for l in range(c.n_layers):
            self._dense_begin(l)
            self._attention(l, b, t, st)
            if l in c.moe_layers:
                self._moe(l, b, t)
            else:
                self._dense_mlp(l, b, t)
            self._dense_end(l)
        st.pos += t
        if not (all_logits or last):
            return None
        rows = x if all_logits else x[t - 1:t]
        n = rows.shape[0]
        hn = b.h[:n]
        self._norm(rows, self.w("final_norm"), hn)
        if self.logits_d is None or self.logits_d.shape[0] < n:
            self.logits_d = cuda.device_array((max(n, 1), c.vocab_size), np.float32)
            self.logits_h = cuda.pinned_array((max(n, 1), c.vocab_size), np.float32)
            self._drop_graphs()   # captured graphs wrote into the old buffer
        self._lm_head(hn, self.logits_d[:n])
        if sample:
            self._seg_sample(0)
            cs.synchronize()
            return int(self.tok_out_h[0])
        self.logits_d[:n].copy_to_host(self.logits_h[:n], stream=cs)
        cs.synchronize()
        return np.array(self.logits_h[:n])

    # ---- decode as CUDA graphs ----------------------------------------------------------------
    # Segments captured once per run state, replayed every token: embed; per layer the dense
    # work + router (ids copied to pinned host memory inside the graph) and the expert launch
    # pair through the device slot table; the head (final norm + lm_head). When every expert is
    # resident, the slot table is filled on the device and the whole token is one graph after
    # a small one that feeds the token and position in. Then one of the small tails: the logits
    # to the host (forward) or the device sampler (the setting in, the id out: forward_sample,
    # decode_stream).

    def _seg_feed(self):
        b, cs = self.one, self.cs
        b.tok.copy_to_device(b.tok_h, stream=cs)
        b.pos.copy_to_device(b.pos_h, stream=cs)
        if self._devres:
            self.seq_d.copy_to_device(self.seq_h, stream=cs)

    def _seg_embed(self):
        self._seg_feed()
        self._embed(self.one.tok, self.one.x)

    def _seg_layer_dense(self, l, st, device_ids: bool = False):
        """device_ids: the router's ids stay in ids_all_d (the all-resident token copies every
        layer's at once), not one copy to the host a layer, and the same launch maps them to
        bank slots in slots_d[l] through slot_of_d."""
        b, c, cs = self.one, self.c, self.cs
        self._attention(l, b, 1, st)
        if l not in c.moe_layers:
            self._dense_mlp(l, b, 1)
            return
        self._norm_router(l, b, 1)
        if device_ids:   # the experts' slots too, from the device slot table (_seg_experts)
            self._topk(l, b.rl, self.ids_all_d[l:l + 1], b.w,
                       slots=(self.slot_of_d[l], self.slots_d[l:l + 1]))
        else:
            self._topk(l, b.rl, b.ids, b.w)
            b.ids[0].copy_to_host(self.ids_all_h[l], stream=cs)
        nl = self.next_moe[l]
        if self.speculate and nl is not None and not self.plan.all_resident \
                and nl not in self._dslot:   # (a streamed layer's router may not be in yet)
            # the next MoE layer's router on this layer's input: its experts can start copying
            # while this layer computes
            self._linear(self.w("router", nl), b.h, self.rl_spec)
            self._topk(nl, self.rl_spec, self.ids_spec, self.w_spec)
            self.ids_spec[0].copy_to_host(self.spec_h[nl], stream=cs)
        if device_ids:   # the streamed path runs it as a segment of its own, behind the ids
            self._shared_expert(l, b, 1)

    def _seg_experts(self, l, device_slots: bool):
        """device_slots: slots_d[l] was filled on the device by the router (_seg_layer_dense with
        device_ids); else it goes in from slots_h[l], which the host resolved."""
        b, c, cs = self.one, self.c, self.cs
        if not device_slots:
            self.slots_d[l].copy_to_device(self.slots_h[l], stream=cs)
        # the down kernel adds into the residual stream itself (x + moe, one add as before)
        out, limit = self._moe_target(b, 1).reshape(-1), self._limit(l)
        if clamped(c):   # gpt-oss: the biases by expert id, the ids the slots were resolved from
            ids = self.ids_all_d[l]
            if not device_slots:   # the host's (route_override may have replaced the router's)
                ids = b.ids[0]
                ids.copy_to_device(self.ids_all_h[l], stream=cs)
            gx.expert_mlp_clamped(self.fmt, self.views, self.lay, self.lay_h, self.slots_d[l], ids,
                                  b.w[0], b.h[0], b.act[:2 * c.top_k], out,
                                  self.w("expert_bias", l), c.swiglu_alpha, c.swiglu_limit, cs,
                                  accumulate=True)
        elif c.routing == "sigmoid_input":   # Llama 4: the weights scale the experts' inputs
            gx.expert_mlp_scaled(self.fmt, self.views, self.lay, self.lay_h, self.slots_d[l], b.w[0],
                                 self.ones, b.h[0], b.act[:2 * c.top_k], out, cs, accumulate=True)
        elif limit:
            gx.expert_mlp_limited(self.fmt, self.views, self.lay, self.lay_h, self.slots_d[l], b.w[0],
                                  b.h[0], b.act[:2 * c.top_k], out, limit, cs,
                                  after=True, accumulate=True, alpha=self.swiglu_alpha)
        elif not c.gated_experts:   # Nemotron-H: down(relu(up x)^2)
            gx.expert_mlp_relu2(self.fmt, self.views, self.lay, self.lay_h, self.slots_d[l], b.w[0],
                                b.h[0], b.act[:2 * c.top_k], out, cs, accumulate=True)
        else:
            gx.expert_mlp(self.fmt, self.views, self.lay, self.lay_h, self.slots_d[l], b.w[0], b.h[0],
                          b.act[:c.top_k], out, cs, accumulate=True)
        self._moe_finish(l, b, 1)

    def _moe_target(self, b, t):
        """The rows a MoE layer's experts and shared expert add into: the residual stream (a
        family that norms the MoE output first gives a buffer of its own)."""
        return b.x[:t]

    def _moe_finish(self, l, b, t) -> None:
        """After a MoE layer's experts (the target's rows complete)."""

    def _embed(self, tok, x) -> None:
        """x [T, H] = the embedding rows of tok."""
        gd.embed(tok, self.w("embed"), x, self.cs)

    def _seg_head(self):
        b = self.one
        self._norm(b.x, self.w("final_norm"), b.h)
        self._lm_head(b.h, self.logits_d[:1])

    def _lm_head(self, h, logits) -> None:
        """logits [N, V] of the normed rows h [N, H]."""
        self._linear(self.w("embed") if self.c.tie_embeddings else self.w("lm_head"), h, logits)

    def _seg_logits(self):
        self.logits_d[:1].copy_to_host(self.logits_h[:1], stream=self.cs)

    def _seg_sample(self, k: int):
        """The last token's logits (row 0) -> its id, with the setting in slot k of samp_h: into
        the device token buffer (the next token's input), the position advanced, the id copied
        to slot k of tok_out_h."""
        b, cs = self.one, self.cs
        self.samp_d.copy_to_device(self.samp_h[k], stream=cs)
        gs.sample(self.logits_d[0], self.samp_d[:3], self.samp_d[3:], self.probs_d, b.tok, cs)
        gm.advance(b.pos, cs)
        b.tok.copy_to_host(self.tok_out_h[k:k + 1], stream=cs)

    def _resident_all(self) -> bool:
        """Every expert in its own slot: load them once, then route on the device."""
        c = self.c
        if not self.plan.all_resident:
            return False
        if not self._all_loaded:
            from tqdm import tqdm
            keys = [(l, e) for l in c.moe_layers for e in range(c.n_experts)]
            with tqdm(total=len(keys), desc="experts -> VRAM", unit="block",
                      disable=len(keys) < 256) as bar:
                self.res.slots_for_hot(keys, progress=bar)
            table = np.zeros((c.n_layers, c.n_experts), np.int32)
            for (l, e), slot in self.res.slot_of.items():
                table[l, e] = slot
            self.slot_of_d = cuda.to_device(table, stream=self.cs)
            self.cs.synchronize()
            self._all_loaded = True
        return True

    def _drop_graphs(self):
        from engine.graphs import destroy_all
        destroy_all(self._graphs)
        self._graphs = None

    def _capture(self, st):
        from engine.graphs import capture_fn
        c, cs, b = self.c, self.cs, self.one
        if self.logits_d is None:
            self.logits_d = cuda.device_array((1, c.vocab_size), np.float32)
            self.logits_h = cuda.pinned_array((1, c.vocab_size), np.float32)
        # warm-up runs execute for real: point them at the last cache row, which any real
        # sequence overwrites before it reads it (the feed runs first)
        b.tok_h[0], b.pos_h[0] = 0, st.max_context - 1
        self._devres = self._use_devres()
        self._route_captured = self.device_route
        if self._devres:
            self._devres_setup()
        self._graphs = {k: capture_fn(f, cs) for k, f in self._segments(st).items()}
        cs.synchronize()
        if self._devres:   # the warm-ups ran on a table of slot 0s: no gate stopped them
            self.res.attach_table(self.slot_of_d)

    # ---- streamed decode as one graph a token ---------------------------------------------------
    # The router maps the ids through the device table slot_of_d (-1: not in VRAM) into
    # slots_d[l]; gm.expert_gate passes when every slot is valid, else it puts the ids and a
    # request (token number, layer) into mapped host memory and waits for flag_d[l]. The host
    # (_serve_token, while the graph runs) resolves that layer as the per-layer path does, and
    # on the copy stream, behind the copies: the table entries that changed (VramResidency keeps
    # them), the layer's slots, then the flag. A layer's copies overwrite only slots no kernel
    # still reads: every kernel before the gate has finished, and the layer's own experts are
    # kept. The layers that did not stop are counted and their LRU recency refreshed after the
    # token (their ids come back with it), so within a token a stop may evict an expert an
    # earlier layer of the same token hit.

    def _use_devres(self) -> bool:
        return (self.device_resolve and self.use_graphs and not self.plan.all_resident
                and not self.speculate and not self._dslot
                and (self.route_override is None or self.device_route is not None))

    def _devres_setup(self) -> None:
        c = self.c
        zeros = np.zeros((c.n_layers, c.n_experts), np.int32)
        if self.slot_of_d is None:
            self.slot_of_d = cuda.to_device(zeros)
        else:
            self.xs.synchronize()   # (entries the residency mirrors land before the zeros)
            self.slot_of_d.copy_to_device(zeros)
        self.flag_d = cuda.to_device(np.full(c.n_layers, -1, np.int32))
        self.seq_h = cuda.pinned_array(1, np.int32)
        self.seq_h[0] = 0
        self.seq_d = cuda.to_device(np.zeros(1, np.int32))
        self.req_h = cuda.mapped_array(1, np.int64)     # token number << REQ_SHIFT | layer
        self.req_h[0] = -1
        self.ids_req_h = cuda.mapped_array((c.n_layers, 2 * c.top_k), np.int32)   # ids, slots
        self.slots_all_h = cuda.pinned_array((c.n_layers, c.top_k), np.int32)
        self._gather_setup()
        self._seq = 0
        self._done = cuda.event()
        self._promoted = cuda.event()
        from engine.residency import DeviceWriter
        self._writer = DeviceWriter(self.xs, self.res._driver)
        # the addresses a served layer writes at (numba builds an array's anew when asked)
        self._serve_addr = None if self._writer.sim else (
            DeviceWriter.ptr(self.slots_d), self.slots_h.ctypes.data, DeviceWriter.ptr(self.flag_d))

    def _gather_setup(self) -> None:
        """The RAM cache's pinned buffers and block table as device arrays, and for each MoE
        layer K slots out of the LRU's reach (stage_h): the streamed token graph copies a
        RAM hit into its layer's slot on its own (gm.expert_gather), and after the token the
        block stays there as an LRU entry (_promote_gathered). Only where the LRU keeps two
        banks besides; without a mapped host tier, or with MOE_STREAM_DEVICE_GATHER=0, the
        tables say "nothing held" and every miss goes to the host."""
        c, res = self.c, self.res
        view = getattr(res.host, "device_view", None)
        view = view() if view is not None and self.device_gather else None
        K, moe = c.top_k, list(c.moe_layers)
        if self._stage_h is None and view is not None \
                and len(res.free) + len(res.lru) >= K * (len(moe) + 2):
            self._stage_h = cuda.pinned_array((c.n_layers, K), np.int32)
            self._stage_h[:] = -1
            for l in moe:
                self._stage_h[l] = res.reserve(K)
        self._gather = None
        if view is not None and self._stage_h is not None:
            pool_addr, n_buf, buf_bytes, table_addr = view

            def dev(addr, shape, typestr):
                return cuda.from_cuda_array_interface(
                    {"shape": shape, "strides": None, "typestr": typestr, "data": (addr, False),
                     "version": 3}, owner=res.host)
            try:
                self._gather = (dev(pool_addr, (n_buf, buf_bytes // 4), "<u4"),
                                res.bank.view(np.uint32))
                self.held_d = dev(table_addr, (c.n_layers, c.n_experts), "<i4")
            except Exception as e:   # (a driver that will not map it: the host copies instead)
                print(f"streamed decode: host RAM not readable by kernels ({e}); the host copies "
                      f"every miss", file=sys.stderr)
                self._gather = None
        if self._gather is not None:
            self.stage_d = cuda.to_device(np.asarray(self._stage_h))
            self.gathered_d = cuda.to_device(np.zeros(c.n_layers, np.int32))   # (the fold's count)
        else:
            self.held_d = cuda.to_device(np.full((c.n_layers, c.n_experts), -1, np.int32))
            self.stage_d = cuda.to_device(np.full((c.n_layers, K), -1, np.int32))

    def _promote_gathered(self, l: int, ids, slots) -> None:
        """Blocks the token graph gathered into layer l's staging slots become LRU entries
        there (the table entries on the copy stream, ahead of the next token); each used
        staging slot is replaced by a free slot or the LRU's oldest."""
        res, st = self.res, self._stage_h[l]
        pos = {int(v): k for k, v in enumerate(st)}
        staged = [(int(e), int(s)) for e, s in zip(ids, slots) if int(s) in pos]
        if not staged:
            return
        res.gathered(l, [e for e, _ in staged])
        keep = {(l, int(e)) for e in ids}
        for e, s in staged:
            res.adopt((l, e), s)
        for e, s in staged:
            st[pos[s]] = res.reserve(1, keep=keep)[0]
        self._stage_dirty = True

    def _serve_token(self) -> list:
        """While the token graph runs: serve the layers whose gate asks for blocks, until the
        graph has finished; returns the (copy start, flag written) events of each served layer."""
        from kernels_numba.gpu_misc import REQ_SHIFT
        seq, mask = self._seq, (1 << REQ_SHIFT) - 1
        served, last = [], -1
        t_last = time.perf_counter()
        try:
            while True:
                v = int(self.req_h[0])
                if v >> REQ_SHIFT == seq and (v & mask) != last:
                    last = v & mask
                    served.append(self._serve_layer(last, seq))
                    t_last = time.perf_counter()
                    continue
                if self._done.query():
                    return served
                if time.perf_counter() - t_last > SERVE_TIMEOUT_S:
                    raise RuntimeError(f"streamed decode: the token graph neither finished nor "
                                       f"asked for blocks in {SERVE_TIMEOUT_S:.0f} s (last layer "
                                       f"served: {last})")
        except BaseException:
            # (a read error, an interrupt): release every gate, so the graph runs out (on slot 0
            # where a slot is missing: the gate clamps) and the device is free when the error
            # reaches the caller; the next token recaptures
            try:
                self._writer.fill(self.flag_d, seq)
                self.cs.synchronize()
            finally:
                self._drop_graphs()
            raise

    def _serve_layer(self, l: int, seq: int):
        K = self.c.top_k
        row = np.array(self.ids_req_h[l])
        ids, slots = row[:K], row[K:].copy()   # the gate's slots: -1 where still missing
        miss = slots < 0
        self._served_missing[l] = set(ids[miss].tolist())
        ev0, ev1 = self._events[l]
        ev0.record(self.xs)
        with self.res.batched_table() if TABLE_BATCH else contextlib.nullcontext():
            slots[miss] = self.res.resolve(l, ids[miss], wait=False,
                                           protect={(l, int(e)) for e in ids[~miss]})
        self.slots_h[l] = slots
        if self._serve_addr is None:
            self._writer.put(self.slots_d[l], self.slots_h[l])
            self._writer.set(self.flag_d, l, seq)
        else:
            slots_d, slots_h, flag_d = self._serve_addr
            row = 4 * K * l
            self._writer.copy(slots_d + row, slots_h + row, 4 * K, f"of layer {l}'s slots")
            self._writer.set(self.flag_d, l, seq, flag_d)
        ev1.record(self.xs)
        return ev0, ev1

    def _segments(self, st) -> dict:
        """name -> fn(stream): the launches of a decode token, in the order of a first run."""
        c, cs, b = self.c, self.cs, self.one
        if self._devres or self._resident_all():
            def token(s):
                self._embed(b.tok, b.x)
                for l in range(c.n_layers):
                    self._seg_layer_dense(l, st, device_ids=True)
                    if l in c.moe_layers:
                        if self._devres:
                            self._seg_gate(l)
                        self._seg_experts(l, True)
                self.ids_all_d.copy_to_host(self.ids_all_h, stream=cs)   # every layer's at once
                if self._devres:   # (which slots each layer used: the tier counts)
                    self.slots_d.copy_to_host(self.slots_all_h, stream=cs)
                self._seg_head()
            segs = {"feed": lambda s: self._seg_feed(), "token": token}
        else:
            segs = {"embed": lambda s: self._seg_embed(), "head": lambda s: self._seg_head()}
            for l in range(c.n_layers):
                segs[("dense", l)] = lambda s, l=l: self._seg_layer_dense(l, st)
                if l in c.moe_layers and c.shared_intermediate:
                    segs[("shared", l)] = lambda s, l=l: self._shared_expert(l, self.one, 1)
                if l in c.moe_layers:
                    segs[("experts", l)] = lambda s, l=l: self._seg_experts(l, False)
        segs["logits"] = lambda s: self._seg_logits()
        for k in range(2):
            segs[("sample", k)] = lambda s, k=k: self._seg_sample(k)
        return segs

    def _seg_gate(self, l):
        """Between a MoE layer's router and its experts in the streamed token graph: the
        benchmark's routing, the blocks RAM holds copied in, then the stop for the rest."""
        c, cs = self.c, self.cs
        if self.device_route == "uniform":
            gm.route_uniform(self.ids_all_d[l], self.slots_d[l], self.slot_of_d[l], self.seq_d,
                             l, c.n_experts, cs)
        args = (self.slots_d[l], self.ids_all_d[l], self.held_d[l], self.stage_d[l])
        stop = (self.seq_d, self.flag_d, self.req_h, self.ids_req_h, l)
        if self._gather is not None and GATE_FOLD:
            gm.expert_gate_gather(*args, *self._gather, *stop, self.gathered_d, cs, GATHER_BLOCKS)
            return
        if self._gather is not None:
            gm.expert_gather(*args, *self._gather, cs, GATHER_BLOCKS)
        gm.expert_gate(*args, *stop, cs)

    def _count_token_tiers(self) -> None:
        """After a streamed token graph: VRAM hits the device resolved, and blocks it gathered
        from host RAM (kept as LRU entries), per layer; a served layer's misses the host
        counted in resolve. The table changes go down as one copy. (Whole arrays at once: a
        loop over the layers took 1.0 ms a token of Python on the CPU machine, this 0.23 ms,
        against the 3.8 ms a token of the model's own routing on an H100.)"""
        moe = self._moe_rows
        ids, slots = self.ids_all_h[moe], self.slots_all_h[moe]   # [Lm, K]
        hit = np.ones(ids.shape, bool)
        if self._stage_h is not None:   # (gathered into a staging slot: a RAM hit)
            hit &= ~(slots[:, :, None] == self._stage_h[moe][:, None, :]).any(-1)
        for l, missed in self._served_missing.items():   # (counted by resolve)
            if missed:
                i = self._moe_row_of[l]
                hit[i] &= ~np.isin(ids[i], np.fromiter(missed, np.int64))
        rows, ks = np.nonzero(hit)
        self.res.touch_keys(zip(moe[rows].tolist(), ids[rows, ks].tolist()))
        if self._stage_h is not None:
            with self.res.batched_table():
                for l in self.c.moe_layers:
                    self._promote_gathered(l, self.ids_all_h[l], self.slots_all_h[l])
        if self._stage_dirty:   # the next token's gathers go to the new staging slots
            self._writer.put(self.stage_d, self._stage_h)
            self._stage_dirty = False
            # the table entries and the staging slots land before the next token reads them
            self._promoted.record(self.xs)
            self._promoted.wait(self.cs)

    def _decode_graphed(self, tid: int, st, sample: bool = False):
        """One token through the graphs -> logits float32 [1, V], or with sample its id drawn
        on the device with the setting in slot 0 of samp_h."""
        c, cs, b = self.c, self.cs, self.one
        if self._graphs is not None and (self._devres != self._use_devres()
                                         or self._route_captured != self.device_route):
            self._drop_graphs()   # (a benchmark's routing override, speculation turned on)
        if self._graphs is None:
            self._capture(st)
        g = self._graphs
        tail = g[("sample", 0) if sample else "logits"]
        b.tok_h[0], b.pos_h[0] = tid, st.pos
        if "token" in g:
            if self._devres:
                if self._seq == 0x7FFFFFFF:   # no flag may hold a token number still to come
                    self._writer.fill(self.flag_d, -1)
                    self.xs.synchronize()
                    self._seq = 0
                self._seq += 1
                self.seq_h[0] = self._seq
                self._served_missing = {}
            # no deferred frees while a gate may wait on the host: a free can synchronize the
            # device, which would wait for the gate
            with cuda.defer_cleanup() if self._devres else contextlib.nullcontext():
                g["feed"].launch(cs)
                g["token"].launch(cs)
                tail.launch(cs)
                if self._devres:
                    self._done.record(cs)
                    served = self._serve_token()
            cs.synchronize()
            if self._devres:
                self._count_token_tiers()
                self.res.stats.h2d_wait_s += 1e-3 * sum(
                    max(cuda.event_elapsed_time(a, z), 0.0) for a, z in served)
            else:
                self.res.stats.vram_hits += len(c.moe_layers) * c.top_k
            if self.on_route is not None:
                for l in c.moe_layers:
                    self.on_route(l, np.array(self.ids_all_h[l:l + 1]))
        else:
            g["embed"].launch(cs)
            waits = []   # (dense done, copies done) events of layers that copied
            for l in range(c.n_layers):
                self._dense_begin(l)
                g[("dense", l)].launch(cs)
                if l not in c.moe_layers:
                    self._dense_end(l)
                    continue
                ev_dense, ev_copy = self._events[l]
                ev_dense.record(cs)
                if ("shared", l) in g:   # the shared expert computes while the host resolves
                    g[("shared", l)].launch(cs)
                ev_dense.synchronize()
                ids = np.array(self.ids_all_h[l:l + 1])
                if self.route_override is not None:
                    ids = self.route_override(l, ids)
                    self.ids_all_h[l] = ids[0]   # the experts' segment takes them (gpt-oss)
                if self.on_route is not None:
                    self.on_route(l, ids)
                self.slots_h[l] = self.res.resolve(l, ids[0])
                if self.res.copied:
                    ev_copy.record(self.xs)
                    waits.append((ev_dense, ev_copy))
                g[("experts", l)].launch(cs)
                self._dense_end(l)
                nl = self.next_moe[l]
                if self.speculate and nl is not None:
                    pred = np.array(self.spec_h[nl])
                    if self.route_override is not None:
                        pred = self.route_override(nl, pred[None])[0]
                    self.res.speculate(nl, pred, protect={(l, int(e)) for e in ids[0]})
            g["head"].launch(cs)
            tail.launch(cs)
            cs.synchronize()
            # the compute stream stood idle from the router's ids to the last copy of the layer
            self.res.stats.h2d_wait_s += 1e-3 * sum(max(cuda.event_elapsed_time(a, b), 0.0)
                                                   for a, b in waits)
        st.pos += 1
        return int(self.tok_out_h[0]) if sample else np.array(self.logits_h[:1])

    def _linear(self, w, x, y):
        (gd.gemm if x.shape[0] >= GEMM_MIN_T else gd.linear)(w, x, y, self.cs)

    def _linear_add(self, w, x, tmp, res):
        """res += x @ w^T: the matvec adds in place (one node fewer a layer); the GEMM of a
        prefill chunk goes through tmp and an add."""
        if x.shape[0] < GEMM_MIN_T:
            gd.linear(w, x, res, self.cs, accumulate=True)
            return
        gd.gemm(w, x, tmp, self.cs)
        gd.add(res.reshape(-1), tmp.reshape(-1), res.reshape(-1), self.cs)

    def _norm(self, x, w, out):
        """The residual stream's norm (attn_norm, mlp_norm, final_norm): x [T, H] -> out."""
        gd.rmsnorm(x, w, self.c.rms_eps, out, self.cs)

    def _qkv(self, l, b, t, fuse_norm: bool = True):
        """Layer l's q, k, v of attn_norm(x) ([T, Hq D], [T, Hkv D] twice). One token: one launch
        of the fused matrix, the norm fused in where fuse_norm (the normed row is not kept);
        else the norm into b.h first."""
        c, cs = self.c, self.cs
        x, h = b.x[:t], b.h[:t]
        if t == 1 and self.fuse_qkv:   # q, k, v of one token are consecutive ranges of b.qkv
            if fuse_norm:
                gd.linear(self.w("qkv", l), x, b.qkv.reshape(1, -1), cs,
                          norm=(self.w("attn_norm", l), c.rms_eps, 0.0, None))
            else:
                self._norm(x, self.w("attn_norm", l), h)
                gd.linear(self.w("qkv", l), h, b.qkv.reshape(1, -1), cs)
            return (b.qkv[:c.q_dim].reshape(1, c.q_dim),
                    b.qkv[c.q_dim:c.q_dim + c.kv_dim].reshape(1, c.kv_dim),
                    b.qkv[c.q_dim + c.kv_dim:].reshape(1, c.kv_dim))
        q, k, v = b.q[:t], b.k[:t], b.v[:t]
        self._norm(x, self.w("attn_norm", l), h)
        self._linear(self.w("q", l), h, q)
        self._linear(self.w("k", l), h, k)
        self._linear(self.w("v", l), h, v)
        return q, k, v

    def _attention(self, l, b, t, st):
        """x += o_proj(the heads' output) (+ gpt-oss's o bias)."""
        x = b.x[:t]
        self._linear_add(self.w("o", l), self._attend(l, b, t, st), b.o[:t], x)
        if clamped(self.c) and self.c.attention_bias:
            gm.add_rows(x, self.w("o_bias", l), self.cs)

    def _attend(self, l, b, t, st):
        """Layer l's attention up to o_proj: q / k / v of attn_norm(x), their biases, norms and
        RoPE, the cache store, attention -> the heads' output b.att [T, Hq D]."""
        c, cs = self.c, self.cs
        q, k, v = self._qkv(l, b, t)
        if c.attention_bias:
            gm.add_rows(q, self.w("q_bias", l), cs)
            gm.add_rows(k, self.w("k_bias", l), cs)
            gm.add_rows(v, self.w("v_bias", l), cs)
        if c.qk_norm == "full":
            gd.rmsnorm(q, self.w("q_norm", l), c.rms_eps, q, cs)
            gd.rmsnorm(k, self.w("k_norm", l), c.rms_eps, k, cs)
        if c.clip_qkv:
            for a in (q, k, v):
                gm.clip(a.reshape(-1), c.clip_qkv, cs)
        q3 = q.reshape(t, c.n_heads, c.head_dim)
        k3 = k.reshape(t, c.n_kv_heads, c.head_dim)
        v3 = v.reshape(t, c.n_kv_heads, c.head_dim)
        pos = b.pos[:t]
        self._rotate_store(l, q3, k3, v3, pos, st)
        att3 = b.att[:t].reshape(t, c.n_heads, c.head_dim)
        kc, vc = self._cache(l, st)
        ga.attention(q3, kc, vc, pos, c.qk_scale, att3,
                     _partials(b.partials, t, c.n_heads), cs, self._window(l), sinks=self._sinks(l))
        return b.att[:t]

    def _window(self, l) -> int:
        """Layer l's keys for ga.attention: 0 every one, W > 0 a sliding window of W, -C the
        query's chunk of C positions (gpu_llama4)."""
        c = self.c
        return c.layer_windows[l] if c.layer_windows else c.sliding_window

    def _rotate_store(self, l, q3, k3, v3, pos, st):
        """Layer l's RoPE of q3 [T, Hq, D] and k3 [T, Hkv, D] (none in a NoPE layer; the
        per-head q / k norms where the config has them), then k3 and v3 into its cache at pos:
        the part of _attend a family with its own rotation overrides (gpu_llama4, gpu_mimo)."""
        c, cs = self.c, self.cs
        freq, scale = self.inv_freq, c.rope.attention_factor
        if l in c.nope_layers:
            freq, scale = self.no_freq, 1.0
        kc, vc = self._cache(l, st)
        if c.qk_norm == "head":   # per-head norms, RoPE of q and k and the cache store: one launch
            gd.qk_norm_rope(q3, k3, self.w("q_norm", l), self.w("k_norm", l), c.rms_eps, pos,
                            freq, scale, cs, cache=(v3, kc, vc))
        else:
            gd.rope(q3, pos, freq, cs, scale)
            gd.rope(k3, pos, freq, cs, scale)
            if c.qk_norm == "head_after_rope":   # Hunyuan: the rotated rows normed a head
                for a, key in ((q3, "q_norm"), (k3, "k_norm")):
                    a2 = a.reshape(-1, c.head_dim)
                    gd.rmsnorm(a2, self.w(key, l), c.rms_eps, a2, cs)
            gm.kv_store(k3, v3, kc, vc, pos, cs)

    def _cache(self, l, st) -> tuple:
        """Layer l's K and V cache in st, [S_max, Hkv, D] each (a hybrid's state holds its
        attention layers' only: engine/gpu_hybrid.py RecurrentDecoder)."""
        return st.k[l], st.v[l]

    def _sinks(self, l):
        """Layer l's attention-sink logits [Hq] on the device, or None: gpt-oss's."""
        return self.w("sinks", l) if clamped(self.c) else None

    def _mlp_in(self, l, b, t):
        """The MLP's input, mlp_norm(x), in b.h (returned)."""
        h = b.h[:t]
        self._norm(b.x[:t], self.w("mlp_norm", l), h)
        return h

    def _dense_mlp(self, l, b, t):
        x, cs = b.x[:t], self.cs
        h = self._mlp_in(l, b, t)
        g = self._swiglu_in(self.w("mlp_gate", l), self.w("mlp_up", l), h, b.g[:t], b.u[:t],
                            self._limit(l, shared=True))
        self._linear(self.w("mlp_down", l), g, b.o[:t])
        gd.add(x.reshape(-1), b.o[:t].reshape(-1), x.reshape(-1), cs)

    def _limit(self, l, shared: bool = False) -> float:
        """Layer l's SwiGLU clamp without biases (0: none), of its routed experts or of its
        shared expert and dense MLP: Step-3.5's limits / shared_limits, the SiLU clamped after
        (reference.limited_expert(after=True))."""
        v = getattr(self.c, "shared_limits" if shared else "limits", ())
        return float(v[l]) if v else 0.0

    def _swiglu_in(self, wg, wu, h, g, u, limit=0.0):
        """g = silu(h @ wg^T) * (h @ wu^T) (clamped: gm.silu_mul's limit), u scratch; returns g
        (the down projection's input)."""
        self._linear(wg, h, g)
        self._linear(wu, h, u)
        gm.silu_mul(g.reshape(-1), u.reshape(-1), g.reshape(-1), self.cs, limit, after=True,
                    alpha=self.swiglu_alpha)
        return g

    def _norm_router(self, l, b, t):
        """h = mlp_norm(x), rl = h @ router^T. One token: one launch, the norm fused into the
        router's matvec, which writes h as well (the experts, the shared expert and the next
        layer's speculative router read it); a prefill chunk: the two launches."""
        c, x, h, rl = self.c, b.x[:t], b.h[:t], b.rl[:t]
        if t == 1:
            gd.linear(self.w("router", l), x, rl, self.cs,
                      norm=(self.w("mlp_norm", l), c.rms_eps, 0.0, h))
            return
        self._linear(self.w("router", l), self._mlp_in(l, b, t), rl)

    def _topk(self, l, rl, ids, w, slots=None):
        """The routing of layer l's logits rl: softmax top-k, or (routing "sigmoid") sigmoid
        scores chosen with the layer's selection bias within groups."""
        c = self.c
        if clamped(c):   # gpt-oss: a bias on the logits, then the softmax top-k
            gm.add_rows(rl, self.w("router_bias", l), self.cs)
        if c.routing == "sigmoid":
            gs.router_sigmoid_topk(rl, self.w("router_bias", l), c.n_group, c.topk_group,
                                   c.norm_topk_prob, c.routed_scale, ids, w, self.cs, slots=slots)
        elif c.routing == "sigmoid_input":   # Llama 4: the top-k logits, their sigmoids
            gs.router_sigmoid_topk(rl, self.zero_bias, 1, 1, False, 1.0, ids, w, self.cs, slots=slots)
        elif c.routing == "softmax_bias":   # ERNIE-4.5 (its bias [1, E])
            gs.router_sigmoid_topk(rl, self.w("router_bias", l).reshape(c.n_experts), 1, 1,
                                   c.norm_topk_prob, c.routed_scale, ids, w, self.cs, slots=slots,
                                   softmax=True)
        elif c.routing == "softmax_grouped":   # Mistral 4: softmax scores in groups, no bias
            gs.router_sigmoid_topk(rl, None, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scale, ids, w,
                                   self.cs, slots=slots, softmax=True, pair_groups=True)
        else:
            gs.router_topk(rl, c.norm_topk_prob, ids, w, self.cs, slots=slots)

    def _shared_expert(self, l, b, t):
        """x += SwiGLU_shared(h), h = the MoE input (b.h after the router): in the all-resident
        token graph after the router; on the streamed path a graph segment of its own behind the
        ids' event (it computes while the host resolves); eager, after the ids' sync."""
        if not self.c.shared_intermediate:
            return
        g = self._swiglu_in(self.w("shared_gate", l), self.w("shared_up", l), b.h[:t], b.sg[:t],
                            b.su[:t], self._limit(l, shared=True))
        self._shared_out(l, b, t, g)

    def _shared_out(self, l, b, t, g):
        """x += g @ shared_down^T, times sigmoid(h . shared_expert_gate) when gated."""
        if not self.c.shared_gated:
            self._linear_add(self.w("shared_down", l), g, b.o[:t], self._moe_target(b, t))
            return
        cs, o = self.cs, b.o[:t]
        self._linear(self.w("shared_down", l), g, o)
        self._linear(self.w("shared_expert_gate", l), b.h[:t], b.sgate[:t])
        gdn.sigmoid_gate(o, b.sgate[:t], cs)
        x = self._moe_target(b, t)
        gd.add(x.reshape(-1), o.reshape(-1), x.reshape(-1), cs)

    def _route(self, l, b, t):
        """Router on the device; ids and weights to the host (the one sync of the layer); then
        the shared expert, as in the graphed segments."""
        cs = self.cs
        self._norm_router(l, b, t)
        self._topk(l, b.rl[:t], b.ids[:t], b.w[:t])
        b.ids[:t].copy_to_host(b.ids_h[:t], stream=cs)
        if t > 1:
            b.w[:t].copy_to_host(b.w_h[:t], stream=cs)
        cs.synchronize()
        self._shared_expert(l, b, t)
        ids = np.array(b.ids_h[:t])
        if self.route_override is not None:
            ids = self.route_override(l, ids)
        if self.on_route is not None:
            self.on_route(l, ids)
        return ids

    def _moe(self, l, b, t):
        ids = self._route(l, b, t)
        if t == 1:   # b is self.one: the same launches the graphed decode replays
            self.slots_h[l] = self.res.resolve(l, ids[0])
            self.ids_all_h[l] = ids[0]
            self._seg_experts(l, False)
            return
        self._moe_grouped(l, b, t, ids)

    def _moe_grouped(self, l, b, t, ids):
        """Prefill: each expert read once for the chunk, in batches whose copies overlap compute."""
        c, cs = self.c, self.cs
        gslot, gstart, order, wts, pos = gx.group_assignments(ids, np.array(b.w_h[:t]), lambda e: 0)
        experts = np.unique(ids)                       # group g <-> experts[g]
        dev = _GroupArrays(gstart, order, wts, pos)
        gslot_d = cuda.to_device(gslot, stream=cs)
        a = t * c.top_k
        act, clamp, limit, wts = b.act[:a], None, self._limit(l), dev.wts
        scaled = c.routing == "sigmoid_input"
        if clamped(c) or limit or scaled or not c.gated_experts:   # act [2A, I]: the RAW gate and up sums
            act = b.act[:2 * a]
        if scaled:   # Llama 4: the weights scale the sums, the down projections add with 1s
            if self.ones_a.shape[0] < a:
                self.ones_a = cuda.to_device(np.ones(a, np.float32))
            wts = self.ones_a[:a]
        if clamped(c):   # gpt-oss: each assignment's expert picks its bias row
            aid = cuda.to_device(np.repeat(experts, np.diff(gstart)).astype(np.int32), stream=cs)
            bias = self.w("expert_bias", l)
        prev_keys, prev_evt, prev2_evt = (), None, None
        # two batches in flight must fit in the slots the hot set leaves free
        batch = max(1, min(self.prefill_batch, (self.res.n_slots - len(self.res.hot)) // 2))
        for g0 in range(0, len(experts), batch):
            g1 = min(g0 + batch, len(experts))
            slots = self.res.resolve(l, experts[g0:g1], protect=prev_keys, after=prev2_evt)
            gslot[g0:g1] = slots
            gslot_d[g0:g1].copy_to_device(gslot[g0:g1], stream=cs)
            lo, hi = int(gstart[g0]), int(gstart[g1])
            if clamped(c):
                def clamp(act, s, lo=lo, hi=hi):
                    gx.clamped_swiglu(act, aid, bias, c.swiglu_alpha, c.swiglu_limit, s, lo, hi)
            elif limit:
                def clamp(act, s, lo=lo, hi=hi):
                    gx.limited_swiglu(act, limit, s, lo, hi, after=True, alpha=self.swiglu_alpha)
            elif scaled:
                def clamp(act, s, lo=lo, hi=hi):
                    gx.scaled_swiglu(act, dev.wts, s, lo, hi)
            elif not c.gated_experts:
                def clamp(act, s, lo=lo, hi=hi):
                    gx.relu2_up(act, s, lo, hi)
            gx.grouped_gate_up_down(self.fmt, self.views, self.lay, self.lay_h, gslot_d[g0:g1],
                                    dev.gstart[g0:g1 + 1], dev.order, wts, b.h[:t], act,
                                    b.y[:a], cs, clamp=clamp)
            evt = cuda.event()
            evt.record(cs)
            prev2_evt, prev_evt = prev_evt, evt
            prev_keys = {(l, int(e)) for e in experts[g0:g1]}
        out = self._moe_target(b, t)
        gx.combine(b.y[:a], dev.pos, out, cs, accumulate=True)   # x += the experts' sum
        if clamped(c):   # + the routing-weighted down biases of the experts that ran
            ids_d = cuda.to_device(np.ascontiguousarray(ids, np.int32), stream=cs)
            gx.expert_bias_add(out, ids_d, b.w[:t], bias, cs)
        self._moe_finish(l, b, t)
        cs.synchronize()   # host arrays above are reused by the next layer


class PostNormBuffers(Buffers):
    """Buffers with a MoE layer's own output rows (PostNormDecoder)."""

    def __init__(self, c, t: int, s_max: int):
        super().__init__(c, t, s_max)
        self.mo = cuda.device_array((t, c.hidden), np.float32)     # a MoE layer's output [T, H]


class PostNormDecoder(GpuDecoder):
    """A decoder whose attention and MLP outputs are normed before their residual adds (AFMoE's
    sandwich norms, FlexOlmo's): o_proj into b.o, normed by post_attn_norm, added into x; a dense
    MLP's output the same by post_mlp_norm; a MoE layer's experts and shared experts add into
    b.mo (zeroed with the router: _moe_target), normed and added into x after the experts
    (_moe_finish), in the eager, graphed and prefill paths alike."""
    buffers_cls = PostNormBuffers

    def _attention(self, l, b, t, st):
        self._linear(self.w("o", l), self._attend(l, b, t, st), b.o[:t])
        self._norm_add(b.o[:t], self.w("post_attn_norm", l), b.x[:t])

    def _dense_mlp(self, l, b, t):
        x = b.x[:t]
        g = self._swiglu_in(self.w("mlp_gate", l), self.w("mlp_up", l), self._mlp_in(l, b, t), b.g[:t], b.u[:t])
        self._linear(self.w("mlp_down", l), g, b.o[:t])
        self._norm_add(b.o[:t], self.w("post_mlp_norm", l), x)

    def _norm_add(self, y, w, x) -> None:
        """x += rmsnorm(y) * w (y normed in place)."""
        self._norm(y, w, y)
        gd.add(x.reshape(-1), y.reshape(-1), x.reshape(-1), self.cs)

    def _norm_router(self, l, b, t):
        super()._norm_router(l, b, t)
        gm.zero(b.mo[:t].reshape(-1), self.cs)

    def _moe_target(self, b, t):
        return b.mo[:t]

    def _moe_finish(self, l, b, t) -> None:
        self._norm_add(b.mo[:t], self.w("post_mlp_norm", l), b.x[:t])


class _GroupArrays:
    def __init__(self, gstart, order, wts, pos):
        self.gstart = cuda.to_device(gstart)
        self.order = cuda.to_device(order)
        self.wts = cuda.to_device(wts)
        self.pos = cuda.to_device(pos)


def _partials(p, t, hq):
    pm, pl, pacc = p
    return pm[:t * hq], pl[:t * hq], pacc[:t * hq]
