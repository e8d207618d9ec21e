"""MiMo-V2-Flash (mimo_v2_flash). CPU backend here; cuda: engine/gpu_mimo.py.

What differs from the llama-like decoder (engine/models/base.py):
- sliding-window layers (sliding_window keys, or the release's sliding_window_size + 1) with
  attention sinks and twice the full layers' KV heads; full layers (the first and every 6th by
  default) without sinks; each kind its own RoPE (rope_parameters keyed by layer type, else the
  release's rope_theta / swa_rope_theta), over the first partial_rotary_factor of a head;
- q / k heads of head_dim (192), v heads of v_head_dim (128), the values times
  attention_value_scale;
- DeepSeek-V3's routing (sigmoid, a selection bias, groups, scaled) without shared experts;
  dense layers by mlp_layer_types (the release: moe_layer_freq); the MTP layers skipped.
The cache holds every layer at the sliding layers' KV heads and head_dim: a full layer's K and V
rows are repeated to that count and V zero-padded to head_dim once, at load (dense_view, for both
backends), so one cache and one attention kernel serve both kinds; an output head's first
v_head_dim values go to o_proj. Legend: D = head_dim, Dv = v_head_dim, Hq / Hkv = query / KV heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, layer_list, need
from engine.models.glm4_moe import sigmoid_moe, with_experts
from engine.models.rope import ConfigError, RopeConfig
from engine.names import key_of, name

SLIDING, FULL = "sliding_attention", "full_attention"
_ROPE = {FULL: 5_000_000.0, SLIDING: 10_000.0}   # the reference's defaults


@dataclass(frozen=True)
class MimoV2FlashConfig(MoeConfig):
    v_head_dim: int = 0
    v_scale: float = 1.0
    full_kv_heads: int = 0          # a full layer's KV heads in the checkpoint
    layer_ropes: tuple = ()         # RopeConfig a layer
    sink_layers: tuple = ()
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "MimoV2FlashConfig":
        cfg = with_experts(cfg)
        n = int(need(cfg, "num_hidden_layers"))
        types = cfg.get("layer_types")
        if types is None and cfg.get("hybrid_layer_pattern") is not None:   # the release's spelling
            types = [SLIDING if x else FULL for x in cfg["hybrid_layer_pattern"]]
        types = layer_list("layer_types", types or [FULL if i == 0 or not (i + 1) % 6 else SLIDING for i in range(n)],
                           n, (SLIDING, FULL))
        mlp = cfg.get("mlp_layer_types")
        if mlp is None and cfg.get("moe_layer_freq") is not None:
            mlp = ["sparse" if x else "dense" for x in cfg["moe_layer_freq"]]
        mlp = layer_list("mlp_layer_types", mlp or ["dense"] + ["sparse"] * (n - 1), n, ("dense", "sparse"))
        d, dv = int(cfg.get("head_dim") or 192), int(cfg.get("v_head_dim") or 128)
        kv = int(cfg.get("num_key_value_heads") or 4)
        swa_kv = cfg.get("swa_num_key_value_heads")
        if swa_kv is not None and int(swa_kv) != 2 * kv:
            raise ConfigError(f"config.json: swa_num_key_value_heads={swa_kv}; the reference gives sliding layers "
                              f"twice num_key_value_heads ({2 * kv})")
        if dv > d:
            raise ConfigError(f"config.json: v_head_dim={dv} exceeds head_dim={d}")
        if cfg.get("attention_bias"):
            raise ConfigError("config.json: attention_bias true is not supported for mimo_v2_flash (the release's "
                              "projections have no biases)")
        if cfg.get("add_full_attention_sink_bias"):
            raise ConfigError("config.json: add_full_attention_sink_bias true is not supported (the reference's "
                              "full layers have no sinks)")
        window = cfg.get("sliding_window", 129)
        if cfg.get("sliding_window_size") is not None:   # the release: the previous tokens, plus the query
            window = int(cfg["sliding_window_size"]) + 1
        params = cfg.get("rope_parameters")
        if not (isinstance(params, dict) and set(params) >= set(types)):
            partial = float(cfg.get("partial_rotary_factor", 0.334))
            params = {t: {"rope_type": "default", "partial_rotary_factor": partial,
                          "rope_theta": float(cfg.get("swa_rope_theta" if t == SLIDING else "rope_theta") or _ROPE[t])}
                      for t in (FULL, SLIDING)}
        ropes = {t: RopeConfig.from_hf({"rope_parameters": params[t],
                                        "max_position_embeddings": cfg.get("max_position_embeddings")}, d)
                 for t in set(types)}
        cfg.update(head_dim=d, num_key_value_heads=2 * kv, rope_parameters=params[types[0]],
                   rms_norm_eps=cfg.get("rms_norm_eps", cfg.get("layernorm_epsilon", 1e-5)))
        if int(need(cfg, "num_attention_heads")) % (2 * kv):
            raise ConfigError(f"config.json: num_attention_heads={cfg['num_attention_heads']} is not a multiple "
                              f"of the sliding layers' {2 * kv} KV heads")
        f = MoeConfig.common_hf(cfg)
        f.update(sigmoid_moe(cfg, f, first_dense=1, shared=0, norm=True))
        f.update(moe_layers=tuple(l for l, t in enumerate(mlp) if t == "sparse"),
                 dense_intermediate=int(cfg.get("intermediate_size") or 0), shared_intermediate=0,
                 layer_windows=tuple(int(window) if t == SLIDING else 0 for t in types))
        v_scale = cfg.get("attention_value_scale", 0.707)
        return cls(**f, v_head_dim=dv, v_scale=1.0 if v_scale is None else float(v_scale), full_kv_heads=kv,
                   layer_ropes=tuple(ropes[t] for t in types),
                   sink_layers=tuple(l for l, t in enumerate(types) if t == SLIDING),
                   ignored_parts=(("model.mtp.", "the multi-token-prediction (MTP) layers"),))


def kv_heads(c: MimoV2FlashConfig, l: int) -> int:
    """Layer l's KV heads in the checkpoint."""
    return c.n_kv_heads if l in c.sink_layers else c.full_kv_heads


def dense_spec(c: MimoV2FlashConfig) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    f, h = c.family, c.hidden
    for l in range(c.n_layers):
        kv = kv_heads(c, l)
        spec[name(f, "k", l)] = (kv * c.head_dim, h)
        spec[name(f, "v", l)] = (kv * c.v_head_dim, h)
        spec[name(f, "o", l)] = (h, c.n_heads * c.v_head_dim)
        if l in c.sink_layers:
            spec[name(f, "sinks", l)] = (c.n_heads,)
    return spec


expert_spec = base.expert_spec


def dense_view(c: MimoV2FlashConfig, n: str, a: np.ndarray) -> np.ndarray:
    """Checkpoint tensor n as both backends read it: a layer's K and V rows in the cache's layout
    (cache_rows: a full layer's KV heads repeated to the sliding layers' count, V heads
    zero-padded to head_dim); the rest as stored."""
    got = key_of(c.family, n, ("k", "v"))
    return a if got is None else cache_rows(c, got[0], got[1], np.asarray(a))


def cache_rows(c: MimoV2FlashConfig, key: str, l: int, a: np.ndarray) -> np.ndarray:
    """k or v [kv * (D or Dv), H] of layer l -> [Hkv * D, H] (dense_view)."""
    kv = kv_heads(c, l)
    heads = a.reshape(kv, -1, a.shape[-1])
    if kv != c.n_kv_heads:   # query head g * rep + i reads KV head g // (Hkv / kv): repeat each
        heads = np.repeat(heads, c.n_kv_heads // kv, axis=0)
    if heads.shape[1] < c.head_dim:
        heads = np.concatenate([heads, np.zeros((c.n_kv_heads, c.head_dim - heads.shape[1], a.shape[-1]),
                                                a.dtype)], axis=1)
    return np.ascontiguousarray(heads.reshape(c.n_kv_heads * c.head_dim, a.shape[-1]))


class MimoV2FlashDecoder(MoeDecoder):
    def __init__(self, c: MimoV2FlashConfig, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        self.freqs = [r.inv_freq() for r in c.layer_ropes]

    def sinks(self, l: int):
        return self.w("sinks", l) if l in self.c.sink_layers else None

    def attention(self, l: int, h, pos: np.ndarray, st):
        c, ops, w = self.c, self.ops, self.w
        t, d = h.shape[0], c.head_dim
        q = ops.linear(h, w("q", l)).reshape(t, c.n_heads, d)
        k = ops.linear(h, w("k", l)).reshape(t, c.n_kv_heads, d)
        v = ops.linear(h, w("v", l)).reshape(t, c.n_kv_heads, d)
        r = c.layer_ropes[l]
        ops.rope(q, pos, self.freqs[l], r.attention_factor)
        ops.rope(k, pos, self.freqs[l], r.attention_factor)
        ops.kv_store(st.k[l], st.v[l], int(pos[0]), k, v, self.kv_bf16)
        a = ops.attention(q, st.k[l], st.v[l], pos, d ** -0.5, self.window(l), self.sinks(l))
        a = np.ascontiguousarray(a[:, :, :c.v_head_dim]) * np.float32(c.v_scale)   # the values' scale, after
        return ops.linear(a.reshape(t, c.n_heads * c.v_head_dim), w("o", l))


Model = MimoV2FlashDecoder
Config = MimoV2FlashConfig
