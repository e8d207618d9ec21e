"""Cohere's MoE (cohere2_moe, engine/models/cohere2_moe.py) on the CPU backend against
transformers on tiny random models: the parallel residual with one norm a layer (LayerNorm or
RMSNorm), RoPE over interleaved pairs in sliding and forced layers only, softmax or sigmoid
routing over the top-k logits, shared experts averaged or summed, the dense prefix, logit_scale."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import (check_against, check_packed_graph_replay, check_state_resumes, run_simulator_decoder, save_tiny,
                      widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
            sliding_window=4, sliding_window_pattern=2, first_k_dense_replace=1,
            prefix_dense_intermediate_size=24, pad_token_id=0, logit_scale=0.5)
CASES = [
    {},                                                             # LayerNorm, softmax, average
    dict(rms_norm_eps=1e-5, expert_selection_fn="sigmoid", shared_expert_combination_strategy="sum",
         tie_word_embeddings=False, prefix_dense_sliding_window_pattern=2, num_shared_experts=2),
    dict(expert_selection_fn="sigmoid", norm_topk_prob=False, num_shared_experts=0, first_k_dense_replace=0),
]


def build(dst, dtype: str = "float32", **over):
    """A random tiny Cohere2MoeForCausalLM (TINY with overrides) saved into dst in dtype, and
    transformers on it in float32."""
    import torch
    import transformers as tf
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    model = tf.Cohere2MoeForCausalLM(tf.Cohere2MoeConfig(**{**TINY, **over}))
    widen_init(model)
    save_tiny(model, dst, dtype)
    return tf.Cohere2MoeForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("over", CASES, ids=[str(i) for i in range(len(CASES))])
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref = build(tmp_path, **over)
    ids = check_against(ref, engine.load(tmp_path, device="cpu"), n_new=20)
    if not over:
        check_state_resumes(tmp_path, ids)


def test_config_read_and_refused():
    c = family_of({**TINY, "model_type": "cohere2_moe"}).config
    assert c.layer_windows == (0, 4, 0, 4) and c.nope_layers == (2,) and c.moe_layers == (1, 2, 3)
    assert c.layer_norm and c.average_shared and c.tie_embeddings and c.logit_scale == 0.5
    with pytest.raises(ConfigError, match="shared_expert_combination_strategy 'max'"):
        family_of({**TINY, "model_type": "cohere2_moe", "shared_expert_combination_strategy": "max"})
    with pytest.raises(ConfigError, match="layer_types must give each of the 4 layers"):
        family_of({**TINY, "model_type": "cohere2_moe", "layer_types": ["full_attention"]})


# the simulator's model: a forced-RoPE dense layer, a sliding routed one and a full one without
# RoPE; LayerNorm, softmax routing, a shared expert averaged in
SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=8, prefix_dense_intermediate_size=12,
           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
           max_position_embeddings=64)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_cohere.py) under NUMBA_ENABLE_CUDASIM=1 against the
    CPU backend on a bf16 build: tests/test_families_cuda.py's check, run as a script."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", CASES, ids=[str(i) for i in range(len(CASES))])
def test_cuda_matches_transformers(tmp_path, over):
    ref = build(tmp_path, "bfloat16", **over)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_new=20)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("over", CASES[:2], ids=["0", "1"])
def test_graph_replay_and_streaming(tmp_path, over, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them),
    resident or streamed under a tiny budget."""
    check_packed_graph_replay(tmp_path, resident, build,
                              **{**over, "hidden_size": 64, "num_experts": 16, "num_experts_per_tok": 4})
