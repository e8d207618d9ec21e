"""Read a Hugging Face checkpoint folder without torch: config, safetensors tensors, tokenizer files.

Tensors are memory-mapped, never copied until asked for. Every header is checked: offsets within
the file, sizes matching shape x dtype, dtypes the engine reads. Errors name the file and tensor.
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
          "F8_E4M3": np.uint8, "U32": np.uint32, "I16": np.int16, "U16": np.uint16}
FLOAT_DTYPES = ("F32", "F16", "BF16")


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
        self.fused: dict[str, str] = {}   # per-expert view name -> the fused tensor it lies in
        self._split_fused_experts()

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

    _FUSED = re.compile(r"^(?P<p>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?$")

    def _split_fused_experts(self) -> None:
        """Checkpoints that store a layer's experts fused (gate_up_proj [E, 2I, H], gate rows
        first; down_proj [E, H, I]) get per-expert views under the per-expert names: contiguous
        byte ranges of the fused tensor, so nothing is copied and packing reads them as usual."""
        for name, t in list(self.tensors.items()):
            m = self._FUSED.match(name)
            if m is None or len(t.shape) != 3:
                continue
            e_n, rows, cols = t.shape
            item = t.nbytes // (e_n * rows * cols)
            per_expert = rows * cols * item
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

    # ---- tensors ------------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {name} not found in the checkpoint") from None

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 bits), memory-mapped, read-only."""
        t = self.info(name)
        mm = self._maps.get(t.file)
        if mm is None:
            mm = self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        return mm[t.start:t.start + t.nbytes].view(DTYPES[t.dtype]).reshape(t.shape)

    def get_f32(self, name: str) -> np.ndarray:
        a = self.get(name)
        dt = self.tensors[name].dtype
        if dt == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(a, dtype=np.float32)

    def require(self, expected: dict[str, tuple]) -> set[str]:
        """Prove completeness: every expected tensor present with its shape and a float dtype.

        Returns the names consumed; raises naming the file and tensor on the first mismatch.
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
            if t.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{t.file}: tensor {name} has dtype {t.dtype}, "
                                      f"expected one of {', '.join(FLOAT_DTYPES)}")
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
        p = self.file("tokenizer.json")
        if p is None:
            raise CheckpointError(f"{self.dir}: missing tokenizer.json")
        return p
