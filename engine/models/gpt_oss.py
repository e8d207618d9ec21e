"""gpt-oss (gpt-oss-20b, gpt-oss-120b): q/k/v/o biases, learned attention sinks, sliding and full
attention layers (layer_types), a biased router (softmax over the top-k logits), experts with
biases and a clamped SwiGLU. Both backends run it (cuda: engine/gpu.py clamped())."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, need
from engine.models.rope import ConfigError
from engine.names import name

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssConfig(MoeConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf(cls, cfg: dict) -> "GptOssConfig":
        cfg = dict(cfg)
        # transformers' GptOssConfig defaults, where config.json leaves them out
        if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
            cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False,
                                      "original_max_position_embeddings": 4096}
        if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
            cfg["rope_theta"] = 150000.0
        cfg.setdefault("head_dim", 64)          # not hidden / heads (2880 / 64 = 45)
        cfg.setdefault("sliding_window", 128)
        f = MoeConfig.common_hf(cfg)
        f["rms_eps"] = float(cfg.get("rms_norm_eps") or 1e-5)
        f["attention_bias"] = bool(cfg.get("attention_bias", True))
        n = f["n_layers"]
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(n)]
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"config.json: layer_types must list {n} of {', '.join(LAYER_TYPES)}; "
                              f"got {types}")
        window = int(cfg.get("sliding_window") or 0)
        if window <= 0 and "sliding_attention" in types:
            raise ConfigError("config.json: layer_types has sliding_attention layers but "
                              f"sliding_window is {cfg.get('sliding_window')!r}")
        return cls(**f, moe_intermediate=int(need(cfg, "intermediate_size")), norm_topk_prob=True,
                   layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                   swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
                   swiglu_limit=float(cfg.get("swiglu_limit") or 7.0))


def dense_spec(c: GptOssConfig) -> dict[str, tuple]:
    f, h = c.family, c.hidden
    spec = base.dense_spec(c)
    for l in range(c.n_layers):
        spec[name(f, "sinks", l)] = (c.n_heads,)
        spec[name(f, "router_bias", l)] = (c.n_experts,)
        if c.attention_bias:
            spec[name(f, "o_bias", l)] = (h,)
        for e in range(c.n_experts):
            spec[name(f, "expert_gate_bias", l, e)] = (c.moe_intermediate,)
            spec[name(f, "expert_up_bias", l, e)] = (c.moe_intermediate,)
            spec[name(f, "expert_down_bias", l, e)] = (h,)
    return spec


class GptOssDecoder(MoeDecoder):
    def sinks(self, l: int):
        return self.w("sinks", l)

    def attention(self, l: int, h, pos: np.ndarray, st):
        o = super().attention(l, h, pos, st)
        if self.c.attention_bias:
            self.ops.add_(o, self.w("o_bias", l))
        return o

    def route(self, l: int, h):
        c, ops, w = self.c, self.ops, self.w
        logits = ops.linear(h, w("router", l))
        ops.add_(logits, w("router_bias", l))
        # softmax over the k largest logits = the softmax over all, its top k renormalized
        return ops.router(logits, c.top_k, True)

    def routed_expert(self, l: int, e: int, x, we):
        c, w = self.c, self.w
        b = tuple(w(k, l, e) for k in ("expert_gate_bias", "expert_up_bias", "expert_down_bias"))
        return self.ops.expert_clamped(x, we, b, c.swiglu_alpha, c.swiglu_limit)


expert_spec = base.expert_spec   # gate, up, down per expert: the checkpoint's per-expert copies
Model = GptOssDecoder
Config = GptOssConfig
