"""The CPU engine against transformers on the same weights: logits and greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from conftest import assert_greedy, build_hf_model, hf_reference, rel_err

CASES = [
    # K-EXAONE: sliding layers (window 4) with RoPE, full ones without; explicit layer_types;
    # every layer full (all NoPE)
    ("exaone_moe", {}),
    ("exaone_moe", dict(layer_types=["full_attention", "sliding_attention", "full_attention"],
                        n_group=1, topk_group=1, num_experts_per_tok=3, norm_topk_prob=False)),
    ("exaone_moe", dict(sliding_window_pattern=1)),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(hidden_size=40, norm_topk_prob=True, num_experts_per_tok=1)),
    ("qwen3_moe", dict(num_experts_per_tok=4, norm_topk_prob=False, num_key_value_heads=1,
                       tie_word_embeddings=True)),
    ("qwen3_moe", dict(num_key_value_heads=4, mlp_only_layers=[0], hidden_size=72)),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 64})),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0})),
    ("mixtral", {}),
    ("mixtral", dict(num_attention_heads=8, num_key_value_heads=2, num_experts_per_tok=4,
                     tie_word_embeddings=True, sliding_window=6)),
    ("qwen2_moe", {}),
    ("qwen2_moe", dict(norm_topk_prob=True, qkv_bias=False, mlp_only_layers=[0],
                       num_key_value_heads=4, tie_word_embeddings=True)),
    ("glm4_moe", {}),
    ("glm4_moe", dict(n_group=4, topk_group=2, num_experts_per_tok=3, use_qk_norm=True,
                      routed_scaling_factor=2.5, first_k_dense_replace=0, attention_bias=False,
                      partial_rotary_factor=0.25, n_shared_experts=2)),
    ("glm4_moe", dict(norm_topk_prob=False, n_shared_experts=0, tie_word_embeddings=True)),
    ("dots1", {}),
    ("dots1", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.0,
                   first_k_dense_replace=0, n_shared_experts=2)),
    ("deepseek_v3", {}),
    ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, attention_bias=True,
                         n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=0,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                          "factor": 4.0, "original_max_position_embeddings": 64,
                                          "mscale": 0.8, "mscale_all_dim": 0.7})),
    # a large rms_norm_eps: the latent norms keep transformers' 1e-6 (engine.models.deepseek_v3)
    ("deepseek_v3", dict(norm_topk_prob=False, n_shared_experts=2, num_attention_heads=6,
                         routed_scaling_factor=1.5, tie_word_embeddings=True, rms_norm_eps=0.05)),
    ("deepseek_v2", {}),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                         num_experts_per_tok=3, routed_scaling_factor=2.0, q_lora_rank=20,
                         n_shared_experts=2, first_k_dense_replace=0)),
    ("glm4_moe_lite", {}),
    ("glm4_moe_lite", dict(mlp_layer_types=["sparse", "dense", "sparse"], n_group=4, topk_group=2,
                           num_experts_per_tok=3, routed_scaling_factor=2.5, q_lora_rank=None,
                           n_shared_experts=2, num_attention_heads=6, rms_norm_eps=0.05)),
    ("minimax_m2", {}),
    ("minimax_m2", dict(num_key_value_heads=1, num_experts_per_tok=4, rotary_dim=16,
                        tie_word_embeddings=True)),
    ("ernie4_5_moe", {}),
    ("ernie4_5_moe", dict(moe_num_shared_experts=0, moe_layer_start_index=0, moe_layer_interval=2,
                          moe_k=3, num_key_value_heads=1, tie_word_embeddings=True)),
    ("olmoe", {}),
    ("olmoe", dict(norm_topk_prob=True, clip_qkv=0.5, num_key_value_heads=4)),
    ("solar_open", {}),
    ("solar_open", dict(n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=False, num_key_value_heads=1,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
                                         "original_max_position_embeddings": 64})),
    ("hunyuan_v1_moe", {}),
    ("hunyuan_v1_moe", dict(moe_topk=1, tie_word_embeddings=True, num_key_value_heads=4)),
    ("gpt_oss", {}),
    ("gpt_oss", dict(num_experts_per_tok=3, num_key_value_heads=4, sliding_window=5,
                     swiglu_limit=0.5, swiglu_alpha=1.2,
                     layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
]


def ids_for(seed=None, n=12, vocab=300):
    return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.mark.parametrize("family,over", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_logits_and_greedy_match_transformers(tmp_path, family, over):
    build_hf_model(tmp_path, family, **over)
    ref = hf_reference(tmp_path)
    m = engine.load(tmp_path, device="cpu")
    ids = ids_for()
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    got = m.logits(ids)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-4
    res = m.generate(ids[:5].tolist(), max_new_tokens=32, temperature=0)
    assert_greedy(ref, ids[:5].tolist(), res.output_ids, 32)


def test_sharded_checkpoint(tmp_path):
    build_hf_model(tmp_path, "qwen3_moe", max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ref = hf_reference(tmp_path)
    ids = ids_for()
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), want) < 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "glm4_moe", "qwen2_moe", "dots1",
                                    "gpt_oss", "deepseek_v3", "deepseek_v2", "glm4_moe_lite",
                                    "minimax_m2", "ernie4_5_moe"])
def test_bf16_checkpoint(tmp_path, family):
    build_hf_model(tmp_path, family, dtype="bfloat16")
    ref = hf_reference(tmp_path)  # the same bf16 weights, upcast to float32
    m = engine.load(tmp_path, device="cpu")
    ids = ids_for()
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(m.logits(ids), want) < 1e-4
    assert_greedy(ref, ids[:5].tolist(), m.generate(ids[:5].tolist(), max_new_tokens=32).output_ids, 32)


def test_glm4_config_refusals(tmp_path):
    """A top-k the kept expert groups cannot fill, and more than 32 groups: refused by name."""
    import json

    from engine.models import family_of
    from engine.models.rope import ConfigError
    build_hf_model(tmp_path, "glm4_moe", n_routed_experts=16, n_group=4, topk_group=1,
                   num_experts_per_tok=4)
    cfg = json.loads((tmp_path / "config.json").read_text())
    family_of(cfg)                                   # 4 of the 4 kept: fine
    with pytest.raises(ConfigError, match="num_experts_per_tok=6 exceeds the 4 experts"):
        family_of({**cfg, "num_experts_per_tok": 6})
    with pytest.raises(ConfigError, match="n_group=64; at most 32"):
        family_of({**cfg, "n_routed_experts": 128, "n_group": 64, "topk_group": 4})


# config.json fields as the released folders write them (older than transformers' own config
# classes): the engine and transformers must read them alike
RELEASED = {
    # MiniMax-M2: rotary_dim and rope_theta at the top, the remote code's switches
    "minimax_m2": dict(rotary_dim=4, rope_theta=5e6, use_qk_norm=True, qk_norm_type="per_layer",
                       scoring_func="sigmoid", use_routing_bias=True, shared_intermediate_size=0,
                       attn_type_list=[1, 1], use_mtp=True, num_mtp_modules=3, sliding_window=None),
    # GLM-4.7-Flash: first_k_dense_replace and no mlp_layer_types, one MTP layer
    "glm4_moe_lite": dict(first_k_dense_replace=1, partial_rotary_factor=1.0, topk_method="noaux_tc",
                          num_nextn_predict_layers=1, rope_theta=1e6),
    # Hunyuan-A13B: per-layer lists (uniform), its switches, rope_scaling with alpha and YaRN's unread fields
    "hunyuan_v1_moe": dict(moe_topk=[2, 2], num_experts=4, moe_intermediate_size=[32, 32], num_shared_expert=[1, 1],
                           use_qk_norm=True, use_mixed_mlp_moe=True, use_cla=False, cla_share_factor=1,
                           attention_head_dim=16, rope_theta=10000.0,
                           rope_scaling={"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"}),
    # Solar-Open-100B: the fields its reference deletes, a yarn rope_scaling at the top
    "solar_open": dict(first_k_dense_replace=1, intermediate_size=64, use_qk_norm=True, num_mtp_layers=0,
                       partial_rotary_factor=1.0, rope_theta=1e6,
                       rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("family", sorted(RELEASED))
def test_released_config_fields(tmp_path, family):
    import json
    build_hf_model(tmp_path, family)
    p = tmp_path / "config.json"
    cfg = json.loads(p.read_text())
    for k in ("rope_parameters", "mlp_layer_types"):
        cfg.pop(k, None)
    p.write_text(json.dumps({**cfg, **RELEASED[family]}))
    ref = hf_reference(tmp_path)
    ids = ids_for()
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), want) < 1e-4


def test_minimax_m2_glm4_lite_and_ernie_configs():
    from engine.models import family_of
    from engine.models.rope import ConfigError
    mm = dict(model_type="minimax_m2", vocab_size=300, hidden_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
              num_local_experts=8, num_experts_per_tok=2, rotary_dim=8)
    assert family_of(mm).config.rope.rotary_dim == 8
    for bad, match in ((dict(attn_type_list=[0, 1]), "attn_type_list"),
                       (dict(qk_norm_type="per_head"), "qk_norm_type 'per_head'"),
                       (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
                       (dict(shared_intermediate_size=64), "shared_intermediate_size")):
        with pytest.raises(ConfigError, match=match):
            family_of({**mm, **bad})
    lite = dict(model_type="glm4_moe_lite", vocab_size=300, hidden_size=48, num_hidden_layers=3,
                num_attention_heads=4, intermediate_size=64, moe_intermediate_size=32,
                n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24,
                qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=20)
    assert family_of(lite).config.moe_layers == (1, 2)
    assert family_of({**lite, "mlp_layer_types": ["sparse", "dense", "sparse"]}).config.moe_layers == (0, 2)
    for bad, match in ((dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
                       (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5")):
        with pytest.raises(ConfigError, match=match):
            family_of({**lite, **bad})
    ernie = dict(model_type="ernie4_5_moe", vocab_size=300, hidden_size=48, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                 moe_intermediate_size=32, moe_num_experts=8, moe_k=2, moe_layer_start_index=1,
                 moe_layer_end_index=4, moe_layer_interval=2, moe_num_shared_experts=2)
    c = family_of(ernie).config
    assert (c.moe_layers, c.tie_embeddings, c.shared_intermediate) == ((1, 3), True, 64)
    for bad, match in ((dict(use_bias=True), "use_bias"), (dict(moe_norm_min=0.1), "moe_norm_min")):
        with pytest.raises(ConfigError, match=match):
            family_of({**ernie, **bad})
