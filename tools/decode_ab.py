"""Decode tokens/s with a kernel module's boolean switch on and off, in one process (GPU machine).

    python3 tools/decode_ab.py MODEL --flag kernels_numba.gpu_dense.LIN_PREFETCH [--vram-gb 40]
        [--tokens 128] [--prompt-len 2048] [--rounds 3] [--out F.json] [--set module.ATTR=INT ...]

The model loads once; each round decodes the same sampled continuation of one random prompt
with the switch True, then False (the order alternates round to round, so drift in the
machine's clocks falls on both). A switch that kernels read when they compile must be part of
their cache key (as LIN_PREFETCH is), so flipping it compiles the other variant; the decode
graphs are dropped at each flip and recaptured by a short warm-up outside the timing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--flag", required=True, help="module.ATTR, a module-level bool")
    ap.add_argument("--vram-gb", type=float, default=40)
    ap.add_argument("--ram-gb", type=float, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--set", action="append", default=[], metavar="module.ATTR=INT",
                    help="a module-level int set before loading (both arms), e.g. a kernel's tile")
    a = ap.parse_args(argv)
    import engine
    for kv in a.set:
        name, _, value = kv.partition("=")
        m_name, m_attr = name.rsplit(".", 1)
        m_mod = importlib.import_module(m_name)
        if not isinstance(getattr(m_mod, m_attr, None), int) or not value.lstrip("-").isdigit():
            raise SystemExit(f"--set {kv}: expected module.ATTR=INT for a module-level int")
        setattr(m_mod, m_attr, int(value))
    mod_name, attr = a.flag.rsplit(".", 1)
    mod = importlib.import_module(mod_name)
    if not isinstance(getattr(mod, attr), bool):
        raise SystemExit(f"{a.flag} is not a module-level bool")
    m = engine.load(a.model, device="cuda", vram_gb=a.vram_gb, ram_gb=a.ram_gb,
                    max_context=a.prompt_len + a.tokens + 8)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, m.config.vocab_size, a.prompt_len).tolist()
    runs = {True: [], False: []}
    for r in range(a.rounds):
        for value in ((True, False) if r % 2 == 0 else (False, True)):
            setattr(mod, attr, value)
            m.gpu._drop_graphs()
            m.generate(prompt[:16], max_new_tokens=3, temperature=1.0, seed=1)   # compile, capture
            s = m.generate(prompt, max_new_tokens=a.tokens, temperature=1.0, seed=0).stats
            runs[value].append({"decode_tok_s": s["decode_tok_s"], "prefill_tok_s": s["prefill_tok_s"]})
            print(f"round {r} {attr}={value}: decode {s['decode_tok_s']:.1f} tok/s, "
                  f"prefill {s['prefill_tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    med = {v: float(np.median([x["decode_tok_s"] for x in runs[v]])) for v in runs}
    print(f"{a.flag}: decode median {med[True]:.1f} tok/s on, {med[False]:.1f} off "
          f"({med[True] / med[False]:.3f}x)", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps({"flag": a.flag, "runs": {str(k): v for k, v in runs.items()},
                                           "median_decode_tok_s": {str(k): v for k, v in med.items()},
                                           "args": vars(a)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
