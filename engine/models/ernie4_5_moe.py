"""ERNIE-4.5 MoE (ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B): softmax routing whose picks add a
selection bias to the probabilities (the weights are the probabilities, renormalized), shared
experts beside the routed ones, routed layers from moe_layer_start_index to moe_layer_end_index
every moe_layer_interval, RoPE over interleaved pairs (q / k rows reordered once at load:
rope.pair_rows), the embedding tied to the head by default. The MTP layer is skipped."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models import base
from engine.models.base import MoeConfig, MoeDecoder, expert_spec, need  # noqa: F401
from engine.models.rope import ConfigError
from engine.names import name


@dataclass(frozen=True)
class Ernie4_5MoeConfig(MoeConfig):
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "Ernie4_5MoeConfig":
        cfg = dict(cfg)
        if cfg.get("use_bias"):
            raise ConfigError("config.json: use_bias true (biases on every projection) is not "
                              "supported for ernie4_5_moe; the released models have none")
        norm_min = float(cfg.get("moe_norm_min") or 0.0)
        if norm_min > 1e-6:
            raise ConfigError(f"config.json: moe_norm_min={norm_min} is not supported; expected "
                              "at most 1e-6 (the top-k weights renormalized by their sum)")
        cfg.setdefault("num_experts", need(cfg, "moe_num_experts", "num_experts"))
        cfg.setdefault("num_experts_per_tok", need(cfg, "moe_k", "num_experts_per_tok"))
        cfg.setdefault("tie_word_embeddings", True)        # the reference's default
        f = MoeConfig.common_hf(cfg)
        n = f["n_layers"]
        start = int(cfg.get("moe_layer_start_index", 1))
        end = int(cfg.get("moe_layer_end_index", -1))
        end = n - 1 if end == -1 else end
        step = int(cfg.get("moe_layer_interval") or 1)
        moe_i = int(need(cfg, "moe_intermediate_size"))
        n_mtp = int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0)
        return cls(**{**f, "moe_layers": tuple(l for l in range(n)
                                               if (l + 1) % step == 0 and start <= l <= end)},
                   moe_intermediate=moe_i, dense_intermediate=int(need(cfg, "intermediate_size")),
                   norm_topk_prob=True, routing="softmax_bias", rope_pairs=True,
                   shared_intermediate=moe_i * int(cfg.get("moe_num_shared_experts", 2) or 0),
                   ignored_parts=(("mtp", "the multi-token-prediction (MTP) layer"),) if n_mtp else ())


def dense_spec(c: Ernie4_5MoeConfig) -> dict[str, tuple]:
    spec = base.dense_spec(c)
    for l in c.moe_layers:   # the selection bias is stored [1, E]
        spec[name(c.family, "router_bias", l)] = (1, c.n_experts)
    return spec


Model = MoeDecoder
Config = Ernie4_5MoeConfig
