"""RoPE parameters from config.json and their inverse frequencies (default, linear, yarn,
llama3, longrope; dynamic NTK with a fixed alpha as the default kind with its stretched base)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class ConfigError(ValueError):
    """config.json is missing a field or holds a value the engine cannot run."""


def rope_params(cfg: dict) -> dict:
    """The rotary fields of config.json: newer configs nest everything in rope_parameters,
    older ones use rope_theta + rope_scaling."""
    return {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


def declared_partial(cfg: dict) -> float | None:
    """config.json's partial_rotary_factor (nested or at the top), or None where it has none."""
    got = rope_params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return None if got is None else float(got)


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int                 # dims of each head that rotate (partial rotary < head_dim)
    kind: str = "default"           # default | linear | yarn | llama3 | longrope
    factor: float = 1.0
    original_max_position: int = 0  # yarn: the pretraining context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0   # yarn: scales cos and sin
    truncate: bool = True
    low_freq_factor: float = 1.0    # llama3: wavelengths past original / low_freq_factor slowed
    high_freq_factor: float = 4.0   #   by factor, under original / high_freq_factor kept, between blended
    ext_factors: tuple = ()         # longrope: each frequency's divisor (short_factor: the reference
                                    #   computes its frequencies without a sequence length)

    @classmethod
    def from_hf(cls, cfg: dict, head_dim: int) -> "RopeConfig":
        params = rope_params(cfg)
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind == "dynamic" and params.get("alpha"):   # Hunyuan: a fixed NTK stretch of the base
            kind, alpha = "default", float(params["alpha"])
            theta = theta * alpha ** (head_dim / (head_dim - 2))
        partial = declared_partial(cfg)
        partial = 1.0 if partial is None else partial
        if kind not in ("default", "linear", "yarn", "llama3", "longrope"):
            raise ConfigError(f"config.json: rope type {kind!r} is not supported; "
                              "supported: default, linear, yarn, llama3, longrope, dynamic with a fixed alpha")
        factor = float(params.get("factor") or 1.0)
        orig = int(cfg.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 0))
        att = params.get("attention_factor")
        if kind == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if params.get(key) is None:
                    raise ConfigError(f"config.json: rope type llama3 without {key} in rope_parameters")
            orig = int(params["original_max_position_embeddings"])
            if float(params["high_freq_factor"]) < float(params["low_freq_factor"]):
                raise ConfigError("config.json: rope_parameters' high_freq_factor must be at least low_freq_factor")
        if kind == "yarn":
            if params.get("factor") is None:
                factor = cfg["max_position_embeddings"] / orig
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

            def get_mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if att is None:
                att = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                       if mscale and mscale_all else get_mscale(factor))
        ext = ()
        if kind == "longrope":
            ext = tuple(float(v) for v in params.get("short_factor") or ())
            if len(ext) != int(head_dim * partial) // 2:
                raise ConfigError(f"config.json: rope_parameters' short_factor must hold "
                                  f"{int(head_dim * partial) // 2} values (rotary dims / 2); got {len(ext)}")
            if params.get("factor") is None:
                factor = cfg.get("max_position_embeddings", orig) / orig
            if att is None:
                att = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return cls(theta=theta, rotary_dim=int(head_dim * partial), kind=kind, factor=factor, ext_factors=ext,
                   original_max_position=orig,
                   beta_fast=float(params.get("beta_fast") or 32.0),
                   beta_slow=float(params.get("beta_slow") or 1.0),
                   attention_factor=float(att) if att is not None else 1.0,
                   truncate=bool(params.get("truncate", True)),
                   low_freq_factor=float(params.get("low_freq_factor") or 1.0),
                   high_freq_factor=float(params.get("high_freq_factor") or 4.0))

    def inv_freq(self) -> np.ndarray:
        """float32 [rotary_dim / 2], computed in float32 as the reference does."""
        dim = self.rotary_dim
        pos_freqs = np.float32(self.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.kind == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.kind == "longrope":   # in float32, as the reference computes it
            return (np.float32(1.0) / (np.asarray(self.ext_factors, np.float32) * pos_freqs)).astype(np.float32)
        if self.kind == "llama3":   # in float32, as the reference computes it
            f, lo, hi = np.float32(self.factor), np.float32(self.low_freq_factor), np.float32(self.high_freq_factor)
            old = np.float32(self.original_max_position)
            wavelen = np.float32(2 * math.pi) / inv
            slow = np.where(wavelen > old / lo, inv / f, inv).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):   # hi == lo (Scout's): no band
                smooth = (old / wavelen - lo) / (hi - lo)
                blended = ((1 - smooth) * slow / f + smooth * slow).astype(np.float32)
            medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
            return np.where(medium, blended, slow).astype(np.float32)
        if self.kind == "yarn":
            def corr_dim(rot):
                return (dim * math.log(self.original_max_position / (rot * 2 * math.pi))) / (
                    2 * math.log(self.theta))
            low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
            extra = (1 - ramp).astype(np.float32)
            interp = (np.float32(1.0) / (np.float32(self.factor) * pos_freqs)).astype(np.float32)
            return (interp * (1 - extra) + inv * extra).astype(np.float32)
        return inv


def pairs_to_halves(r: int, d: int | None = None) -> np.ndarray:
    """Column order that gathers r rotary dims in interleaved pairs (x0, x1), (x2, x3)... into
    rotate-half order (x0, x2, ...), (x1, x3, ...); the dims from r to d (default r) stay."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, r if d is None else d)])


def pair_rows(c, key: str, a):
    """A q or k projection (weight [heads * D, H], bias or column index [heads * D]) of a model
    whose rotary dims come in interleaved pairs (c.rope_pairs: (x0, x1), (x2, x3)...) with its
    rows put in rotate-half order within each head (evens, then odds), so the rotate-half RoPE
    gives the same q . k; anything else as it is. (q / k norms over all heads would need their
    weights in the same order: no family has both.)"""
    if not getattr(c, "rope_pairs", False) or key not in ("q", "k"):
        return a
    a = np.asarray(a)
    r = c.rope.rotary_dim
    head = pairs_to_halves(r, c.head_dim)
    rows = (np.arange(a.shape[0] // c.head_dim)[:, None] * c.head_dim + head).ravel()
    return np.ascontiguousarray(a[rows])
