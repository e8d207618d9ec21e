"""engine.synth: every preset parses as its family; a preset cut down to a tiny size is written
as a packed folder that loads and generates (the CPU backend; the GPU benchmarks use the real
sizes)."""
from __future__ import annotations

import json

import pytest

from engine import synth as S
from engine.models import family_of
from engine.names import name


@pytest.mark.parametrize("preset", sorted(S.PRESETS))
def test_presets_parse(preset):
    c = family_of(S.PRESETS[preset]).config
    cfg = S.PRESETS[preset]
    k = cfg.get("num_experts_per_tok", cfg.get("moe_topk"))   # (Hunyuan's: a list, a value a layer)
    assert (c.hidden, c.n_layers, c.top_k) == (cfg["hidden_size"], cfg["num_hidden_layers"],
                                               k[0] if isinstance(k, list) else k)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite",
                                    "glm-4.7-flash", "minimax-m2", "llama-4-scout", "hunyuan-a13b",
                                    "mimo-v2-flash"])
def test_tiny_preset_packs_and_generates(tmp_path, monkeypatch, preset):
    import engine
    tiny = dict(S.PRESETS[preset], vocab_size=300, hidden_size=64, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tiny.update({"qwen3-30b-a3b": {"moe_intermediate_size": 32, "num_experts": 8},
                 "gpt-oss-20b": {"num_local_experts": 8},
                 "deepseek-v2-lite": {"moe_intermediate_size": 32, "n_routed_experts": 8,
                                      "kv_lora_rank": 32, "qk_rope_head_dim": 8,
                                      "qk_nope_head_dim": 16, "v_head_dim": 16},
                 "glm-4.7-flash": {"moe_intermediate_size": 32, "n_routed_experts": 8,
                                   "kv_lora_rank": 32, "q_lora_rank": 24, "qk_rope_head_dim": 8,
                                   "qk_nope_head_dim": 16, "v_head_dim": 24},
                 "minimax-m2": {"intermediate_size": 32, "num_local_experts": 8,
                                "rotary_dim": 8},
                 "llama-4-scout": {"intermediate_size": 32, "intermediate_size_mlp": 48, "num_local_experts": 8},
                 "hunyuan-a13b": {"intermediate_size": 32, "moe_intermediate_size": [32] * 32, "num_experts": 8},
                 "mimo-v2-flash": {"moe_intermediate_size": 32, "n_routed_experts": 8, "num_key_value_heads": 1,
                                   "swa_num_key_value_heads": 2, "v_head_dim": 8}}[preset])
    monkeypatch.setitem(S.PRESETS, preset, tiny)
    man = S.synth(preset, tmp_path / "m", "nvfp4", layers=2, progress=False)
    dense_first = preset.startswith(("deepseek", "glm", "mimo"))
    assert len(man["blocks"]) == (1 if dense_first else 2) * 8   # (a dense layer 0)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and len(cfg.get("layer_types", [0, 0])) == 2
    m = engine.load(tmp_path / "m", device="cpu")
    out = m.generate([1, 2, 3], max_new_tokens=4)
    assert len(out.output_ids) == 4
    if preset == "gpt-oss-20b":   # biases and sinks drawn near 0, norms near 1
        from loader.checkpoint import Checkpoint
        ck = Checkpoint(tmp_path / "m")
        assert abs(ck.get_f32(name("gpt_oss", "sinks", 0)).mean()) < 0.1
        assert abs(ck.get_f32(name("gpt_oss", "o_bias", 1)).mean()) < 0.1
        assert abs(ck.get_f32(name("gpt_oss", "attn_norm", 0)).mean() - 1.0) < 0.1
