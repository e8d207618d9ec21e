"""ERNIE-4.5-VL (ernie4_5_vl_moe: the image-text wrapper) on text against transformers on the
same weights: ERNIE-4.5's language model with modality-isolated experts (the text experts and
router alone; the release's transposed router and two-row bias read through dense_view), the
vision tower and resampler skipped by name; packed; on cuda, parity."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import check_against, rel_err, save_tiny, widen_init

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, moe_intermediate_size=[32, 16], moe_num_experts=4, moe_k=2, moe_num_shared_experts=2,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]})
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64)


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    model = tf.Ernie4_5_VLMoeForConditionalGeneration(tf.Ernie4_5_VLMoeConfig(text_config={**TEXT, **over},
                                                                             vision_config=VISION))
    widen_init(model)
    with torch.no_grad():
        for n, b in list(model.named_buffers()) + list(model.named_parameters()):
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)
    return tf.Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(dst, dtype=torch.float32).eval()


def test_matches_transformers(tmp_path, capfd):
    from engine.pack import pack
    from safetensors import safe_open
    ref = build(tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "np") as f:   # the layout as saved
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_shape() == [64, 4]
    capfd.readouterr()
    m = engine.load(tmp_path / "m", device="cpu")
    assert "ernie4_5_vl_moe: skipping the vision tower" in capfd.readouterr().err
    assert m.config.moe_layers == (1, 2) and m.config.moe_intermediate == 32 and m.config.tie_embeddings
    ids = check_against(ref, m, n_ids=14, n_new=16)
    build(tmp_path / "b", "bfloat16")   # packed: the dense layout read the same (bf16 experts: the same bits)
    pack(tmp_path / "b", tmp_path / "p", "bf16", progress=False)
    want = engine.load(tmp_path / "b", device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


@pytest.mark.gpu
def test_cuda_matches_transformers(tmp_path):
    ref = build(tmp_path, "bfloat16")
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=14, n_new=16)
