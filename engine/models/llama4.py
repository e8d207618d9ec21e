"""Llama 4 (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E; llama4: the image-text wrapper's
language model, the vision tower skipped; llama4_text: a text-only folder). CPU backend.

What differs from the llama-like decoder (engine/models/base.py):
- routing (routing "sigmoid_input"): the top-k router logits, their sigmoids scaling each routed
  expert's input (not its output); a shared expert of intermediate_size beside them; dense
  layers (intermediate_size_mlp) between the MoE ones (moe_layers, else every
  interleave_moe_layer_step-th);
- RoPE over interleaved pairs (q / k rows reordered once: rope.pair_rows), llama3 scaling, in
  the layers no_rope_layers marks (else all but every no_rope_layer_interval-th); a RoPE layer
  normalizes q and k a head without a weight (use_qk_norm) and attends within its chunk of
  attention_chunk_size positions (layer_types "chunked_attention"); a NoPE layer attends to
  every earlier position with its queries scaled by log1p(floor((p + 1) / floor_scale)) *
  attn_scale + 1 (attn_temperature_tuning).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, layer_list, need, text_config
from engine.models.rope import ConfigError

CHUNKED, FULL = "chunked_attention", "full_attention"


@dataclass(frozen=True)
class Llama4Config(MoeConfig):
    chunk: int = 0                  # a chunked layer's chunk of positions
    chunked_layers: tuple = ()
    qk_l2: bool = False             # RoPE layers: q and k normed a head, without a weight
    temperature: bool = False       # NoPE layers: queries scaled by position (attn_temperature_tuning)
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "Llama4Config":
        ignored: tuple = ()
        if cfg.get("model_type") == "llama4":
            cfg = text_config(cfg, "llama4", "Llama4ForConditionalGeneration",
                              inherited=("eos_token_id", "bos_token_id"))
            ignored = (("vision_model.", "the vision tower"), ("multi_modal_projector.", "the vision projector"))
        cfg = dict(cfg)
        cfg.setdefault("rms_norm_eps", 1e-5)
        n = int(need(cfg, "num_hidden_layers"))
        inter = int(need(cfg, "intermediate_size"))
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        moe = cfg.get("moe_layers")
        moe = tuple(range(step - 1, n, step)) if moe is None else tuple(int(l) for l in moe)
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        rope = cfg.get("no_rope_layers") or [int((l + 1) % interval != 0) for l in range(n)]
        chunk = cfg.get("attention_chunk_size")
        types = cfg.get("layer_types") or [CHUNKED if r and chunk is not None else FULL for r in rope]
        rope = layer_list("no_rope_layers", rope, n, (0, 1))
        types = layer_list("layer_types", types, n, (CHUNKED, FULL))
        if any(not 0 <= l < n for l in moe):
            raise ConfigError(f"config.json: moe_layers {list(moe)} must be layers of 0..{n - 1}")
        chunked = tuple(l for l, t in enumerate(types) if t == CHUNKED)
        if chunked and not chunk:
            raise ConfigError(f"config.json: layer_types has {CHUNKED} layers but attention_chunk_size is {chunk!r}")
        f = MoeConfig.common_hf(cfg)
        f.update(moe_layers=moe, routing="sigmoid_input", norm_topk_prob=False, rope_pairs=True,
                 shared_intermediate=inter, dense_intermediate=int(cfg.get("intermediate_size_mlp") or inter),
                 nope_layers=tuple(l for l, r in enumerate(rope) if not r))
        return cls(**f, moe_intermediate=inter, chunk=int(chunk or 0), chunked_layers=chunked,
                   qk_l2=bool(cfg.get("use_qk_norm", True)),
                   temperature=bool(cfg.get("attn_temperature_tuning", True)),
                   floor_scale=float(cfg.get("floor_scale", 8192)), attn_scale=float(cfg.get("attn_scale", 0.1)),
                   ignored_parts=ignored)


dense_spec = base.dense_spec
expert_spec = base.expert_spec


def query_scales(c: Llama4Config, pos: np.ndarray) -> np.ndarray:
    """A NoPE layer's query scale at each position (float32, as the reference computes it)."""
    p = np.asarray(pos, np.float32)
    return (np.log1p(np.floor((p + np.float32(1)) / np.float32(c.floor_scale))) * np.float32(c.attn_scale)
            + np.float32(1)).astype(np.float32)


class Llama4Decoder(MoeDecoder):
    def attention(self, l: int, h, pos: np.ndarray, st):
        c, ops, w = self.c, self.ops, self.w
        t, d = h.shape[0], c.head_dim
        q, k, v = ops.linear(h, w("q", l)), ops.linear(h, w("k", l)), ops.linear(h, w("v", l))
        if c.attention_bias:
            ops.add_(q, w("q_bias", l))
            ops.add_(k, w("k_bias", l))
            ops.add_(v, w("v_bias", l))
        q = np.ascontiguousarray(q[:, self.q_cols]).reshape(t, c.n_heads, d)
        k = np.ascontiguousarray(k[:, self.k_cols]).reshape(t, c.n_kv_heads, d)
        v = v.reshape(t, c.n_kv_heads, d)
        if l not in c.nope_layers:
            ops.rope(q, pos, self.inv_freq, c.rope.attention_factor)
            ops.rope(k, pos, self.inv_freq, c.rope.attention_factor)
            if c.qk_l2:
                ones = np.ones(d, np.float32)
                q, k = ops.rmsnorm(q, ones, c.rms_eps), ops.rmsnorm(k, ones, c.rms_eps)
        elif c.temperature:
            q = q * query_scales(c, pos)[:, None, None]
        ops.kv_store(st.k[l], st.v[l], int(pos[0]), k, v, self.kv_bf16)
        scale = d ** -0.5
        if l not in c.chunked_layers:
            a = ops.attention(q, st.k[l], st.v[l], pos, scale, 0, None)
        else:   # each query within its chunk: the chunk's rows, positions from its start
            a = np.empty(q.shape, np.float32)
            starts = (pos // c.chunk) * c.chunk
            for s in np.unique(starts):
                m = starts == s
                a[m] = ops.attention(np.ascontiguousarray(q[m]), st.k[l, s:], st.v[l, s:], pos[m] - s, scale, 0, None)
        return ops.linear(a.reshape(t, c.q_dim), w("o", l))


Model = Llama4Decoder
Config = Llama4Config
