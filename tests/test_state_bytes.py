"""The sequence-state bytes a decode token reads (engine.bench's HBM bound counts them beside the
weights), against the run state the decoder really allocates."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import build_hf_model
from test_hybrid import build as build_hybrid


def state_arrays_bytes(st) -> tuple[int, int]:
    """(KV cache bytes, other state bytes) of a CPU run state."""
    kv = np.asarray(st.k).nbytes + np.asarray(st.v).nbytes
    other = sum(np.asarray(getattr(st, n)).nbytes for n in ("conv", "ssm") if hasattr(st, n))
    return kv, other


def check_state_bytes(m, kv_row: int, other: int) -> None:
    """A hybrid's run state holds kv_row bytes of K and V a position (its attention layers)
    and `other` bytes of state whole (conv, scan), and state_bytes_per_token reads them: every
    row at the last position, the mean over a run from position 0 (engine.bench's bound)."""
    s = int(np.random.default_rng().integers(9, 40))
    assert state_arrays_bytes(m.model.new_state(s)) == (kv_row * s, other)
    assert m.state_bytes_per_token(s - 1, 1) == pytest.approx(kv_row * s + other)
    assert m.state_bytes_per_token(0, s) == pytest.approx(kv_row * (s + 1) / 2 + other)


@pytest.mark.parametrize("family,window", [("qwen3_moe", 0), ("mixtral", 5), ("hybrid", 0)])
def test_state_bytes_per_token_matches_the_run_state(tmp_path, family, window):
    if family == "hybrid":
        build_hybrid(tmp_path, "qwen3_next")
    else:
        build_hf_model(tmp_path, family, **({"sliding_window": window} if window else {}))
    m = engine.load(tmp_path, device="cpu")
    s = int(np.random.default_rng().integers(9, 40))
    kv, other = state_arrays_bytes(m.model.new_state(s))
    row = kv / s                       # K and V of one position, every attention layer
    # the last position reads every row (or the window's), the first one row
    last = min(s, window) if window else s
    assert m.state_bytes_per_token(s - 1, 1) == pytest.approx(row * last + other)
    assert m.state_bytes_per_token(0, 1) == pytest.approx(row + other)
    # the mean over positions 0 .. s - 1
    rows = [min(p + 1, window) if window else p + 1 for p in range(s)]
    assert m.state_bytes_per_token(0, s) == pytest.approx(row * np.mean(rows) + other)


def test_state_bytes_per_layer_windows(tmp_path):
    """gpt-oss: a sliding layer reads at most its window's rows, a full layer every row."""
    build_hf_model(tmp_path, "gpt_oss", sliding_window=4)
    m = engine.load(tmp_path, device="cpu")
    windows = m.config.layer_windows
    assert 4 in windows and 0 in windows
    s = int(np.random.default_rng().integers(9, 40))
    kv, _ = state_arrays_bytes(m.model.new_state(s))
    layer_row = kv / s / len(windows)   # K and V of one position, one layer
    assert m.state_bytes_per_token(s - 1, 1) == pytest.approx(
        layer_row * sum(w or s for w in windows))
