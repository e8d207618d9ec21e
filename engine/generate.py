"""python -m engine.generate: text generation in the terminal.

Text streams to stdout as it is produced; the summary (prefill and decode tokens/s) goes to
stderr at the end; --json prints one JSON object instead. Bad input exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from engine.cli import add_load_args, load_from_args
from loader.checkpoint import CheckpointError


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__.splitlines()[0])
    add_load_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--trace-out", metavar="FILE", help="record the routed experts per token and layer")
    p.add_argument("--profile-out", metavar="FILE", help="record routed counts per (layer, expert)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
        p.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    return a


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def main(argv=None) -> int:
    a = parse_args(argv)
    from engine.models.rope import ConfigError
    from engine.tokenizer import TemplateError
    try:
        from engine.runtime import TraceRecorder
        m = load_from_args(a)
        from engine.profile import Observers, RoutingProfile
        rec = TraceRecorder(m.config.moe_layers) if a.trace_out else None
        prof = RoutingProfile(m.config.n_layers, m.config.n_experts) if a.profile_out else None
        if rec or prof:
            m.model.on_route = Observers(rec, prof)
        if a.prompt_ids is not None:
            try:
                ids = [int(x) for x in a.prompt_ids.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"--prompt-ids: expected comma-separated integers, got {a.prompt_ids!r}")
        else:
            ids = m.encode(a.prompt if a.prompt is not None else "def ", chat=a.chat)
        stream = None if a.json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        res = m.generate(ids, a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed, on_text=stream)
    except (CheckpointError, ConfigError, TemplateError, ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = res.stats
    if a.trace_out:
        from engine.trace import save_trace
        save_trace(a.trace_out, rec.array(), {"model": str(m.dir), "top_k": m.config.top_k,
                                              "n_experts": m.config.n_experts,
                                              "moe_layers": list(m.config.moe_layers),
                                              "block_bytes": getattr(m.experts, "block_bytes", 0)})
    if a.profile_out:
        prof.save(a.profile_out)
    if a.json:
        print(json.dumps({"prompt_ids": res.prompt_ids, "output_ids": res.output_ids, "text": res.text,
                          "finish_reason": res.finish_reason, "stats": s}))
    else:
        sys.stdout.write("\n")
        cached = s.get("prefill_cached_tokens", 0)
        print(f"prefill: {s['prefill_tokens']} tokens{f' ({cached} resumed)' if cached else ''} "
              f"at {s['prefill_tok_s']:.1f} tok/s | "
              f"decode: {s['decode_tokens']} tokens at {s['decode_tok_s']:.2f} tok/s | "
              f"device {m.device} | finish: {res.finish_reason}", file=sys.stderr)
        jit = (s.get("prefill_compile_s", 0.0), s.get("decode_compile_s", 0.0))
        if sum(jit) >= 0.5:   # a first run: the rates above include compiling the kernels
            print(f"first run: {jit[0]:.1f} s of the prefill and {jit[1]:.1f} s of the decode went to "
                  f"compiling the CPU kernels (cached on disk: later runs skip it)", file=sys.stderr)
        print(m.cores.describe(), file=sys.stderr)
        ex = s.get("experts", {})
        if ex.get("source") == "arena":
            print(f"experts ({ex['format']}): RAM cache hit rate {ex.get('hit_rate', 0):.1%} "
                  f"({ex.get('hits', 0)} hits, {ex.get('misses', 0)} misses, "
                  f"{ex.get('evictions', 0)} evictions) | read {_size(ex.get('bytes_read', 0))} "
                  f"at {ex.get('read_gbps', 0):.2f} GB/s | budget {_size(ex['ram_budget_bytes'])}",
                  file=sys.stderr)
        vr, pt = s.get("vram"), s.get("decode_per_token")
        if vr and pt:
            spec = ("" if vr.get("spec_accuracy") is None else
                    f" | speculative accuracy {vr['spec_accuracy']:.0%}, "
                    f"{_size(vr['spec_wasted_bytes'])} wasted")
            print(f"experts by tier: VRAM {vr['vram_hit_rate']:.1%}, RAM {vr['ram_hit_rate']:.1%}, "
                  f"disk {vr['disk_rate']:.1%} | per decode token: H2D {_size(pt['h2d_bytes'])}, "
                  f"disk {_size(pt['disk_bytes'])}; compute {1e3 * pt['compute_s']:.1f} ms, "
                  f"waiting on H2D {1e3 * pt['wait_h2d_s']:.1f} ms, on the host tier "
                  f"{1e3 * pt['wait_host_s']:.1f} ms{spec}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
