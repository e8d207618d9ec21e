"""Packed folders: pack -> generate, against transformers on the dequantized weights."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import engine
from conftest import assert_greedy, build_hf_model, hf_reference, rel_err
from engine.names import expert_names
from engine.pack import pack
from loader.arena import ArenaError, ArenaFile
from loader.quant import decode_expert_block


def dequantized_copy(src, packed, dst):
    """The checkpoint with each expert replaced by what the arena holds, decoded."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    man = json.loads((packed / "manifest.json").read_text())
    arena = ArenaFile.from_manifest(man, packed)
    t = load_file(dst / "model.safetensors")
    fam = man["model_type"]
    for rec in arena.records:
        l, e = rec["layer"], rec["expert"]
        for n, w in zip(expert_names(fam, l, e), decode_expert_block(arena.read_block(l, e), arena.layout)):
            assert t[n].shape == w.shape
            t[n] = w.astype(np.float32)
    arena.close()
    save_file(t, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("family,fmt,over", [
    ("qwen3_moe", "nvfp4", dict(hidden_size=40)),   # 40 % 16 != 0: padded NVFP4 rows
    ("qwen3_moe", "fp8", {}),
    ("mixtral", "nvfp4", {}),
    ("olmoe", "fp8", dict(num_experts_per_tok=4)),
    ("glm4_moe", "nvfp4", dict(n_group=2, topk_group=1)),
    ("deepseek_v3", "fp8", {}),
])
def test_quantized_arena_matches_transformers_on_dequantized_weights(tmp_path, family, fmt, over):
    src = tmp_path / "src"
    build_hf_model(src, family, **over)
    pack(src, tmp_path / "packed", fmt, progress=False)
    ref = hf_reference(dequantized_copy(src, tmp_path / "packed", tmp_path / "deq"))
    m = engine.load(tmp_path / "packed", device="cpu")
    ids = np.random.default_rng().integers(0, 300, 12)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(m.logits(ids), want) < 1e-4
    assert_greedy(ref, ids[:5].tolist(), m.generate(ids[:5].tolist(), max_new_tokens=32).output_ids, 32)


def test_bf16_arena_same_tokens_as_checkpoint(tmp_path):
    src = tmp_path / "src"
    build_hf_model(src, "qwen3_moe", dtype="bfloat16")
    pack(src, tmp_path / "packed", "bf16", progress=False)
    a = engine.load(src, device="cpu").generate([3, 1, 4, 1, 5], max_new_tokens=32).output_ids
    b = engine.load(tmp_path / "packed", device="cpu").generate([3, 1, 4, 1, 5], max_new_tokens=32).output_ids
    assert a == b


def test_tiny_ram_budget_streams_without_changing_tokens(tmp_path):
    src = tmp_path / "src"
    build_hf_model(src, "qwen3_moe", num_experts=8, num_experts_per_tok=2)
    pack(src, tmp_path / "packed", "nvfp4", progress=False)
    big = engine.load(tmp_path / "packed", device="cpu")
    bb = big.experts.block_bytes
    small = engine.load(tmp_path / "packed", device="cpu", ram_gb=2 * 2 * 2 * bb / 1e9)  # 2 per layer
    prompt = np.random.default_rng().integers(0, 300, 16).tolist()   # routes to most experts
    a = big.generate(prompt, max_new_tokens=24)
    b = small.generate(prompt, max_new_tokens=24)
    assert a.output_ids == b.output_ids
    st = b.stats["experts"]
    assert st["evictions"] > 0 and st["misses"] >= a.stats["experts"]["misses"]


def test_generate_cli_on_packed_folder_with_trace(tmp_path):
    src = tmp_path / "src"
    build_hf_model(src, "mixtral")
    r = subprocess.run([sys.executable, "-m", "engine.pack", str(src), str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stderr
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--model", str(tmp_path / "p"),
                        "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--device", "cpu",
                        "--trace-out", str(tmp_path / "t.npz")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "RAM cache hit rate" in r.stderr
    from engine.trace import load_trace
    ids = load_trace(tmp_path / "t.npz")[0]
    assert ids.shape == (3 + 5, 2, 2)   # prompt + decoded tokens, layers, top-k


def test_pack_refuses_overwrite_and_interrupted_pack_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "src"
    build_hf_model(src, "qwen3_moe")
    pack(src, tmp_path / "p", "fp8", progress=False)
    r = subprocess.run([sys.executable, "-m", "engine.pack", str(src), str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--force" in r.stderr
    import engine.pack as ep

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ep, "write_arena", boom)
    with pytest.raises(KeyboardInterrupt):
        ep.pack(src, tmp_path / "q", "fp8", progress=False)
    assert not (tmp_path / "q").exists()
    assert [p.name for p in tmp_path.iterdir() if "packing" in p.name] == []


def test_corrupt_block_named_on_load(tmp_path):
    src = tmp_path / "src"
    build_hf_model(src, "qwen3_moe")
    pack(src, tmp_path / "p", "nvfp4", progress=False)
    man = json.loads((tmp_path / "p" / "manifest.json").read_text())
    rec = [r for r in man["blocks"] if r["layer"] == 1 and r["expert"] == 2][0]
    arena = tmp_path / "p" / "experts.arena"
    data = bytearray(arena.read_bytes())
    data[rec["offset"] + 300] ^= 0xFF
    arena.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "engine.pack", "--verify", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "(layer 1, expert 2)" in r.stderr
    m = engine.load(tmp_path / "p", device="cpu")
    with pytest.raises(ArenaError, match=r"layer 1, expert 2"):
        for _ in range(20):  # route until expert (1, 2) is read
            m.generate(np.random.default_rng().integers(0, 300, 8).tolist(), max_new_tokens=8)
