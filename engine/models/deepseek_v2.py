"""DeepSeek-V2 (DeepSeek-V2, V2-Lite, V2.5, Coder-V2): DeepSeek-V3's multi-head latent attention
(engine/models/deepseek_v3.py) with softmax routing: the top-k of all experts (topk_method
greedy), or of the topk_group groups whose best expert scores highest (group_limited_greedy);
the weights are the softmax probabilities times routed_scaling_factor, not renormalized (as in
the reference: its router never reads norm_topk_prob)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models.deepseek_v3 import DeepseekV3Config, DeepseekV3Decoder, dense_spec, expert_spec  # noqa: F401
from engine.models.rope import ConfigError

METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekV2Config(DeepseekV3Config):
    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekV2Config":
        cfg = dict(cfg)
        method = cfg.pop("topk_method", None) or "greedy"
        if cfg.pop("scoring_func", None) not in (None, "softmax"):
            raise ConfigError("config.json: scoring_func must be 'softmax' for deepseek_v2")
        if method not in METHODS:
            raise ConfigError(f"config.json: topk_method {method!r} is not supported; "
                              f"supported: {', '.join(METHODS)}")
        if method == "greedy":
            cfg.update(n_group=1, topk_group=1)
        cfg.setdefault("first_k_dense_replace", 0)     # the reference's defaults
        cfg.setdefault("n_shared_experts", 2)
        c = DeepseekV3Config.from_hf(cfg)
        return cls(**{**c.__dict__, "routing": "softmax", "norm_topk_prob": False,
                      "routed_scale": float(cfg.get("routed_scaling_factor") or 1.0)})


class DeepseekV2Decoder(DeepseekV3Decoder):
    def route(self, l: int, h):
        c, ops = self.c, self.ops
        logits = ops.linear(h, self.w("router", l))
        if c.n_group == 1:
            ids, w = ops.router(logits, c.top_k, False)
        else:   # the float32 softmax, groups ranked by their best expert, the rest zeroed
            p = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float32)
            p /= p.sum(axis=1, keepdims=True)
            best = p.reshape(len(p), c.n_group, -1).max(axis=2)
            groups = np.argsort(-best, axis=1, kind="stable")[:, :c.topk_group]
            keep = np.zeros_like(best, dtype=bool)
            np.put_along_axis(keep, groups, True, axis=1)
            p = np.where(np.repeat(keep, c.n_experts // c.n_group, axis=1), p, np.float32(0))
            ids = np.argsort(-p, axis=1, kind="stable")[:, :c.top_k].astype(np.int32)
            w = np.take_along_axis(p, ids, axis=1)
        return ids, (w * np.float32(c.routed_scale)).astype(np.float32)


Model = DeepseekV2Decoder
Config = DeepseekV2Config
