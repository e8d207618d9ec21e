"""Command-line pieces shared by engine.generate and engine.serve: the model and budget flags,
and loading from them."""
from __future__ import annotations

import argparse

from engine.affinity import parse_cores, parse_decode_core
from engine.runtime import KV_CACHE_KINDS


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder or repo id in the local HF cache "
                                   "(default: the embedded demo model)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--max-context", type=int, default=None,
                   help="KV cache length in tokens: prompt + completion (default min(model's, 4096))")
    p.add_argument("--kv-cache", choices=KV_CACHE_KINDS, default="f32",
                   help="KV cache values: float32, or bfloat16 (half the cache's VRAM on cuda; "
                        "K and V rounded as they are stored)")
    p.add_argument("--ram-gb", type=float, default=None,
                   help="host-RAM expert cache budget for packed models (default: fits the arena, "
                        "at most half the available RAM), and for experts an unpacked FP8 / NVFP4 / "
                        "MXFP4 checkpoint builds on read (default: a quarter of it)")
    p.add_argument("--vram-gb", type=float, default=None,
                   help="GPU memory budget (default: 90%% of what is free)")
    p.add_argument("--hot-from", metavar="FILE", help="fill the VRAM hot set from a routing profile")
    p.add_argument("--prefill-batch", type=int, default=32, help="experts fetched per prefill batch")
    p.add_argument("--speculate", action="store_true",
                   help="run the next layer's router on this layer's input and start its copies early")
    p.add_argument("--cache-policy", choices=("lru", "lfu", "decay"), default="lru")
    p.add_argument("--reader-threads", type=int, default=4)
    p.add_argument("--decode-core", type=_arg(parse_decode_core), default="auto", metavar="N",
                   help="pin the generating thread to core N while it generates; 'none' or -1: "
                        "unpinned (default auto: the last allowed core on cuda, unpinned on cpu)")
    p.add_argument("--reader-cores", type=_arg(parse_cores), default=None, metavar="LIST",
                   help="cores the arena reader threads run on, like 0-6,8 (default: the allowed "
                        "cores but the decode core; the only one when just one is allowed)")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    """For the commands that resume prompts from earlier run states (serve, chat)."""
    p.add_argument("--prefix-cache-gb", type=float, default=1.0, metavar="GB",
                   help="host RAM for copies of earlier run states that a later prompt may "
                        "resume from, e.g. a chat's state while a UI's title request ran "
                        "(default 1; 0: the last request's state only)")


def check_prefix_args(p: argparse.ArgumentParser, a) -> None:
    if a.prefix_cache_gb < 0:
        p.error("--prefix-cache-gb must be >= 0")


def _arg(parse):
    """An argparse type from a parser that raises ValueError: the message names the flag already,
    argparse prefixes 'argument --flag:', so keep what follows the flag."""
    def conv(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).split(" ", 1)[1]) from None
    conv.__name__ = parse.__name__
    return conv


def model_dir(a):
    """--model, or the embedded demo model."""
    if a.model is not None:
        return a.model
    from engine.demo import demo_model_dir
    return demo_model_dir()


def load_from_args(a):
    import engine
    return engine.load(model_dir(a), device=a.device, max_context=a.max_context, ram_gb=a.ram_gb,
                       cache_policy=a.cache_policy, reader_threads=a.reader_threads,
                       vram_gb=a.vram_gb, hot_from=a.hot_from, prefill_batch=a.prefill_batch,
                       speculate=a.speculate, decode_core=a.decode_core, reader_cores=a.reader_cores,
                       kv_cache=a.kv_cache, prefix_cache_gb=getattr(a, "prefix_cache_gb", 1.0))
