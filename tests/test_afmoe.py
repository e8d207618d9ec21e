"""AFMoE (Arcee Trinity; engine/models/afmoe.py) on the CPU backend against transformers on tiny
random models: sandwich norms, the muP embedding scale, q / k norms, RoPE and windows of 4 in the
sliding layers only, the attention output gate, sigmoid routing with the expert bias times
route_scale, shared experts, dense first layers."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, hf_logits, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
            num_experts_per_tok=2, num_shared_experts=1, route_scale=2.5, global_attn_every_n_layers=2,
            sliding_window=4, mup_enabled=True, max_position_embeddings=256)
CASES = [{}, dict(mup_enabled=False, num_shared_experts=2, num_dense_layers=0, tie_word_embeddings=True,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])]
# the released config.json's fields the reference does not read, at the values it runs
RELEASED = dict(score_func="sigmoid", route_norm=True, n_group=1, topk_group=1, num_expert_groups=1,
                num_limited_groups=1, load_balance_coeff=0.001)


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"afmoe weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.AfmoeForCausalLM(tf.AfmoeConfig(**{**TINY, **over}))
    widen_init(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("expert_bias"):
                p.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)
    return tf.AfmoeForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("over", CASES, ids=["0", "1"])
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref = build(tmp_path, **over)
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref, m, n_ids=14, n_new=20)
    if not over:
        p = tmp_path / "config.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), **RELEASED}))
        assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), hf_logits(ref, ids)) < 1e-4
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


def test_config_read_and_refused():
    c = family_of({"model_type": "afmoe", **TINY}).config
    assert c.moe_layers == (1, 2, 3) and c.nope_layers == (1, 3) and c.layer_windows == (4, 0, 4, 0)
    assert c.mup and c.routed_scale == 2.5 and c.shared_intermediate == 16 and c.qk_norm == "head"
    with pytest.raises(ConfigError, match="score_func='softmax' is not supported"):
        family_of({"model_type": "afmoe", **TINY, "score_func": "softmax"})
    with pytest.raises(ConfigError, match="layer_types must give each of the 4 layers"):
        family_of({"model_type": "afmoe", **TINY, "layer_types": ["full_attention"]})


# the simulator's model: a dense sliding layer, a routed full one with a shared expert
SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=12, moe_intermediate_size=8, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, num_experts=4, sliding_window=2, max_position_embeddings=64)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_afmoe.py) under NUMBA_ENABLE_CUDASIM=1 against the CPU
    backend on a bf16 build: tests/test_families_cuda.py's check, run as a script."""
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
