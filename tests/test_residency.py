"""The VRAM tier's resolution logic (hits, host reads batched per layer, LRU eviction,
protection, hot set, speculation counts), run under numba's CUDA simulator in a subprocess."""
import os
import subprocess
import sys
from pathlib import Path


def test_vram_tier_logic_under_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "sim" / "residency_check.py")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
