"""moe-stream engine: load a MoE checkpoint and generate from it."""
from __future__ import annotations


def load(model, device: str = "auto", **kw):
    """Load a model folder (or a repo id in the local Hugging Face cache): see engine.runtime."""
    from engine.runtime import load as _load
    return _load(model, device=device, **kw)
