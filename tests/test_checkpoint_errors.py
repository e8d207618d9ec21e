"""Bad input: each a clear one-line error naming the file or tensor, and exit status 2 from the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import build_hf_model
from loader.checkpoint import Checkpoint, CheckpointError, resolve_model_dir


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.generate", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def cli_error(model_dir):
    r = run_cli("--model", model_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    build_hf_model(d, "qwen3_moe", max_shard_size="20KB")
    return d


def copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_shard(good, tmp_path):
    d = copy_model(good, tmp_path / "m")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (d / shard).unlink()
    msg = cli_error(d)
    assert shard in msg and "missing shard" in msg


def test_truncated_safetensors(good, tmp_path):
    d = copy_model(good, tmp_path / "m")
    shard = sorted(d.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) - 100])
    msg = cli_error(d)
    assert shard.name in msg and "truncated" in msg


def test_tensor_of_wrong_shape(tmp_path):
    from safetensors.numpy import load_file, save_file
    build_hf_model(tmp_path, "qwen3_moe")
    t = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    t[name] = np.zeros((t[name].shape[0] + 1, t[name].shape[1]), np.float32)
    save_file(t, tmp_path / "model.safetensors")
    msg = cli_error(tmp_path)
    assert name in msg and "model.safetensors" in msg and "has shape [33, 48], expected [32, 48]" in msg


def test_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file
    build_hf_model(tmp_path, "mixtral")
    t = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    del t[name]
    save_file(t, tmp_path / "model.safetensors")
    assert name in cli_error(tmp_path)


def test_unknown_model_type(tmp_path):
    build_hf_model(tmp_path, "olmoe")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = cli_error(tmp_path)
    assert "'llama'" in msg and "qwen3_moe" in msg and "mixtral" in msg and "olmoe" in msg


def test_missing_tokenizer(tmp_path):
    build_hf_model(tmp_path, "qwen3_moe")
    (tmp_path / "tokenizer.json").unlink()
    msg = cli_error(tmp_path)
    assert "tokenizer.json" in msg and str(tmp_path) in msg


def test_not_a_folder_nor_cached_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        resolve_model_dir("someorg/somemodel")


def test_repo_id_resolved_in_hub_cache(good, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny-moe"
    snap = repo / "snapshots" / "abc123"
    snap.parent.mkdir(parents=True)
    copy_model(good, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model_dir("acme/tiny-moe") == snap
    ck = Checkpoint("acme/tiny-moe")
    assert ck.config["model_type"] == "qwen3_moe"


def test_header_offsets_beyond_file(tmp_path):
    import struct
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 10)
    from loader.checkpoint import read_safetensors_header
    with pytest.raises(CheckpointError, match=r"tensor w data ends at byte .* truncated"):
        read_safetensors_header(p)


def test_fused_expert_checkpoint_loads(tmp_path):
    """Experts stored fused per layer ([E, 2I, H] gate_up, [E, H, I] down), as transformers holds
    them in memory and some releases ship them: same logits as the per-expert checkpoint."""
    import torch
    from safetensors.torch import save_file

    import engine
    from conftest import hf_reference, rel_err
    model = build_hf_model(tmp_path / "per", "qwen3_moe")
    fused = tmp_path / "fused"
    fused.mkdir()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file(sd, str(fused / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / f).write_bytes((tmp_path / "per" / f).read_bytes())
    ck = Checkpoint(fused)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in ck.fused
    ids = np.random.default_rng().integers(0, 300, 12)
    ref = hf_reference(tmp_path / "per")
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(engine.load(fused, device="cpu").logits(ids), want) < 1e-4
    from engine.pack import pack
    pack(fused, tmp_path / "packed_fused", "bf16", progress=False)
    pack(tmp_path / "per", tmp_path / "packed_per", "bf16", progress=False)
    a = (tmp_path / "packed_fused" / "experts.arena").read_bytes()
    assert a == (tmp_path / "packed_per" / "experts.arena").read_bytes()
