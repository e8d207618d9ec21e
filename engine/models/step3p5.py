"""Step-3.5-Flash (step3p5) and Step-3.7-Flash's language model (step3p7, an image-text wrapper:
the vision tower is skipped). CPU backend.

What differs from the llama-like decoder (engine/models/base.py):
- every RMSNorm scales by 1 + w (the stored weights are offsets; q / k norms a head too):
  dense_view gives both backends the norms' weights as 1 + w at load;
- sliding-window and full layers (layer_types), each type with its own RoPE theta and rotary
  share; sliding layers may have fewer query heads (num_sliding_attention_heads);
- each head's output times sigmoid of its gate (g_proj, one a head) before o_proj;
- scores scaled by query_pre_attn_scalar ** -0.5;
- MoE: sigmoid scores, top-k of scores + router_bias, the chosen scores normalized; the routed
  sum times moe_router_scaling_factor; a shared expert; dense first layers (mlp_layer_types);
- per-layer SwiGLU clamps after the SiLU (swiglu_limits for the routed experts,
  swiglu_limits_shared for the shared expert and the dense MLP; 0 or none: no clamp).
The release's config lists per-layer fields with trailing entries for its MTP layers, names the
MoE layers in moe_layers_enum and the sliding heads in attention_other_setting; read as
transformers' Step3p7TextConfig reads them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, need, text_config
from engine.models.rope import ConfigError, RopeConfig
from engine.names import name

SLIDING, FULL = "sliding_attention", "full_attention"
NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")


def _per_layer(cfg: dict, key: str, n: int, padded: int):
    """A per-layer list of config.json, its MTP layers' trailing entries dropped; None if absent."""
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) not in (n, padded):
        raise ConfigError(f"config.json: {key} must list a value for each of the {n} layers; got {v!r}")
    return v[:n]


@dataclass(frozen=True)
class Step3p5Config(MoeConfig):
    layer_heads: tuple = ()          # per layer: its query heads
    layer_ropes: tuple = ()          # per layer: its RopeConfig
    limits: tuple = ()               # per layer: the routed experts' clamp (0: none)
    shared_limits: tuple = ()        # per layer: the shared expert's / dense MLP's clamp
    attn_scale: float = 1.0
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "Step3p5Config":
        if cfg.get("model_type") == "step3p7":
            cfg = text_config(cfg, "step3p7", "Step3p7ForConditionalGeneration")
        cfg = dict(cfg, model_type="step3p5" if cfg.get("model_type") in (None, "step3p5") else cfg["model_type"])
        cfg.setdefault("num_experts", need(cfg, "n_routed_experts", "num_local_experts"))
        cfg.setdefault("rms_norm_eps", 1e-5)
        if cfg.get("use_bidirectional_attention"):
            raise ConfigError("config.json: use_bidirectional_attention is true; step3p5 runs causal "
                              "attention only")
        n = int(need(cfg, "num_hidden_layers"))
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        padded = n + n_mtp
        types = _per_layer(cfg, "layer_types", n, padded) or [FULL] * n
        if any(t not in (SLIDING, FULL) for t in types):
            raise ConfigError(f"config.json: layer_types has {sorted(set(types) - {SLIDING, FULL})}; "
                              f"step3p5 runs {SLIDING} and {FULL} layers (not sparse attention)")
        window = int(cfg.get("sliding_window") or 0)
        if SLIDING in types and window <= 0:
            raise ConfigError(f"config.json: layer_types has {SLIDING} layers but sliding_window is "
                              f"{cfg.get('sliding_window')!r}")
        mlp = _per_layer(cfg, "mlp_layer_types", n, padded)
        if mlp is None:
            enum = cfg.get("moe_layers_enum")
            if enum is not None:
                items = enum.split(",") if isinstance(enum, str) else enum
                sparse = {int(i) for i in items if str(i).strip()}
            else:
                sparse = set(range(3, n))
            mlp = ["sparse" if l in sparse else "dense" for l in range(n)]
        if any(t not in ("sparse", "dense") for t in mlp):
            raise ConfigError(f"config.json: mlp_layer_types must list sparse or dense; got {mlp}")
        f = MoeConfig.common_hf({**cfg, "rope_parameters": None, "rope_scaling": None, "rope_theta": 10000.0})
        heads = f["n_heads"]
        sliding_heads = cfg.get("num_sliding_attention_heads")
        if sliding_heads is None:
            sliding_heads = (cfg.get("attention_other_setting") or {}).get("num_attention_heads", heads)
        layer_heads = tuple(int(sliding_heads) if t == SLIDING else heads for t in types)
        if any(h % f["n_kv_heads"] for h in layer_heads):
            raise ConfigError(f"config.json: query heads {sorted(set(layer_heads))} must be multiples "
                              f"of num_key_value_heads={f['n_kv_heads']}")
        head_dim = f["head_dim"]
        params = cfg.get("rope_parameters") or {}
        if all(isinstance(params.get(t), dict) for t in set(types)):
            by_type = {t: params[t] for t in set(types)}
        else:
            thetas = cfg.get("rope_theta", 10000.0)
            thetas = _per_layer(cfg, "rope_theta", n, padded) if isinstance(thetas, list) else [thetas] * n
            partial = _per_layer(cfg, "partial_rotary_factors", n, padded)
            by_type = {}
            for t in set(types):
                i = types.index(t)
                by_type[t] = {"rope_type": "default", "rope_theta": thetas[i],
                              **({"partial_rotary_factor": partial[i]} if partial else {})}
            if cfg.get("rope_scaling") and FULL in by_type:
                by_type[FULL] = {**by_type[FULL], **cfg["rope_scaling"]}
        ropes = {t: RopeConfig.from_hf({"max_position_embeddings": f["max_position"], "rope_parameters": p},
                                       head_dim) for t, p in by_type.items()}
        limits = _per_layer(cfg, "swiglu_limits", n, padded) or [0] * n
        shared_limits = _per_layer(cfg, "swiglu_limits_shared", n, padded) or [0] * n
        f.update(moe_layers=tuple(l for l, t in enumerate(mlp) if t == "sparse"),
                 routing="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
                 routed_scale=float(cfg.get("moe_router_scaling_factor") or 1.0),
                 shared_intermediate=int(need(cfg, "share_expert_dim")),
                 dense_intermediate=int(cfg.get("intermediate_size") or 0),
                 qk_norm="head", sliding_window=window, rope=ropes[types[0]],
                 layer_windows=tuple(window if t == SLIDING else 0 for t in types))
        ignored = tuple((f"model.layers.{n + i}.", "the multi-token-prediction (MTP) layers") for i in range(n_mtp))
        ignored += (("vision_model.", "the vision tower"), ("vit_large_projector.", "the vision projector"))
        return cls(**f, moe_intermediate=int(need(cfg, "moe_intermediate_size")), layer_heads=layer_heads,
                   layer_ropes=tuple(ropes[t] for t in types),
                   limits=tuple(float(x or 0) for x in limits),
                   shared_limits=tuple(float(x or 0) for x in shared_limits),
                   attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                   ignored_parts=ignored)


def dense_spec(c: Step3p5Config) -> dict[str, tuple]:
    f, h, d = c.family, c.hidden, c.head_dim
    spec = {name(f, "embed"): (c.vocab_size, h), name(f, "final_norm"): (h,)}
    if not c.tie_embeddings:
        spec[name(f, "lm_head")] = (c.vocab_size, h)
    for l in range(c.n_layers):
        q = c.layer_heads[l] * d
        s = {"attn_norm": (h,), "mlp_norm": (h,), "q": (q, h), "k": (c.kv_dim, h), "v": (c.kv_dim, h),
             "o": (h, q), "q_norm": (d,), "k_norm": (d,), "g": (c.layer_heads[l], h)}
        if l in c.moe_layers:
            s.update(router=(c.n_experts, h), router_bias=(c.n_experts,),
                     shared_gate=(c.shared_intermediate, h), shared_up=(c.shared_intermediate, h),
                     shared_down=(h, c.shared_intermediate))
        else:
            s.update(mlp_gate=(c.dense_intermediate, h), mlp_up=(c.dense_intermediate, h),
                     mlp_down=(h, c.dense_intermediate))
        spec.update({name(f, k, l): shape for k, shape in s.items()})
    return spec


expert_spec = base.expert_spec   # gate, up, down per expert (the stacked tensors' views)


def dense_view(c: Step3p5Config, n: str, a: np.ndarray) -> np.ndarray:
    """Checkpoint tensor n as both backends read it: an RMSNorm's weight (NORMS) as 1 + w."""
    return base.one_plus_view(c.family, n, a, NORMS)


class Step3p5Decoder(MoeDecoder):
    def __init__(self, c: Step3p5Config, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        self.freqs = [r.inv_freq() for r in c.layer_ropes]

    def attention(self, l: int, h, pos: np.ndarray, st):
        c, ops, w = self.c, self.ops, self.w
        t, heads, d = h.shape[0], c.layer_heads[l], c.head_dim
        q = ops.rmsnorm(ops.linear(h, w("q", l)).reshape(t, heads, d), w("q_norm", l), c.rms_eps)
        k = ops.rmsnorm(ops.linear(h, w("k", l)).reshape(t, c.n_kv_heads, d), w("k_norm", l), c.rms_eps)
        v = ops.linear(h, w("v", l)).reshape(t, c.n_kv_heads, d)
        rope = c.layer_ropes[l]
        ops.rope(q, pos, self.freqs[l], rope.attention_factor)
        ops.rope(k, pos, self.freqs[l], rope.attention_factor)
        ops.kv_store(st.k[l], st.v[l], int(pos[0]), k, v, self.kv_bf16)
        a = ops.attention(q, st.k[l], st.v[l], pos, c.attn_scale, self.window(l), None)   # [T, Hq, D]
        gate = ops.linear(h, w("g", l))                                                   # [T, Hq]
        a = a * (np.float32(1) / (np.float32(1) + np.exp(-gate)))[:, :, None]
        return ops.linear(np.ascontiguousarray(a.reshape(t, heads * d), np.float32), w("o", l))

    def _mlp(self, h, weights, limit: float):
        ops = self.ops
        return ops.expert_limited(h, weights, limit, after=True) if limit > 0 else ops.expert(h, weights)

    def dense_mlp(self, l: int, h):
        w = self.w   # transformers clamps the dense MLP by the shared expert's limit
        return self._mlp(h, (w("mlp_gate", l), w("mlp_up", l), w("mlp_down", l)), self.c.shared_limits[l])

    def routed_expert(self, l: int, e: int, x, we):
        return self._mlp(x, we, self.c.limits[l])

    def shared_expert(self, l: int, h):
        w = self.w
        return self._mlp(h, (w("shared_gate", l), w("shared_up", l), w("shared_down", l)),
                         self.c.shared_limits[l])


Model = Step3p5Decoder
Config = Step3p5Config
