"""The generate CLI as a user runs it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import build_hf_model, hf_greedy, hf_reference
from engine import runtime
from engine.models import FAMILIES

CPU_ONLY = sorted(set(FAMILIES) - set(runtime.GPU_FAMILIES))


@pytest.mark.parametrize("family", CPU_ONLY)
def test_cpu_only_family_refused_on_cuda(family, capsys, monkeypatch):
    """A family without a cuda decoder: --device cuda says so by name, auto runs it on the CPU
    saying why, with a GPU that works."""
    monkeypatch.setattr(runtime, "cuda_status", lambda: (True, ""))
    with pytest.raises(RuntimeError, match=f"--device cuda: the cuda backend does not run {family} yet"):
        runtime.pick_device("cuda", family)
    assert runtime.pick_device("auto", family) == "cpu"
    assert f"device auto: using cpu (the cuda backend does not run {family} yet)" in capsys.readouterr().err


def test_readme_names_the_cpu_only_families():
    """The README's sentence on the backends names exactly the families without a cuda decoder."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("Every family but"))
    named = re.findall(r"`([a-z0-9_]+)`", line.split("runs on both backends")[0])
    assert sorted(named) == CPU_ONLY


def test_cli_json_greedy_matches_transformers(tmp_path):
    build_hf_model(tmp_path, "qwen3_moe")
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--model", str(tmp_path),
                        "--prompt-ids", "1,2,3", "--max-new-tokens", "16", "--temperature", "0",
                        "--json", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"prompt_ids", "output_ids", "text", "stats"}
    want = hf_greedy(hf_reference(tmp_path), [1, 2, 3], 16)
    assert out["prompt_ids"] == [1, 2, 3]
    assert out["output_ids"] == want
    assert out["stats"]["decode_tok_s"] > 0


def test_cli_streams_text_and_stops_at_eos(tmp_path):
    build_hf_model(tmp_path, "mixtral")
    first = hf_greedy(hf_reference(tmp_path), [5, 6, 7], 4)
    # make the third greedy token the EOS id: generation must stop at its first occurrence
    eos = first[2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--model", str(tmp_path),
                        "--prompt-ids", "5,6,7", "--max-new-tokens", "20", "--device", "cpu", "--json"],
                       capture_output=True, text=True, timeout=300)
    out = json.loads(r.stdout)
    assert out["output_ids"] == first[:first.index(eos) + 1]
    assert out["finish_reason"] == "stop"
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--model", str(tmp_path),
                        "--prompt", "hi", "--max-new-tokens", "5", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "decode:" in r.stderr and "tok/s" in r.stderr


def test_demo_model_runs_without_model_flag(tmp_path):
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--max-new-tokens", "8", "--json",
                        "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "demo model" in r.stderr
    assert len(json.loads(r.stdout)["output_ids"]) == 8


def test_cli_bf16_kv_cache_and_state_bytes(tmp_path):
    """--kv-cache is accepted (f32, bf16) and checked; the JSON stats carry the KV bytes a
    decode token read."""
    build_hf_model(tmp_path, "qwen3_moe")
    outs = {}
    for kind in ("f32", "bf16"):
        r = subprocess.run([sys.executable, "-m", "engine.generate", "--model", str(tmp_path),
                            "--prompt-ids", "1,2,3,4", "--max-new-tokens", "6", "--temperature", "0",
                            "--json", "--device", "cpu", "--kv-cache", kind],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        outs[kind] = json.loads(r.stdout)["stats"]["decode_per_token"]
    # 5 decode tokens at positions 4..8 read 5..9 rows of K and V: 2 layers, 2 kv heads x 16
    rows = sum(range(5, 10)) / 5
    assert outs["f32"]["state_bytes"] == 2 * 2 * 32 * 4 * rows
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--model", str(tmp_path),
                        "--prompt-ids", "1", "--kv-cache", "fp8", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--kv-cache" in r.stderr
