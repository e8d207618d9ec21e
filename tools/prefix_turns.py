"""A chat's second turn with a title request before it, with and without saved state copies.

    python3 tools/prefix_turns.py MODEL [--device cuda] [--vram-gb 40] [--prompt-len 2048]

Turn 1: a random prompt of --prompt-len ids, 16 ids generated. Then a 48-id "title" prompt
that shares nothing with it (it takes the live run state). Turn 2: turn 1's prompt, its reply
and 64 new ids. Printed as JSON: each turn's prefill seconds and resumed ids, with the copies
(--prefix-cache-gb, default 1) and without them (budget 0: turn 2 prefilled whole).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--device", default="auto")
    p.add_argument("--vram-gb", type=float, default=None)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--prefix-cache-gb", type=float, default=1.0)
    a = p.parse_args()
    m = engine.load(a.model, device=a.device, vram_gb=a.vram_gb, prefix_cache=True,
                    max_context=a.prompt_len + 256, prefix_cache_gb=a.prefix_cache_gb)
    rng = np.random.default_rng(0)
    v = m.config.vocab_size
    p1 = rng.integers(0, v, a.prompt_len).tolist()
    title = rng.integers(0, v, 48).tolist()
    m.generate(p1[:32], max_new_tokens=4)   # compile / capture first
    out = {}
    for budget in (m.saved.budget, 0):
        m.release_state()
        m.saved.budget = budget
        r1 = m.generate(p1, max_new_tokens=16)
        t0 = time.perf_counter()
        m.generate(title, max_new_tokens=4)   # (saves turn 1's state first, when it may)
        title_s = time.perf_counter() - t0
        p2 = p1 + r1.output_ids[:15] + rng.integers(0, v, 64).tolist()
        t0 = time.perf_counter()
        r2 = m.generate(p2, max_new_tokens=1)
        wall = time.perf_counter() - t0
        out[f"copies {budget / 1e9:g} GB"] = {
            "turn1_prefill_s": round(r1.stats["prefill_s"], 4),
            "title_wall_s": round(title_s, 4), "turn2_prompt": len(p2), "turn2_resumed": r2.stats["prefill_cached_tokens"],
            "turn2_from": r2.stats["prefill_cached_from"],
            "turn2_prefill_s": round(r2.stats["prefill_s"], 4), "turn2_wall_s": round(wall, 4),
            "saved_bytes": m.saved.nbytes}
    print(json.dumps({"model": str(a.model), "device": m.device, **out}, indent=1))


if __name__ == "__main__":
    main()
