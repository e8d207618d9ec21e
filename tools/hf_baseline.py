"""The baseline a Python user would otherwise pick: transformers + accelerate offload.

Builds a Qwen3MoeForCausalLM at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts top-8, expert
intermediate 768, 32 query / 4 key-value heads of 128, vocab 151936) with fewer decoder layers
than the real 48 (--layers), random bf16 weights, saved with save_pretrained. Then, per row, loads
it back with device_map="auto" under memory caps and times greedy decoding with the KV cache:

  reference  GPU capped at the share of the weights an 8 GB GPU holds of the real 61 GB model,
             RAM capped likewise from a 32 GB machine (24 GB for weights), the rest offloaded to
             disk (page cache dropped before each forward, so those reads come from the disk)
  ram        the same GPU cap, everything else in RAM (a machine with RAM to spare)
  gpu        everything on the GPU, when it fits

Per row it prints the load time, prefill and decode tokens/s, where device_map put the modules,
and decode tokens/s projected to the real model's 48 layers. The projection times each unit
(embedding, each decoder layer, final norm, lm_head) with synchronized forward hooks, so a
unit's time includes accelerate moving its weights in, and sums the real model's units, each at
the time measured for its kind on the tier accelerate gives it in the real model under the same
caps (infer_auto_device_map on the meta device), plus the unmeasured rest once. The measured
run cannot reproduce the real split (a 1.25 GB layer is the unit of placement), so the tiers are
measured in the rows where they occur.

    python tools/hf_baseline.py --out hf.json --dir /tmp/hfq          # GPU machine, ~2-3 min
    python tools/hf_baseline.py --tiny --out /tmp/hf.json --dir /tmp/hft   # CPU smoke test
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import sys
import time
from pathlib import Path

GB = 1e9
REF_LAYERS = 48                 # Qwen3-30B-A3B's decoder layers
REF_GPU_GB = 8.0                # the reference machine: 8 GB GPU ...
REF_RAM_GB = 24.0               # ... and 32 GB RAM, 8 GB of it left to the OS, Python, the KV cache

# Qwen3-30B-A3B's config.json, layers aside
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960, tie_word_embeddings=False, decoder_sparse_step=1,
    mlp_only_layers=[], hidden_act="silu")
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python tools/hf_baseline.py", description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="folder for the saved model (built if missing)")
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --tiny 2)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 32 (--tiny 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens decoded (default 16; --tiny 4)")
    p.add_argument("--gpu-gb", type=float, default=None,
                   help="GPU cap for the offload rows (default: 8 GB scaled by this model's share "
                        "of the real model's bytes)")
    p.add_argument("--ram-gb", type=float, default=None,
                   help="RAM cap of the reference row (default: 24 GB scaled likewise)")
    p.add_argument("--rows", default="reference,ram,gpu", help="which rows, comma-separated")
    p.add_argument("--row-budget-s", type=float, default=60.0,
                   help="stop a row's decoding after this many seconds (at least 3 tokens; default 60)")
    p.add_argument("--warm-disk", action="store_true",
                   help="leave the page cache alone (default: drop it before each forward)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test that runs on a CPU")
    p.add_argument("--rebuild", action="store_true", help="rebuild the model even if --dir has one")
    a = p.parse_args(argv)
    dflt = (2, 8, 4) if a.tiny else (4, 32, 16)
    a.layers = a.layers or dflt[0]
    a.prompt_tokens = a.prompt_tokens or dflt[1]
    a.new_tokens = a.new_tokens or dflt[2]
    a.rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    bad = set(a.rows) - {"reference", "ram", "gpu"}
    if bad:
        p.error(f"--rows: unknown {sorted(bad)}; choose from reference, ram, gpu")
    if a.layers < 1 or a.new_tokens < 1 or a.prompt_tokens < 1:
        p.error("--layers, --prompt-tokens and --new-tokens must be at least 1")
    return a


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.3f} MB"


# ---- the model -------------------------------------------------------------------------------------

def make_config(shapes: dict, layers: int):
    import transformers as tf
    return tf.Qwen3MoeConfig(num_hidden_layers=layers, bos_token_id=None, eos_token_id=None,
                             pad_token_id=None, **shapes)


def meta_model(cfg):
    """The model on the meta device: shapes and names, no memory."""
    import torch
    import transformers as tf
    with torch.device("meta"):
        return tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def build(d: Path, cfg, device: str) -> float:
    """Random bf16 weights, saved to d; returns seconds. Init runs on the GPU when there is one:
    normal_ over 1.2 GB of experts per layer is slow on a CPU."""
    import torch
    import transformers as tf
    t = time.perf_counter()
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)     # init straight in bf16: half the bytes to fill
    try:
        with torch.device(device):
            model = tf.Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():   # routers start at zero in some versions: random routing instead
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.02)
    model.save_pretrained(d)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - t


def saved_layers(d: Path) -> int | None:
    try:
        return json.loads((d / "config.json").read_text())["num_hidden_layers"]
    except (OSError, KeyError, ValueError):
        return None


# ---- placement ---------------------------------------------------------------------------------------
# A unit is what the projection counts: the embedding, each decoder layer, the final norm, lm_head.
HEADS = {"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}


def tier(dev) -> str:
    """A device_map value -> 'gpu', 'cpu' or 'disk'."""
    return "gpu" if isinstance(dev, int) or str(dev).startswith("cuda") else str(dev)


def unit_tier(dm: dict, name: str) -> str:
    """The tier device_map gives the module `name`: its own entry or its nearest parent's."""
    for k in sorted(dm, key=len, reverse=True):
        if k == "" or name == k or name.startswith(k + "."):
            return tier(dm[k])
    inside = [v for k, v in dm.items() if k.startswith(name + ".")]   # split below the unit
    return tier(inside[0]) if inside else "gpu"


def unit_names(n_layers: int) -> dict:
    return {**HEADS, **{f"layer{i}": f"model.layers.{i}" for i in range(n_layers)}}


def placement(model) -> dict:
    """Counts and bytes of what device_map put on each tier, and each unit's tier."""
    dm = getattr(model, "hf_device_map", None) or {"": next(model.parameters()).device}
    out = {t: {"modules": 0, "bytes": 0, "layers": 0} for t in ("gpu", "cpu", "disk")}
    for name, dev in dm.items():
        out[tier(dev)]["modules"] += 1
        out[tier(dev)]["bytes"] += param_bytes(model.get_submodule(name))
    units = {u: unit_tier(dm, n) for u, n in unit_names(len(model.model.layers)).items()}
    for u, t in units.items():
        out[t]["layers"] += u.startswith("layer")
    return {"tiers": out, "unit_tier": units}


_META: dict = {}


def real_placement(cfg48, gpu_bytes: float | None, ram_bytes: float | None, have_gpu: bool) -> dict:
    """Where accelerate puts the 48-layer model's units under the caps: the heads' tiers and the
    layer count per tier (infer_auto_device_map on the meta device, as from_pretrained does)."""
    import torch
    from accelerate import infer_auto_device_map
    m = _META.get(id(cfg48)) or _META.setdefault(id(cfg48), meta_model(cfg48))
    mm = {}
    if have_gpu:
        mm[0] = int(gpu_bytes) if gpu_bytes is not None else int(1e15)
    mm["cpu"] = int(ram_bytes) if ram_bytes is not None else int(1e15)
    dm = infer_auto_device_map(m, max_memory=mm, no_split_module_classes=m._no_split_modules,
                               dtype=torch.bfloat16)
    units = {u: unit_tier(dm, n) for u, n in unit_names(cfg48.num_hidden_layers).items()}
    layers = {t: sum(1 for u, x in units.items() if u.startswith("layer") and x == t)
              for t in ("gpu", "cpu", "disk")}
    return {"heads": {u: units[u] for u in HEADS}, "layers": layers}


# ---- timing ------------------------------------------------------------------------------------------

class UnitClock:
    """Seconds per unit in the current forward (synchronized forward hooks): with accelerate's
    hooks inside, a unit's time includes moving its weights in."""

    def __init__(self, model, sync):
        self.sync, self.t0, self.handles = sync, {}, []
        self.units = unit_names(len(model.model.layers))
        self.sec = dict.fromkeys(self.units, 0.0)
        for u, name in self.units.items():
            mod = model.get_submodule(name)
            self.handles.append(mod.register_forward_pre_hook(self._pre(u)))
            self.handles.append(mod.register_forward_hook(self._post(u)))

    def _pre(self, u):
        def hook(mod, args):
            self.sync()
            self.t0[u] = time.perf_counter()
        return hook

    def _post(self, u):
        def hook(mod, args, out):
            self.sync()
            self.sec[u] += time.perf_counter() - self.t0[u]
        return hook

    def take(self) -> dict:
        s, self.sec = self.sec, dict.fromkeys(self.units, 0.0)
        return s

    def remove(self):
        for h in self.handles:
            h.remove()


def drop_cache(paths) -> None:
    """Evict files from the page cache (posix_fadvise DONTNEED; pages a process has mapped stay)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)    # the freshly saved model's pages may still be dirty: those stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass    # best effort: a file the kernel will not advise is read warm
        finally:
            os.close(fd)


def run_row(name: str, d: Path, device_map, max_memory, a, have_gpu: bool) -> dict:
    import torch
    import transformers as tf
    sync = torch.cuda.synchronize if have_gpu else (lambda: None)
    offload = d / f"offload-{name}"
    t = time.perf_counter()
    kw = dict(dtype=torch.bfloat16, device_map=device_map)
    if max_memory is not None:
        kw.update(max_memory=max_memory, offload_folder=str(offload))
    model = tf.AutoModelForCausalLM.from_pretrained(d, **kw).eval()
    load_s = time.perf_counter() - t
    where = placement(model)
    disk = where["tiers"]["disk"]["modules"] > 0 and not a.warm_disk and hasattr(os, "posix_fadvise")
    files = [p for p in [*d.glob("*.safetensors"), *offload.rglob("*")] if p.is_file()]
    log(f"[{name}] loaded in {load_s:.1f} s: " + ", ".join(
        f"{t}: {v['modules']} modules, {v['layers']} layers, {size(v['bytes'])}"
        for t, v in where["tiers"].items() if v["modules"]))
    # accelerate runs offloaded modules on the GPU only when device_map put something there;
    # a map with nothing on the GPU runs plainly on the CPU, inputs included
    dev = "cuda:0" if have_gpu and where["tiers"]["gpu"]["modules"] else "cpu"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, a.prompt_tokens), generator=g).to(dev)
    clock = UnitClock(model, sync)
    out_ids, steps = [], []
    # the KV cache argument was renamed from past_key_values to cache in transformers 5.x
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    past = tf.DynamicCache()
    with torch.no_grad():
        if disk:
            drop_cache(files)
        sync()
        t = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, **{kv: past})
        nxt = out.logits[:, -1].argmax(-1)
        sync()
        prefill_s = time.perf_counter() - t
        clock.take()
        for _ in range(a.new_tokens):
            if len(steps) >= 3 and sum(s for s, _ in steps) > a.row_budget_s:
                break   # a slow row: enough tokens to average, within the run's time
            out_ids.append(int(nxt))
            if disk:
                drop_cache(files)
            sync()
            t = time.perf_counter()
            out = model(input_ids=nxt[:, None], use_cache=True, **{kv: past})
            nxt = out.logits[:, -1].argmax(-1)
            sync()
            total = time.perf_counter() - t
            steps.append((total, clock.take()))
    clock.remove()
    # the first decode step carries one-off costs (allocator growth, kernel selection)
    timed = steps[1:] if len(steps) > 1 else steps
    dec_s = sum(s for s, _ in timed) / len(timed)
    if len(steps) < a.new_tokens:
        log(f"[{name}] decoded {len(steps)} of {a.new_tokens} tokens within --row-budget-s {a.row_budget_s:g}")
    per_unit = {u: sum(us[u] for _, us in timed) / len(timed) for u in clock.units}
    rest_s = max(dec_s - sum(per_unit.values()), 0.0)    # rotary, masks, glue between units
    # seconds per unit kind ('layer' or a head) and tier, as measured in this row
    measured: dict = {}
    for u, sec in per_unit.items():
        kind = "layer" if u.startswith("layer") else u
        measured.setdefault(kind, {}).setdefault(where["unit_tier"][u], []).append(sec)
    measured = {k: {t: sum(v) / len(v) for t, v in d.items()} for k, d in measured.items()}
    row = {"row": name, "device_map": str(device_map), "max_memory_bytes":
           None if max_memory is None else {str(k): v for k, v in max_memory.items()},
           "load_s": load_s, "prefill_tokens": a.prompt_tokens, "prefill_s": prefill_s,
           "prefill_tok_s": a.prompt_tokens / prefill_s, "decode_tokens": len(steps),
           "decode_tokens_timed": len(timed), "decode_s_per_token": dec_s, "decode_tok_s": 1 / dec_s,
           "decode_step_s": [s for s, _ in steps], "unit_s_per_token": per_unit,
           "unit_s_by_tier": measured, "rest_s_per_token": rest_s, "page_cache_dropped": disk,
           "placement": where["tiers"], "unit_tier": where["unit_tier"], "greedy_ids": out_ids}
    log(f"[{name}] prefill {a.prompt_tokens} tokens at {row['prefill_tok_s']:.1f} tok/s | decode "
        f"{1 / dec_s:.3f} tok/s ({1e3 * dec_s:.0f} ms/token; per unit: "
        + ", ".join(f"{k} on {t} {1e3 * sec:.1f} ms" for k, d in measured.items() for t, sec in d.items())
        + f", the rest {1e3 * rest_s:.1f} ms)")
    del model, past, out
    gc.collect()
    if have_gpu:
        torch.cuda.empty_cache()
    return row


def project(row: dict, real: dict, rows: list, n_layers: int) -> dict:
    """Decode s/token at 48 layers: each unit of the real model at the time measured for its kind
    on the tier accelerate gives it there (this row's measurement, else another row's, else this
    row's on whatever tier it had), plus this row's rest once."""
    def seconds(kind: str, t: str):
        for r in [row] + [r for r in rows if r is not row]:
            if t in r["unit_s_by_tier"].get(kind, {}):
                return r["unit_s_by_tier"][kind][t], f"{r['row']} ({kind} on {t})"
        d = row["unit_s_by_tier"][kind]
        return sum(d.values()) / len(d), f"{row['row']} ({kind} on {'/'.join(d)}: no row had it on {t})"
    total, used = row["rest_s_per_token"], {}
    for kind, t in real["heads"].items():
        sec, src = seconds(kind, t)
        used[kind] = {"tier": t, "s": sec, "measured_in": src}
        total += sec
    for t, c in real["layers"].items():
        if c:
            sec, src = seconds("layer", t)
            used[f"layers on {t}"] = {"count": c, "s_each": sec, "measured_in": src}
            total += c * sec
    linear = row["decode_s_per_token"] * REF_LAYERS / n_layers
    return {"decode_s_per_token_48": total, "decode_tok_s_48": 1 / total, "projection_48": used,
            "decode_tok_s_48_linear": 1 / linear}


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    import transformers as tf
    try:
        import accelerate
        import psutil
    except ImportError:
        log("error: accelerate is not installed (pip install accelerate): device_map offload needs it")
        return 2
    have_gpu = torch.cuda.is_available()
    shapes = TINY if a.tiny else QWEN3_30B_A3B
    d = Path(a.dir)
    cfg, cfg48 = make_config(shapes, a.layers), make_config(shapes, REF_LAYERS)
    nbytes, size48 = param_bytes(meta_model(cfg)), param_bytes(_META.setdefault(id(cfg48), meta_model(cfg48)))
    real48 = param_bytes(meta_model(make_config(QWEN3_30B_A3B, REF_LAYERS)))
    # the caps hold the share of this model's weights that 8 GB (24 GB) holds of the real model's
    gpu_cap = a.gpu_gb * GB if a.gpu_gb is not None else REF_GPU_GB * GB * nbytes / real48
    ram_cap = a.ram_gb * GB if a.ram_gb is not None else REF_RAM_GB * GB * nbytes / real48
    log(f"model: Qwen3-30B-A3B shapes{' (tiny)' if a.tiny else ''}, {a.layers} of {REF_LAYERS} layers: "
        f"{size(nbytes)} bf16 (the real {REF_LAYERS}-layer model: {size(real48)})")
    log(f"caps: GPU {size(gpu_cap)}" + ("" if a.gpu_gb is not None else
        f" = {REF_GPU_GB:g} GB x {size(nbytes)} / {size(real48)}: the GPU holds the share of "
        f"the weights that {REF_GPU_GB:g} GB holds of the real model ({REF_GPU_GB * GB / real48:.1%})")
        + f"; RAM of the reference row {size(ram_cap)}" + ("" if a.ram_gb is not None else
        f" = {REF_RAM_GB:g} GB scaled likewise ({REF_RAM_GB * GB / real48:.1%})"))
    build_s = None
    if a.rebuild or saved_layers(d) != a.layers or not list(d.glob("*.safetensors")):
        d.mkdir(parents=True, exist_ok=True)
        build_s = build(d, cfg, "cuda" if have_gpu else "cpu")
        log(f"built and saved {d} in {build_s:.1f} s")
    ram_free = int(0.9 * psutil.virtual_memory().available)
    caps = {"reference": ({0: int(gpu_cap), "cpu": int(ram_cap)} if have_gpu else {"cpu": int(ram_cap)},
                          gpu_cap, ram_cap),
            "ram": ({0: int(gpu_cap), "cpu": ram_free} if have_gpu else None, gpu_cap, None),
            "gpu": (None, None, None)}
    rows = []
    for name in a.rows:
        mm = caps[name][0]
        if name == "gpu":
            free = torch.cuda.mem_get_info()[0] if have_gpu else 0
            if nbytes > 0.9 * free:
                log(f"[gpu] skipped: {size(nbytes)} does not fit the GPU's free {size(free)}"
                    if have_gpu else "[gpu] skipped: no GPU")
                continue
            dm = {"": 0}
        else:
            dm = "auto" if mm is not None else "cpu"
        rows.append(run_row(name, d, dm, mm, a, have_gpu))
    for r in rows:
        _, g, ram = caps[r["row"]]
        up = size48 / nbytes    # the caps at 48 layers: the same share of the weights
        real = (real_placement(cfg48, g and g * up, ram and ram * up, have_gpu) if r["row"] != "gpu"
                else {"heads": dict.fromkeys(HEADS, "gpu"), "layers": {"gpu": REF_LAYERS, "cpu": 0, "disk": 0}})
        r["real_model_placement"] = real
        r.update(project(r, real, rows, a.layers))
        log(f"[{r['row']}] at {REF_LAYERS} layers, placed as accelerate would place the real model "
            f"(layers: " + ", ".join(f"{t} {c}" for t, c in real["layers"].items() if c)
            + "; " + ", ".join(f"{k} {t}" for k, t in real["heads"].items())
            + f"): {r['decode_tok_s_48']:.3f} tok/s (whole token time x 48/{a.layers}: "
            f"{r['decode_tok_s_48_linear']:.3f})")
    n_cmp = min((len(r["greedy_ids"]) for r in rows), default=0)   # rows may stop early
    ids = {tuple(r["greedy_ids"][:n_cmp]) for r in rows}
    if len(ids) > 1:    # bf16 on different devices may break a near-tie; worth a look, not an error
        log("note: the rows' greedy ids differ: " + "; ".join(f"{r['row']} {r['greedy_ids']}" for r in rows))
    result = {
        "tool": "tools/hf_baseline.py", "tiny": a.tiny, "layers": a.layers, "ref_layers": REF_LAYERS,
        "shapes": shapes, "model_bytes": nbytes, "model_bytes_48": size48, "gpu_cap_bytes": gpu_cap,
        "ram_cap_bytes": ram_cap, "build_s": build_s, "rows": rows, "greedy_ids_agree": len(ids) <= 1,
        "versions": {"torch": torch.__version__, "transformers": tf.__version__,
                     "accelerate": accelerate.__version__},
        "gpu": torch.cuda.get_device_name(0) if have_gpu else None,
        "assumptions": [
            "random bf16 weights; greedy ids are noise, timing is what counts",
            "decode s/token at 48 layers = each unit (embedding, 48 layers, final norm, lm_head) "
            "at the time measured for its kind on the tier accelerate gives it in the real model "
            "under the same caps, plus the unmeasured rest once; decode_tok_s_48_linear scales the "
            "whole measured token time by 48/layers",
            "the first decode step is left out of the averages (one-off warm-up)",
            "disk rows: page cache dropped before each forward with posix_fadvise (best effort)"]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
