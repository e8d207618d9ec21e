"""The shipped demo model (engine/data/demo, trained by tools/train_demo.py): it runs offline with no
--model, scores the held-out stdlib text as recorded, and its bf16 export matches transformers."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import engine
from conftest import hf_reference, rel_err
from engine.demo import DEMO_DIR, demo_model_dir
from engine.trace import load_trace

DATA = Path(__file__).parent / "data"
HF_DIR = DATA / "demo-hf"          # the bf16 Hugging Face folder the pack was made from
TRACE = DATA / "demo-trace.npz"    # routed experts on held-out stdlib text (engine, CPU)


def recorded() -> dict:
    """engine/data/demo/eval.json: the perplexity test's token ids and the recorded figure."""
    return json.loads((DEMO_DIR / "eval.json").read_text())


def nll(logits: np.ndarray, ids) -> float:
    """Mean -log p(ids[t+1] | ids[..t]) from logits [T, V]."""
    lg = np.asarray(logits, np.float64)[:-1]
    mx = lg.max(1)
    lse = np.log(np.exp(lg - mx[:, None]).sum(1)) + mx
    return float(np.mean(lse - lg[np.arange(len(lg)), np.asarray(ids[1:])]))


def test_demo_runs_offline_without_model_flag(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--max-new-tokens", "16", "--json",
                        "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stderr and "standard library" in r.stderr
    assert "RANDOM" not in r.stderr
    out = json.loads(r.stdout)
    assert len(out["output_ids"]) == 16 and out["finish_reason"] == "length"
    assert out["stats"]["experts"]["format"] == "nvfp4"
    assert len(out["prompt_ids"]) == 2 and out["text"]   # "def " -> "def", " " (the shipped BPE)
    assert not (tmp_path / "cache").exists()    # nothing built on first use any more


def test_demo_writes_python():
    """Greedy continuation of a method's signature: it closes the parameter list and writes an
    indented body that uses self."""
    m = engine.load(demo_model_dir(), device="cpu")
    text = m.generate(m.encode("class Foo:\n    def __init__(self"), 16).text
    assert re.match(r"[^)\n]*\):\n        self", text), text


def test_demo_model_dir_is_the_packed_model():
    d = demo_model_dir()
    assert d == DEMO_DIR
    size = sum(p.stat().st_size for p in d.iterdir())
    assert size < 10e6, f"shipped demo grew to {size / 1e6:.1f} MB"
    man = json.loads((d / "manifest.json").read_text())
    assert man["experts"]["format"] == "nvfp4" and man["dense"]["source_dtypes"] == ["BF16"]


def test_demo_perplexity_matches_record():
    rec = recorded()
    ids = rec["ids"]
    assert len(ids) == rec["tokens"]
    m = engine.load(DEMO_DIR, device="cpu")
    assert m.encode(Path(__file__).read_text())  # the shipped tokenizer loads and encodes
    ppl = math.exp(nll(m.logits(ids), ids))
    assert ppl == pytest.approx(rec["ppl_nvfp4_engine"], rel=0.01), (ppl, rec["ppl_nvfp4_engine"])
    assert ppl < 400, "the demo model no longer knows Python (uniform guessing scores 4096)"


def test_demo_bf16_logits_match_transformers():
    import torch
    ids = recorded()["ids"][:96]
    want = hf_reference(HF_DIR)(torch.tensor([ids])).logits[0].detach().numpy()
    got = engine.load(HF_DIR, device="cpu").logits(ids)
    assert rel_err(got, want) < 1e-4
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_demo_routing_trace():
    ids, meta = load_trace(TRACE)
    assert TRACE.stat().st_size < 1_000_000
    man = json.loads((DEMO_DIR / "manifest.json").read_text())
    assert ids.shape[1:] == (len(man["experts"]["moe_layers"]), man["config"]["num_experts_per_tok"])
    assert meta["n_experts"] == man["experts"]["n_experts"]
    assert meta["block_bytes"] == man["experts"]["block_bytes"]
    assert sum(meta["doc_lengths"]) == ids.shape[0]
