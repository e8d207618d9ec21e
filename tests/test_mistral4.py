"""Mistral Small 4 (engine/models/mistral4.py: DeepSeek-V3's decoders) on the CPU backend against
transformers on tiny random models: softmax routing in DeepSeek-V3's groups (no selection bias),
renormalized or not, scaled; the queries scaled by position (llama_4_scaling_beta, a period of a
few tokens so it bites); YaRN and plain RoPE, interleaved or not; low-rank q or q_proj; biases;
the reference's default rope_parameters; config defaults and refusals; the cuda decoder
(engine/gpu_mla.py) under the simulator and, marked gpu, on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError
from kernels_numba import reference as ref

TINY = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=256,
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3}
# YaRN with the queries' scale stepping every 4 positions, groups of 4 (one kept), scaled; q_proj,
# one group, the weights not renormalized, RoPE halves not interleaved, q_a / kv_a / o biases, two
# shared experts, top-3, linear RoPE with a period of 3; 16 experts in 4 groups (2 kept), top-4, no
# dense layer, tied embeddings and the reference's default rope_parameters (the release's YaRN,
# whose scale does not step within 8192 positions)
CASES = [dict(rope_parameters=YARN, routed_scaling_factor=1.5),
         dict(q_lora_rank=None, n_group=1, norm_topk_prob=False, rope_interleave=False, attention_bias=True,
              n_shared_experts=2, num_experts_per_tok=3, routed_scaling_factor=2.0,
              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0,
                               "llama_4_scaling_beta": 0.2, "original_max_position_embeddings": 3}),
         dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=0,
              tie_word_embeddings=True)]
IDS = ["yarn-scaled", "qproj-plain-biases", "groups-tied-default-rope"]


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"mistral4 weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.Mistral4ForCausalLM(tf.Mistral4Config(**{**TINY, **over}))
    widen_init(model)
    with torch.no_grad():   # biases away from their zero init
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
    save_tiny(model, dst, dtype)
    return tf.Mistral4ForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref_model = build(tmp_path, **over)
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref_model, m, n_ids=16, n_new=24)
    if over is CASES[0]:
        check_prefill_equals_token_by_token(m.model, ids)
        check_state_resumes(tmp_path, ids)


def test_routing_matches_reference():
    """The routing's oracle (reference.router_sigmoid_topk's softmax form, a zero bias) on fresh
    logits against transformers' Mistral4TopkRouter (its weight the identity: the logits are its
    input), groups or none, renormalized or not, scaled. The reference's picks come unsorted:
    compared as sets, each with its weight."""
    import torch
    import transformers as tf
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter
    e = 16
    logits = (np.random.default_rng().standard_normal((32, e)) * 2).astype(np.float32)
    for groups, kept, k, norm, scale in ((1, 1, 4, True, 1.0), (4, 2, 3, True, 2.5), (8, 3, 4, False, 1.5)):
        router = Mistral4TopkRouter(tf.Mistral4Config(**{**TINY, "hidden_size": e, "n_routed_experts": e,
                                                         "n_group": groups, "topk_group": kept,
                                                         "num_experts_per_tok": k, "norm_topk_prob": norm,
                                                         "routed_scaling_factor": scale}))
        with torch.no_grad():
            router.weight.copy_(torch.eye(e))
            _, w_ref, ids_ref = router(torch.tensor(logits))
        ids, w = ref.router_sigmoid_topk(logits, np.zeros(e), k, groups, kept, norm, scale, softmax=True)
        o_ref, o = np.argsort(ids_ref.numpy(), axis=1), np.argsort(ids, axis=1)
        assert np.array_equal(np.take_along_axis(ids, o, 1), np.take_along_axis(ids_ref.numpy(), o_ref, 1))
        assert np.allclose(np.take_along_axis(w, o, 1), np.take_along_axis(w_ref.numpy(), o_ref, 1),
                           rtol=1e-5, atol=1e-7), (groups, kept, k, norm)


def test_packed(tmp_path):
    """A bf16 arena packed from a checkpoint (its weights bf16 values) gives that checkpoint's
    logits: the fused experts per (layer, expert), the latent attention dense."""
    from engine.pack import pack
    build(tmp_path / "f32", **CASES[2])
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 16)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


# Mistral-Small-4-119B-2603's text shapes (transformers' Mistral4Config defaults), no rope_parameters
RELEASE = dict(model_type="mistral4", vocab_size=131072, hidden_size=4096, intermediate_size=12288,
               moe_intermediate_size=2048, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=32,
               n_shared_experts=1, n_routed_experts=128, kv_lora_rank=256, qk_rope_head_dim=64, v_head_dim=128,
               qk_nope_head_dim=64, num_experts_per_tok=4, max_position_embeddings=1048576, eos_token_id=2)


def test_config_read_and_refused():
    """Where config.json leaves them out, transformers' defaults: low-rank q of 1024, every layer
    routed, one group, renormalized, and YaRN (factor 128 over 8192, mscale_all_dim 1: the softmax
    scale times (0.1 ln 128 + 1) squared) with the queries' scale (beta 0.1 every 8192 positions);
    refusals by field."""
    fam = family_of(RELEASE)
    c = fam.config
    assert (c.routing, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scale) == ("softmax_grouped", 1, 1,
                                                                                      True, 1.0)
    assert (c.q_lora_rank, c.kv_lora_rank, c.head_dim, c.n_kv_heads, c.kv_tensors) == (1024, 256, 320, 1, 1)
    assert c.moe_layers == tuple(range(36)) and c.shared_intermediate == 2048 and c.rms_eps == 1e-6
    assert (c.rope.kind, c.rope.rotary_dim, c.rope.factor, c.rope.original_max_position, c.rope.theta) == \
        ("yarn", 64, 128.0, 8192, 10000.0)
    m = 0.1 * np.log(128) + 1
    assert c.softmax_scale == pytest.approx(128 ** -0.5 * m * m)
    assert (c.query_scale_beta, c.query_scale_period) == (0.1, 8192)
    assert not any("e_score_correction_bias" in n for n in fam.dense_spec)
    assert fam.dense_spec["model.layers.0.self_attn.q_b_proj.weight"] == (32 * 128, 1024)
    c = family_of({**RELEASE, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
                   "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": None,
                   "first_k_dense_replace": None}).config
    assert (c.query_scale_beta, c.rope.kind, c.rope.rotary_dim, c.q_lora_rank) == (0.0, "linear", 64, 0)
    assert c.moe_layers == tuple(range(36))
    linear = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    refused = [
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported; mistral4 runs silu"),
        (dict(rope_parameters={**linear, "partial_rotary_factor": 0.25}),
         "partial_rotary_factor 0.25 rotates 32 of the 128 query dims; mistral4 rotates qk_rope_head_dim=64"),
        (dict(rope_parameters={**linear, "llama_4_scaling_beta": 0.1}),
         "llama_4_scaling_beta without original_max_position_embeddings"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope type default is not supported"),
        (dict(n_group=3), "n_group=3 must divide n_routed_experts=128"),
        (dict(n_group=8, topk_group=1, num_experts_per_tok=20), "num_experts_per_tok=20 exceeds the 16 experts"),
    ]
    for over, msg in refused:
        with pytest.raises(ConfigError, match=msg):
            family_of({**RELEASE, **over})


SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=2, moe_intermediate_size=8, n_routed_experts=4, n_group=2, topk_group=1,
           kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6,
           max_position_embeddings=64, rope_parameters={**YARN, "original_max_position_embeddings": 1})


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_mla.py) under NUMBA_ENABLE_CUDASIM=1 against the CPU
    backend on a bf16 build: tests/test_families_cuda.py's check, run as a script. Layer 0 dense,
    layer 1 routed in two groups; the queries' scale steps every position."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_cuda_matches_transformers(tmp_path, over):
    ref_model = build(tmp_path, "bfloat16", **over)
    check_against(ref_model, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them in 4
    groups, top-4), resident or streamed under a tiny budget, the queries' scale stepping every 4
    positions."""
    check_packed_graph_replay(tmp_path, resident, build, hidden_size=64, n_routed_experts=16, n_group=4,
                              topk_group=2, num_experts_per_tok=4, rope_parameters=YARN)
