"""python -m engine.pack: a Hugging Face checkpoint folder -> a packed model folder.

    python -m engine.pack SRC DST [--experts nvfp4|fp8|bf16] [--force]
    python -m engine.pack --verify DST

DST holds experts.arena (one 4096-aligned block per (layer, expert)), manifest.json, the dense
weights in dense.safetensors (in the checkpoint's dtype) and the tokenizer files; the engine
loads it like any model folder. Everything is written under a temporary name and renamed at the
end, so an interrupted pack leaves no folder that loads. docs/ARENA.md specifies the format.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from engine.models import family_of
from engine.names import expert_names
from loader.arena import ARENA_NAME, ArenaError, ArenaFile, write_arena
from loader.checkpoint import Checkpoint, CheckpointError
from loader.layout import FORMATS, ExpertLayout
from loader.quant import MATRICES, nvfp4_from_mxfp4
from loader.st_write import write_safetensors

MANIFEST = "manifest.json"
DENSE = "dense.safetensors"
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "chat_template.json", "special_tokens_map.json", "tiktoken.model")
FORMAT_VERSION = 1


class PackError(ValueError):
    """The destination cannot be written as asked."""


def pack(src, dst, experts: str = "nvfp4", force: bool = False, progress: bool = True,
         workers: int | None = None) -> dict:
    """Pack src into dst; returns the manifest. Raises PackError / CheckpointError / ValueError."""
    dst = Path(dst)
    if experts not in FORMATS:
        raise PackError(f"--experts {experts!r}: expected one of {', '.join(FORMATS)}")
    if dst.exists() and not force:
        raise PackError(f"{dst} exists; pass --force to replace it")
    ck = Checkpoint(src)
    fam = family_of(ck.config)
    c = fam.config
    ck.require(fam.dense_spec, getattr(fam.config, "int_tensors", ()))
    ck.require(fam.expert_spec)
    ck.tokenizer_path()
    if not c.moe_layers:   # an arena of no blocks: the engine's expert cache has nothing to serve
        raise PackError(f"{ck.dir}: {c.family} without routed experts (a dense model) has nothing "
                        "to pack; run the checkpoint folder itself")
    if experts == "nvfp4" and c.moe_layers and \
            any(n in ck.intq for n in expert_names(c.family, c.moe_layers[0], 0)):
        print(f"{ck.dir}: its integer-quantized experts are re-quantized into NVFP4, whose grid is "
              "not theirs; --experts fp8 stays closer to them (bf16 keeps them)", file=sys.stderr)
    t0 = time.perf_counter()
    tmp = dst.with_name(f".{dst.name}.packing-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        dense = {n: ck.get(n) for n in fam.dense_spec}
        write_safetensors(tmp / DENSE, dense,
                          bf16={n for n in dense if ck.info(n).dtype == "BF16"},
                          metadata={"source": str(ck.dir)})
        layout = ExpertLayout.build(experts, c.expert_hidden, c.moe_intermediate, c.gated_experts)

        requantized = []   # MXFP4 experts whose scales NVFP4 cannot hold exactly

        def get_expert(layer, e):
            names = expert_names(c.family, layer, e)
            if experts == "nvfp4" and all(n in ck.nvfp4 for n in names if n):
                # an NVFP4 checkpoint's bytes are the arena's: copied, not re-quantized
                return {m: ck.nvfp4_parts(n) for m, n in zip(MATRICES, names) if n}
            mx = [ck.mxfp4_parts(n) for n in names] if experts == "nvfp4" and all(names) else [None]
            if all(p is not None for p in mx):
                # MXFP4 (gpt-oss): the same E2M1 bytes, each power-of-two scale re-expressed
                parts = [nvfp4_from_mxfp4(*p) for p in mx]
                if all(p is not None for p in parts):
                    return dict(zip(MATRICES, parts))
                requantized.append((layer, e))
            return tuple(ck.get_f32(n) if n else None for n in names)   # no gate: an ungated layout

        records = write_arena(tmp / ARENA_NAME, experts, layout, c.n_layers, c.n_experts, get_expert,
                              progress=progress, layers=c.moe_layers, workers=workers)
        for f in SIDE_FILES:
            p = ck.file(f)
            if p is not None:
                shutil.copyfile(p, tmp / f)
        config = ck.config
        text = config.get("text_config")
        if "quantization_config" in config or (isinstance(text, dict) and "quantization_config" in text):
            # the weights were dequantized: no longer true (also a wrapper's, under text_config)
            config = {k: v for k, v in config.items() if k != "quantization_config"}
            if isinstance(text, dict):
                config["text_config"] = {k: v for k, v in text.items() if k != "quantization_config"}
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        manifest = {
            "format_version": FORMAT_VERSION,
            "model_type": c.family,
            "config": config,
            "experts": {"format": experts, "hidden": c.expert_hidden, "intermediate": c.moe_intermediate,
                        "block_bytes": layout.block_bytes, "n_layers": c.n_layers,
                        "n_experts": c.n_experts, "moe_layers": list(c.moe_layers)},
            "blocks": records,
            "quantization": {
                "nvfp4": "E2M1 values, low nibble first; E4M3 scale per 16; fp32 global per tensor",
                "fp8": "E4M3 FN values; fp32 scale per output row",
                "bf16": "bfloat16, rounded to nearest even from the checkpoint",
            }[experts],
            "dense": {"file": DENSE, "source_dtypes": sorted(
                {("F8_E4M3" if n in ck.fp8 else "NVFP4" if n in ck.nvfp4 else ck.info(n).dtype)
                 for n in dense})},
            "source": str(ck.dir),
        }
        if ck.fp8 or ck.nvfp4 or ck.quantization:
            manifest["source_quantization"] = ck.quantization or {
                "quant_method": "nvfp4" if ck.nvfp4 else "fp8"}
        # the manifest is written last: a folder without one is not a packed model
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            dst.rename(old)
            tmp.rename(dst)
            shutil.rmtree(old)
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dt = time.perf_counter() - t0
    arena_bytes = (dst / ARENA_NAME).stat().st_size
    if requantized:   # said even without progress: the arena is not the release's bytes there
        print(f"{ck.dir}: {len(requantized)} MXFP4 expert(s) (first: layer {requantized[0][0]}, "
              f"expert {requantized[0][1]}) hold scales more than 17 binades apart, which NVFP4 "
              "cannot keep exactly: re-quantized from their values", file=sys.stderr)
    if progress:
        print(f"packed {len(records)} expert blocks ({experts}, {arena_bytes / 1e9:.2f} GB arena) "
              f"+ {len(dense)} dense tensors into {dst} in {dt:.1f} s "
              f"({arena_bytes / 1e9 / max(dt, 1e-9):.2f} GB/s)", file=sys.stderr)
    return manifest


def load_manifest(folder) -> dict:
    p = Path(folder) / MANIFEST
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ArenaError(f"{folder}: no {MANIFEST}: not a packed model folder") from None
    except json.JSONDecodeError as e:
        raise ArenaError(f"{p}: not valid JSON ({e})") from None


def verify(folder, progress: bool = True) -> int:
    """Re-read every block and check its checksum; returns the number of blocks checked."""
    arena = ArenaFile.from_manifest(load_manifest(folder), folder)
    try:
        arena.verify_all(progress=progress)
        return len(arena.records)
    finally:
        arena.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.pack", description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", help="Hugging Face checkpoint folder (or repo id in the local cache)")
    p.add_argument("dst", nargs="?", help="packed model folder to write")
    p.add_argument("--experts", choices=FORMATS, default="nvfp4", help="expert format (default nvfp4)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--workers", type=int, default=None, help="encoding threads")
    p.add_argument("--verify", metavar="DST", help="re-read and check every block of a packed folder")
    a = p.parse_args(argv)
    try:
        if a.verify:
            n = verify(a.verify)
            print(f"{a.verify}: all {n} expert blocks match their checksums", file=sys.stderr)
            return 0
        if not (a.src and a.dst):
            p.error("give SRC and DST (or --verify DST)")
        pack(a.src, a.dst, a.experts, a.force, workers=a.workers)
    except (PackError, CheckpointError, ArenaError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
