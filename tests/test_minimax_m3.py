"""MiniMax-M3 (engine/models/minimax_m3.py) on the CPU backend against transformers'
MiniMaxM3SparseForConditionalGeneration on text: a tiny random model with a dense first layer,
a full and two sparse attention layers whose indexer has to choose (blocks of 4 keys, 2 picked a
KV head, the query's own among them) once the prompt passes 8 positions, partial RoPE, clamped
SwiGLU everywhere, a shared expert. Prompts long enough that the choice bites in prefill and in
decode; fed whole and token by token."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

TEXT = dict(vocab_size=300, hidden_size=32, intermediate_size=16, dense_intermediate_size=40,
            shared_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rotary_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5},
            num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.5, swiglu_limit=1.2,
            index_n_heads=2, index_head_dim=12, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
            layer_types=["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=256)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


def build(dst, dtype: str = "float32", **over):
    """A random tiny MiniMaxM3SparseForConditionalGeneration (TEXT with overrides) saved into
    dst in dtype; transformers on it in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"minimax_m3 weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.MiniMaxM3SparseForConditionalGeneration(tf.MiniMaxM3VLConfig(text_config={**TEXT, **over},
                                                                              vision_config=VISION))
    widen_init(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)
    return tf.MiniMaxM3SparseForConditionalGeneration.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("minimax_m3")
    return d, build(d)


def test_logits_and_greedy_match_transformers(tiny, capfd):
    d, ref = tiny
    m = engine.load(d, device="cpu")
    assert "skipping the vision tower" in capfd.readouterr().err
    check_against(ref, m, n_ids=21, n_new=20)


def test_prefill_equals_token_by_token(tiny):
    m = engine.load(tiny[0], device="cpu").model
    ids = np.random.default_rng().integers(0, 300, 19)
    check_prefill_equals_token_by_token(m, ids)


def test_state_resumes_and_packed(tiny, tmp_path):
    """The prefix cache resumes; a packed arena (the clamped experts in the block kernel, bf16)
    gives the logits of the checkpoint it was packed from (its weights bf16 values)."""
    from engine.pack import pack
    check_state_resumes(tiny[0], np.random.default_rng().integers(0, 300, 12))
    ids = np.random.default_rng().integers(0, 300, 16)
    src = bf16_copy(tiny[0], tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_dense_mlp_fused_gate_up(tiny, tmp_path):
    """A checkpoint whose dense MLP holds gate and up as one gate_up_proj (as older transformers
    save MiniMax-M3) reads as the split one."""
    import shutil
    from safetensors.numpy import load_file, save_file
    d = tmp_path / "fused"
    shutil.copytree(tiny[0], d)
    f = next(d.glob("*.safetensors"))
    sd = load_file(str(f))
    p = "language_model.model.layers.0.mlp."
    sd[p + "gate_up_proj.weight"] = np.concatenate([sd.pop(p + "gate_proj.weight"), sd.pop(p + "up_proj.weight")])
    save_file(sd, str(f), metadata={"format": "pt"})
    ids = np.random.default_rng().integers(0, 300, 10)
    assert rel_err(engine.load(d, device="cpu").logits(ids), engine.load(tiny[0], device="cpu").logits(ids)) < 1e-6


def test_config_read(tiny):
    c = family_of(json.loads((tiny[0] / "config.json").read_text())).config
    assert c.sparse_layers == (1, 3) and c.moe_layers == (1, 2, 3) and c.rope.rotary_dim == 8
    assert (c.block_size, c.block_topk, c.block_local) == (4, 2, 1)
    # the older fields: sparse_attention_config, moe_layer_freq; rotary_dim alone sets the share
    older = {k: v for k, v in TEXT.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")}
    c = family_of({"model_type": "minimax_m3_vl", "text_config": {
        **older, "moe_layer_freq": [0, 1, 1, 1],
        "sparse_attention_config": {"sparse_attention_freq": [0, 1, 0, 1], "sparse_block_size": 64}}}).config
    assert c.sparse_layers == (1, 3) and c.moe_layers == (1, 2, 3) and c.block_size == 64
    assert c.rope.rotary_dim == 8


@pytest.mark.parametrize("fields,says", [
    (dict(index_n_heads=1), "index_n_heads=1 must equal num_key_value_heads=2"),
    (dict(index_head_dim=4), "index_head_dim=4 must be at least the rotary dims"),
    (dict(layer_types=["full_attention"] * 3), "layer_types must give each of the 4 layers"),
])
def test_config_refused(fields, says):
    with pytest.raises(ConfigError, match=says):
        family_of({"model_type": "minimax_m3_vl", "text_config": {**TEXT, **fields}})


def test_cuda_context_capped(tiny, capsys):
    """On cuda the sparse layers run dense attention, exact up to index_topk_blocks *
    index_block_size positions: the context is capped there, a longer one refused."""
    from engine.runtime import context_length
    c = family_of(json.loads((tiny[0] / "config.json").read_text())).config
    assert context_length(c, "cpu", None) == 256
    assert context_length(c, "cuda", None) == 8
    assert "context capped at index_topk_blocks * index_block_size=8" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--max-context 16: .*=8 .*at most 8"):
        context_length(c, "cuda", 16)


# the simulator's model: a dense layer with a full attention, a routed one with a sparse
# attention (dense below the cap), clamps that bite
SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=8, dense_intermediate_size=12,
           shared_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
           head_dim=8, rotary_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5},
           num_local_experts=4, index_n_heads=1, index_head_dim=8, swiglu_limit=0.6,
           layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"],
           max_position_embeddings=64)
# the GPU tests' model: two sparse layers, cap 4 blocks of 16 keys
GPU = dict(index_block_size=16, index_topk_blocks=4)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_m3.py) under NUMBA_ENABLE_CUDASIM=1 against the CPU
    backend on a bf16 build: tests/test_families_cuda.py's check, run as a script."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
def test_cuda_matches_transformers(tmp_path):
    ref = build(tmp_path, "bfloat16", **GPU)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=40)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them),
    resident or streamed under a tiny budget."""
    check_packed_graph_replay(tmp_path, resident, build, **GPU, hidden_size=64, num_local_experts=16,
                              num_experts_per_tok=4)
