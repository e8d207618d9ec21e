"""Read a Hugging Face checkpoint folder without torch: config, safetensors tensors, tokenizer files.

Tensors are memory-mapped, never copied until asked for. Every header is checked: offsets within
the file, sizes matching shape x dtype, dtypes the engine reads. Errors name the file and tensor.

NVFP4 (ModelOpt, compressed-tensors) and FP8 checkpoints read as bf16, each weight dequantized on
read (rounded to bf16 as transformers does), its scale tensors hidden. NVFP4: uint8 packed E2M1
pairs beside E4M3 scales (one a 16 values) and a float32 global scale (_find_nvfp4 has both
layouts); the packer copies those bytes into an nvfp4 arena as they are. FP8: an F8_E4M3 weight beside
`<name>_scale_inv` (one a block: quant_method "fp8", Qwen's and DeepSeek's -FP8 releases) or
`<name>_scale` (a channel or the tensor: AutoFP8, ModelOpt FP8, compressed-tensors with 8-bit
float weights) or `<module>.scale` (DeepSeek-V4's release: E8M0 a 128 x 128 block),
W = q * scale. MXFP4 weights read as bf16 too: gpt-oss's experts (quant_method "mxfp4",
_split_transposed_experts) and DeepSeek-V4's (a weight of packed E2M1 pairs beside
`<module>.scale`, E8M0 a 32 values: _find_mxfp4). Other quantization methods are refused by name.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype -> numpy storage dtype (bfloat16 stays as its uint16 bits)
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
          "I64": np.int64, "I32": np.int32, "U8": np.uint8, "I8": np.int8,
          "F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "U32": np.uint32, "I16": np.int16,
          "U16": np.uint16}
FLOAT_DTYPES = ("F32", "F16", "BF16")
INT_DTYPES = ("I64", "I32", "I16")
FP8_SCALES = ("_scale_inv", "_scale")   # suffixes of an FP8 weight's scale tensor (q * scale)
NVFP4_GROUP = 16                          # NVFP4 values a block scale covers
TRANSPOSED_FUSED = ("gpt_oss",)           # model types whose fused experts are [E, K, N]
FLAT_FUSED = ("dbrx",)                    # model types whose fused experts are [E I, H] a projection
# tensors a family's releases name otherwise than transformers does after loading them (its
# conversion_mapping's renames): (model types, a pattern of one naming, the other's as a match
# template), so a release and a folder transformers saved with save_original_format=False load
# alike. Granite MoE: the released names read under transformers' (engine/names.py has those);
# Hy3-preview: transformers' read under the released ones (save_pretrained's default writes those)
RENAMED = tuple((("granitemoe", "granitemoeshared", "granitemoehybrid"),
                 re.compile(rf"^(?P<p>.*\.block_sparse_moe)\.{old}$"), rf"\g<p>.{new}")
                for old, new in ((r"input_linear\.weight", "experts.gate_up_proj"),
                                 (r"output_linear\.weight", "experts.down_proj"),
                                 (r"router\.layer\.weight", "router.weight"))) + \
    tuple((("hy_v3",), re.compile(rf"^(?P<p>.*\.mlp)\.{old}$"), rf"\g<p>.{new}")
          for old, new in ((r"gate\.weight", "router.gate.weight"),
                           (r"e_score_correction_bias", "expert_bias"),
                           (r"shared_experts\.(?P<w>gate_proj|up_proj|down_proj)\.weight",
                            r"shared_mlp.\g<w>.weight")))
# where AutoGPTQ and AutoAWQ wrote their settings before config.json's quantization_config
SIDE_QUANT_CONFIGS = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed, or disagrees with what the model needs."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str        # safetensors dtype string: F32, BF16, ...
    shape: tuple
    start: int        # absolute byte offset of the data in file
    nbytes: int


def hub_cache_dirs() -> list[Path]:
    """Where a repo id is looked up: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return [home / "hub"]


def resolve_model_dir(spec: str | os.PathLike) -> Path:
    """A folder path, or a repo id ("org/name") resolved in the local hub cache, offline only."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return p
    s = str(spec)
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        tried = []
        for cache in hub_cache_dirs():
            repo = cache / ("models--" + s.replace("/", "--"))
            tried.append(str(repo))
            snaps = repo / "snapshots"
            if not snaps.is_dir():
                continue
            ref = repo / "refs" / "main"
            if ref.is_file():
                snap = snaps / ref.read_text().strip()
                if snap.is_dir():
                    return snap
            cands = sorted(snaps.iterdir(), key=lambda q: q.stat().st_mtime, reverse=True)
            if cands:
                return cands[0]
        raise CheckpointError(f"{s}: not a folder, and not in the local Hugging Face cache "
                              f"(looked in {', '.join(tried)}; nothing is downloaded)")
    raise CheckpointError(f"{s}: no such model folder")


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and bounds-check one .safetensors file's header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > size - 8 or hlen > 100 << 20:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file "
                                      f"(header of {hlen} bytes in a {size}-byte file)")
            header = json.loads(f.read(hlen))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dt = meta.get("dtype")
        if dt not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dt}, which the engine does not read")
        shape = tuple(int(d) for d in meta["shape"])
        a, b = (int(x) for x in meta["data_offsets"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dt]).itemsize
        if b - a != nbytes:
            raise CheckpointError(f"{path}: tensor {name} holds {b - a} bytes but shape {list(shape)} "
                                  f"x {dt} needs {nbytes}")
        if base + b > size:
            raise CheckpointError(f"{path}: tensor {name} data ends at byte {base + b} but the file has "
                                  f"{size} bytes: truncated or incomplete")
        out[name] = TensorInfo(name, path, dt, shape, base + a, nbytes)
    return out


class Checkpoint:
    """An HF model folder: config.json, model.safetensors or index + shards, tokenizer files."""

    def __init__(self, spec: str | os.PathLike):
        self.dir = resolve_model_dir(spec)
        cfg_path = self.dir / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.dir}: no config.json")
        try:
            self.config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, np.memmap] = {}
        for f in self._weight_files():
            self.tensors.update(read_safetensors_header(f))
        self._rename()
        # FP8 weight name -> (its stored tensor, its scale tensor, block rows, block columns)
        self.fp8: dict[str, tuple] = {}
        # NVFP4 weight name -> (its values, its block scales, its global scale tensor)
        self.nvfp4: dict[str, tuple] = {}
        # MXFP4 weight name -> (its packed E2M1 pairs [N, K / 2], its E8M0 scales [N, K / 32])
        self.mxfp4: dict[str, tuple] = {}
        # integer weight name -> (layout "ct" / "gptq" / "awq", its stored tensors, bits, N, K)
        self.intq: dict[str, tuple] = {}
        self._int_layout, self._int_opts = None, {}
        declared = self._quant_config(cfg_path)
        self._find_nvfp4()   # first: its block scales are F8_E4M3 tensors too
        self._find_mxfp4()
        self._find_fp8(declared)
        self._find_int()
        self.fused: dict[str, str] = {}   # per-expert view name -> the fused tensor it lies in
        # per-expert copy name -> (the fused tensor, expert, the slice of its last axis (gate or
        # up) or None, MXFP4 scales or None): copied out transposed
        self.derived: dict[str, tuple] = {}
        if self.config.get("model_type") in TRANSPOSED_FUSED:
            self._split_transposed_experts()
        elif self.config.get("model_type") in FLAT_FUSED:
            self._split_flat_experts()
        else:
            self._split_fused_experts()

    def _rename(self) -> None:
        """The names RENAMED matches read under the names it makes of them (the same bytes)."""
        rules = [(pat, new) for types, pat, new in RENAMED if self.config.get("model_type") in types]
        for name, t in list(self.tensors.items()):
            for pat, to in rules:
                m = pat.match(name)
                if m is not None:
                    del self.tensors[name]
                    to = m.expand(to)
                    self.tensors[to] = TensorInfo(to, t.file, t.dtype, t.shape, t.start, t.nbytes)
                    break

    def _weight_files(self, base: str = "model") -> list[Path]:
        index = self.dir / f"{base}.safetensors.index.json"
        if index.is_file():
            wm = json.loads(index.read_text()).get("weight_map", {})
            files = sorted(set(wm.values()))
            for f in files:
                if not (self.dir / f).is_file():
                    raise CheckpointError(f"{self.dir / f}: missing shard (listed in {index.name})")
            return [self.dir / f for f in files]
        single = self.dir / f"{base}.safetensors"
        if single.is_file():
            return [single]
        shards = sorted(self.dir.glob("*.safetensors"))
        if shards:
            return shards
        raise CheckpointError(f"{self.dir}: no {base}.safetensors and no {base}.safetensors.index.json")

    # NVFP4 layouts: (suffix of the stored values, of the block scales, of the global scale, the
    # global scale divides rather than multiplies, what else the layout stores beside a weight)
    NVFP4_LAYOUTS = (("", "_scale", "_scale_2", False, ("input_scale",)),             # ModelOpt
                     ("_packed", "_scale", "_global_scale", True,                      # compressed-
                      ("input_global_scale", "weight_zero_point")))                    # tensors

    def _find_nvfp4(self) -> None:
        """Register each NVFP4 weight: uint8 values [N, K / 2] (element 2j in the low nibble of
        byte j), F8_E4M3 block scales [N, K / 16], one float32 global scale. ModelOpt stores
        them as `weight`, `weight_scale`, `weight_scale_2` with W = E2M1 * scale * global;
        compressed-tensors ("nvfp4-pack-quantized") as `weight_packed`, `weight_scale`,
        `weight_global_scale` with W = E2M1 * scale / global. Either reads as a bf16 `weight`
        [N, K]; its scale tensors and the recipe's static activation scales are hidden (the
        engine runs expert matrices on full-precision activations)."""
        for name, t in list(self.tensors.items()):
            for vals, scale, glob, inverse, beside in self.NVFP4_LAYOUTS:
                if not name.endswith("weight" + vals):
                    continue
                base = name[:len(name) - len(vals)]   # the weight's name, "...weight"
                sc, g = self.tensors.get(base + scale), self.tensors.get(base + glob)
                if t.dtype != "U8" or sc is None or sc.dtype != "F8_E4M3":
                    continue
                if len(t.shape) != 2:
                    raise CheckpointError(f"{t.file}: NVFP4 tensor {name} has shape "
                                          f"{list(t.shape)}; expected a 2-D weight")
                n, k = t.shape[0], 2 * t.shape[1]
                if sc.shape != (n, k // NVFP4_GROUP) or k % NVFP4_GROUP:
                    raise CheckpointError(f"{sc.file}: tensor {sc.name} has shape {list(sc.shape)}; "
                                          f"expected [{n}, {k // NVFP4_GROUP}] (one E4M3 scale a "
                                          f"{NVFP4_GROUP} values of {name}, {n} x {k} in NVFP4)")
                if g is None or g.dtype != "F32" or int(np.prod(g.shape, dtype=np.int64)) != 1:
                    got = "missing" if g is None else f"{g.dtype} {list(g.shape)}"
                    raise CheckpointError(f"{t.file}: NVFP4 tensor {name} needs {base}{glob}, "
                                          f"one float32 global scale ({got})")
                self.nvfp4[base] = (t, sc, g, inverse)
                del self.tensors[name], self.tensors[sc.name], self.tensors[g.name]
                self.tensors[base] = TensorInfo(base, t.file, "BF16", (n, k), t.start, n * k * 2)
                for extra in beside:
                    self.tensors.pop(base[:-len("weight")] + extra, None)

    def _find_mxfp4(self) -> None:
        """Register each MXFP4 weight stored as DeepSeek-V4's release does: `<module>.weight`
        int8 / uint8 [N, K / 2] (E2M1 pairs, element 2j in the low nibble of byte j) beside
        `<module>.scale` F8_E8M0 [N, K / 32] (2^(s - 127), one a 32 values). It reads as a bf16
        weight [N, K]; the scale is hidden."""
        for name, t in list(self.tensors.items()):
            if t.dtype not in ("I8", "U8") or not name.endswith(".weight"):
                continue
            sc = self.tensors.get(name[:-len("weight")] + "scale")
            if sc is None or sc.dtype != "F8_E8M0":
                continue
            if len(t.shape) != 2:
                raise CheckpointError(f"{t.file}: MXFP4 tensor {name} has shape {list(t.shape)}; "
                                      "expected a 2-D weight")
            n, k = t.shape[0], 2 * t.shape[1]
            if k % 32 or sc.shape != (n, k // 32):
                raise CheckpointError(f"{sc.file}: tensor {sc.name} has shape {list(sc.shape)}; "
                                      f"expected [{n}, {k / 32:g}] (one E8M0 scale a 32 values of "
                                      f"{name}, {n} x {k} in MXFP4)")
            self.mxfp4[name] = (t, sc)
            del self.tensors[sc.name]
            self.tensors[name] = TensorInfo(name, t.file, "BF16", (n, k), t.start, n * k * 2)

    def nvfp4_parts(self, name: str) -> tuple | None:
        """An NVFP4 weight as stored: (values uint8 [N, K / 2], block scales uint8 [N, K / 16]
        E4M3 bits, global scale float), its scales checked finite; None for any other tensor."""
        if name not in self.nvfp4:
            return None
        t, sc, g, inverse = self.nvfp4[name]
        q, s, gv = self._stored(t), self._stored(sc), float(self._stored(g).reshape(-1)[0])
        if not np.isfinite(gv) or (inverse and gv == 0):
            raise CheckpointError(f"{g.file}: {g.name} is {gv}, expected a finite "
                                  f"{'non-zero ' if inverse else ''}global scale")
        if inverse:   # compressed-tensors divides by it; the arena's global multiplies
            gv = float(np.float32(1) / np.float32(gv))
        bad = int(np.count_nonzero((s & 0x7F) == 0x7F))
        if bad:
            raise CheckpointError(f"{sc.file}: {sc.name}: {bad} NaN E4M3 scale(s)")
        return q, s, gv

    def mxfp4_parts(self, name: str) -> tuple | None:
        """A gpt-oss expert matrix stored in MXFP4, as stored: (blocks uint8 [N, K / 32, 16],
        E8M0 scales uint8 [N, K / 32]), NaN scales refused; None for any other tensor."""
        if name in self.mxfp4:   # DeepSeek-V4's: [N, K / 2] pairs, a weight of its own
            t, sc = self.mxfp4[name]
            q, s = self._stored(t).view(np.uint8), self._stored(sc)
            if np.any(s == 0xFF):
                raise CheckpointError(f"{sc.file}: {sc.name}: NaN E8M0 scale(s) (0xFF)")
            return q.reshape(q.shape[0], -1, 16), s
        src, e, sl, sc = self.derived.get(name, (None, None, None, None))
        if sc is None:
            return None
        a, s = self._stored(src)[e], self._stored(sc)[e]
        if sl is not None:   # its rows: stored [N, K] already
            a, s = a[sl], s[sl]
        if np.any(s == 0xFF):
            raise CheckpointError(f"{sc.file}: {sc.name}: NaN E8M0 scale(s) (0xFF) in expert {e}")
        return np.ascontiguousarray(a), np.ascontiguousarray(s)

    def _quant_config(self, cfg_path: Path) -> list | None:
        """Refuses the quantization methods and formats the engine does not read; returns the
        declared FP8 block shape (None: derive it from each scale tensor's grid)."""
        qc = self.config.get("quantization_config") or {}
        text = self.config.get("text_config")
        if not qc and isinstance(text, dict):   # an image-text wrapper's (Kimi-K2.5's INT4)
            qc = text.get("quantization_config") or {}
        for side, kind in SIDE_QUANT_CONFIGS:   # older GPTQ / AWQ releases: a file of its own
            if not qc and (self.dir / side).is_file():
                qc = {"quant_method": kind, **self.json_file(side)}
                cfg_path = self.dir / side
        self.quantization = qc   # as declared (engine.pack records it in the manifest)
        method = qc.get("quant_method")
        if method == "modelopt":   # NVIDIA ModelOpt: NVFP4 (_find_nvfp4) or FP8 a tensor
            algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo")
                       or "").upper()
            if algo not in ("NVFP4", "FP8"):
                raise CheckpointError(f"{cfg_path}: quantization_config.quant_algo is {algo!r}; "
                                      "the engine reads ModelOpt NVFP4 and FP8 checkpoints")
            return None
        if method == "compressed-tensors":
            return self._compressed_tensors(qc, cfg_path)
        if method == "mxfp4":   # gpt-oss: its experts' _blocks / _scales (_split_transposed_experts)
            if self.config.get("model_type") not in TRANSPOSED_FUSED:
                raise CheckpointError(f"{cfg_path}: quantization_config.quant_method 'mxfp4' is "
                                      "read for gpt_oss checkpoints only")
            return None
        if method in ("gptq", "awq"):
            self._int_config(method, qc, cfg_path)
            return None
        if method not in (None, "fp8"):
            raise CheckpointError(
                f"{cfg_path}: quantization_config.quant_method is {method!r}; the engine reads "
                "bf16 / fp16 / fp32 checkpoints, FP8 ones (quant_method 'fp8', or "
                "'compressed-tensors' with 8-bit float weights), ModelOpt NVFP4 / FP8 ones, "
                "4- / 8-bit integer ones (GPTQ, AWQ, compressed-tensors 'pack-quantized') and "
                "gpt_oss MXFP4 ones")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{cfg_path}: quantization_config.fmt is {qc['fmt']!r}; "
                                  "expected 'e4m3'")
        return qc.get("weight_block_size")

    # compressed-tensors formats read: (format, weights' num_bits, type) -> what it is
    CT_FORMATS = {("float-quantized", 8, "float"): "FP8", ("naive-quantized", 8, "float"): "FP8",
                  ("nvfp4-pack-quantized", 4, "float"): "NVFP4",
                  ("pack-quantized", 4, "int"): "INT", ("pack-quantized", 8, "int"): "INT"}

    def _compressed_tensors(self, qc: dict, cfg_path: Path) -> list | None:
        """FP8 (8-bit float weights, a scale a channel / tensor / block) or NVFP4 (4-bit float
        weights, a group of 16, 'nvfp4-pack-quantized'), each config group checked, a
        'mixed-precision' checkpoint's groups each by their own format; returns the FP8 block
        shape if one is declared."""
        top, block = qc.get("format"), None
        groups = qc.get("config_groups") or {}
        if top not in {f for f, _, _ in self.CT_FORMATS} | {"mixed-precision"}:
            raise CheckpointError(
                f"{cfg_path}: quantization_config.format is {top!r}; the engine reads "
                "compressed-tensors checkpoints in 'float-quantized' (FP8), "
                "'nvfp4-pack-quantized' (NVFP4) and 'pack-quantized' (4- / 8-bit integer) "
                "formats, or 'mixed-precision' of those")
        if top == "mixed-precision" and not groups:
            raise CheckpointError(f"{cfg_path}: quantization_config.format is 'mixed-precision' "
                                  "but config_groups is empty: nothing says each group's format")
        for gname, g in groups.items():
            w = g.get("weights") or {}
            fmt = g.get("format") or top
            kind = self.CT_FORMATS.get((fmt, w.get("num_bits"), w.get("type")))
            if kind is None:
                raise CheckpointError(
                    f"{cfg_path}: quantization_config.config_groups.{gname}.weights is "
                    f"{w.get('num_bits')}-bit {w.get('type')} ({fmt}); the engine reads "
                    "compressed-tensors checkpoints with FP8 (8-bit float), NVFP4 (4-bit float, "
                    "'nvfp4-pack-quantized') or 4- / 8-bit integer ('pack-quantized') weights")
            if kind == "INT":
                group = (int(w.get("group_size") or 0) if w.get("strategy") == "group" else 0)
                seen = self._int_opts.setdefault("group", group)
                if seen != group:
                    raise CheckpointError(
                        f"{cfg_path}: quantization_config.config_groups give integer weights "
                        f"group sizes {seen} and {group}; the engine reads one size for all")
                self._int_layout = "ct"
                self._int_opts["symmetric"] = bool(w.get("symmetric", True))
            if kind == "NVFP4" and w.get("group_size") not in (None, NVFP4_GROUP):
                raise CheckpointError(
                    f"{cfg_path}: quantization_config.config_groups.{gname}.weights.group_size "
                    f"is {w.get('group_size')}; NVFP4 has one scale a {NVFP4_GROUP} values")
            if w.get("strategy") == "block":
                block = w.get("block_structure")
        return block

    def _find_fp8(self, declared) -> None:
        """Register each FP8 weight (it then reads as bf16) and hide its scale tensor (and a
        static activation scale, which the engine does not use: activations stay float);
        declared: the config's block shape, if any."""
        for name, t in list(self.tensors.items()):
            if t.dtype != "F8_E4M3":
                continue
            names = [name + x for x in FP8_SCALES]
            if name.endswith(".weight"):   # DeepSeek-V4's release: <module>.scale
                names.append(name[:-len("weight")] + "scale")
            sc = next((self.tensors[n] for n in names if n in self.tensors), None)
            if sc is None:
                raise CheckpointError(f"{t.file}: tensor {name} is FP8 (F8_E4M3) but "
                                      f"{name}{FP8_SCALES[0]} (or {name}{FP8_SCALES[1]}) is "
                                      "missing: its scales are needed")
            if len(t.shape) != 2:
                raise CheckpointError(f"{t.file}: FP8 tensor {name} has shape {list(t.shape)}; "
                                      "expected a 2-D weight")
            if sc.dtype not in FLOAT_DTYPES + ("F8_E8M0", "U8"):
                raise CheckpointError(f"{sc.file}: tensor {sc.name} has dtype {sc.dtype}; expected "
                                      "float scales (F32, BF16, F16) or F8_E8M0 exponents")
            (r, k), grid = t.shape, tuple(sc.shape) or (1, 1)
            if grid == (1,):
                grid = (1, 1)
            if declared and len(grid) == 2 and grid != (1, 1):
                bn, bk = (int(x) for x in declared)
            elif len(grid) == 2 and r % grid[0] == 0 and k % grid[1] == 0:
                bn, bk = r // grid[0], k // grid[1]
            else:
                bn = bk = 0
            if len(grid) != 2 or bn <= 0 or bk <= 0 or grid != (-(-r // bn), -(-k // bk)):
                want = (f"[{-(-r // bn)}, {-(-k // bk)}] ({bn} x {bk} blocks)" if bn > 0 and bk > 0
                        else f"a grid that divides {r} x {k}")
                raise CheckpointError(f"{sc.file}: tensor {sc.name} has shape {list(sc.shape)}; "
                                      f"expected {want} for {name} {list(t.shape)}")
            self.fp8[name] = (t, sc, bn, bk)
            self.tensors[name] = TensorInfo(name, t.file, "BF16", t.shape, t.start, r * k * 2)
            del self.tensors[sc.name]
            if name.endswith("weight"):
                self.tensors.pop(name[:-len("weight")] + "input_scale", None)

    def _int_config(self, method: str, qc: dict, cfg_path: Path) -> None:
        """GPTQ (AutoGPTQ / GPTQModel: 'gptq' checkpoints store each zero point less one,
        'gptq_v2' as it is) or AWQ (its GEMM packing) with 4- or 8-bit weights, else refused."""
        bits = qc.get("bits", qc.get("w_bit"))
        if method == "awq":
            version = str(qc.get("version") or "gemm").lower()
            if version != "gemm" or bits != 4 or qc.get("zero_point") is False:
                raise CheckpointError(
                    f"{cfg_path}: quantization_config is AWQ version {version!r}, {bits}-bit, "
                    f"zero_point {qc.get('zero_point', True)}; the engine reads 4-bit GEMM "
                    "AWQ checkpoints with zero points")
            self._int_opts = {"group": int(qc.get("group_size", qc.get("q_group_size", 128)))}
        else:   # transformers' GPTQConfig names it format; checkpoint_format is the older key
            fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
            if qc.get("is_marlin_format"):
                fmt = "marlin"
            if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2"):
                raise CheckpointError(
                    f"{cfg_path}: quantization_config is GPTQ {bits}-bit, checkpoint_format "
                    f"{fmt!r}; the engine reads 4- and 8-bit GPTQ checkpoints in the 'gptq' or "
                    "'gptq_v2' format")
            if qc.get("dynamic"):
                raise CheckpointError(
                    f"{cfg_path}: quantization_config.dynamic gives some modules other bits or "
                    "group sizes; the engine reads GPTQ checkpoints with one setting for all")
            self._int_opts = {"group": int(qc.get("group_size", 128)),
                              "zero_offset": 1 if fmt == "gptq" else 0}
        self._int_layout, self._int_opts["bits"] = method, int(bits)

    def _find_int(self) -> None:
        """Register each integer-quantized weight (it then reads as bf16 [N, K], dequantized on
        read) and hide the tensors it is stored in: compressed-tensors `weight_packed` I32
        [N, K bits / 32] (value i at bit i * bits, offset by 2^(bits - 1)), `weight_scale` [N, G],
        `weight_shape`, `weight_zero_point` (packed along N) and `weight_g_idx` if any; GPTQ
        `qweight` I32 [K bits / 32, N], `qzeros` [G, N bits / 32], `scales` [G, N], `g_idx`
        [K]; AWQ `qweight` [K, N / 8] and `qzeros` [G, N / 8] in its column order, `scales`."""
        if self._int_layout is None:
            return
        ct = self._int_layout == "ct"
        stored = "weight_packed" if ct else "qweight"
        for name, t in list(self.tensors.items()):
            if not name.endswith(stored) or t.dtype != "I32":
                continue
            p = name[:-len(stored)]   # the module's prefix, "...proj."
            side = (("weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx") if ct
                    else ("scales", "qzeros", "g_idx"))
            parts = {"q": t, **{k: self.tensors[p + k] for k in side if p + k in self.tensors}}
            need = ("weight_scale", "weight_shape") if ct else ("scales", "qzeros")
            lack = [p + k for k in need if k not in parts]
            if lack:
                raise CheckpointError(f"{t.file}: integer-quantized tensor {name} needs "
                                      f"{lack[0]} beside it (missing)")
            sc = parts[need[0]]
            if len(t.shape) != 2 or len(sc.shape) != 2 or sc.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{t.file}: integer-quantized tensor {name} is "
                                      f"{list(t.shape)} beside {sc.name} {sc.dtype} "
                                      f"{list(sc.shape)}; expected 2-D values and float scales")
            if ct:
                n, k = (int(v) for v in self._stored(parts["weight_shape"]).reshape(-1)[:2])
                words = t.shape[1]
                bits = 4 if words == -(-k * 4 // 32) else 8 if words == -(-k * 8 // 32) else 0
                ok = bits and t.shape[0] == n and sc.shape[0] == n
            else:
                bits = self._int_opts["bits"]
                n = sc.shape[1]
                k = t.shape[0] * 32 // bits if self._int_layout == "gptq" else t.shape[0]
                width = n if self._int_layout == "gptq" else n * bits // 32
                ok = t.shape[1] == width and (self._int_layout == "gptq" or n % 8 == 0)
            if not ok:
                raise CheckpointError(f"{t.file}: integer-quantized tensor {name} has shape "
                                      f"{list(t.shape)} beside {sc.name} {list(sc.shape)}, which "
                                      f"no {self._int_layout} layout of 4- or 8-bit values packs")
            w = p + "weight"
            self.intq[w] = (self._int_layout, parts, bits, n, k)
            for part in parts.values():
                self.tensors.pop(part.name, None)
            self.tensors[w] = TensorInfo(w, t.file, "BF16", (n, k), t.start, n * k * 2)

    @staticmethod
    def _as_f32(a: np.ndarray, dtype: str) -> np.ndarray:
        """Stored values of a safetensors dtype (bf16 as its bits) as float32."""
        if dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(a, dtype=np.float32)

    def _floats(self, t: TensorInfo) -> np.ndarray:
        return self._as_f32(self._stored(t), t.dtype)

    def _ct_zeros(self, zp: TensorInfo | None, bits: int, n: int, g: int) -> np.ndarray:
        """compressed-tensors zero points int16 [N, G] in the codes' signed domain: none (or a
        symmetric recipe's) 0; packed along N into int32 as pack-quantized writes them; or an
        int8 [N, G] as older releases stored them."""
        from loader.quant import unpack_int32
        if zp is None or self._int_opts.get("symmetric", True):
            return np.zeros((n, g), np.int16)
        a = self._stored(zp)
        if zp.dtype == "I32" and a.shape == (-(-n * bits // 32), g):
            return unpack_int32(a, bits, n, axis=0).astype(np.int16) - (1 << (bits - 1))
        if zp.dtype == "I8" and a.shape == (n, g):
            return a.astype(np.int16)
        raise ValueError(f"{zp.name} is {zp.dtype} {list(a.shape)}; expected int32 "
                         f"[{-(-n * bits // 32)}, {g}] (packed) or int8 [{n}, {g}]")

    def _dequant_int(self, name: str) -> np.ndarray:
        """An integer-quantized weight as float32 [N, K]: (q - zero) * scale, a group's zero
        point and scale for each column."""
        from loader.quant import AWQ_ORDER, dequant_grouped_int, unpack_int32
        layout, parts, bits, n, k = self.intq[name]
        q = self._stored(parts["q"])
        try:
            if layout == "ct":
                off = 1 << (bits - 1)
                codes = unpack_int32(q, bits, k, axis=1).astype(np.int16) - off
                scales = self._floats(parts["weight_scale"])            # [N, G]
                g = scales.shape[1]
                group = self._int_opts.get("group") or k   # 0: a scale a row (channel, tensor)
                if g != -(-k // group):
                    raise ValueError(f"{parts['weight_scale'].name} has {g} groups a row; "
                                     f"expected {-(-k // group)} ({k} columns in groups of {group})")
                zeros = self._ct_zeros(parts.get("weight_zero_point"), bits, n, g)
                gi = parts.get("weight_g_idx")
                groups = (self._stored(gi).astype(np.int64) if gi is not None
                          else np.arange(k) // group)
                return dequant_grouped_int(codes, zeros, scales, groups)
            scales = self._floats(parts["scales"]).T                    # [N, G]
            zeros = unpack_int32(self._stored(parts["qzeros"]), bits, n, axis=1)   # [G, N]
            if layout == "gptq":
                codes = unpack_int32(q, bits, k, axis=0).T                   # [N, K]
                zeros = (zeros.astype(np.int16) + self._int_opts["zero_offset"]) & ((1 << bits) - 1)
                gi = parts.get("g_idx")
            else:   # AWQ: column c of each 8 sits in nibble ORDER.index(c)
                cols = np.arange(n)
                pick = cols // 8 * 8 + np.argsort(AWQ_ORDER)[cols % 8]
                codes = unpack_int32(q, bits, n, axis=1)[:, pick].T          # [N, K]
                zeros, gi = zeros[:, pick], None
            group = self._int_opts["group"]
            groups = (self._stored(gi).astype(np.int64) if gi is not None
                      else np.arange(k) // (group if group > 0 else k))
            return dequant_grouped_int(codes, zeros.T, scales, groups)
        except (ValueError, IndexError) as e:
            raise CheckpointError(f"{parts['q'].file}: {parts['q'].name}: {e}") from None

    _FUSED = re.compile(r"^(?P<p>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?$")
    # a dense or shared MLP's gate and up rows as one matrix [2I, H], gate first (transformers
    # versions that save MiniMax-M3's dense MLPs as they hold them; Granite's shared_mlp.input_linear)
    _DENSE_FUSED = re.compile(r"^(?P<p>.*\.(?:mlp|shared_mlp|shared_expert|shared_experts|feed_forward))"
                              r"\.(?:gate_up_proj|input_linear)\.weight$")
    # Step-3.5's experts: each projection stacked alone, [E, I, H] / [E, H, I], under .moe.
    _STACKED = re.compile(r"^(?P<p>.*\.moe)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")

    def _expert_dims(self) -> tuple[int, int] | None:
        """(hidden, moe intermediate) from config.json (an image-text wrapper's text_config),
        or None where it does not say."""
        cfg = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) \
            else self.config
        h, i = cfg.get("hidden_size"), cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
        if isinstance(i, list):   # one a layer (Hunyuan's): a single width only where all agree
            i = i[0] if i and all(x == i[0] for x in i) else None
        return (int(h), int(i)) if h and i else None

    def _split_fused_experts(self) -> None:
        """Checkpoints that store a layer's experts fused (gate_up_proj [E, 2I, H], gate rows
        first; down_proj [E, H, I]) get per-expert views under the per-expert names: contiguous
        byte ranges of the fused tensor, so nothing is copied and packing reads them as usual.
        Stored transposed (gate_up_proj [E, H, 2I], gate the first columns; down_proj [E, I, H]:
        Qwen3-VL-MoE's releases), as transformers tells them apart (by shape, the untransposed
        reading where both fit), each expert's matrices are copied out on read. Step-3.5 stacks
        each projection alone under `.moe.` ([E, I, H] / [E, H, I]): views the same way."""
        dims = self._expert_dims()
        for name, t in list(self.tensors.items()):
            m = self._DENSE_FUSED.match(name)
            if m is not None and len(t.shape) == 2 and t.shape[0] % 2 == 0 and t.dtype in FLOAT_DTYPES:
                half, cols = t.shape[0] // 2, t.shape[1]
                part = t.nbytes // 2
                for i, proj in enumerate(("gate_proj", "up_proj")):   # row ranges: views, no copy
                    view = f"{m['p']}.{proj}.weight"
                    if view not in self.tensors:
                        self.tensors[view] = TensorInfo(view, t.file, t.dtype, (half, cols), t.start + i * part, part)
                        self.fused[view] = name
                continue
            m = self._STACKED.match(name)
            if m is not None and len(t.shape) == 3:   # per-expert views `<p>.<e>.<kind>.weight`
                e_n, rows, cols = t.shape
                per_expert = t.nbytes // e_n
                for e in range(e_n):
                    view = f"{m['p']}.{e}.{m['kind']}.weight"
                    self.tensors[view] = TensorInfo(view, t.file, t.dtype, (rows, cols),
                                                    t.start + e * per_expert, per_expert)
                    self.fused[view] = name
                continue
            m = self._FUSED.match(name)
            if m is None or len(t.shape) != 3:
                continue
            e_n, rows, cols = t.shape
            item = t.nbytes // (e_n * rows * cols)
            per_expert = rows * cols * item
            if dims is not None and t.dtype in FLOAT_DTYPES:
                h, i = dims
                want = (2 * i, h) if m["kind"] == "gate_up_proj" else (h, i)
                if (rows, cols) != want and (cols, rows) == want:
                    self._add_copies(t, m["p"], (("gate_proj", slice(0, i), (i, h)),
                                                 ("up_proj", slice(i, 2 * i), (i, h)))
                                     if m["kind"] == "gate_up_proj" else (("down_proj", None, (h, i)),))
                    continue
            if m["kind"] == "gate_up_proj":
                if rows % 2:
                    raise CheckpointError(f"{t.file}: fused tensor {name} has {rows} rows per expert; "
                                          "expected gate and up halves (an even count)")
                parts = (("gate_proj", 0, rows // 2), ("up_proj", rows // 2, rows // 2))
            else:
                parts = (("down_proj", 0, rows),)
            for e in range(e_n):
                for proj, r0, nr in parts:
                    view = f"{m['p']}.{e}.{proj}.weight"
                    if view in self.tensors:
                        continue
                    self.tensors[view] = TensorInfo(view, t.file, t.dtype, (nr, cols),
                                                    t.start + e * per_expert + r0 * cols * item,
                                                    nr * cols * item)
                    self.fused[view] = name

    def _add_copies(self, t, prefix: str, parts, dtype: str | None = None, sc=None,
                    suffix: str = "weight") -> None:
        """Per-expert views of the fused tensor t that get() copies out transposed: parts
        (projection, the slice of t's last axis or None, the view's shape), each expert's under
        `<prefix>.<expert>.<projection>.<suffix>`; sc: MXFP4 scales."""
        dtype = dtype or t.dtype
        item = np.dtype(DTYPES[dtype]).itemsize
        for e in range(t.shape[0]):
            for proj, sl, shape in parts:
                view = f"{prefix}.{e}.{proj}.{suffix}"
                self.tensors[view] = TensorInfo(view, t.file, dtype, shape, t.start,
                                                int(np.prod(shape)) * item)
                self.derived[view] = (t, e, sl, sc)

    _FLAT = re.compile(r"^(?P<p>.*\.experts\.mlp)\.(?P<kind>w1|v1|w2)$")

    def _split_flat_experts(self) -> None:
        """DBRX fuses a layer's experts flat, one [E I, H] tensor a projection: w1 (gate) and v1
        (up) as x @ w^T, w2 as act @ w2. Each expert's I rows of w1 / v1 are views (byte ranges,
        no copy) under `<p>.<expert>.w1` / `.v1`; its w2 rows are copied out transposed, [H, I],
        under `<p>.<expert>.w2`. E from config.json's ffn_config.moe_num_experts."""
        ffn = self.config.get("ffn_config") if isinstance(self.config.get("ffn_config"), dict) else {}
        e_n = int(ffn.get("moe_num_experts", 4))
        for name, t in list(self.tensors.items()):
            m = self._FLAT.match(name)
            if m is None or t.dtype not in FLOAT_DTYPES:
                continue   # require() names the dtype when the model asks for a view
            if len(t.shape) != 2 or t.shape[0] % e_n:
                raise CheckpointError(f"{t.file}: fused tensor {name} has shape {list(t.shape)}; expected "
                                      f"[{e_n} experts x their rows, hidden] (ffn_config.moe_num_experts={e_n})")
            rows, cols = t.shape[0] // e_n, t.shape[1]
            per_expert = t.nbytes // e_n
            src = TensorInfo(name, t.file, t.dtype, (e_n, rows, cols), t.start, t.nbytes)   # [E, I, H]
            for e in range(e_n):
                view = f"{m['p']}.{e}.{m['kind']}"
                if m["kind"] == "w2":   # get() copies expert e's rows out transposed
                    self.tensors[view] = TensorInfo(view, t.file, t.dtype, (cols, rows), t.start, per_expert)
                    self.derived[view] = (src, e, None, None)
                else:
                    self.tensors[view] = TensorInfo(view, t.file, t.dtype, (rows, cols), t.start + e * per_expert,
                                                    per_expert)
                    self.fused[view] = name

    _FUSED_T = re.compile(r"^(?P<p>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)"
                          r"(?P<suffix>_bias|_blocks)?$")

    def _split_transposed_experts(self) -> None:
        """gpt-oss fuses a layer's experts transposed against the engine's [N, K] matrices:
        gate_up_proj [E, H, 2I] (gate the even columns, up the odd), gate_up_proj_bias [E, 2I]
        (likewise), down_proj [E, I, H], down_proj_bias [E, H]. Each expert's gate / up [I, H],
        down [H, I] and their biases get the per-expert names; get() copies them out (strided,
        so no byte range of the file holds them). MXFP4 (`<name>_blocks` [E, N, K / 32, 16]
        beside `<name>_scales` [E, N, K / 32]) is stored untransposed, [N, K] per expert (gate
        the even rows, up the odd): its views read as bf16, dequantized on read."""
        for name, t in list(self.tensors.items()):
            m = self._FUSED_T.match(name)
            if m is None:
                continue
            sc = None
            if m["suffix"] == "_blocks":
                sc = self.tensors.get(name[:-len("_blocks")] + "_scales")
                if t.dtype != "U8" or len(t.shape) != 4 or t.shape[3] != 16 or sc is None \
                        or sc.dtype != "U8" or sc.shape != t.shape[:3]:
                    got = "missing" if sc is None else f"{sc.dtype} {list(sc.shape)}"
                    raise CheckpointError(
                        f"{t.file}: MXFP4 tensor {name} is {t.dtype} {list(t.shape)} beside "
                        f"{name[:-len('_blocks')]}_scales ({got}); expected U8 [E, N, K / 32, 16] "
                        "and U8 [E, N, K / 32]")
                n, cols = t.shape[1], 32 * t.shape[2]
            else:
                dims = 2 if m["suffix"] else 3
                if len(t.shape) != dims:
                    raise CheckpointError(f"{t.file}: fused tensor {name} has shape "
                                          f"{list(t.shape)}; expected {dims} dimensions")
                if t.dtype not in FLOAT_DTYPES:
                    continue   # require() names the dtype when the model asks for a view
                n, cols = t.shape[-1], (t.shape[1] if dims == 3 else 0)
            if m["kind"] == "gate_up_proj":
                if n % 2:
                    raise CheckpointError(f"{t.file}: fused tensor {name} interleaves gate and up "
                                          f"in {n} rows / columns; expected an even count")
                parts = (("gate_proj", slice(0, None, 2), n // 2), ("up_proj", slice(1, None, 2), n // 2))
            else:
                parts = (("down_proj", None, n),)
            bias = m["suffix"] == "_bias"
            self._add_copies(t, m["p"], [(proj, sl, (rows,) if bias else (rows, cols))
                                         for proj, sl, rows in parts],
                             "BF16" if sc is not None else None, sc, "bias" if bias else "weight")

    # ---- tensors ------------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {name} not found in the checkpoint") from None

    def _stored(self, t: TensorInfo) -> np.ndarray:
        mm = self._maps.get(t.file)
        if mm is None:
            mm = self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        return mm[t.start:t.start + t.nbytes].view(DTYPES[t.dtype]).reshape(t.shape)

    def _dequant(self, name: str) -> np.ndarray:
        """An FP8 weight as float32: q * its block's scale."""
        from loader.quant import bf16_to_f32, dequant_fp8_blocks
        t, sc, bn, bk = self.fp8[name]
        s = self._stored(sc)
        if sc.dtype in ("F8_E8M0", "U8"):     # E8M0: a power-of-two exponent a byte
            s = np.exp2(s.astype(np.float32) - 127)
        elif sc.dtype == "BF16":
            s = bf16_to_f32(s)
        s = np.asarray(s, np.float32).reshape(-(-t.shape[0] // bn), -(-t.shape[1] // bk))
        try:
            return dequant_fp8_blocks(self._stored(t), s, (bn, bk), name)
        except ValueError as e:
            raise CheckpointError(f"{t.file}: {e}") from None

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 bits), memory-mapped, read-only; an FP8 or
        NVFP4 weight dequantized to bf16 bits, or a transposed expert's copy (a new array)."""
        t = self.info(name)
        if name in self.derived:
            src, e, sl, sc = self.derived[name]
            a = self._stored(src)[e]
            if sc is not None:   # MXFP4, [N, K] already: its rows, dequantized
                from loader.quant import dequant_mxfp4, f32_to_bf16
                return f32_to_bf16(dequant_mxfp4(*self.mxfp4_parts(name)))
            if sl is not None:
                a = a[..., sl]
            return np.ascontiguousarray(a.T)
        if name in self.fp8 or name in self.nvfp4 or name in self.intq or name in self.mxfp4:
            from loader.quant import f32_to_bf16
            return f32_to_bf16(self.get_f32(name))
        return self._stored(t)

    def get_f32(self, name: str) -> np.ndarray:
        """The tensor as float32; an FP8 or NVFP4 weight dequantized without the bf16 rounding
        (what the packer quantizes from)."""
        if name in self.fp8:
            return self._dequant(name)
        if name in self.nvfp4:
            from loader.quant import dequant_nvfp4
            q, s, g = self.nvfp4_parts(name)
            return dequant_nvfp4(q, s, g, 2 * q.shape[1])
        if name in self.intq:
            return self._dequant_int(name)
        if name in self.mxfp4:
            from loader.quant import dequant_mxfp4
            return dequant_mxfp4(*self.mxfp4_parts(name))
        return self._as_f32(self.get(name), self.tensors[name].dtype)

    def require(self, expected: dict[str, tuple], ints=()) -> set[str]:
        """Prove completeness: every expected tensor present with its shape and a float dtype.

        ints: the names stored as integers (DeepSeek-V4's routing tables). Returns the names
        consumed; raises naming the file and tensor on the first mismatch.
        """
        missing = [n for n in expected if n not in self.tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.dir}: tensor {missing[0]} not found in the checkpoint{more}")
        for name, shape in expected.items():
            t = self.tensors[name]
            if t.shape != tuple(shape):
                raise CheckpointError(f"{t.file}: tensor {name} has shape {list(t.shape)}, "
                                      f"expected {list(shape)}")
            allowed = INT_DTYPES if name in ints else FLOAT_DTYPES
            if t.dtype not in allowed:
                raise CheckpointError(f"{t.file}: tensor {name} has dtype {t.dtype}, "
                                      f"expected one of {', '.join(allowed)}")
        return set(expected)

    # ---- side files ---------------------------------------------------------------------------

    def file(self, name: str) -> Path | None:
        p = self.dir / name
        return p if p.is_file() else None

    def json_file(self, name: str) -> dict:
        p = self.file(name)
        if p is None:
            return {}
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{p}: not valid JSON ({e})") from None

    def tokenizer_path(self) -> Path:
        """tokenizer.json, else tiktoken.model (Kimi's), which engine.tokenizer converts."""
        p = self.file("tokenizer.json") or self.file("tiktoken.model")
        if p is None:
            raise CheckpointError(f"{self.dir}: missing tokenizer.json (and no tiktoken.model)")
        return p
