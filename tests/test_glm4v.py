"""GLM-4.5V / GLM-4.6V (glm4v_moe: the image-text wrapper, model.language_model.*) on text
against transformers on the same weights: GLM-4.5's language model with partial RoPE, q/k/v
biases, sigmoid routing with a selection bias, shared experts, a dense first layer; the vision
tower skipped by name; on cuda, parity and graph replay."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import check_against, save_tiny, widen_init

TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1]})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2)


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    model = tf.Glm4vMoeForConditionalGeneration(tf.Glm4vMoeConfig(text_config={**TEXT, **over}, vision_config=VISION))
    widen_init(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)
    return tf.Glm4vMoeForConditionalGeneration.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("over", [{}, dict(attention_bias=False, n_group=1, n_shared_experts=2, norm_topk_prob=False)],
                         ids=["0", "1"])
def test_matches_transformers(tmp_path, over, capfd):
    ref = build(tmp_path, **over)
    capfd.readouterr()
    m = engine.load(tmp_path, device="cpu")
    assert "glm4v_moe: skipping the vision tower (" in capfd.readouterr().err
    assert m.config.attention_bias == over.get("attention_bias", True)
    check_against(ref, m, n_ids=14, n_new=16)


@pytest.mark.gpu
def test_cuda_matches_transformers(tmp_path):
    ref = build(tmp_path, "bfloat16")
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=14, n_new=16)
