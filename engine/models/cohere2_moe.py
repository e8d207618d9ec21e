"""Cohere's MoE (cohere2_moe: Command A+). CPU backend.

What differs from the llama-like decoder (engine/models/base.py):
- parallel residual: x + attention(n(x)) + mlp(n(x)), one norm a layer (input_layernorm): an
  RMSNorm where rms_norm_eps is set, else a LayerNorm without bias (layer_norm_eps);
- RoPE over interleaved pairs, only in sliding-window layers and the dense prefix layers when
  prefix_dense_sliding_window_pattern is 1 (force_rope); the other full layers rotate nothing;
- routing: the top-k logits, then their softmax (or their sigmoids, normalized when
  norm_topk_prob); experts of intermediate_size; shared experts (num_shared_experts times as
  wide) summed with the routed output or averaged with it (shared_expert_combination_strategy);
  dense prefix layers of prefix_dense_intermediate_size (first_k_dense_replace / mlp_layer_types);
- the logits times logit_scale; the embeddings tied by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, layer_list, need
from engine.models.rope import ConfigError
from engine.names import name

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Cohere2MoeConfig(MoeConfig):
    layer_norm: bool = False        # a LayerNorm without bias (else an RMSNorm)
    average_shared: bool = False    # (routed + shared) / 2, else their sum
    sigmoid_router: bool = False
    logit_scale: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict) -> "Cohere2MoeConfig":
        cfg = dict(cfg)
        cfg.setdefault("tie_word_embeddings", True)
        rms = cfg.get("rms_norm_eps")
        n = int(need(cfg, "num_hidden_layers"))
        first = int(cfg.get("first_k_dense_replace") or 0)
        window = cfg.get("sliding_window", 4096)
        pattern, prefix_pattern = int(cfg.get("sliding_window_pattern", 4)), \
            int(cfg.get("prefix_dense_sliding_window_pattern", 1))
        if min(pattern, prefix_pattern) < 1:
            raise ConfigError(f"config.json: sliding_window_pattern {pattern} and prefix_dense_sliding_"
                              f"window_pattern {prefix_pattern} must be at least 1")
        types = cfg.get("layer_types") or (
            [SLIDING if (i + 1) % prefix_pattern else FULL for i in range(first)]
            + [SLIDING if (i + 1) % pattern else FULL for i in range(n - first)])
        mlp = cfg.get("mlp_layer_types") or ["dense" if i < first else "sparse" for i in range(n)]
        types = layer_list("layer_types", types, n, (SLIDING, FULL))
        mlp = layer_list("mlp_layer_types", mlp, n, ("dense", "sparse"))
        if SLIDING in types and not window:
            raise ConfigError(f"config.json: layer_types has {SLIDING} layers but sliding_window is {window!r}")
        strategy = cfg.get("shared_expert_combination_strategy", "average")
        select = cfg.get("expert_selection_fn", "softmax")
        if strategy not in ("sum", "average") or select not in ("softmax", "sigmoid"):
            raise ConfigError(f"config.json: shared_expert_combination_strategy {strategy!r} (expected sum or "
                              f"average) / expert_selection_fn {select!r} (expected softmax or sigmoid)")
        f = MoeConfig.common_hf({**cfg, "rms_norm_eps": rms if rms is not None else cfg.get("layer_norm_eps", 1e-5)})
        force = prefix_pattern == 1
        inter = int(need(cfg, "intermediate_size"))
        f.update(moe_layers=tuple(l for l, t in enumerate(mlp) if t == "sparse"), rope_pairs=True,
                 shared_intermediate=inter * int(cfg.get("num_shared_experts") or 0),
                 dense_intermediate=int(cfg.get("prefix_dense_intermediate_size") or inter),
                 layer_windows=tuple(int(window) if t == SLIDING else 0 for t in types),
                 nope_layers=tuple(l for l, t in enumerate(types)
                                   if t == FULL and not (mlp[l] == "dense" and force)))
        return cls(**f, moe_intermediate=inter, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   layer_norm=rms is None, average_shared=strategy == "average",
                   sigmoid_router=select == "sigmoid", logit_scale=float(cfg.get("logit_scale", 0.0625)))


def dense_spec(c: Cohere2MoeConfig) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    for l in range(c.n_layers):   # one norm a layer
        del spec[name(c.family, "mlp_norm", l)]
    return spec


expert_spec = base.expert_spec


class Cohere2MoeDecoder(MoeDecoder):
    def norm(self, x, w):
        c = self.c
        if not c.layer_norm:
            return self.ops.rmsnorm(x, w, c.rms_eps)
        return self.ops.layernorm(x, w, c.rms_eps)

    def layer(self, l: int, x, pos: np.ndarray, st) -> None:
        """The parallel residual: x += attention(h) + mlp(h), h = attn_norm(x)."""
        h = self.norm(x, self.w("attn_norm", l))
        a = self.attention(l, h, pos, st)
        self.ops.add_(a, self.mlp(l, h))
        self.ops.add_(x, a)

    def head(self, x):
        c, w = self.c, self.w
        logits = self.ops.linear(self.norm(x, w("final_norm")), w("embed") if c.tie_embeddings else w("lm_head"))
        return logits * np.float32(c.logit_scale)
    def route(self, l: int, h):
        c = self.c
        if not c.sigmoid_router:   # softmax of the top-k logits: the softmax of all, its top k renormalized
            return self.ops.router(self.ops.linear(h, self.w("router", l)), c.top_k, True)
        logits = self.ops.linear(h, self.w("router", l))
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :c.top_k]
        wt = np.float32(1) / (np.float32(1) + np.exp(-np.take_along_axis(logits, ids, -1)))
        if c.norm_topk_prob:
            wt = wt / wt.sum(-1, keepdims=True)
        return ids, wt.astype(np.float32)

    def moe(self, l: int, h):
        out = super().moe(l, h)   # routed + shared
        return out * np.float32(0.5) if self.c.shared_intermediate and self.c.average_shared else out


Model = Cohere2MoeDecoder
Config = Cohere2MoeConfig
