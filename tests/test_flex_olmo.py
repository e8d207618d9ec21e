"""FlexOlmo (engine/models/flex_olmo.py, cuda: engine/gpu_flex_olmo.py) against transformers on
tiny random models: no norms before attention or the MLP, RMSNorms of their outputs before each
residual add, RMSNorms over the whole q and k projections, softmax top-k routing with and without
renormalization."""
from __future__ import annotations


import numpy as np
import pytest

import engine
from conftest import (check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            pad_token_id=0, eos_token_id=1)
CASES = [{}, dict(norm_topk_prob=True, num_key_value_heads=4, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})]


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"flex_olmo weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.FlexOlmoForCausalLM(tf.FlexOlmoConfig(**{**TINY, **over}))
    widen_init(model)
    save_tiny(model, dst, dtype)
    return tf.FlexOlmoForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()



@pytest.mark.parametrize("over", CASES, ids=["0", "1"])
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref = build(tmp_path, **over)
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref, m, n_ids=14, n_new=20)
    if not over:
        check_state_resumes(tmp_path, ids)
        check_prefill_equals_token_by_token(m.model, ids)


def test_packed(tmp_path):
    """A bf16 checkpoint packed with bf16 experts gives its logits."""
    from engine.pack import pack
    build(tmp_path / "src", "bfloat16")
    pack(tmp_path / "src", tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 12)
    want = engine.load(tmp_path / "src", device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_config_read():
    c = family_of({"model_type": "flex_olmo", **TINY}).config
    assert c.moe_layers == (0, 1, 2) and c.qk_norm == "full" and not c.norm_topk_prob and c.rms_eps == 1e-6


def test_missing_post_norm_named(tmp_path):
    """A checkpoint without a layer's output norm is refused, naming the tensor."""
    from safetensors.numpy import load_file, save_file
    build(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    t = load_file(f)
    del t["model.layers.1.post_feedforward_layernorm.weight"]
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(Exception, match="post_feedforward_layernorm"):
        engine.load(tmp_path, device="cpu")


SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, num_experts=4, max_position_embeddings=64)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_flex_olmo.py) under NUMBA_ENABLE_CUDASIM=1 against the
    CPU backend on a bf16 build: tests/test_families_cuda.py's check, run as a script."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", CASES, ids=["0", "1"])
def test_cuda_matches_transformers(tmp_path, over):
    ref = build(tmp_path, "bfloat16", **over)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them),
    resident or streamed under a tiny budget: the MoE output's own buffer and norm in every path."""
    check_packed_graph_replay(tmp_path, resident, build, hidden_size=64, num_experts=16, num_experts_per_tok=4)
