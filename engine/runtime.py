"""The engine object under the CLI and the server: load a model folder, prefill, decode, sample.

    import engine
    m = engine.load("path/or/org-name", device="cpu")
    m.generate("def ", max_new_tokens=32).text
    m.logits([1, 2, 3])          # [T, V] float32, every position
"""
from __future__ import annotations

import os
import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from engine.affinity import pin_current_thread, plan_cores
from engine.models import family_of
from engine.jitclock import compile_seconds
from engine.names import expert_names, name
from engine.prefix import PrefixStore, usable
from engine.tokenizer import StreamDecoder, load_tokenizer
from loader.checkpoint import Checkpoint

KV_CACHE_KINDS = ("f32", "bf16")   # Engine(kv_cache=...), --kv-cache


@dataclass
class GenerationParams:
    max_new_tokens: int = 128
    temperature: float = 0.0        # 0 = greedy
    top_k: int = 0                  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple | None = None   # None = the model's EOS ids
    # nothing here needs the logits on the host (no logprobs, penalties or logit bias: serve.py
    # refuses them), so the cuda backend samples decode tokens on the device; a field that
    # does must turn that off in Engine._samples_on_device


@dataclass
class GenerationResult:
    prompt_ids: list
    output_ids: list
    text: str
    finish_reason: str              # "stop" (an EOS id) or "length"
    stats: dict = field(default_factory=dict)


class CheckpointExperts:
    """Routed experts read straight from the checkpoint's safetensors (memory-mapped). Experts
    that are built on read (FP8 / NVFP4 / MXFP4 dequantized, fused tensors transposed) are kept
    in an LRU cache of budget bytes: building one can take longer than a token's math."""

    def __init__(self, ck: Checkpoint, family: str, ops, budget: int = 0):
        self.ck, self.family, self.ops = ck, family, ops
        self.budget, self.held = int(budget), 0
        self.cache: OrderedDict = OrderedDict()   # (layer, expert) -> weights, oldest first
        self.fetched = self.hits = 0

    def _read(self, layer: int, e: int) -> tuple:
        return tuple(self.ops.weight(self.ck.get(n)) if n else None for n in expert_names(self.family, layer, e))

    def fetch(self, layer: int, ids) -> list:
        out = []
        for e in ids:
            key = (layer, int(e))
            w = self.cache.get(key)
            if w is not None:
                self.cache.move_to_end(key)
                self.hits += 1
            else:
                w = self._read(*key)
                self.fetched += 1
                n = sum(a.nbytes for a in w if a is not None)
                if n <= self.budget:
                    self.cache[key] = w
                    self.held += n
                    while self.held > self.budget:
                        _, old = self.cache.popitem(last=False)
                        self.held -= sum(a.nbytes for a in old if a is not None)
            out.append(w)
        return out

    def stats(self) -> dict:
        total = self.fetched + self.hits
        return {"source": "checkpoint", "experts_fetched": self.fetched, "cache_hits": self.hits,
                "hit_rate": self.hits / total if total else 0.0, "ram_budget_bytes": self.budget}


class ArenaExperts:
    """Routed experts from a packed folder's arena, through the host-RAM cache (loader/cache.py)."""

    def __init__(self, folder: Path, manifest: dict, c, ram_gb: float | None, policy: str,
                 reader_threads: int, reader_cores=None):
        from loader.arena import ArenaError, ArenaFile
        from loader.cache import ExpertCache
        from loader.reader import ReaderPool
        self.arena = ArenaFile.from_manifest(manifest, folder)
        lay = self.arena.layout
        got = (lay.hidden, lay.intermediate, self.arena.n_experts, tuple(self.arena.moe_layers))
        want = (c.expert_hidden, c.moe_intermediate, c.n_experts, tuple(c.moe_layers))
        if got != want:
            raise ArenaError(f"{self.arena.path}: arena holds (hidden, intermediate, experts, moe layers) "
                             f"= {got[:3]}, {list(got[3])} but config.json says {want[:3]}, {list(want[3])}")
        self.fmt, self.lay, self.block_bytes = lay.fmt, lay.as_array(), lay.block_bytes
        arena_bytes = len(self.arena.records) * lay.block_bytes
        if ram_gb is None:
            budget = min(arena_bytes, int(0.5 * _available_ram()))
        else:
            budget = int(ram_gb * 1e9)
        self.reader = ReaderPool(self.arena.path, n_threads=reader_threads, cores=reader_cores)
        self.cache = ExpertCache(self.arena, self.reader, budget, c.n_layers, c.n_experts, policy=policy)
        self.budget = budget

    def resize(self, budget: int) -> None:
        """Shrink (or grow) the RAM cache before its first read."""
        self.cache.resize(budget)
        self.budget = budget

    def fetch(self, layer: int, ids) -> list:
        return [(self.fmt, b, self.lay) for b in self.cache.get_many(layer, [int(e) for e in ids])]

    def get(self, layer: int, expert: int) -> np.ndarray:
        return self.cache.get(layer, expert)

    def get_many(self, layer: int, experts) -> list:
        """A layer's blocks at once: the misses are read concurrently."""
        return self.cache.get_many(layer, experts)

    def prefetch(self, layer: int, experts) -> int:
        """Start reads into RAM without waiting; they queue behind every demand read."""
        return self.cache.prefetch(layer, experts)

    def contains(self, layer: int, expert: int) -> bool:
        return self.cache.contains(layer, expert)

    def buffer_addresses(self) -> list:
        """(block view, host address) of the RAM cache's pinned buffers, for the VRAM tier's copies."""
        return self.cache.buffer_addresses()

    def device_view(self):
        """The RAM cache's pinned buffers and block table as kernels read them (or None)."""
        return self.cache.device_view()

    def note_hits(self, layer: int, experts) -> int:
        """Blocks the GPU read from RAM on its own: hits for the cache's policy and counts."""
        return self.cache.note_hits(layer, experts)

    def stats(self) -> dict:
        return {"source": "arena", "format": self.fmt, "ram_budget_bytes": self.budget,
                **self.cache.stats_dict()}

    def close(self):
        self.reader.close()
        self.arena.close()


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class CheckpointBlocks:
    """Expert blocks (bf16) built on demand from a checkpoint, for the cuda backend."""

    def __init__(self, ck: Checkpoint, family: str, layout):
        self.ck, self.family, self.layout = ck, family, layout

    def contains(self, layer: int, expert: int) -> bool:
        return False

    def get(self, layer: int, expert: int) -> np.ndarray:
        from loader.quant import encode_expert_block
        g, u, d = (self.ck.get_f32(n) if n else None   # no gate: an ungated layout
                   for n in expert_names(self.family, layer, expert))
        return encode_expert_block("bf16", self.layout, g, u, d, f"layer {layer} expert {expert}")


class TraceRecorder:
    """Collects the routed expert ids of every token and MoE layer: int32 [T, L_moe, K]."""

    def __init__(self, moe_layers):
        self.col = {l: i for i, l in enumerate(moe_layers)}
        self.rows: list = []
        self.pending: dict = {}

    def __call__(self, layer: int, ids):
        self.pending[self.col[layer]] = np.asarray(ids, dtype=np.int32)
        if len(self.pending) == len(self.col):
            self.rows.append(np.stack([self.pending[i] for i in range(len(self.col))], axis=1))
            self.pending = {}

    def array(self) -> np.ndarray:
        return np.concatenate(self.rows, axis=0) if self.rows else np.zeros((0, len(self.col), 0), np.int32)


def cuda_status() -> tuple[bool, str]:
    """(works, why not): whether a CUDA GPU is usable through numba-cuda."""
    try:
        from numba import cuda
        if cuda.is_available():
            return True, ""
        return False, "no working CUDA GPU found"
    except Exception as e:  # numba-cuda missing or broken driver: say why, run on the CPU
        return False, f"CUDA unavailable ({type(e).__name__}: {e})"


GPU_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "dots1", "qwen3_next",
                "qwen3_5_moe", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3", "deepseek_v2",
                "glm4_moe_lite", "minimax_m2", "qwen3_vl_moe", "ernie4_5_moe", "kimi_k25",
                "deepseek_v32", "glm_moe_dsa", "exaone_moe", "step3p5", "step3p7", "cohere2_moe",
                "granitemoe", "granitemoeshared", "granitemoe_swa", "granitemoehybrid", "nemotron_h",
                "minimax_m3_vl", "llama4", "llama4_text", "solar_open", "hunyuan_v1_moe",
                "mimo_v2_flash", "afmoe", "glm4v_moe", "qwen3_omni_moe", "ernie4_5_vl_moe",
                "minicpm5_moe", "flex_olmo", "phimoe", "dbrx", "hy_v3", "mistral4")

# model_type -> (module of engine, class): the llama-like families whose cuda decoder is their own
# (the hybrid and MLA ones are chosen by their configs' kind); any other runs engine/gpu.py's
GPU_DECODERS = {
    "step3p5": ("gpu_step", "GpuStepDecoder"), "step3p7": ("gpu_step", "GpuStepDecoder"),   # Step-3.5's attention
    "cohere2_moe": ("gpu_cohere", "GpuCohereDecoder"),         # the parallel residual
    "minimax_m3_vl": ("gpu_m3", "GpuM3Decoder"),               # clamped MLPs, dense attention to index_topk
    "llama4": ("gpu_llama4", "GpuLlama4Decoder"),              # weightless q / k norms, NoPE temperature
    "llama4_text": ("gpu_llama4", "GpuLlama4Decoder"),
    "mimo_v2_flash": ("gpu_mimo", "GpuMimoDecoder"),           # narrow V heads, sinks a layer
    "afmoe": ("gpu_afmoe", "GpuAfmoeDecoder"),                 # sandwich norms, the output gate
    "granitemoe": ("gpu_granitemoe", "GpuGraniteMoeDecoder"),  # the multipliers, granitemoe_swa's sinks
    "granitemoeshared": ("gpu_granitemoe", "GpuGraniteMoeDecoder"),
    "granitemoe_swa": ("gpu_granitemoe", "GpuGraniteMoeDecoder"),
    "granitemoehybrid": ("gpu_granite_hybrid", "GpuGraniteHybridDecoder"),   # Mamba-2 layers, the multipliers
    "nemotron_h": ("gpu_nemotron_h", "GpuNemotronHDecoder"),   # single-mixer blocks, relu^2 experts
    "minicpm5_moe": ("gpu_minicpm", "GpuMinicpmDecoder"),      # the gate from q_proj
    "flex_olmo": ("gpu_flex_olmo", "GpuFlexOlmoDecoder"),      # norms after attention and the MLP only
    "phimoe": ("gpu_phimoe", "GpuPhimoeDecoder"),              # LayerNorms with bias, sparsemixer routing
    "dbrx": ("gpu_dbrx", "GpuDbrxDecoder"),                    # LayerNorms, Wqkv, p-normed routing
}


def cuda_lacks(c) -> str:
    """What of config c the cuda backend does not run though its family runs there ("" if
    nothing): Nemotron-3-Super's latent experts (nemotron_h's moe_latent_size)."""
    if getattr(c, "latent", 0):
        return f"the cuda backend does not run {c.family}'s latent experts (moe_latent_size) yet"
    return ""


def pick_device(device: str, family: str, config=None) -> str:
    """auto -> cuda when a GPU works and the family runs there (and config, if given, has
    nothing cuda_lacks), cpu otherwise (saying which)."""
    if device == "cpu":
        return "cpu"
    ok, reason = cuda_status()
    if ok and family not in GPU_FAMILIES:
        ok, reason = False, f"the cuda backend does not run {family} yet"
    if ok and config is not None and cuda_lacks(config):
        ok, reason = False, cuda_lacks(config)
    if device == "cuda":
        if not ok:
            raise RuntimeError(f"--device cuda: {reason}")
        return "cuda"
    print(f"device auto: using {'cuda' if ok else 'cpu'}" + ("" if ok else f" ({reason})"),
          file=sys.stderr)
    return "cuda" if ok else "cpu"


def context_length(c, device: str, max_context: int | None) -> int:
    """The run state's positions: max_context, or the config's up to 4096. On cuda, MiniMax-M3
    runs dense attention, its sparse layers' exactly up to index_topk_blocks blocks of
    index_block_size keys: capped there, or refused above it. (DeepSeek-V3.2's and GLM-5's
    indexer runs on cuda too: engine/gpu_dsa.py; no cap.)"""
    n = int(max_context or min(c.max_position, 4096))
    if device != "cuda" or not getattr(c, "sparse_layers", ()):
        return n
    cap, what = c.block_topk * c.block_size, "index_topk_blocks * index_block_size"
    if n > cap:
        if max_context:
            raise ValueError(f"--max-context {max_context}: the cuda backend runs {c.family}'s "
                             f"sparse attention as dense attention, exact up to {what}={cap} "
                             f"positions (config.json); expected at most {cap}, or --device cpu")
        print(f"{c.family} on cuda: context capped at {what}={cap} positions (dense "
              f"attention; --device cpu runs the sparse attention past it)", file=sys.stderr)
        n = cap
    return n


class Engine:
    def __init__(self, model: str | os.PathLike, device: str = "auto", max_context: int | None = None,
                 on_route: Callable | None = None, ram_gb: float | None = None,
                 cache_policy: str = "lru", reader_threads: int = 4, vram_gb: float | None = None,
                 hot_from: str | None = None, prefill_batch: int = 32, speculate: bool = False,
                 decode_core: int | str | None = "auto", reader_cores=None, kv_cache: str = "f32",
                 prefix_cache: bool = False, prefix_cache_gb: float = 1.0):
        """decode_core: the core the generating thread is pinned to while it generates ('auto':
        the last allowed core on cuda, unpinned on cpu; None or -1: unpinned); reader_cores: the
        arena reader threads' cores (None: the allowed cores but the decode one). engine/affinity.py
        kv_cache: "f32" or "bf16" (K and V rounded to bfloat16 as they are stored: half the
        cache's VRAM on cuda; the CPU backend rounds the same way in a float32 cache).
        prefix_cache: a prompt that begins with the ids the last generation ran through the
        model (a chat's next turn) resumes from that run state: only the rest is prefilled
        (engine.serve turns it on; off, each generation starts from an empty state).
        prefix_cache_gb: host RAM for copies of run states that another prompt took over (a
        UI's title request between two turns of a chat), resumed the same way (engine/prefix.py);
        0: the live state alone."""
        if kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache {kv_cache!r}: expected one of {', '.join(KV_CACHE_KINDS)}")
        self.kv_cache = kv_cache
        from kernels_numba.cpu import CpuOps
        self.ops = ops = CpuOps()
        ck = self.checkpoint = Checkpoint(model)
        self.dir: Path = ck.dir
        fam = family_of(ck.config)
        self.config = c = fam.config
        self.device = pick_device(device, c.family, c)
        self.cores = plan_cores(decode_core, reader_cores, self.device)
        for prefix, what in getattr(c, "ignored_parts", ()):   # e.g. a vision tower, MTP layers
            n = sum(1 for t in ck.tensors if t.startswith(prefix))
            if n:
                print(f"{c.family}: skipping {what} ({n} tensors under {prefix}*)", file=sys.stderr)
        self.tokenizer = load_tokenizer(ck.dir, ck.tokenizer_path())
        if getattr(c, "chat_template", None):   # DeepSeek-V4's release has no Jinja template
            self.tokenizer.default_template(c.chat_template)
        self.consumed = ck.require(fam.dense_spec, getattr(fam.config, "int_tensors", ()))
        view = fam.dense_view or (lambda c, n, a: a)   # a family's stored layout -> its decoders'
        self._dense = {n: ops.weight(view(c, n, ck.get(n))) for n in fam.dense_spec}
        self.packed = (ck.dir / "manifest.json").is_file()
        if self.packed:
            from engine.pack import load_manifest
            self.experts = ArenaExperts(ck.dir, load_manifest(ck.dir), c, ram_gb, cache_policy,
                                        reader_threads, self.cores.reader_mask)
        else:
            self.cores = replace(self.cores, readers=None)   # no reader threads
            self.consumed |= ck.require(fam.expert_spec)
            built = bool(ck.fp8 or ck.nvfp4 or ck.intq or ck.derived or ck.mxfp4)   # made on read
            budget = 0
            if built:
                budget = int(ram_gb * 1e9) if ram_gb is not None else int(0.25 * _available_ram())
            self.experts = CheckpointExperts(ck, c.family, ops, budget)
            if built:
                mx = ck.mxfp4 or any(d[3] is not None for d in ck.derived.values())
                kind = ("NVFP4" if ck.nvfp4 else "MXFP4" if mx else "FP8" if ck.fp8 else
                        "integer-quantized" if ck.intq else "fused")
                hint = f"; pack the folder once for speed (python -m engine.pack {ck.dir} DST)"
                print(f"{ck.dir}: {kind} experts are built when first read and kept in a RAM "
                      f"cache of {budget / 1e9:.1f} GB (--ram-gb){hint}", file=sys.stderr)
        self.max_context = context_length(c, self.device, max_context)
        if self.device == "cuda":
            self.model = self._gpu_decoder(fam, ram_gb, vram_gb, hot_from, prefill_batch, on_route,
                                           speculate)
        else:
            self.model = fam.model_cls(c, ops, self._weight, self.experts, on_route)
            self.model.kv_bf16 = kv_cache == "bf16"
        gen = ck.json_file("generation_config.json")
        eos = gen.get("eos_token_id", None)
        if eos is None:
            self.eos_ids = tuple(c.eos_token_ids)
        else:
            self.eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
        self.generation_defaults = gen
        self.state = None
        self.prefix_cache = prefix_cache
        self.saved = PrefixStore(int(prefix_cache_gb * 1e9), self.model.rewinds)
        self._fed = None   # the ids self.state holds, in order (positions 0 .. len - 1)
        self._prompt_len = 0   # of the generation that left _fed
        self._epoch = 0    # bumped by whatever takes the state over: a generator closed after
                           # that leaves _fed alone
        # cuda: decode tokens drawn on the device, only the id read back. "auto": greedy and
        # uncut sampling there; a top-k / top-p cut on the host, because the device kernel's
        # thresholds by bisection took 1.8 ms a token at 151,936 tokens on the H200 (the host
        # sampler ~0.9 ms). True / False force one side (tests compare the two).
        self.sample_on_device = "auto"
        # compile the sampler now (a few seconds without numba's cache), not in the first token
        self.ops.sample(np.zeros(4, np.float32), 1.0, 0, 0.9, 0.5)

    def _gpu_decoder(self, fam, ram_gb, vram_gb, hot_from, prefill_batch, on_route, speculate):
        """Plan the tiers for the budgets and build the CUDA decoder (engine/gpu.py, gpu_hybrid.py,
        gpu_mla.py, gpu_dsa.py, gpu_step.py, gpu_cohere.py, gpu_m3.py, gpu_llama4.py, gpu_mimo.py,
        gpu_afmoe.py, gpu_minicpm.py)."""
        from numba import cuda

        from engine.models.deepseek_v3 import DeepseekV3Config
        from engine.models.deepseek_v32 import DeepseekV32Config
        from engine.models.hybrid import HybridConfig
        from engine.planner import PlanError, plan
        from loader.layout import ExpertLayout
        c = self.config
        if self.packed:
            layout, host = self.experts.arena.layout, self.experts
        else:  # experts straight from the checkpoint: bf16 blocks built on demand
            layout = ExpertLayout.build("bf16", c.expert_hidden, c.moe_intermediate, c.gated_experts)
            host = CheckpointBlocks(self.checkpoint, c.family, layout)
        if vram_gb is None:
            try:
                vram_gb = 0.9 * cuda.current_context().get_memory_info()[0] / 1e9
            except (AttributeError, NotImplementedError):
                vram_gb = float("nan")
            if not np.isfinite(vram_gb):  # the simulator reports no real memory
                vram_gb = 1.0
        vram = vram_gb
        ram = ram_gb if ram_gb is not None else getattr(self.experts, "budget", 0) / 1e9
        from engine.gpu import embed_on_host
        host_only = {name(c.family, "embed")} if embed_on_host(c) else set()
        if getattr(c, "sparse_layers", ()):   # MiniMax-M3's indexer: not uploaded (context_length)
            from engine.models import base, minimax_m3
            host_only |= set(minimax_m3.dense_spec(c)) - set(base.dense_spec(c))
        dense_bytes = sum(np.asarray(w).nbytes for n, w in self._dense.items() if n not in host_only)
        if isinstance(c, HybridConfig):   # DeltaNet + gated attention: engine/gpu_hybrid.py
            from engine import gpu_hybrid as g
            Decoder, kv = g.GpuHybridDecoder, g.state_bytes(c, self.max_context, self.kv_itemsize)
        elif isinstance(c, DeepseekV32Config):   # MLA with DSA's indexer: engine/gpu_dsa.py
            from engine import gpu_dsa as g
            Decoder, kv = g.GpuDsaDecoder, g.state_bytes(c, self.max_context, self.kv_itemsize)
        elif isinstance(c, DeepseekV3Config):   # multi-head latent attention: engine/gpu_mla.py
            from engine import gpu_mla as g
            Decoder, kv = g.GpuMlaDecoder, g.state_bytes(c, self.max_context, self.kv_itemsize)
        else:
            import importlib
            mod, cls = GPU_DECODERS.get(c.family, ("gpu", "GpuDecoder"))
            g = importlib.import_module(f"engine.{mod}")
            Decoder = getattr(g, cls)
            if hasattr(g, "state_bytes"):   # a state of its own (gpu_granite_hybrid: KV rows of
                kv = g.state_bytes(c, self.max_context, self.kv_itemsize)   # some layers, Mamba state)
            else:
                kv = 2 * c.n_layers * self.max_context * c.kv_dim * self.kv_itemsize
        chunk = g.pick_prefill_chunk(c, self.max_context, vram * 1e9)
        run_state = g.run_state_bytes(c, chunk, self.max_context)
        total_experts = len(c.moe_layers) * c.n_experts
        kw = dict(vram_gb=vram, ram_gb=max(ram, 1e-9) if self.packed else 1e6, kv_bytes=kv,
                  run_state_bytes=run_state, block_bytes=layout.block_bytes, top_k=c.top_k,
                  total_experts=total_experts, kv_halvable=self.kv_itemsize == 4)
        try:
            p = plan(dense_bytes=dense_bytes, **kw)
        except PlanError:
            # the dense side does not fit: stream the layers that don't (their packed size, with
            # alignment and the decoder's float32 copies of small weights, bounded generously)
            per_layer: dict = {}
            for n, w in self._dense.items():
                m = re.search(r"\.(?:layers|blocks)\.(\d+)\.", n)   # blocks: DBRX's
                if m and n not in host_only:
                    per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + np.asarray(w).nbytes
            glob = dense_bytes - sum(per_layer.values())
            per_layer = {l: int(b * 1.05) + (16 << 10) for l, b in per_layer.items()}
            p = plan(dense_bytes=glob + sum(per_layer.values()), dense_layer_bytes=per_layer,
                     dense_from_ram=ram_gb is not None, **kw)
        self.plan = p
        if p.dense_host_bytes and self.packed and ram_gb is not None:
            # the streamed dense layers take their share of --ram-gb first
            self.experts.resize(max(p.ram_slots, c.top_k) * layout.block_bytes)
        print(p.describe(), file=sys.stderr)
        dec = Decoder(c, self._weight, host, p, layout, on_route, prefill_batch,
                      max_context=self.max_context, speculate=speculate, prefill_chunk=chunk,
                      kv_dtype=np.uint16 if self.kv_cache == "bf16" else np.float32)
        dec.upload_all(Decoder.dense_keys(c))
        if hot_from:
            from engine.profile import RoutingProfile
            prof = RoutingProfile.load(hot_from, c.n_layers, c.n_experts)
            n = dec.res.pin_hot(prof.hot_set(p.hot_slots, c.moe_layers))
            print(f"hot set: {n} experts pinned in VRAM by profile rank ({hot_from})", file=sys.stderr)
        if p.all_resident:
            dec._resident_all()   # every expert into its slot now, not inside the first token
        self.gpu = dec
        return dec

    def _weight(self, key: str, layer: int | None = None, expert: int | None = None):
        return self._dense[name(self.config.family, key, layer, expert)]

    # ---- plain forward ------------------------------------------------------------------------

    def logits(self, ids) -> np.ndarray:
        """Logits at every position of ids, from an empty context: float32 [T, V]."""
        ids = np.asarray(ids, dtype=np.int64)
        self._take_state()   # (on cuda the decoder's one preallocated state is reused)
        st = self.model.new_state(max(len(ids), 1))
        return np.asarray(self.model.forward(ids, st, all_logits=True))

    def release_state(self) -> None:
        """Drop the run state and the saved copies (the prompt prefixes a next generation could
        resume)."""
        self._take_state()
        self.state = None
        self.saved.clear()

    def _take_state(self) -> int:
        """Something other than the last generation takes the run state: nothing is left to
        resume, and a generator of before that closes later leaves _fed alone. The new epoch."""
        self._fed = None
        self._epoch += 1
        return self._epoch

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    # ---- generation ---------------------------------------------------------------------------

    def stream(self, prompt_ids, params: GenerationParams, stats: dict | None = None) -> Iterator[int]:
        """Yields generated ids one at a time; fills stats (if given) as it goes. The thread that
        iterates it is pinned to the decode core until the generator ends or is closed."""
        stats = {} if stats is None else stats
        stats["cores"] = self.cores.as_dict()
        restore = pin_current_thread(self.cores.decode, self._start_cpu_threads)
        try:
            yield from self._stream(prompt_ids, params, stats)
        finally:
            restore()

    def _start_cpu_threads(self) -> None:
        # numba's worker threads inherit the mask of the thread that first runs a parallel kernel:
        # start them while the decode thread is still unpinned, so they keep every core
        self.ops.rmsnorm(np.ones((1, 1), np.float32), np.ones(1, np.float32), 1e-6)

    def _stream(self, prompt_ids, params: GenerationParams, stats: dict) -> Iterator[int]:
        prompt_ids = [int(i) for i in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [i for i in prompt_ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        budget = self.max_context - len(prompt_ids)
        if budget < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the "
                             f"{self.max_context}-token context")
        n_new = min(params.max_new_tokens, budget)
        stop = set(self.eos_ids if params.stop_ids is None else params.stop_ids)
        rng = np.random.default_rng(params.seed)
        st, keep, src, last = self._resume(prompt_ids, len(prompt_ids) + n_new)
        epoch = self._take_state()   # (_fed again once this generation ends cleanly)
        self.state = st
        j0 = compile_seconds()
        t0 = time.perf_counter()
        if last is None:
            logits = self.model.forward(np.asarray(prompt_ids[keep:], dtype=np.int64), st)
        else:   # a saved copy holds the whole prompt and its last logits: nothing to prefill
            logits = last[None]
        t1 = time.perf_counter()
        j1 = compile_seconds()
        self._prompt_len = len(prompt_ids)
        if self.prefix_cache and not self.model.rewinds and last is None and \
                0 < st.save_nbytes(st.pos) <= self.saved.budget:
            # a recurrent state cannot go back: keep it at the prompt's end, for a next turn
            # whose history differs from what this one generates, and for the same prompt again
            self.saved.add(prompt_ids, self.model.save_state(st, st.pos), np.asarray(logits[-1]))
        stats.update(prefill_tokens=len(prompt_ids), prefill_cached_tokens=keep,
                     prefill_cached_from=src, prefill_s=t1 - t0,
                     prefill_tok_s=(len(prompt_ids) - keep) / max(t1 - t0, 1e-9), decode_tokens=0,
                     decode_s=0.0, prefill_compile_s=j1 - j0, decode_compile_s=0.0)
        stats["finish_reason"] = "length"
        c0 = self._counters()
        ids = self._sampled_ids(logits[-1], st, params, rng, n_new)   # runs as the loop asks
        out = []
        clean = False
        try:
            for i in range(n_new):
                ts = time.perf_counter()
                tid = next(ids)
                if i:   # a decode token's time: its forward pass + sampling from its logits
                    stats["decode_s"] += time.perf_counter() - ts
                    stats["decode_tokens"] += 1
                out.append(tid)
                yield tid
                if tid in stop:
                    stats["finish_reason"] = "stop"
                    break
            clean = True
        except GeneratorExit:   # the caller stopped early (a stop string, a client gone)
            clean = True
            raise
        finally:
            ids.close()
            stats["decode_compile_s"] = compile_seconds() - j1   # (kernels a first run compiles)
            self._finish_stats(stats, c0)
            # the state holds the prompt and the generated ids a forward pass has taken (the
            # last one yielded never went in); after an error it holds nothing reliable; and
            # if another generation (or logits()) has taken the state since, it is not ours
            if self._epoch == epoch and self.state is st:
                self._fed = (prompt_ids + out)[:st.pos] if clean else None

    def _resume(self, prompt_ids: list, need: int):
        """(run state for need positions, keep, where from, the prompt's last logits or None):
        the state that holds the longest prefix of the prompt (keep ids of it, at most all but
        the last prompt id, whose logits are wanted, unless a saved copy kept those): the live
        state of the last generation, or a saved copy restored into a state; else a fresh one
        (keep 0). The live state is saved first where the prompt would
        lose ids a later prompt may still share (_save_live)."""
        if not self.prefix_cache:
            return self.model.new_state(need), 0, None, None
        n, fed, rewinds = len(prompt_ids) - 1, self._fed, self.model.rewinds
        live = usable(fed, prompt_ids, n, rewinds) if fed else 0
        copy, k = self.saved.best(prompt_ids, n)
        use_copy = copy is not None and k > live
        if use_copy:
            self.saved.touch(copy)   # (most recent: the save below evicts others first)
        if fed and (use_copy or live < len(fed)):
            self._save_live(fed, live)
        if use_copy:
            last = copy.logits if k == len(prompt_ids) else None
            return self.model.restore_state(copy.arrays, need, k), k, "saved", last
        st = self.model.resume_state(self.state, need, live) if live else None
        if st is not None:
            return st, live, "live", None
        return self.model.new_state(need), 0, None, None

    def _save_live(self, fed: list, live: int) -> None:
        """Copy the live state (holding fed) to host RAM before a prompt overwrites it, unless
        no later prompt is likely to want it: a KV cache kept up to `live` already holds what a
        prompt shares with fed (so only when the prompt leaves fed inside its last prompt, not
        in the ids generated after it, which a chat template may rewrite, e.g. Qwen3 dropping
        the reasoning); a copy already covers it; or it exceeds the whole budget (not copied
        only to be refused)."""
        if self.model.rewinds and live >= self._prompt_len:
            return
        if self.saved.covers(fed) or self.state.save_nbytes(len(fed)) > self.saved.budget:
            return
        self.saved.add(fed, self.model.save_state(self.state, len(fed)))

    def _sampled_ids(self, logits, st, params: GenerationParams, rng, n: int) -> Iterator[int]:
        """n ids: the first from the prompt's last logits [V] on the host, then one forward pass
        each, drawn with rng.random() in token order on every path: from the logits on the host,
        or on the device (only the id read back), pipelined one token ahead where the decoder
        can (engine/gpu.py decode_stream)."""
        m, p = self.model, params
        tid = self.ops.sample(np.asarray(logits), p.temperature, p.top_k, p.top_p, rng.random())
        yield tid
        if not self._samples_on_device(p):
            for _ in range(n - 1):
                logits = m.forward(np.asarray([tid], dtype=np.int64), st)
                tid = self.ops.sample(np.asarray(logits[-1]), p.temperature, p.top_k, p.top_p,
                                      rng.random())
                yield tid
        elif m.can_pipeline():
            yield from m.decode_stream(tid, st, p.temperature, p.top_k, p.top_p, rng.random, n - 1)
        else:
            for _ in range(n - 1):
                tid = m.forward_sample(tid, st, p.temperature, p.top_k, p.top_p, rng.random())
                yield tid

    def _samples_on_device(self, params: GenerationParams) -> bool:
        """Whether decode tokens are drawn on the GPU (engine/gpu.py forward_sample): 4 bytes
        read back a token instead of the logits, no host softmax. Every GenerationParams can;
        sample_on_device "auto" keeps top-k / top-p cuts on the host (faster there for now)."""
        if self.device != "cuda" or not self.sample_on_device:
            return False
        if self.sample_on_device == "auto":
            return params.temperature <= 0 or (params.top_k <= 0 and params.top_p >= 1.0)
        return True

    def _finish_stats(self, stats: dict, c0: dict) -> None:
        stats["decode_tok_s"] = stats["decode_tokens"] / max(stats["decode_s"], 1e-9)
        stats["experts"] = self.experts.stats()
        if self.device == "cuda":
            stats["vram"] = self.gpu.res.stats.as_dict()
        n = max(stats["decode_tokens"], 1)
        c1 = self._counters()
        stats["decode_per_token"] = {
            "disk_bytes": (c1["disk"] - c0["disk"]) / n, "h2d_bytes": (c1["h2d"] - c0["h2d"]) / n,
            "weight_bytes": self.weight_bytes_per_token(),
            "state_bytes": self.state_bytes_per_token(stats["prefill_tokens"], n),
            "wait_host_s": (c1["wait"] - c0["wait"]) / n}
        # the decode thread fetches from the host tier while the GPU stands idle, so the stall
        # seen on the GPU (router done -> copies done) contains that wait: split it off
        pt = stats["decode_per_token"]
        stall = (c1["stall"] - c0["stall"]) / n
        pt["wait_h2d_s"] = max(stall - pt["wait_host_s"], 0.0)
        pt["compute_s"] = max(stats["decode_s"] / n - pt["wait_host_s"] - pt["wait_h2d_s"], 0.0)
        pt["issue_s"] = (c1["issue"] - c0["issue"]) / n   # the decode thread resolving slots and
                                                          # issuing copies (Python, driver calls)

    def _counters(self) -> dict:
        ex = self.experts.stats()
        vr = self.gpu.res.stats if self.device == "cuda" else None
        return {"disk": ex.get("bytes_read", 0), "h2d": vr.h2d_bytes if vr else 0,
                "wait": vr.host_wait_s if vr else ex.get("read_seconds", 0.0),
                "stall": vr.h2d_wait_s if vr else 0.0, "issue": vr.issue_s if vr else 0.0}

    def weight_bytes_per_token(self) -> int:
        """Weight bytes one decode token reads: the dense side (the embedding table only when it
        is also the lm_head) and top-k experts in every MoE layer."""
        c = self.config
        per_expert_dense = re.compile(r"\.experts\.\d+\.")   # gpt-oss's expert biases
        embed = name(c.family, "embed")   # (a token reads one row of it, unless it is the lm_head)
        dense = sum(np.asarray(w).nbytes for n, w in self._dense.items()
                    if not ((n == embed or n.endswith("embed_tokens.weight")) and not c.tie_embeddings)
                    and not per_expert_dense.search(n))
        biases = sum(np.asarray(w).nbytes for n, w in self._dense.items() if per_expert_dense.search(n))
        dense += biases * c.top_k // max(c.n_experts, 1)   # a token's top-k of them
        if self.packed:
            per_expert = self.experts.block_bytes
        else:
            per_expert = sum(self.checkpoint.info(n).nbytes
                             for n in expert_names(c.family, c.moe_layers[0], 0) if n) if c.moe_layers else 0
        return int(dense + len(c.moe_layers) * c.top_k * per_expert)

    @property
    def kv_itemsize(self) -> int:
        """Bytes a K or V value takes in the cache on this device."""
        return 2 if self.kv_cache == "bf16" and self.device == "cuda" else 4

    def state_bytes_per_token(self, first: int, n: int) -> float:
        """Mean bytes of sequence state a decode token reads, over the n tokens at positions
        first.. first + n - 1: the K and V rows of every attention layer (up to a sliding
        window, or the index_topk rows a DSA layer picks, beside its indexer's float32 keys), the
        compressed entries DeepSeek-V4's layers read, and the float32 conv and recurrent state of
        the DeltaNet (Mamba-2) layers, the conv state of LFM2's conv layers."""
        from engine.models.hybrid import HybridConfig
        from engine.models.lfm2_moe import Lfm2MoeConfig
        from engine.models.nemotron_h import NemotronHConfig
        c = self.config
        pos = np.arange(first, first + max(n, 1)) + 1
        if isinstance(c, (HybridConfig, NemotronHConfig, Lfm2MoeConfig)):   # DeltaNet, Mamba-2, a conv + attention
            windows = (0,) * len(c.full_layers)
            fixed = 4 * len(c.linear_layers) * ((c.conv_kernel - 1) * c.conv_dim + int(np.prod(c.ssm_shape)))
        elif getattr(c, "index_topk", 0):   # DSA: index_topk picked rows; the indexer reads
            windows = (c.index_topk,) * c.n_layers   # every key only where there is a choice
            fixed = 4 * c.index_head_dim * len(c.index_layers) * np.where(pos > c.index_topk, pos, 0).mean()
        elif getattr(c, "sparse_layers", ()):   # MiniMax-M3: a sparse layer's picked blocks, and
            windows = tuple(c.block_topk * c.block_size if l in c.sparse_layers else 0   # its indexer's
                            for l in range(c.n_layers))                                  # float32 keys
            fixed = 4 * c.idx_dim * len(c.sparse_layers) * pos.mean()
        elif getattr(c, "rates", ()):   # DeepSeek-V4: a window of key rows a layer, and the
            windows = (c.sliding_window,) * c.n_layers   # float32 entries a compressed layer reads
            fixed = 0.0                                  # (CSA: its picks, and its indexer's keys)
            for kind, m in zip(c.layer_types, c.rates):
                if m:
                    n_ent = pos // m
                    picked = np.minimum(n_ent, c.csa_topk) if kind.startswith("compressed_sparse") else n_ent
                    fixed += 4 * c.head_dim * picked.mean()
                    if kind.startswith("compressed_sparse"):
                        fixed += 4 * c.csa_dim * n_ent.mean()
        else:   # a window a layer (gpt-oss alternates sliding and full layers) or one for all
            windows = getattr(c, "layer_windows", ()) or (c.sliding_window,) * c.n_layers
            fixed = 0
        rows = sum(np.minimum(pos, w).mean() if w else pos.mean() for w in windows)
        return float(c.kv_tensors * c.kv_dim * self.kv_itemsize * rows + fixed)

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, on_text: Callable | None = None,
                 chat: bool = False) -> GenerationResult:
        """prompt: text, or a list of token ids. on_text receives text pieces as they decode."""
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else [int(i) for i in prompt]
        params = GenerationParams(max_new_tokens, temperature, top_k, top_p, seed)
        stats: dict = {}
        out = []
        dec = StreamDecoder(self.tokenizer)
        for tid in self.stream(ids, params, stats):
            out.append(tid)
            piece = dec.push(tid)
            if on_text and piece:
                on_text(piece)
        tail = dec.flush()
        if on_text and tail:
            on_text(tail)
        return GenerationResult(ids, out, self.tokenizer.decode(out), stats.pop("finish_reason"), stats)


def load(model: str | os.PathLike, device: str = "auto", **kw) -> Engine:
    return Engine(model, device=device, **kw)
