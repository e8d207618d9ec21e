"""Model families: model_type -> (config class, model class). One small file per family."""
from __future__ import annotations

from engine.models import mixtral, olmoe, qwen3_moe
from engine.models.rope import ConfigError

FAMILIES = {
    "qwen3_moe": (qwen3_moe.Qwen3MoeConfig, qwen3_moe.Model),
    "mixtral": (mixtral.MixtralConfig, mixtral.Model),
    "olmoe": (olmoe.OlmoeConfig, olmoe.Model),
}


def family_of(cfg: dict):
    """(config, model class) for a config.json dict; refuses unknown model types by name."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"config.json: model_type {mt!r} is not supported; "
                          f"supported: {', '.join(sorted(FAMILIES))}")
    conf_cls, model_cls = FAMILIES[mt]
    return conf_cls.from_hf(cfg), model_cls
