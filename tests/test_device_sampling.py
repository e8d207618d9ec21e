"""Decode tokens sampled on the device equal the host sampler's on the same logits and draw
(greedy, temperature, top-k, top-p), and a seeded stream equals the host path's, plain and
pipelined: the cuda decoder without graphs under numba's CUDA simulator, in a subprocess
(tests/sim/device_sampling_check.py)."""
import os
import subprocess
import sys
from pathlib import Path

from conftest import build_hf_model


def test_device_sampling_matches_host_under_simulator(tmp_path):
    # one layer and a 64-token vocabulary: the simulator runs each block's threads in Python
    build_hf_model(tmp_path, "qwen3_moe", seed=3, num_hidden_layers=1, vocab_size=64,
                   hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                   moe_intermediate_size=8, intermediate_size=16)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "sim" / "device_sampling_check.py"),
                        str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
