"""Qwen3-Omni (qwen3_omni_moe: the omni wrapper, thinker.*) on text against transformers' thinker
on the same weights: Qwen3-MoE's language model, the audio and vision encoders skipped by name."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import hf_logits, rel_err, save_tiny, widen_init

TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[1], max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
AUDIO = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
             output_dim=48, n_window=4, n_window_infer=8, downsample_hidden_size=8)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48,
              num_position_embeddings=16, deepstack_visual_indexes=[0])


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    cfg = tf.Qwen3OmniMoeConfig(thinker_config=dict(text_config={**TEXT, **over}, audio_config=AUDIO,
                                                    vision_config=VISION), enable_audio_output=False)
    model = tf.Qwen3OmniMoeForConditionalGeneration(cfg)
    widen_init(model)
    save_tiny(model, dst, dtype)
    return tf.Qwen3OmniMoeForConditionalGeneration.from_pretrained(dst, dtype=torch.float32).eval().thinker


def _greedy(ref, prompt, n):
    """The thinker's greedy continuation, a full forward a token (its generate() wants the
    wrapper's multimodal token ids)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(hf_logits(ref, ids)[-1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("over", [{}, dict(norm_topk_prob=False, mlp_only_layers=[], num_key_value_heads=4)],
                         ids=["0", "1"])
def test_matches_transformers(tmp_path, over, capfd):
    ref = build(tmp_path, **over)
    ids = np.random.default_rng().integers(0, 300, 14)
    capfd.readouterr()
    m = engine.load(tmp_path, device="cpu")
    err = capfd.readouterr().err
    assert "skipping the audio encoder" in err and "skipping the vision tower" in err
    assert m.config.norm_topk_prob == over.get("norm_topk_prob", True)
    assert rel_err(m.logits(ids), hf_logits(ref, ids)) < 1e-4
    assert m.generate(ids[:5].tolist(), max_new_tokens=12).output_ids == _greedy(ref, ids[:5].tolist(), 12)


@pytest.mark.gpu
def test_cuda_matches_transformers(tmp_path):
    ref = build(tmp_path, "bfloat16")
    ids = np.random.default_rng().integers(0, 300, 14)
    g = engine.load(tmp_path, device="cuda")
    assert rel_err(g.logits(ids), hf_logits(ref, ids)) < 1e-4
    assert g.generate(ids[:5].tolist(), max_new_tokens=12).output_ids == _greedy(ref, ids[:5].tolist(), 12)
