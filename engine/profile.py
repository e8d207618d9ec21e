"""Routing profiles: how often each (layer, expert) was routed, and the hot set they imply.

    python -m engine.generate ... --profile-out prof.json     # record
    python -m engine.generate ... --hot-from prof.json        # fill the VRAM hot set by rank
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class ProfileError(ValueError):
    """A profile file is malformed or belongs to another model shape."""


class RoutingProfile:
    """counts int64 [L, E]: routed-token counts per (layer, expert)."""

    def __init__(self, n_layers: int, n_experts: int, counts: np.ndarray | None = None):
        self.counts = np.zeros((n_layers, n_experts), np.int64) if counts is None else counts

    def __call__(self, layer: int, ids) -> None:
        """ids: the layer's routed expert ids (any shape); -1, a slot that reads no expert (a
        LongCat-Flash zero expert), is not counted."""
        ids = np.asarray(ids).reshape(-1)
        np.add.at(self.counts[layer], ids[ids >= 0], 1)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"kind": "moe-stream routing profile", "version": 1,
                                          "shape": list(self.counts.shape),
                                          "counts": self.counts.tolist()}))

    @classmethod
    def load(cls, path, n_layers: int, n_experts: int) -> "RoutingProfile":
        try:
            d = json.loads(Path(path).read_text())
            counts = np.asarray(d["counts"], dtype=np.int64)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{path}: not a routing profile ({e})") from None
        if counts.shape != (n_layers, n_experts):
            raise ProfileError(f"{path}: profile is for {counts.shape[0]} layers x {counts.shape[1]} "
                               f"experts, this model has {n_layers} x {n_experts}")
        return cls(n_layers, n_experts, counts)

    def ranked(self, layers=None) -> list[tuple[int, int]]:
        """(layer, expert) by descending count (ties by layer, expert); zero counts excluded."""
        layers = range(self.counts.shape[0]) if layers is None else layers
        keys = [(-int(self.counts[l, e]), l, e) for l in layers for e in range(self.counts.shape[1])
                if self.counts[l, e] > 0]
        return [(l, e) for _, l, e in sorted(keys)]

    def hot_set(self, n: int, layers=None) -> list[tuple[int, int]]:
        return self.ranked(layers)[:n]


class Observers:
    """Fans one on_route call out to several observers (trace, profile, ...)."""

    def __init__(self, *obs):
        self.obs = [o for o in obs if o is not None]

    def __call__(self, layer, ids):
        for o in self.obs:
            o(layer, ids)
