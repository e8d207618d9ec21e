"""Routing traces: files round trip; the simulator against hand-computed LRU and Belady."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.trace import TraceError, load_trace, main, save_trace, simulate


@pytest.mark.parametrize("name", ["t.npz", "t.jsonl"])
def test_round_trip(tmp_path, name):
    ids = np.random.default_rng().integers(0, 16, (7, 3, 2)).astype(np.int32)
    meta = {"model": "tiny", "n_experts": 16, "block_bytes": 8192, "moe_layers": [0, 2, 3]}
    save_trace(tmp_path / name, ids, meta)
    back, m = load_trace(tmp_path / name)
    np.testing.assert_array_equal(back, ids)
    assert back.dtype == np.int32 and m == meta


def test_hand_computed():
    # one layer, top-1, capacity 2:  A B C A B D A
    # Belady: miss A, miss B, miss C (evict B, next use 4 > A's 3), hit A, miss B (evict C, never
    # used again), miss D (evict B, never again; A returns at 6), hit A -> 2 hits
    # LRU: every access misses
    ids = np.array([0, 1, 2, 0, 1, 3, 0])[:, None, None]
    assert simulate(ids, 2, "belady") == {"hits": 2, "misses": 5, "hit_rate": 2 / 7}
    assert simulate(ids, 2, "lru")["hits"] == 0
    # LFU (ties to the least recent): C evicts A (1, older), A evicts B, B evicts C, D evicts A
    assert simulate(ids, 2, "lfu")["hits"] == 0
    assert simulate(ids, 2, "belady", "global") == simulate(ids, 2, "belady", "layer")


def test_two_layers_split_vs_global():
    # layers alternate over the same two experts each; capacity 2 < 2 layers x 2 distinct
    ids = np.array([[[0], [5]], [[1], [6]], [[0], [5]], [[1], [6]]])
    g = simulate(ids, 2, "lru", "global")
    l = simulate(ids, 2, "lru", "layer")
    assert g["hits"] == 0 and l["hits"] == 0             # each layer cycles over 2 with 1 slot
    ids = np.array([[[0], [5]], [[0], [6]], [[0], [5]], [[0], [6]]])
    assert simulate(ids, 2, "lru", "layer")["hits"] == 3  # layer 0 keeps its expert
    # Belady never loses to a policy under the same split
    rng = np.random.default_rng()
    ids = rng.integers(0, 6, (40, 3, 2))
    for split in ("layer", "global"):
        best = simulate(ids, 5, "belady", split)["hits"]
        for p in ("lru", "lfu", "decay"):
            assert simulate(ids, 5, p, split)["hits"] <= best


def test_cli(tmp_path, capsys):
    ids = np.random.default_rng().integers(0, 8, (20, 4, 2))
    save_trace(tmp_path / "t.npz", ids, {"block_bytes": 1_000_000})
    assert main(["simulate", str(tmp_path / "t.npz"), "--capacity-gb", "0.006", "--policy", "all"]) == 0
    out = capsys.readouterr().out
    assert "6 slots" in out and "belady" in out and "global" in out and "decay" in out
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    assert main(["simulate", str(tmp_path / "bad.npz"), "--capacity-gb", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "bad.npz" in err and "\n" not in err
    save_trace(tmp_path / "nobb.npz", ids, {})
    assert main(["simulate", str(tmp_path / "nobb.npz"), "--capacity-gb", "1"]) == 2
    assert "--block-bytes" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine.trace", "simulate", str(tmp_path / "missing.npz"),
                        "--capacity-gb", "1", "--block-bytes", "4096"], capture_output=True, text=True)
    assert r.returncode == 2 and "missing.npz" in r.stderr


def test_bad_ids_refused(tmp_path):
    with pytest.raises(TraceError, match=r"integer array \[T, L, K\]"):
        save_trace(tmp_path / "x.npz", np.zeros((3, 2)), {})
    save_trace(tmp_path / "y.npz", np.full((2, 2, 2), 9), {"n_experts": 8})
    with pytest.raises(TraceError, match="y.npz: expert ids out of range"):
        load_trace(tmp_path / "y.npz")


def test_slots_without_a_block(tmp_path):
    """-1 (a LongCat-Flash zero expert's slot) reads no block: a top-2 trace with such slots
    replays as the top-1 trace of its real ids, a token routed to none requests nothing; such a
    trace loads back; -2 is refused."""
    rng = np.random.default_rng()
    real = rng.integers(0, 6, (30, 2, 1))
    ids = np.concatenate([real, np.full_like(real, -1)], axis=2)
    swap = rng.random(30) < 0.5
    ids[swap] = ids[swap][:, :, ::-1]
    for policy in ("lru", "lfu", "belady"):
        for split in ("layer", "global"):
            assert simulate(ids, 4, policy, split) == simulate(real, 4, policy, split)
    assert simulate(np.full((3, 2, 2), -1), 1, "belady") == {"hits": 0, "misses": 0, "hit_rate": 0.0}
    save_trace(tmp_path / "z.npz", ids, {"n_experts": 6})
    np.testing.assert_array_equal(load_trace(tmp_path / "z.npz")[0], ids)
    ids[0, 0, 0] = -2
    save_trace(tmp_path / "z.npz", ids, {"n_experts": 6})
    with pytest.raises(TraceError, match="expert ids out of range"):
        load_trace(tmp_path / "z.npz")
