"""python -m engine.generate: text generation in the terminal.

Text streams to stdout as it is produced; the summary (prefill and decode tokens/s) goes to
stderr at the end; --json prints one JSON object instead. Bad input exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from loader.checkpoint import CheckpointError


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder or repo id in the local HF cache "
                                   "(default: the embedded demo model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--max-context", type=int, default=None, help="KV cache length in tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
        p.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import engine
    from engine.models.rope import ConfigError
    from engine.tokenizer import TemplateError
    try:
        if a.model is None:
            from engine.demo import demo_model_dir
            model_dir = demo_model_dir()
        else:
            model_dir = a.model
        m = engine.load(model_dir, device=a.device, max_context=a.max_context)
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
    if a.json:
        print(json.dumps({"prompt_ids": res.prompt_ids, "output_ids": res.output_ids, "text": res.text,
                          "finish_reason": res.finish_reason, "stats": s}))
    else:
        sys.stdout.write("\n")
        print(f"prefill: {s['prefill_tokens']} tokens at {s['prefill_tok_s']:.1f} tok/s | "
              f"decode: {s['decode_tokens']} tokens at {s['decode_tok_s']:.2f} tok/s | "
              f"device {m.device} | finish: {res.finish_reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
