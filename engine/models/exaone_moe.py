"""K-EXAONE (exaone_moe, LG AI Research's K-EXAONE-236B-A23B): Qwen3's attention (per-head q/k
RMSNorm) with DeepSeek-V3's MoE (sigmoid routing with a selection bias and groups, scaled weights,
shared experts, the first layers dense), in sliding-window layers with RoPE and full-attention
layers without it (NoPE) wherever a window is configured: layer_types, else
sliding_window_pattern (an int n: every n-th layer full; or letters, L sliding and G full, a
layer each, repeating). Both backends run it."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import MoeConfig, MoeDecoder, dense_spec, expert_spec  # noqa: F401
from engine.models.glm4_moe import sigmoid_moe
from engine.models.rope import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg: dict, n: int, window) -> list:
    """Each layer's attention, as transformers' ExaoneMoeConfig derives it (a letter pattern too)."""
    types = cfg.get("layer_types")
    if types is None:
        if not window:
            return [FULL] * n
        pattern = cfg.get("sliding_window_pattern", 4)
        if isinstance(pattern, str):
            if not pattern or set(pattern) - {"L", "G"}:
                raise ConfigError(f"config.json: sliding_window_pattern {pattern!r}; expected an "
                                  "integer or letters L (sliding) and G (full)")
            return [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(n)]
        pattern = int(pattern or 0)
        if pattern < 1:
            raise ConfigError(f"config.json: sliding_window_pattern {pattern}; expected at least 1")
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ConfigError(f"config.json: layer_types must give each of the {n} layers {SLIDING} or "
                          f"{FULL}; got {types}")
    return list(types)


@dataclass(frozen=True)
class ExaoneMoeConfig(MoeConfig):
    ignored_parts: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "ExaoneMoeConfig":
        cfg = dict(cfg)
        cfg.setdefault("n_shared_experts", cfg.get("num_shared_experts", 1))
        cfg.setdefault("routed_scaling_factor", 2.5)          # transformers' defaults
        cfg.setdefault("rms_norm_eps", 1e-5)
        f = MoeConfig.common_hf(cfg)
        f.update(sigmoid_moe(cfg, f, first_dense=1, shared=1, norm=True))
        n = f["n_layers"]
        mlp = cfg.get("mlp_layer_types")
        if mlp is not None:
            if len(mlp) != n or any(t not in ("dense", "sparse") for t in mlp):
                raise ConfigError(f"config.json: mlp_layer_types must give each of the {n} layers "
                                  f"dense or sparse; got {mlp}")
            f["moe_layers"] = tuple(l for l, t in enumerate(mlp) if t == "sparse")
        window = cfg.get("sliding_window", 4096)
        types = layer_types(cfg, n, window)
        if SLIDING in types and not window:
            raise ConfigError(f"config.json: layer_types has {SLIDING} layers but sliding_window "
                              f"is {window!r}")
        windows = tuple(int(window) if t == SLIDING else 0 for t in types)
        nope = tuple(l for l, t in enumerate(types) if t == FULL) if window else ()
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        return cls(**f, qk_norm="head", layer_windows=windows, nope_layers=nope,
                   ignored_parts=(("mtp.", "the multi-token-prediction (MTP) layers"),) if n_mtp else ())


Model = MoeDecoder
Config = ExaoneMoeConfig
