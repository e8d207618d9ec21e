"""Llama 4 (engine/models/llama4.py) on the CPU backend against transformers on tiny random
models: the image-text wrapper (Llama4ForConditionalGeneration, its vision tower skipped) and a
text-only folder (Llama4ForCausalLM). Dense and MoE layers interleaved, top-1 (and top-2)
routing whose sigmoid scales the expert's input, a shared expert, the experts fused and
transposed in the checkpoint; RoPE layers over interleaved pairs with llama3 scaling, weightless
q / k norms and attention within chunks of 4 positions; NoPE layers with the queries' temperature
by position. Prompts longer than a chunk and past several floor_scale steps."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

TEXT = dict(vocab_size=300, hidden_size=40, intermediate_size=16, intermediate_size_mlp=24, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=1,
            interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=2,
            attn_scale=0.3, max_position_embeddings=256, pad_token_id=0,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=40)
# the text-only folder: top-2, MoE layers by index, no q / k norm, no temperature
TEXT_ONLY = dict(num_experts_per_tok=2, moe_layers=[0, 2, 3], use_qk_norm=False, attn_temperature_tuning=False)


def build(dst, dtype: str = "float32", text_only: bool = False, **over):
    """A random tiny Llama 4 (TEXT with overrides) saved into dst in dtype; transformers on it
    in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"llama4 weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    if text_only:
        cls, cfg = tf.Llama4ForCausalLM, tf.Llama4TextConfig(**{**TEXT, **over})
    else:
        cls, cfg = tf.Llama4ForConditionalGeneration, tf.Llama4Config(text_config={**TEXT, **over},
                                                                       vision_config=VISION)
    model = cls(cfg)
    widen_init(model)
    save_tiny(model, dst, dtype)
    return cls.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama4")
    return d, build(d)


def test_logits_and_greedy_match_transformers(tiny, capfd):
    d, ref = tiny
    m = engine.load(d, device="cpu")
    assert "skipping the vision tower" in capfd.readouterr().err
    check_against(ref, m, n_ids=21, n_new=20)


def test_text_only_folder(tmp_path):
    ref = build(tmp_path, text_only=True, **TEXT_ONLY)
    m = engine.load(tmp_path, device="cpu")
    assert m.config.moe_layers == (0, 2, 3) and m.config.top_k == 2 and not m.config.qk_l2
    check_against(ref, m, n_ids=17, n_new=16)


def test_prefill_equals_token_by_token(tiny):
    m = engine.load(tiny[0], device="cpu").model
    ids = np.random.default_rng().integers(0, 300, 19)
    check_prefill_equals_token_by_token(m, ids)


def test_state_resumes_and_packed(tiny, tmp_path):
    """The prefix cache resumes; a packed arena (the fused, transposed experts read per expert,
    bf16 blocks) gives the logits of the checkpoint it was packed from (its weights bf16 values)."""
    from engine.pack import pack
    check_state_resumes(tiny[0], np.random.default_rng().integers(0, 300, 12))
    ids = np.random.default_rng().integers(0, 300, 16)
    src = bf16_copy(tiny[0], tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_config_read(tiny):
    c = family_of(json.loads((tiny[0] / "config.json").read_text())).config
    assert c.family == "llama4" and c.moe_layers == (1, 3) and c.nope_layers == (1, 3)
    assert c.chunked_layers == (0, 2) and c.chunk == 4 and c.qk_l2 and c.temperature
    assert c.routing == "sigmoid_input" and c.shared_intermediate == 16 and c.dense_intermediate == 24
    assert c.rope.kind == "llama3" and c.rope_pairs and not c.tie_embeddings


def test_llama3_inv_freq():
    """rope.py's llama3 frequencies against transformers' own on the same parameters."""
    import torch
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from engine.models.rope import RopeConfig
    # (the last: Llama-4-Scout's, no band between the kept and the slowed wavelengths)
    for theta, orig, factor, high in ((10000.0, 16, 8.0, 4.0), (500000.0, 8192, 16.0, 4.0), (500000.0, 8192, 16.0, 1.0)):
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
                  "high_freq_factor": high, "original_max_position_embeddings": orig}
        cfg = tf.Llama4TextConfig(**{**TEXT, "head_dim": 128, "rope_parameters": params})
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
        got = RopeConfig.from_hf({"rope_parameters": params}, 128).inv_freq()
        assert rel_err(got, want.numpy()) < 1e-6


@pytest.mark.parametrize("fields,says", [
    (dict(no_rope_layers=[1, 0]), "no_rope_layers must give each of the 4 layers"),
    (dict(layer_types=["chunked_attention"] * 4, attention_chunk_size=None), "attention_chunk_size is None"),
    (dict(moe_layers=[4]), r"moe_layers \[4\] must be layers of 0..3"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "llama3 without low_freq_factor"),
])
def test_config_refused(fields, says):
    with pytest.raises(ConfigError, match=says):
        family_of({"model_type": "llama4_text", **TEXT, **fields})


def test_cuda_context_not_capped(tiny):
    """Chunked attention runs on cuda as itself (ga.attention's window -attention_chunk_size),
    so the context is the config's on both backends."""
    from engine.runtime import context_length
    c = family_of(json.loads((tiny[0] / "config.json").read_text())).config
    assert context_length(c, "cpu", None) == 256 and context_length(c, "cuda", None) == 256
    assert context_length(c, "cuda", 64) == 64


# the simulator's model: a RoPE layer (chunks of 2: the decode step at position 2 starts a new
# one) with a dense MLP, a NoPE layer whose temperature changes at every position, top-2 of 4
# experts
SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=8, intermediate_size_mlp=12, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
           attention_chunk_size=2, floor_scale=1, max_position_embeddings=64)
# the GPU tests' model: chunks of 16 (the tests' 40 positions span three)
GPU = dict(attention_chunk_size=16, max_position_embeddings=64)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_llama4.py) under NUMBA_ENABLE_CUDASIM=1 against the
    CPU backend on a bf16 build: tests/test_families_cuda.py's check, run as a script."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("text_only", [False, True])
def test_cuda_matches_transformers(tmp_path, text_only):
    ref = build(tmp_path, "bfloat16", text_only, **GPU, **(TEXT_ONLY if text_only else {}))
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=40)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them),
    resident or streamed under a tiny budget."""
    check_packed_graph_replay(tmp_path, resident, build, **GPU, hidden_size=64, num_local_experts=16)
