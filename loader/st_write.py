"""Write safetensors files from numpy arrays, bf16 included (stored as uint16 bits)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

_NP_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8"}


def write_safetensors(path: str | os.PathLike, tensors: dict, bf16: set | None = None,
                      metadata: dict | None = None) -> None:
    """tensors: name -> array. Names in bf16 hold uint16 bfloat16 bits and are typed BF16."""
    bf16 = bf16 or set()
    header, off, order = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dt = "BF16" if name in bf16 else _NP_TO_ST.get(a.dtype)
        if dt is None:
            raise ValueError(f"{path}: tensor {name} has dtype {a.dtype}, which cannot be written")
        if dt == "BF16" and a.dtype != np.uint16:
            raise ValueError(f"{path}: tensor {name} marked BF16 must hold uint16 bits")
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        order.append(a)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-aligned
    with open(Path(path), "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in order:
            f.write(memoryview(a).cast("B"))
