"""Phi-3.5-MoE (engine/models/phimoe.py) on the CPU backend against transformers on tiny random
models: LayerNorms with bias, q / k / v / o and lm_head biases, sparsemixer routing (top-2),
longrope frequencies and mscale, a sliding window."""
from __future__ import annotations


import numpy as np
import pytest

import engine
from conftest import (check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError
from kernels_numba import reference as ref

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
HALF = 4   # head_dim 8: four rotary frequencies
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                short_factor=[1.0, 1.3, 2.1, 3.5], long_factor=[1.1, 2.0, 4.0, 8.0],
                short_mscale=1.2, long_mscale=1.2)
CASES = [dict(attention_bias=True, lm_head_bias=True, rope_parameters=LONGROPE),
         dict(sliding_window=5, router_jitter_noise=0.3)]


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"phimoe weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.PhimoeForCausalLM(tf.PhimoeConfig(**{**TINY, **over}))
    widen_init(model)
    with torch.no_grad():   # LayerNorm and o biases away from their zero init
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.1)
    save_tiny(model, dst, dtype)
    return tf.PhimoeForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()



@pytest.mark.parametrize("over", CASES, ids=["biases-longrope", "window-jitter"])
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref = build(tmp_path, **over)
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref, m, n_ids=14, n_new=20)
    if over is CASES[0]:
        check_state_resumes(tmp_path, ids)
        check_prefill_equals_token_by_token(m.model, ids)


def test_sparsemixer_matches_reference():
    """The routing's oracle (kernels_numba/reference.py) on fresh logits against the reference's:
    some rows with near ties, all-negative ones."""
    import torch
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as ref_mixer
    rng = np.random.default_rng()
    logits = rng.normal(0, 1, (64, 16)).astype(np.float32)
    logits[:8] -= 5.0
    logits[8:16, 3] = logits[8:16, 7] + rng.uniform(0, 0.01, 8).astype(np.float32)
    for eps in (0.01, 0.3):
        w_ref, ids_ref = ref_mixer(torch.tensor(logits), jitter_eps=eps, training=False)
        ids, w = ref.router_sparsemixer(logits, eps)
        assert np.array_equal(ids, ids_ref.numpy())
        assert np.allclose(w, w_ref.numpy(), rtol=1e-6, atol=1e-7)


def test_packed(tmp_path):
    """A bf16 checkpoint packed with bf16 experts gives its logits."""
    from engine.pack import pack
    build(tmp_path / "src", "bfloat16", attention_bias=True, lm_head_bias=True)
    pack(tmp_path / "src", tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 12)
    want = engine.load(tmp_path / "src", device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_config_read_and_refused():
    c = family_of({"model_type": "phimoe", **TINY, "rope_parameters": LONGROPE}).config
    assert c.rope.kind == "longrope" and c.rope.attention_factor == 1.2 and len(c.rope.ext_factors) == HALF
    with pytest.raises(ConfigError, match="picks exactly 2 experts"):
        family_of({"model_type": "phimoe", **TINY, "num_experts_per_tok": 3})
    with pytest.raises(ConfigError, match="long_mscale 1.5 differs from short_mscale"):
        family_of({"model_type": "phimoe", **TINY, "rope_parameters": {**LONGROPE, "long_mscale": 1.5}})
    with pytest.raises(ConfigError, match="short_factor must hold 4 values"):
        family_of({"model_type": "phimoe", **TINY, "rope_parameters": {**LONGROPE, "short_factor": [1.0]}})


SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, num_local_experts=4, max_position_embeddings=64, attention_bias=True,
           lm_head_bias=True, router_jitter_noise=0.3,
           rope_parameters=LONGROPE)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_phimoe.py) under NUMBA_ENABLE_CUDASIM=1 against the CPU
    backend on a bf16 build: tests/test_families_cuda.py's check, run as a script."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", CASES, ids=["biases-longrope", "window-jitter"])
def test_cuda_matches_transformers(tmp_path, over):
    ref = build(tmp_path, "bfloat16", **over)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them),
    resident or streamed under a tiny budget: the LayerNorms' biases, the sparsemixer with the
    device slot table, the lm_head bias in every path."""
    check_packed_graph_replay(tmp_path, resident, build, hidden_size=64, num_local_experts=16, **CASES[0])
