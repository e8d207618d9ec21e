"""Qwen3-VL-MoE (the image-text wrapper, model.language_model.*) on text, against transformers
on the same weights: the layout transformers writes (fused experts [E, 2I, H] / [E, H, I]) and
the released one (fused and transposed: [E, H, 2I] / [E, I, H]), read directly and packed; the
vision tower skipped by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from conftest import assert_same_greedy, check_against, run_simulator_decoder, save_tiny, widen_init

TEXT = dict(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], rms_norm_eps=1e-6,
            max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
              out_hidden_size=48, num_position_embeddings=16, deepstack_visual_indexes=[0])


def build(dst, released: bool, dtype=torch.float32, **over):
    """A random Qwen3VLMoeForConditionalGeneration saved to dst in dtype (released: its fused
    experts rewritten transposed, as Qwen's releases store them); the model transformers loads
    back, in float32."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    model = tf.Qwen3VLMoeForConditionalGeneration(
        tf.Qwen3VLMoeConfig(text_config={**TEXT, **over}, vision_config=VISION))
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    widen_init(model)
    save_tiny(model, dst, dtype)
    if released:
        f = dst / "model.safetensors"
        t = load_file(f)
        for n in [n for n in t if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
            t[n] = t[n].transpose(1, 2).contiguous()
        save_file(t, f, metadata={"format": "pt"})
    return tf.Qwen3VLMoeForConditionalGeneration.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("released", [False, True])
def test_qwen3_vl_moe_matches_transformers(tmp_path, released, capfd):
    from safetensors import safe_open
    ref = build(tmp_path, released)
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        shape = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert shape == ([8, 48, 64] if released else [8, 64, 48])
    capfd.readouterr()
    m = engine.load(tmp_path, device="cpu")
    assert "qwen3_vl_moe: skipping the vision tower (" in capfd.readouterr().err
    assert m.config.moe_layers == (0, 2) and not any(n.startswith("model.visual.") for n in m.consumed)
    check_against(ref, m)


def test_released_layout_packs(tmp_path):
    """The transposed experts pack (each expert copied out on read) and give the same tokens. A
    bf16 checkpoint: packing one in float32 to bf16 blocks would round the experts (~1e-3, past
    the tie rule, which allows for summation order only)."""
    from engine.pack import pack
    build(tmp_path / "src", released=True, dtype=torch.bfloat16)
    pack(tmp_path / "src", tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 5).tolist()
    src = engine.load(tmp_path / "src", device="cpu")
    a = src.generate(ids, max_new_tokens=16).output_ids
    b = engine.load(tmp_path / "p", device="cpu")
    assert b.experts.stats()["source"] == "arena"
    assert_same_greedy(src, ids, b.generate(ids, max_new_tokens=16).output_ids, a, 16)


def test_simulator_decoder(tmp_path):
    """The cuda backend's eager decoder = the CPU backend (tests/test_families_cuda.py's check,
    in the CUDA simulator) on a tiny released-layout model."""
    # bf16, as the cuda backend builds bf16 expert blocks from a checkpoint
    build(tmp_path, released=True, dtype=torch.bfloat16, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
          head_dim=8, intermediate_size=8, moe_intermediate_size=8, num_experts=4, vocab_size=24,
          num_hidden_layers=2, mlp_only_layers=[0],
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    run_simulator_decoder(tmp_path)
