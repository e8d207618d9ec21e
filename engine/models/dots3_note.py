"""dots.3 note (dots3_note: Dots3NoteForConditionalGeneration, the omni wrapper; dots3_note_text:
a text-only Dots3NoteForCausalLM folder): the language model on text; the vision and audio
encoders (vision_encoder., audio_encoder.) and the MTP layer are left unread. CPU backend:
DeepSeek-V3.2's MLA and sparse attention (engine/models/deepseek_v32.py).

What differs from deepseek_v32, as transformers' modeling_dots3_note:
- layers of three kinds by layer_types: indexed_attention (DSA: an indexer of its own in every
  such layer, its RoPE over interleaved pairs as GLM-5's, no picks shared), full_attention (dense
  MLA: use_dsa false) and sliding_attention (dense MLA over the last sliding_window positions, no
  indexer) with shapes of their own (per_layer_config, or the release's swa_* fields: heads, q /
  kv ranks, head dims) and a RoPE of their own (swa_rope_theta);
- the normed low-rank query times sqrt(hidden / q_lora_rank) (the indexer's queries read it
  too), the normed latent times sqrt(hidden / kv_lora_rank), the rotated key RMS-normed
  (k_rope_only_layernorm) before RoPE; every norm takes rms_norm_eps;
- each head's output times sigmoid(g_proj(h)) before o_proj;
- the softmax scale (qk_nope + qk_rope)^-0.5 with no YaRN mscale; each kind rotates its
  qk_rope_head_dim dims (partial_rotary_factor qk_rope / head_dim, as the reference derives it);
- DeepSeek-V3's routing (sigmoid, a selection bias, groups, renormalized where norm_topk_prob,
  scaled), shared experts of shared_experts_intermediate_size x n_shared_experts; dense layers by
  mlp_layer_types, else first_k_dense_replace and moe_layer_freq;
- the release's config.json holds the text model's fields at its top level (no text_config),
  with the aliases the reference reads (use_dsa, use_sliding_window, sliding_window_size,
  swa_*, moe_shared_expert_intermediate_size); the wrapper's tie_word_embeddings rules.
The cache holds a row a position a layer as wide as the widest kind's C + R, a narrower kind's
rows zero past its own (and its queries likewise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.models.base import expert_spec, layer_list, need, text_config  # noqa: F401
from engine.models.deepseek_v3 import DeepseekV3Config
from engine.models.deepseek_v32 import DeepseekV32Config, DeepseekV32Decoder
from engine.models.deepseek_v32 import dense_spec as dsa_spec
from engine.models.rope import ConfigError, RopeConfig, pairs_to_halves
from engine.names import name

KINDS = ("indexed_attention", "full_attention", "sliding_attention")
SLIDING = "sliding_attention"
# the release's sliding layers (swa_* in config.json), as the reference defaults them
SWA = dict(num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1024, kv_lora_rank=1024, head_dim=256,
           qk_nope_head_dim=192, v_head_dim=128)
SHAPE_KEYS = (*SWA, "qk_rope_head_dim")
# transformers' Dots3NoteTextConfig defaults where config.json leaves a field out (or null)
DEFAULTS = dict(rms_norm_eps=1e-5, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                n_shared_experts=1, index_topk=2048, index_head_dim=128, index_n_heads=64, head_dim=256)


def text_fields(cfg: dict) -> dict:
    """The language model's fields: the wrapper's text_config as transformers saves it, else
    config.json's top level (the release's, and a text-only folder's)."""
    family = cfg["model_type"]
    if family == "dots3_note" and "text_config" in cfg:
        text = text_config(cfg, family, "Dots3NoteForConditionalGeneration", ("eos_token_id", "bos_token_id"))
    else:
        text = dict(cfg)
    text["model_type"] = family
    if family == "dots3_note":   # the wrapper ties lm_head: its flag rules (false by default)
        text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings") or False)
    for key, v in DEFAULTS.items():
        if text.get(key) is None:
            text[key] = v
    text.setdefault("q_lora_rank", 1024)
    return text


def kinds(text: dict, n: int) -> list:
    """Each layer's kind, derived as the reference derives it: layer_types as given, else the
    first two and every fourth from 1 indexed and the rest sliding (use_sliding_window: all
    indexed); use_dsa (true unless per_layer_config is given) renames full_attention to
    indexed_attention, false the other way."""
    use_dsa = text.get("use_dsa", None if "per_layer_config" in text else True)
    types = text.get("layer_types")
    if types is None:
        full = "full_attention" if use_dsa is False else "indexed_attention"
        sliding = text.get("use_sliding_window", True)
        types = [full if not sliding or i < 2 or i % 4 == 1 else SLIDING for i in range(n)]
    if use_dsa is not None:
        old, new = ("full_attention", "indexed_attention") if use_dsa else ("indexed_attention", "full_attention")
        types = [new if t == old else t for t in types]
    return layer_list("layer_types", types, n, KINDS)


def sliding_shapes(text: dict, types: list) -> dict:
    """The shapes the sliding layers take in place of the config's (per_layer_config as given:
    the same overrides for each sliding layer and none for the others; else the swa_* fields)."""
    plc = text.get("per_layer_config")
    if plc is None:
        swa = {k: text.get("swa_" + k, v) for k, v in SWA.items()}
        swa["qk_rope_head_dim"] = text.get("swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"])
        return swa
    if not isinstance(plc, dict):
        raise ConfigError(f"config.json: per_layer_config must map layer indices to fields; got {plc!r}")
    over = {}
    for key, fields in plc.items():
        l = int(key)
        if not 0 <= l < len(types) or not isinstance(fields, dict):
            raise ConfigError(f"config.json: per_layer_config has {key!r}: {fields!r}; expected a layer index "
                              f"below {len(types)} and its fields")
        bad = sorted(set(fields) - set(SHAPE_KEYS))
        if bad:
            raise ConfigError(f"config.json: per_layer_config gives layer {l} {', '.join(bad)}; the engine reads "
                              f"the attention shapes there only ({', '.join(SHAPE_KEYS)})")
        over[l] = dict(fields)
    sliding = [l for l, t in enumerate(types) if t == SLIDING]
    odd = next((l for l in over if types[l] != SLIDING), None)
    if odd is not None:
        raise ConfigError(f"config.json: per_layer_config gives layer {odd} ({types[odd]}) shapes of its own; "
                          "only sliding_attention layers may differ from the config's")
    first = over.get(sliding[0], {}) if sliding else {}
    odd = next((l for l in sliding if over.get(l, {}) != first), None)
    if odd is not None:
        raise ConfigError(f"config.json: per_layer_config gives sliding layer {odd} other shapes than layer "
                          f"{sliding[0]}; the reference runs one set a layer kind")
    return first


def kind_rope(text: dict, types: list, kind: str, head_dim: int, rope: int) -> RopeConfig:
    """A layer kind's RoPE as the reference builds it: rope_parameters (nested a kind, or one
    set for all), else default RoPE at rope_theta (swa_rope_theta for the sliding layers); over
    int(head_dim * qk_rope / head_dim) dims, which must be qk_rope_head_dim."""
    params = text.get("rope_parameters") or text.get("rope_scaling")
    if params is None:
        theta = text.get("swa_rope_theta", 50000.0) if kind == SLIDING else text.get("rope_theta", 8e7)
        params = {"rope_type": "default", "rope_theta": theta}
    elif any(t in params for t in KINDS):
        if not isinstance(params.get(kind), dict):
            raise ConfigError(f"config.json: rope_parameters has no entry for {kind}, a kind in layer_types")
        params = params[kind]
    params = {"rope_theta": text.get("rope_theta", 8e7), **params, "partial_rotary_factor": rope / head_dim}
    r = RopeConfig.from_hf({"rope_parameters": params, "max_position_embeddings": text.get("max_position_embeddings")},
                           head_dim)
    if r.rotary_dim != rope:
        raise ConfigError(f"config.json: {kind}'s head_dim={head_dim} rotates {r.rotary_dim} dims by the "
                          f"reference's count; expected its qk_rope_head_dim={rope}")
    return r


def moe_layers(text: dict, n: int) -> tuple:
    """The routed layers: mlp_layer_types, else from first_k_dense_replace (1) on, where
    moe_layer_freq (1; or one flag a layer) says."""
    types = text.get("mlp_layer_types")
    if types is None:
        first, freq = text.get("first_k_dense_replace", 1), text.get("moe_layer_freq", 1)
        if isinstance(freq, (list, tuple)) and len(freq) < n or not isinstance(freq, (list, tuple)) and freq < 1:
            raise ConfigError(f"config.json: moe_layer_freq {freq!r} must be positive, or give each of the {n} "
                              "layers a flag")
        types = ["sparse" if i >= first and (bool(freq[i]) if isinstance(freq, (list, tuple)) else i % freq == 0)
                 else "dense" for i in range(n)]
    types = layer_list("mlp_layer_types", types, n, ("dense", "sparse"))
    return tuple(l for l, t in enumerate(types) if t == "sparse")


def check_shape(kind: str, s: dict) -> None:
    if s.get("q_lora_rank") is None:
        raise ConfigError(f"config.json: {kind} layers without q_lora_rank; dots3_note's queries are low-rank")
    if s.get("num_key_value_heads") not in (None, s["num_attention_heads"]):
        raise ConfigError(f"config.json: {kind} layers' num_key_value_heads={s['num_key_value_heads']} must equal "
                          f"num_attention_heads={s['num_attention_heads']}")


@dataclass(frozen=True)
class Dots3NoteConfig(DeepseekV32Config):
    sliding_layers: tuple = ()      # the sliding_attention layers, which take swa_shape and swa_rope
    swa_shape: tuple = ()           # their (heads, q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head_dim)
    swa_rope: RopeConfig | None = None
    swa_scale: float = 1.0          # their softmax scale

    def mla(self, l: int) -> tuple:
        return self.swa_shape if l in self.sliding_layers else super().mla(l)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Dots3NoteConfig":
        text = text_fields(cfg)
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {text['hidden_act']!r} is not supported; dots3_note runs silu")
        n = int(need(text, "num_hidden_layers"))
        types = kinds(text, n)
        main = {k: text.get(k) for k in SHAPE_KEYS}
        if main["num_key_value_heads"] is None:
            main["num_key_value_heads"] = main["num_attention_heads"]
        check_shape("the indexed / full", main)
        swa = {**main, **sliding_shapes(text, types)}
        sliding = tuple(l for l, t in enumerate(types) if t == SLIDING)
        if sliding:
            check_shape("sliding_attention", swa)
            if swa["head_dim"] != swa["qk_nope_head_dim"] + swa["qk_rope_head_dim"]:
                raise ConfigError(f"config.json: the sliding layers' head_dim={swa['head_dim']} must equal their "
                                  f"qk_nope_head_dim + qk_rope_head_dim={swa['qk_nope_head_dim']} + "
                                  f"{swa['qk_rope_head_dim']}")
        swa_rope = kind_rope(text, types, SLIDING, int(swa["head_dim"]), int(swa["qk_rope_head_dim"])) \
            if sliding else None
        ropes = {t: kind_rope(text, types, t, int(main["head_dim"]), int(main["qk_rope_head_dim"]))
                 for t in KINDS[:2] if t in types}
        if len(set(ropes.values())) > 1:
            raise ConfigError("config.json: rope_parameters differ between indexed_attention and full_attention; "
                              "the engine runs one RoPE for the two")
        rope = next(iter(ropes.values()), swa_rope)
        window = text.get("sliding_window")
        window = text.get("sliding_window_size", 512) if window is None else window
        if sliding and int(window) < 1:
            raise ConfigError(f"config.json: sliding_window={window} must be positive")
        moe = moe_layers(text, n)
        shared = int(text.get("moe_shared_expert_intermediate_size") or text.get("shared_experts_intermediate_size")
                     or 1536)
        if int(text["n_shared_experts"]) < 1:
            raise ConfigError(f"config.json: n_shared_experts={text['n_shared_experts']}; dots3_note has at least "
                              "one shared expert")
        plain = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling", "head_dim")}
        c = DeepseekV3Config.from_hf({**plain, "first_k_dense_replace": 0, "rope_interleave": True})
        heads, dim, topk = (int(text[k]) for k in ("index_n_heads", "index_head_dim", "index_topk"))
        indexed = tuple(l for l, t in enumerate(types) if t == "indexed_attention")
        if indexed and (min(heads, topk) < 1 or dim < c.qk_rope_dim):
            raise ConfigError(f"config.json: index_n_heads={heads}, index_topk={topk} must be positive and "
                              f"index_head_dim={dim} at least qk_rope_head_dim={c.qk_rope_dim}")
        shape = tuple(int(swa[k]) for k in ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                             "qk_rope_head_dim", "v_head_dim"))
        widest = max(c.kv_lora_rank + c.qk_rope_dim, (shape[2] + shape[4]) if sliding else 0)
        n_mtp = int(text.get("num_nextn_predict_layers") or 0)
        mtp = tuple((f"model.layers.{n + i}.", "the multi-token-prediction (MTP) layer") for i in range(max(n_mtp, 1)))
        ignored = (("vision_encoder.", "the vision encoder"), ("audio_encoder.", "the audio encoder and adapter"),
                   *mtp, ("model.mtp.", "the multi-token-prediction (MTP) layers"))
        return cls(**{**c.__dict__, "raw": cfg, "rope": rope, "moe_layers": moe, "shared_intermediate": shared
                      * int(text["n_shared_experts"]), "head_dim": widest, "softmax_scale": float(
                          (c.qk_nope_dim + c.qk_rope_dim) ** -0.5), "ignored_parts": ignored,
                      "layer_windows": tuple(int(window) if l in sliding else 0 for l in range(n))},
                   index_n_heads=heads, index_head_dim=dim, index_topk=topk, index_layers=indexed,
                   index_rope_pairs=True, sliding_layers=sliding, swa_shape=shape, swa_rope=swa_rope,
                   swa_scale=float((shape[3] + shape[4]) ** -0.5))


def dense_spec(c: Dots3NoteConfig) -> dict[str, tuple]:
    """deepseek_v32's tensors at each layer's shapes (the indexer's in the indexed layers), and
    each layer's output gate and rotated key's norm."""
    spec = dsa_spec(c)
    for l in range(c.n_layers):
        heads, _, _, _, rope, _ = c.mla(l)
        spec[name(c.family, "g", l)] = (heads, c.hidden)
        spec[name(c.family, "k_rope_norm", l)] = (rope,)
    return spec


class Dots3NoteDecoder(DeepseekV32Decoder):
    def __init__(self, c: Dots3NoteConfig, ops, weights, experts, on_route=None):
        super().__init__(c, ops, weights, experts, on_route)
        if c.sliding_layers:   # their rotary dims in halves, their frequencies
            self.swa_rot = pairs_to_halves(c.swa_shape[4])
            self.swa_inv_freq = c.swa_rope.inv_freq()

    def latent(self, l: int, h, pos: np.ndarray, st):
        """The queries in the latent space [T, Hq, D] (D: the cache row's width, zero past the
        layer's C + R), the tokens' rows stored in st; and the scaled low-rank query [T, Lq]."""
        c, ops, w = self.c, self.ops, self.w
        t = h.shape[0]
        heads, lq, cd, nope, r, _ = c.mla(l)
        if l in c.sliding_layers:
            rot, inv, att = self.swa_rot, self.swa_inv_freq, c.swa_rope.attention_factor
        else:
            rot, inv, att = self.rot, self.inv_freq, c.rope.attention_factor
        qa = ops.linear(h, w("q_a", l))
        if c.attention_bias:
            ops.add_(qa, w("q_a_bias", l))
        qr = ops.rmsnorm(qa, w("q_a_norm", l), c.rms_eps) * np.float32(math.sqrt(c.hidden / lq))
        q = ops.linear(qr, w("q_b", l)).reshape(t, heads, nope + r)
        kv = ops.linear(h, w("kv_a", l))                                   # [T, C + R]
        if c.attention_bias:
            ops.add_(kv, w("kv_a_bias", l))
        lat = ops.rmsnorm(kv[:, :cd], w("kv_a_norm", l), c.rms_eps) * np.float32(math.sqrt(c.hidden / cd))
        k_pe = np.ascontiguousarray(ops.rmsnorm(kv[:, cd:], w("k_rope_norm", l), c.rms_eps)[:, None, rot])
        q_pe = np.ascontiguousarray(q[:, :, nope + rot])
        ops.rope(q_pe, pos, inv, att)
        ops.rope(k_pe, pos, inv, att)
        pad = c.head_dim - cd - r
        row = np.concatenate([lat[:, None], k_pe, np.zeros((t, 1, pad), np.float32)], axis=-1)   # [T, 1, D]
        ops.kv_store(st.k[l], st.v[l], int(pos[0]), row, row, self.kv_bf16)
        q_lat = np.concatenate([ops.per_head_linear(q[:, :, :nope], w("w_uk", l)), q_pe,
                                np.zeros((t, heads, pad), np.float32)], axis=-1)
        return q_lat, qr

    def attention(self, l: int, h, pos: np.ndarray, st):
        c, ops, w = self.c, self.ops, self.w
        t = h.shape[0]
        q_lat, qr = self.latent(l, h, pos, st)
        if l in self.index_row:   # its own indexer's picks
            st.picked = self.select(l, h, qr, pos, st)
            a = self.attend(l, q_lat, pos, st)
        else:   # dense, within the window in a sliding layer
            scale = c.swa_scale if l in c.sliding_layers else c.softmax_scale
            a = ops.attention(q_lat, st.k[l], st.v[l], pos, scale, self.window(l), None)
        heads, _, cd, _, _, v = c.mla(l)
        o = ops.per_head_linear(a[:, :, :cd], w("w_uv_t", l))             # [T, Hq, V]
        g = ops.linear(h, w("g", l))                                       # [T, Hq]
        o *= (np.float32(1) / (np.float32(1) + np.exp(-g)))[:, :, None]
        o = ops.linear(np.ascontiguousarray(o.reshape(t, heads * v)), w("o", l))
        if c.attention_bias:
            ops.add_(o, w("o_bias", l))
        return o


Model = Dots3NoteDecoder
Config = Dots3NoteConfig
