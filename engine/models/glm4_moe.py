"""GLM-4.5 (GLM-4.5-Air, GLM-4.5, GLM-4.6): sigmoid routing with a selection bias (group-limited, scaled
weights), ungated shared experts, partial RoPE, q/k/v biases, optional per-head q/k RMSNorm, the
first layers dense."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec, need  # noqa: F401
from engine.models.rope import ConfigError, declared_partial


def sigmoid_moe(cfg: dict, f: dict, first_dense: int, shared: int, norm: bool) -> dict:
    """DeepSeek-V3's MoE fields (GLM-4.5, dots.llm1) from config.json, checked: sigmoid routing
    with a selection bias among the topk_group best of n_group groups, scaled weights, shared
    experts, the first layers dense. first_dense, shared, norm: the family's defaults for
    first_k_dense_replace, n_shared_experts and norm_topk_prob."""
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if f["n_experts"] % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(f"config.json: n_group={n_group} must divide n_routed_experts="
                          f"{f['n_experts']} and topk_group={topk_group} be in 1..{n_group}")
    if n_group > 1 and f["n_experts"] // n_group < 2:
        raise ConfigError(f"config.json: n_group={n_group} leaves fewer than 2 experts a group")
    if n_group > 32:
        raise ConfigError(f"config.json: n_group={n_group}; at most 32 expert groups")
    kept = topk_group * (f["n_experts"] // n_group)
    if f["top_k"] > kept:
        raise ConfigError(f"config.json: num_experts_per_tok={f['top_k']} exceeds the {kept} "
                          f"experts of the topk_group={topk_group} groups kept")
    moe_i = int(need(cfg, "moe_intermediate_size"))
    first = cfg.get("first_k_dense_replace")
    n_shared = cfg.get("n_shared_experts")
    norm_topk = cfg.get("norm_topk_prob")
    return dict(moe_layers=tuple(range(first_dense if first is None else int(first),
                                       f["n_layers"])),
                moe_intermediate=moe_i, dense_intermediate=int(cfg.get("intermediate_size") or 0),
                norm_topk_prob=norm if norm_topk is None else bool(norm_topk),
                routing="sigmoid", n_group=n_group, topk_group=topk_group,
                routed_scale=float(cfg.get("routed_scaling_factor") or 1.0),
                shared_intermediate=moe_i * (shared if n_shared is None else int(n_shared)))


def with_experts(cfg: dict) -> dict:
    """config.json with num_experts set from n_routed_experts (common_hf's field)."""
    cfg = dict(cfg)
    cfg.setdefault("num_experts", need(cfg, "n_routed_experts", "num_local_experts"))
    return cfg


@dataclass(frozen=True)
class Glm4MoeConfig(MoeConfig):
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "Glm4MoeConfig":
        cfg = with_experts(cfg)
        if declared_partial(cfg) is None:
            cfg["partial_rotary_factor"] = 0.5            # the reference's default
        f = MoeConfig.common_hf(cfg)
        f.update(sigmoid_moe(cfg, f, first_dense=1, shared=1, norm=True))   # the reference's defaults
        n_mtp = int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0)
        mtp = tuple((f"model.layers.{f['n_layers'] + i}.",
                     "the multi-token-prediction (MTP) layer") for i in range(n_mtp))
        return cls(**f, qk_norm="head" if cfg.get("use_qk_norm") else "none", ignored_parts=mtp)


Model = MoeDecoder
Config = Glm4MoeConfig
