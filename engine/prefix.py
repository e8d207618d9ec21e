"""Saved run states for prompt prefix reuse (Engine(prefix_cache=True)).

The engine resumes a prompt from the live run state when the prompt begins with the ids that
state holds. One live state is not enough for a chat UI: Open WebUI sends a title, tags or
follow-up request (another prompt) between a chat's turns, and that request takes the state.
So before a prompt overwrites what the live state holds, a host copy of it is kept here, up to
a byte budget, least recently used first out; a later prompt resumes from whichever copy (or
the live state) shares the most ids with it.

A KV cache can go back to any position it holds, so a copy serves any prompt that shares a
prefix with its ids. A recurrent state (Qwen3-Next / Qwen3.5 DeltaNet layers) holds exactly
the positions up to its end: a copy serves only a prompt that extends all of its ids. For those
models the engine also keeps the state at the end of each prompt, so a next turn whose history
differs from what was generated (a chat template that drops the reasoning of earlier turns)
still resumes at the end of the last prompt; that copy keeps the prompt's last logits too, so the
same prompt sent again (a retry, a UI's "regenerate") starts decoding at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def shared(a, b, n: int) -> int:
    """How many leading ids a and b share, at most n."""
    n = min(len(a), len(b), n)
    if n <= 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def usable(ids, prompt, n: int, rewinds: bool) -> int:
    """Positions of a state holding ids that a prompt can start from (n: at most this many,
    all but the prompt's last id): the shared prefix, or for a state that cannot go back all of
    ids or nothing."""
    k = shared(ids, prompt, n)
    return k if rewinds or k == len(ids) else 0


def nbytes(arrays) -> int:
    if isinstance(arrays, dict):
        return sum(nbytes(a) for a in arrays.values())
    if isinstance(arrays, (list, tuple)):
        return sum(nbytes(a) for a in arrays)
    return int(arrays.nbytes)


@dataclass
class Saved:
    ids: list
    arrays: dict     # the state's host copy: the model's save_state()
    nbytes: int
    logits: np.ndarray | None = None   # f32 [V] of its last position, where kept: then the same
                                       # prompt again (a retry, "regenerate") needs no prefill


class PrefixStore:
    """Host copies of run states, most recently used last, within budget bytes."""

    def __init__(self, budget: int, rewinds: bool):
        self.budget, self.rewinds = int(budget), rewinds
        self.items: list[Saved] = []

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.items)

    def best(self, prompt, n: int) -> tuple[Saved | None, int]:
        """The copy a prompt can start furthest into, and how far (0: none): at most n ids, or
        all of the prompt where a copy holds exactly it and its last logits."""
        best, keep = None, 0
        for s in self.items:
            k = len(s.ids) if s.logits is not None and s.ids == list(prompt) else \
                usable(s.ids, prompt, n, self.rewinds)
            if k > keep:
                best, keep = s, k
        return best, keep

    def covers(self, ids) -> bool:
        """Whether a copy already serves every prompt a state holding ids would."""
        return any(s.ids == ids or (self.rewinds and shared(s.ids, ids, len(ids)) == len(ids))
                   for s in self.items)

    def add(self, ids, arrays, logits=None) -> bool:
        """Keep a copy of a state holding ids (False: larger than the whole budget), with the
        logits of its last position if given. Copies it makes redundant go (with a KV cache,
        those whose ids it begins with), then the least recently used until it fits."""
        s = Saved(list(ids), arrays, nbytes(arrays) + (0 if logits is None else logits.nbytes),
                  None if logits is None else np.array(logits, dtype=np.float32))
        if s.nbytes > self.budget:
            return False
        self.items = [o for o in self.items
                      if not (o.ids == s.ids or (self.rewinds and
                                                 shared(o.ids, s.ids, len(o.ids)) == len(o.ids)))]
        while self.items and self.nbytes + s.nbytes > self.budget:
            self.items.pop(0)
        self.items.append(s)
        return True

    def touch(self, s: Saved) -> None:
        self.items.remove(s)
        self.items.append(s)

    def clear(self) -> None:
        self.items = []
