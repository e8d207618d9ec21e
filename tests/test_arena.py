"""The arena file: written blocks decode back, and every kind of damage is refused by name."""
from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest

from loader import arena as A
from loader.layout import ExpertLayout
from loader.quant import decode_expert_block, encode_expert_block


def make_arena(path, fmt="nvfp4", h=40, i=72, layers=(1, 3), n_experts=3):
    rng = np.random.default_rng()
    lay = ExpertLayout.build(fmt, h, i)
    weights = {}

    def get(layer, e):
        w = (rng.standard_normal((i, h)).astype(np.float32), rng.standard_normal((i, h)).astype(np.float32),
             rng.standard_normal((h, i)).astype(np.float32))
        weights[(layer, e)] = w
        return w

    recs = A.write_arena(path, fmt, lay, 4, n_experts, get, progress=False, layers=layers)
    expect = {"format": fmt, "hidden": h, "intermediate": i, "block_bytes": lay.block_bytes,
              "n_layers": 4, "n_experts": n_experts, "moe_layers": list(layers)}
    return lay, recs, expect, weights


@pytest.fixture(params=["bf16", "fp8", "nvfp4"])
def packed(tmp_path, request):
    path = tmp_path / A.ARENA_NAME
    return (path, *make_arena(path, request.param))


def test_write_and_read_back(packed):
    path, lay, recs, expect, weights = packed
    assert [(r["layer"], r["expert"]) for r in recs] == [(l, e) for l in (1, 3) for e in range(3)]
    assert os.path.getsize(path) == A.HEADER_BYTES + 6 * lay.block_bytes
    with A.ArenaFile.open(path, recs, expect) as ar:
        assert ar.layout == lay and ar.moe_layers == [1, 3]
        ar.verify_all(progress=False)
        for (layer, e), w in weights.items():
            rec = ar.block_record(layer, e)
            assert rec["offset"] % 4096 == 0 and rec["size"] == lay.block_bytes
            block = ar.read_block(layer, e)
            want = encode_expert_block(lay.fmt, lay, *w)
            np.testing.assert_array_equal(block, want)
            ar.verify_block(layer, e, block)
            for got, ww in zip(decode_expert_block(block, lay), w):
                assert got.shape == ww.shape
        with pytest.raises(A.ArenaError, match=r"no expert block \(layer 0, expert 0\)"):
            ar.block_record(0, 0)


def test_flipped_byte_names_the_block(tmp_path):
    path = tmp_path / "experts.arena"
    lay, recs, expect, _ = make_arena(path, "fp8")
    rec = recs[4]                                   # (layer 3, expert 1)
    with open(path, "r+b") as f:
        f.seek(rec["offset"] + 1000)
        b = f.read(1)
        f.seek(rec["offset"] + 1000)
        f.write(bytes([b[0] ^ 0x10]))
    ar = A.ArenaFile.open(path, recs, expect)
    with pytest.raises(A.ArenaError, match=r"checksum mismatch in expert block \(layer 3, expert 1\) "
                                           r"of .*experts\.arena"):
        ar.verify_all(progress=False)
    ar.verify_block(3, 0, ar.read_block(3, 0))     # its neighbours are fine
    ar.close()


def test_truncated(tmp_path):
    path = tmp_path / "experts.arena"
    lay, recs, expect, _ = make_arena(path, "bf16")
    full = os.path.getsize(path)
    os.truncate(path, full - 4096)
    with pytest.raises(A.ArenaError, match=rf"experts\.arena: truncated arena: header says {full} "
                                           rf"bytes, file has {full - 4096}"):
        A.ArenaFile.open(path, recs, expect)
    os.truncate(path, 100)
    with pytest.raises(A.ArenaError, match="truncated arena"):
        A.ArenaFile.open(path, recs, expect)


def _patch_header(path, offset, fmt, value, fix_crc=True):
    with open(path, "r+b") as f:
        head = bytearray(f.read(A.HEADER_BYTES))
        struct.pack_into(fmt, head, offset, value)
        if fix_crc:
            struct.pack_into("<I", head, A.HEADER_BYTES - 4, zlib.crc32(bytes(head[:A.HEADER_BYTES - 4])))
        f.seek(0)
        f.write(head)


def test_wrong_magic_version_crc(tmp_path):
    path = tmp_path / "experts.arena"
    _, recs, expect, _ = make_arena(path, "fp8")
    _patch_header(path, 8, "<I", 2)
    with pytest.raises(A.ArenaError, match="arena version 2, this build reads 1"):
        A.ArenaFile.open(path, recs, expect)
    _patch_header(path, 8, "<I", 1)
    A.ArenaFile.open(path, recs, expect)
    _patch_header(path, 40, "<I", 41, fix_crc=False)
    with pytest.raises(A.ArenaError, match="header checksum mismatch"):
        A.ArenaFile.open(path, recs, expect)
    _patch_header(path, 0, "8s", b"GGUF\0\0\0\0")
    with pytest.raises(A.ArenaError, match="not a moe-stream arena"):
        A.ArenaFile.open(path, recs, expect)


def test_manifest_disagrees(tmp_path):
    path = tmp_path / "experts.arena"
    lay, recs, expect, _ = make_arena(path, "nvfp4")
    A.ArenaFile.open(path, recs, expect)
    with pytest.raises(A.ArenaError, match="manifest lists 5 blocks, arena holds 6"):
        A.ArenaFile.open(path, recs[:5], expect)
    with pytest.raises(A.ArenaError, match="disagree on format: manifest 'fp8', arena 'nvfp4'"):
        A.ArenaFile.open(path, recs, {**expect, "format": "fp8"})
    with pytest.raises(A.ArenaError, match="disagree on hidden"):
        A.ArenaFile.open(path, recs, {**expect, "hidden": 48})
    bad = [dict(r) for r in recs]
    bad[2]["offset"] = os.path.getsize(path)
    with pytest.raises(A.ArenaError, match=r"block \(layer 1, expert 2\) at offset \d+ is not a "
                                           r"4096-aligned block within the file"):
        A.ArenaFile.open(path, bad, expect)
    bad = [dict(r) for r in recs]
    bad[0]["size"] = 4096
    with pytest.raises(A.ArenaError, match=r"\(layer 1, expert 0\) has size 4096"):
        A.ArenaFile.open(path, bad, expect)
    bad = [dict(r) for r in recs]
    bad[3]["format"] = "bf16"
    with pytest.raises(A.ArenaError, match=r"\(layer 3, expert 0\) has format 'bf16'"):
        A.ArenaFile.open(path, bad, expect)
    bad = [dict(r) for r in recs]
    bad[1]["expert"] = 0
    with pytest.raises(A.ArenaError, match="listed twice"):
        A.ArenaFile.open(path, bad, expect)
    with pytest.raises(A.ArenaError, match="moe_layers says"):
        A.ArenaFile.open(path, recs, {**expect, "moe_layers": [1, 2]})
