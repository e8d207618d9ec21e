"""MiniCPM5-MoE (engine/models/minicpm5_moe.py) against transformers on tiny random models:
gated attention (q_proj gives each head its query and gate), DeepSeek-V3's routing in groups with
shared experts, dense layers; the cuda decoder (engine/gpu_minicpm.py) under the simulator and on
a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import check_against, check_packed_graph_replay, run_simulator_decoder, save_tiny, widen_init

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, max_position_embeddings=256)
CASES = [{}, dict(mlp_layer_types=["sparse", "dense", "sparse"], n_group=1, routed_scaling_factor=1.0,
                  n_shared_experts=2, norm_topk_prob=False)]


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    model = tf.MiniCPM5MoeForCausalLM(tf.MiniCPM5MoeConfig(**{**TINY, **over}))
    widen_init(model)
    with torch.no_grad():
        for n, b in list(model.named_buffers()) + list(model.named_parameters()):
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)
    return tf.MiniCPM5MoeForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("over", CASES, ids=["0", "1"])
def test_matches_transformers(tmp_path, over):
    ref = build(tmp_path, **over)
    check_against(ref, engine.load(tmp_path, device="cpu"), n_ids=14, n_new=16)


SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, n_routed_experts=4, n_group=1, topk_group=1,
           max_position_embeddings=64)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder under NUMBA_ENABLE_CUDASIM=1 against the CPU backend on a bf16
    build: tests/test_families_cuda.py's check, run as a script."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", CASES, ids=["0", "1"])
def test_cuda_matches_transformers(tmp_path, over):
    ref = build(tmp_path, "bfloat16", **over)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=14, n_new=16)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    check_packed_graph_replay(tmp_path, resident, build, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                              topk_group=2)
