"""IBM Granite MoE: granitemoe (granite-3.0 / 3.1 -1b-a400m, -3b-a800m), granitemoeshared (the
same with a shared expert beside the routed ones) and granitemoe_swa (sliding-window layers with
attention sinks beside full ones). CPU backend here; cuda: engine/gpu_granitemoe.py.

Mixtral's layer (RMSNorms before attention and the MoE, q / k / v / o biases where
attention_bias) with Granite's multipliers:
- the embeddings times embedding_multiplier;
- the attention scores times attention_multiplier, in place of head_dim ** -0.5;
- each branch's output (attention after o_proj; the routed experts plus the shared expert) times
  residual_multiplier before its residual add;
- the logits divided by logits_scaling.
Routing: the top-k logits, a softmax over those k (the softmax over all experts renormalized over
the k: norm_topk_prob). The experts are fused, input_linear [E, 2I, H] (gate rows, then up) and
output_linear [E, H, I], the router under router.layer (transformers renames them on load:
experts.gate_up_proj / down_proj, router.weight); loader/checkpoint.py reads either naming. The
shared expert's shared_mlp.input_linear [2I_s, H] holds its gate rows, then its up rows.
granitemoe_swa: layer_types picks sliding layers (window sliding_window) and full ones, every
layer has attention sinks (one logit a head in the softmax's denominator, as gpt-oss's), and a
layer whose layer_rope_theta is 0 has no RoPE; the others must share one theta.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, layer_list, need
from engine.models.rope import ConfigError
from engine.names import name

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


@dataclass(frozen=True)
class GraniteMoeConfig(MoeConfig):
    embedding_multiplier: float = 1.0   # the embeddings' scale
    residual_multiplier: float = 1.0    # each branch's output scale before its residual add
    logits_scaling: float = 1.0         # the logits' divisor
    sinks: bool = False                 # granitemoe_swa: attention sinks in every layer

    @classmethod
    def from_hf(cls, cfg: dict) -> "GraniteMoeConfig":
        cfg = dict(cfg)
        family = cfg["model_type"]
        cfg.setdefault("rms_norm_eps", 1e-6)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported; {family} runs silu")
        m = multipliers(cfg)
        f = MoeConfig.common_hf(cfg)
        f["score_scale"] = m["attention_multiplier"]
        if family == "granitemoe_swa":
            f.update(swa_fields(cfg, f))
        return cls(**f, moe_intermediate=int(need(cfg, "intermediate_size")), norm_topk_prob=True,
                   shared_intermediate=0 if family == "granitemoe" else int(cfg.get("shared_intermediate_size") or 0),
                   embedding_multiplier=m["embedding_multiplier"], residual_multiplier=m["residual_multiplier"],
                   logits_scaling=m["logits_scaling"], sinks=family == "granitemoe_swa")


def multipliers(cfg: dict) -> dict:
    """MULTIPLIERS from config.json; absent ones are 1.0, as transformers' config defaults them
    (the scores' scale too). Also granitemoehybrid's."""
    m = {k: 1.0 if cfg.get(k) is None else float(cfg[k]) for k in MULTIPLIERS}
    for k in ("attention_multiplier", "logits_scaling"):
        if m[k] == 0:
            raise ConfigError(f"config.json: {k} is 0; expected a nonzero {k}")
    return m


def swa_fields(cfg: dict, f: dict) -> dict:
    """granitemoe_swa's layer windows, NoPE layers and RoPE theta (common_hf's fields f), with
    transformers' defaults: every fourth layer full from layer 0, the rest sliding (window 128);
    every layer at rope_theta."""
    n = f["n_layers"]
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if l % 4 == 0 else "sliding_attention" for l in range(n)]
    kinds = layer_list("layer_types", kinds, n, ("full_attention", "sliding_attention"))
    window = int(cfg["sliding_window"] if cfg.get("sliding_window") is not None else 128)
    if window < 1 and "sliding_attention" in kinds:
        raise ConfigError(f"config.json: sliding_window {window}; expected a positive window")
    thetas = cfg.get("layer_rope_theta")
    if thetas is None:
        thetas = [f["rope"].theta] * n
    if not isinstance(thetas, (list, tuple)) or len(thetas) != n:
        raise ConfigError(f"config.json: layer_rope_theta must give each of the {n} layers a theta "
                          f"(0: no RoPE); got {thetas!r}")
    rotating = sorted({float(t) for t in thetas if t})
    if len(rotating) > 1:
        raise ConfigError(f"config.json: layer_rope_theta {list(thetas)} has {len(rotating)} nonzero thetas; "
                          "granitemoe_swa runs one theta (0 in NoPE layers)")
    rope = dataclasses.replace(f["rope"], theta=rotating[0]) if rotating else f["rope"]
    return dict(rope=rope, nope_layers=tuple(l for l, t in enumerate(thetas) if not t),
                layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds))


def dense_spec(c: GraniteMoeConfig) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    for l in range(c.n_layers):
        if c.attention_bias:
            spec[name(c.family, "o_bias", l)] = (c.hidden,)
        if c.sinks:
            spec[name(c.family, "sinks", l)] = (c.n_heads,)
    return spec


expert_spec = base.expert_spec


class GraniteMoeDecoder(MoeDecoder):
    def embed(self, ids: np.ndarray):
        x = super().embed(ids)
        x *= np.float32(self.c.embedding_multiplier)
        return x

    def layer(self, l: int, x, pos: np.ndarray, st) -> None:
        """x += r * attention(attn_norm(x)), then x += r * mlp(mlp_norm(x)); r = residual_multiplier."""
        c, ops, w = self.c, self.ops, self.w
        r = np.float32(c.residual_multiplier)
        ops.add_(x, r * self.attention(l, ops.rmsnorm(x, w("attn_norm", l), c.rms_eps), pos, st))
        ops.add_(x, r * self.mlp(l, ops.rmsnorm(x, w("mlp_norm", l), c.rms_eps)))

    def attention(self, l: int, h, pos: np.ndarray, st):
        a = super().attention(l, h, pos, st)
        if self.c.attention_bias:
            self.ops.add_(a, self.w("o_bias", l))
        return a

    def sinks(self, l: int):
        return self.w("sinks", l) if self.c.sinks else None

    def head(self, x):
        logits = super().head(x)
        logits /= np.float32(self.c.logits_scaling)
        return logits


Model = GraniteMoeDecoder
Config = GraniteMoeConfig
