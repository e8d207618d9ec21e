"""The packed expert arena: one file of 4096-aligned expert blocks behind a fixed 4096-byte header.

The format is written down in docs/ARENA.md; the block layout in loader/layout.py.
Header (little-endian), bytes [0, 4096):
    0   8s   magic b"MOEARENA"
    8   u32  version (1)
    12  u32  header size (4096)
    16  u64  block count
    24  u64  total file size
    32  u64  block bytes
    40  u32  H (hidden)
    44  u32  I (expert intermediate)
    48  u32  model layers
    52  u32  MoE layers in the arena
    56  u32  experts per layer
    60  16s  format, ASCII, NUL-padded ("bf16", "fp8", "nvfp4")
    76  u32  flags: bit 0 set = ungated blocks (no gate rows: loader/layout.py); 0 in older arenas
    80  ...  zeros
    4092 u32 crc32 of bytes [0, 4092)
Block i (i = moe_layer_index * n_experts + expert) starts at 4096 + i * block_bytes.
"""
from __future__ import annotations

import os
import queue
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
from tqdm import tqdm

from loader.layout import BLOCK_ALIGN, ExpertLayout
from loader.quant import assemble_expert_block, encode_expert_block

MAGIC = b"MOEARENA"
VERSION = 1
HEADER_BYTES = 4096
ARENA_NAME = "experts.arena"
_FIELDS = struct.Struct("<8sIIQQQIIIII16s")  # the header fields above, offsets 0..75
_CRC_OFFSET = HEADER_BYTES - 4
_UNGATED = 1   # flags bit 0


class ArenaError(ValueError):
    """The arena file or its manifest is damaged, truncated or of another format."""


def _pack_header(fmt: str, layout: ExpertLayout, n_layers: int, n_moe_layers: int,
                 n_experts: int) -> bytes:
    n_blocks = n_moe_layers * n_experts
    head = bytearray(HEADER_BYTES)
    _FIELDS.pack_into(head, 0, MAGIC, VERSION, HEADER_BYTES, n_blocks,
                      HEADER_BYTES + n_blocks * layout.block_bytes, layout.block_bytes,
                      layout.hidden, layout.intermediate, n_layers, n_moe_layers, n_experts,
                      fmt.encode("ascii"))
    struct.pack_into("<I", head, _FIELDS.size, 0 if layout.gated else _UNGATED)
    struct.pack_into("<I", head, _CRC_OFFSET, zlib.crc32(bytes(head[:_CRC_OFFSET])))
    return bytes(head)


def block_offset(index: int, block_bytes: int) -> int:
    """Byte offset of the index-th block in (layer, expert) order."""
    return HEADER_BYTES + index * block_bytes


def write_arena(path: str | os.PathLike, fmt: str, layout: ExpertLayout, n_layers: int,
                n_experts: int, get_expert: Callable[[int, int], tuple], progress: bool = True,
                layers: Sequence[int] | None = None, workers: int | None = None) -> list[dict]:
    """Quantize every expert and write the arena to path; returns one record per block.

    get_expert(layer, expert) -> (gate [I, H], up [I, H], down [H, I]) float32, or a dict of
    pre-quantized parts in the arena's format (quant.assemble_expert_block), copied as they are.
    layers: the layer indices that hold experts (default: all n_layers), written in this order.
    Encoding runs on `workers` threads (numpy releases the GIL); blocks are written in order.
    Record: {"layer", "expert", "offset", "size", "format", "crc32"}.
    """
    if fmt != layout.fmt:
        raise ArenaError(f"write_arena: format {fmt!r} does not match the layout's {layout.fmt!r}")
    layers = list(range(n_layers)) if layers is None else [int(x) for x in layers]
    keys = [(layer, e) for layer in layers for e in range(n_experts)]
    workers = workers or min(8, os.cpu_count() or 1)

    def encode(key):
        layer, e = key
        got = get_expert(layer, e)
        if isinstance(got, dict):
            try:
                block = assemble_expert_block(layout, got)
            except ValueError as err:
                raise ArenaError(f"layer {layer} expert {e}: {err}") from None
        else:
            block = encode_expert_block(fmt, layout, *got, f"layer {layer} expert {e}")
        return block, zlib.crc32(block)

    records = []
    bar = tqdm(total=len(keys) * layout.block_bytes, unit="B", unit_scale=True, unit_divisor=1000,
               desc=f"arena {fmt}", disable=not progress)
    with open(path, "wb") as f, ThreadPoolExecutor(workers) as pool:
        f.write(_pack_header(fmt, layout, n_layers, len(layers), n_experts))
        window = queue.Queue()
        it = iter(enumerate(keys))
        for _ in range(2 * workers):  # bounded look-ahead keeps memory at a few blocks per thread
            nxt = next(it, None)
            if nxt is not None:
                window.put((nxt, pool.submit(encode, nxt[1])))
        while not window.empty():
            (i, (layer, e)), fut = window.get()
            block, crc = fut.result()
            nxt = next(it, None)
            if nxt is not None:
                window.put((nxt, pool.submit(encode, nxt[1])))
            f.write(block.data)
            records.append({"layer": layer, "expert": e, "offset": block_offset(i, layout.block_bytes),
                            "size": layout.block_bytes, "format": fmt, "crc32": crc})
            bar.update(layout.block_bytes)
        f.flush()
        os.fsync(f.fileno())
    bar.close()
    return records


class ArenaFile:
    """An opened, validated arena: block records by (layer, expert), layout, checksums."""

    def __init__(self, path: str, header: dict, records: list[dict]):
        self.path = str(path)
        self.header = header
        self.fmt: str = header["format"]
        self.layout = ExpertLayout.build(self.fmt, header["hidden"], header["intermediate"],
                                         header.get("gated", True))
        self.records = records
        self._by_key = {(r["layer"], r["expert"]): r for r in records}
        self.moe_layers = sorted({r["layer"] for r in records})
        self.n_experts: int = header["n_experts"]
        self.block_bytes: int = header["block_bytes"]
        self.file_size: int = header["file_size"]
        self._fd: int | None = None
        self._fd_lock = threading.Lock()

    @staticmethod
    def read_header(path: str | os.PathLike) -> dict:
        path = str(path)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
                actual = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise ArenaError(f"{path}: cannot open the arena ({e.strerror})") from None
        if len(head) < _FIELDS.size + 4 or head[:8] != MAGIC:
            raise ArenaError(f"{path}: not a moe-stream arena (magic {head[:8]!r}, expected {MAGIC!r})")
        (_, version, header_bytes, n_blocks, file_size, block_bytes, hidden, intermediate,
         n_layers, n_moe_layers, n_experts, fmt) = _FIELDS.unpack_from(head, 0)
        (flags,) = struct.unpack_from("<I", head, _FIELDS.size)
        if version != VERSION:
            raise ArenaError(f"{path}: arena version {version}, this build reads {VERSION}")
        if len(head) < HEADER_BYTES:
            raise ArenaError(f"{path}: truncated arena: header needs {HEADER_BYTES} bytes, "
                             f"file has {actual}")
        (crc,) = struct.unpack_from("<I", head, _CRC_OFFSET)
        if crc != zlib.crc32(head[:_CRC_OFFSET]) or header_bytes != HEADER_BYTES:
            raise ArenaError(f"{path}: arena header checksum mismatch (header damaged)")
        if actual != file_size:
            what = "truncated arena" if actual < file_size else "arena has trailing bytes"
            raise ArenaError(f"{path}: {what}: header says {file_size} bytes, file has {actual}")
        return {"version": version, "n_blocks": n_blocks, "file_size": file_size,
                "block_bytes": block_bytes, "hidden": hidden, "intermediate": intermediate,
                "n_layers": n_layers, "n_moe_layers": n_moe_layers, "n_experts": n_experts,
                "format": fmt.rstrip(b"\0").decode("ascii", "replace"), "gated": not flags & _UNGATED}

    @classmethod
    def open(cls, path: str | os.PathLike, manifest_blocks: list[dict], expect: dict) -> "ArenaFile":
        """Validate the arena at path against the manifest's "blocks" records and its "experts"
        dict (format, hidden, intermediate, block_bytes, n_layers, n_experts, moe_layers)."""
        path = str(path)
        h = cls.read_header(path)
        if h["n_blocks"] != h["n_moe_layers"] * h["n_experts"]:
            raise ArenaError(f"{path}: header says {h['n_blocks']} blocks, expected "
                             f"{h['n_moe_layers']} layers x {h['n_experts']} experts")
        layout = ExpertLayout.build(h["format"], h["hidden"], h["intermediate"], h["gated"]) \
            if h["format"] in ("bf16", "fp8", "nvfp4") else None
        if layout is None:
            raise ArenaError(f"{path}: unknown expert format {h['format']!r} in the arena header")
        if layout.block_bytes != h["block_bytes"]:
            raise ArenaError(f"{path}: header block size {h['block_bytes']}, the {h['format']} "
                             f"layout for H={h['hidden']}, I={h['intermediate']} gives {layout.block_bytes}")
        for key in ("format", "hidden", "intermediate", "block_bytes", "n_layers", "n_experts"):
            if key in expect and expect[key] != h[key]:
                raise ArenaError(f"{path}: manifest and arena disagree on {key}: manifest "
                                 f"{expect[key]!r}, arena {h[key]!r}")
        if "moe_layers" in expect and len(expect["moe_layers"]) != h["n_moe_layers"]:
            raise ArenaError(f"{path}: manifest lists {len(expect['moe_layers'])} MoE layers, "
                             f"arena holds {h['n_moe_layers']}")
        if len(manifest_blocks) != h["n_blocks"]:
            raise ArenaError(f"{path}: manifest lists {len(manifest_blocks)} blocks, arena holds "
                             f"{h['n_blocks']}")
        records, seen = [], set()
        for n, r in enumerate(manifest_blocks):
            try:
                rec = {"layer": int(r["layer"]), "expert": int(r["expert"]), "offset": int(r["offset"]),
                       "size": int(r["size"]), "format": str(r["format"]), "crc32": int(r["crc32"])}
            except (KeyError, TypeError, ValueError) as e:
                raise ArenaError(f"{path}: manifest block record {n} is malformed ({e!r})") from None
            where = f"{path}: manifest block (layer {rec['layer']}, expert {rec['expert']})"
            if rec["format"] != h["format"]:
                raise ArenaError(f"{where} has format {rec['format']!r}, arena holds {h['format']!r}")
            if rec["size"] != h["block_bytes"]:
                raise ArenaError(f"{where} has size {rec['size']}, arena blocks are {h['block_bytes']}")
            if (rec["offset"] < HEADER_BYTES or rec["offset"] % BLOCK_ALIGN
                    or rec["offset"] + rec["size"] > h["file_size"]):
                raise ArenaError(f"{where} at offset {rec['offset']} is not a {BLOCK_ALIGN}-aligned "
                                 f"block within the file ({h['file_size']} bytes)")
            if not 0 <= rec["expert"] < h["n_experts"]:
                raise ArenaError(f"{where}: expert out of range 0..{h['n_experts'] - 1}")
            key = (rec["layer"], rec["expert"])
            if key in seen:
                raise ArenaError(f"{where} is listed twice")
            seen.add(key)
            records.append(rec)
        if "moe_layers" in expect:
            layers = {r["layer"] for r in records}
            if layers != {int(x) for x in expect["moe_layers"]}:
                raise ArenaError(f"{path}: manifest blocks cover layers {sorted(layers)}, "
                                 f"moe_layers says {list(expect['moe_layers'])}")
        return cls(path, h, records)

    @classmethod
    def from_manifest(cls, manifest: dict, folder: str | os.PathLike) -> "ArenaFile":
        """Open folder/experts.arena as described by a loaded manifest.json dict."""
        if manifest.get("format_version") != 1:
            raise ArenaError(f"{folder}/manifest.json: format_version "
                             f"{manifest.get('format_version')!r}, this build reads 1")
        return cls.open(os.path.join(folder, ARENA_NAME), manifest["blocks"], manifest["experts"])

    def block_record(self, layer: int, expert: int) -> dict:
        try:
            return self._by_key[(layer, expert)]
        except KeyError:
            raise ArenaError(f"{self.path}: no expert block (layer {layer}, expert {expert})") from None

    def verify_block(self, layer: int, expert: int, buf: np.ndarray) -> None:
        """Raise ArenaError unless buf (the block's bytes, at least size long) matches its crc32."""
        rec = self.block_record(layer, expert)
        data = memoryview(np.ascontiguousarray(buf).reshape(-1).view(np.uint8))[:rec["size"]]
        crc = zlib.crc32(data)
        if len(data) != rec["size"] or crc != rec["crc32"]:
            raise ArenaError(f"checksum mismatch in expert block (layer {layer}, expert {expert}) of "
                             f"{self.path} at offset {rec['offset']}: crc32 {crc:#010x}, "
                             f"manifest {rec['crc32']:#010x}")

    def read_block(self, layer: int, expert: int, out: np.ndarray | None = None) -> np.ndarray:
        """Buffered read of one block (tests, tools, CPU path); the cache reads via ReaderPool."""
        rec = self.block_record(layer, expert)
        with self._fd_lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
        out = np.empty(rec["size"], np.uint8) if out is None else out
        n = os.preadv(self._fd, [memoryview(out)[:rec["size"]]], rec["offset"])
        if n != rec["size"]:
            raise ArenaError(f"{self.path}: short read of expert block (layer {layer}, expert "
                             f"{expert}): {n} of {rec['size']} bytes at offset {rec['offset']}")
        return out

    def verify_all(self, progress: bool = True) -> None:
        """Read every block and check its crc32 (engine.pack --verify)."""
        bar = tqdm(total=len(self.records) * self.block_bytes, unit="B", unit_scale=True,
                   unit_divisor=1000, desc="verify", disable=not progress)
        buf = np.empty(self.block_bytes, np.uint8)
        try:
            for rec in sorted(self.records, key=lambda r: r["offset"]):
                self.read_block(rec["layer"], rec["expert"], buf)
                self.verify_block(rec["layer"], rec["expert"], buf)
                bar.update(self.block_bytes)
        finally:
            bar.close()

    def close(self) -> None:
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "ArenaFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
