"""Byte layout of one expert block in the arena: the single place it is written down.

A block holds one (layer, expert): gate [I, H], up [I, H], down [H, I] with their scales. An
ungated layout (experts without a gate projection: Nemotron-H's up -> relu^2 -> down) has a gate
of zero rows: its gate sections are empty, so the block holds up and down alone.
Legend: H = hidden size, I = expert intermediate size, K = a matrix's inner (column) size,
Kp = K rounded up to a multiple of 16 (NVFP4 pads each row with zeros to Kp).

    offset 0     block header, 64 bytes: float32 global scales [gate, up, down]
                 (NVFP4; 1.0 for the other formats), then zeros
    then, each section starting on a 256-byte boundary, in this order:
    gate_q, gate_s, up_q, up_s, down_q, down_s
    block size rounded up to 4096 (the arena's alignment), padding zeros

Per format, for a matrix of R rows and K columns:
    bf16   q: uint16 [R, K] (bfloat16 bits)            s: empty
    fp8    q: uint8  [R, K] (E4M3 FN bits)             s: float32 [R] (one scale per row)
    nvfp4  q: uint8  [R, Kp/2] (E2M1, element 2j in the low nibble, 2j+1 in the high)
           s: uint8  [R, Kp/16] (E4M3 FN bits, one scale per 16 values)
    dequant: bf16 -> value; fp8 -> value * s[r]; nvfp4 -> value * s[r, j // 16] * global
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMATS = ("bf16", "fp8", "nvfp4")
FORMAT_CODE = {"bf16": 0, "fp8": 1, "nvfp4": 2}  # what kernels receive
BLOCK_ALIGN = 4096  # arena alignment of every block (O_DIRECT needs 512; 4096 suits NVMe pages)
SECTION_ALIGN = 256
HEADER_BYTES = 64
NVFP4_GROUP = 16


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def padded_k(fmt: str, k: int) -> int:
    """Columns as stored: NVFP4 rows are padded with zeros to a multiple of 16."""
    return _round_up(k, NVFP4_GROUP) if fmt == "nvfp4" else k


def matrix_bytes(fmt: str, rows: int, k: int) -> tuple[int, int]:
    """(bytes of q, bytes of s) for one [rows, k] matrix in format fmt."""
    if fmt == "bf16":
        return rows * k * 2, 0
    if fmt == "fp8":
        return rows * k, rows * 4
    if fmt == "nvfp4":
        kp = padded_k(fmt, k)
        return rows * kp // 2, rows * kp // NVFP4_GROUP
    raise ValueError(f"unknown expert format {fmt!r}; expected one of {', '.join(FORMATS)}")


@dataclass(frozen=True)
class ExpertLayout:
    """Offsets (bytes from the block start) of every section of one expert block."""

    fmt: str
    hidden: int          # H
    intermediate: int    # I
    gated: bool = True   # False: no gate rows (an ungated expert)
    gate_q: int = 0
    gate_s: int = 0
    up_q: int = 0
    up_s: int = 0
    down_q: int = 0
    down_s: int = 0
    payload_bytes: int = 0   # bytes that carry data (header + sections), before 4096 padding
    block_bytes: int = 0     # size of the block in the arena, a multiple of BLOCK_ALIGN

    @classmethod
    def build(cls, fmt: str, hidden: int, intermediate: int, gated: bool = True) -> "ExpertLayout":
        if fmt not in FORMATS:
            raise ValueError(f"unknown expert format {fmt!r}; expected one of {', '.join(FORMATS)}")
        off = HEADER_BYTES
        offs = {}
        for name, rows, k in (("gate", intermediate if gated else 0, hidden), ("up", intermediate, hidden),
                              ("down", hidden, intermediate)):
            qb, sb = matrix_bytes(fmt, rows, k)
            off = _round_up(off, SECTION_ALIGN)
            offs[name + "_q"] = off
            off += qb
            off = _round_up(off, SECTION_ALIGN)
            offs[name + "_s"] = off
            off += sb
        return cls(fmt=fmt, hidden=hidden, intermediate=intermediate, gated=gated, payload_bytes=off,
                   block_bytes=_round_up(off, BLOCK_ALIGN), **offs)

    @property
    def hp(self) -> int:
        """Stored columns of gate/up (H padded for NVFP4)."""
        return padded_k(self.fmt, self.hidden)

    @property
    def ip(self) -> int:
        """Stored columns of down (I padded for NVFP4)."""
        return padded_k(self.fmt, self.intermediate)

    def as_array(self) -> np.ndarray:
        """int64 [10] for kernels: gate_q, gate_s, up_q, up_s, down_q, down_s, H, I, Hp, Ip."""
        return np.array([self.gate_q, self.gate_s, self.up_q, self.up_s, self.down_q,
                         self.down_s, self.hidden, self.intermediate, self.hp, self.ip],
                        dtype=np.int64)
