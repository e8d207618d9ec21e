"""Step-3.5-Flash / Step-3.7-Flash (engine/models/step3p5.py) on the CPU backend against
transformers' Step3p7ForConditionalGeneration on text: a tiny random model with sliding layers
of fewer heads and their own RoPE, full layers with partial RoPE, per-head output gates, a dense
first layer, clamped experts and shared expert, the experts stacked a projection under .moe.
The same weights as the text-only step3p5 folder, with the release's older config fields."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_packed_graph_replay, check_state_resumes, rel_err,
                      run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

TEXT = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_local_experts=8,
            n_routed_experts=8, num_experts_per_tok=2, share_expert_dim=24, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_sliding_attention_heads=2,
            rope_theta=[10000.0, 5000.0, 10000.0, 5000.0], partial_rotary_factors=[1.0, 0.5, 1.0, 0.5],
            swiglu_limits=[0, 0, 0, 0.8], swiglu_limits_shared=[0.9, 0, 0, 1.0],
            moe_router_scaling_factor=2.0, query_pre_attn_scalar=12)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


def build(dst, dtype: str = "float32", **over):
    """A random tiny Step3p7ForConditionalGeneration (TEXT with overrides) saved into dst."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"step3p5 weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.Step3p7ForConditionalGeneration(tf.Step3p7Config(text_config={**TEXT, **over},
                                                                vision_config=VISION))
    widen_init(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The wrapper's folder (step3p7), the text-only folder (step3p5, older config fields), and
    transformers on them."""
    import torch
    import transformers as tf
    d = tmp_path_factory.mktemp("step3p5")
    build(d / "vl")
    # the text-only release: the same tensors, its config.json flat with the older fields (each
    # per-layer list with an entry for an MTP layer, the MoE layers by index, the sliding heads)
    shutil.copytree(d / "vl", d / "text")
    cfg = json.loads((d / "vl" / "config.json").read_text())["text_config"]
    for k in ("mlp_layer_types", "num_sliding_attention_heads", "per_layer_config", "rope_parameters"):
        cfg.pop(k, None)
    cfg.update(model_type="step3p5", num_nextn_predict_layers=1, moe_layers_enum="1,2,3",
               attention_other_setting={"num_attention_heads": 2},
               layer_types=TEXT["layer_types"] + ["full_attention"],
               rope_theta=TEXT["rope_theta"] + [5000.0], partial_rotary_factors=TEXT["partial_rotary_factors"] + [0.5],
               swiglu_limits=TEXT["swiglu_limits"] + [0], swiglu_limits_shared=TEXT["swiglu_limits_shared"] + [0])
    (d / "text" / "config.json").write_text(json.dumps(cfg))
    ref = tf.Step3p7ForConditionalGeneration.from_pretrained(d / "vl", dtype=torch.float32).eval()
    return d, ref


@pytest.mark.parametrize("folder", ["vl", "text"])
def test_logits_and_greedy_match_transformers(tiny, folder, capfd):
    d, ref = tiny
    m = engine.load(d / folder, device="cpu")
    if folder == "vl":
        assert "skipping the vision tower" in capfd.readouterr().err
    check_against(ref, m, n_ids=14, n_new=20, n_prompt=6)


def test_config_read(tiny):
    c = family_of(json.loads((tiny[0] / "text" / "config.json").read_text())).config
    assert c.layer_heads == (2, 4, 2, 4) and c.moe_layers == (1, 2, 3)
    assert c.layer_windows == (4, 0, 4, 0) and c.limits == (0, 0, 0, 0.8)
    assert [r.rotary_dim for r in c.layer_ropes] == [8, 4, 8, 4] and c.attn_scale == 12 ** -0.5


def test_packed_and_resumed(tiny, tmp_path):
    """A packed arena (the clamped experts in the block kernel, bf16) gives the logits of the
    checkpoint it was packed from (its weights bf16 values); the prefix cache resumes."""
    from engine.pack import pack
    d = tiny[0]
    ids = np.random.default_rng().integers(0, 300, 10)
    src = bf16_copy(d / "text", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5
    check_state_resumes(d / "text", np.concatenate([ids, ids[:2]]))


@pytest.mark.parametrize("fields,says", [
    (dict(layer_types=["sliding_attention", "minimax_m3_sparse", "full_attention", "full_attention"]),
     "step3p5 runs sliding_attention and full_attention layers"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention is true"),
    (dict(swiglu_limits=[0, 0]), "swiglu_limits must list a value for each of the 4 layers"),
    (dict(num_sliding_attention_heads=3), r"query heads \[3, 4\] must be multiples of num_key_value_heads=2"),
])
def test_config_refused(fields, says):
    with pytest.raises(ConfigError, match=says):
        family_of({**TEXT, "model_type": "step3p5", **fields})


# ---- the cuda backend (engine/gpu_step.py) ------------------------------------------------------

# sliding layers with more heads than the full ones (Step-3.5-Flash's 96 against 64: the buffers
# take the widest, a full layer reads a prefix), window 2 (it bites in the check's decode step)
WIDE = dict(num_sliding_attention_heads=6, sliding_window=2)
# the simulator's model, two layers (it costs about 0.1 s a block): a sliding dense layer with
# the dense MLP clamped, a full routed layer (fewer heads, partial RoPE) with the experts and
# the shared expert clamped
SIM = dict(WIDE, num_hidden_layers=2, num_attention_heads=2, num_sliding_attention_heads=4,
           layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
           rope_theta=[10000.0, 5000.0], partial_rotary_factors=[1.0, 0.5], swiglu_limits=[0, 0.8],
           swiglu_limits_shared=[0.9, 1.0], vocab_size=24, hidden_size=16, intermediate_size=16,
           moe_intermediate_size=8, share_expert_dim=8, num_local_experts=4, n_routed_experts=4,
           max_position_embeddings=64)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder under NUMBA_ENABLE_CUDASIM=1 against the CPU backend (bf16, as
    the cuda backend builds its expert blocks from a checkpoint): tests/test_families_cuda.py's
    check, run as a script in a subprocess."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", [{}, WIDE])
def test_cuda_matches_transformers(tmp_path, over):
    import torch
    import transformers as tf
    build(tmp_path, "bfloat16", **over)
    ref = tf.Step3p7ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    check_against(ref, engine.load(tmp_path, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them, the
    clamp on a routed layer), resident or streamed under a tiny budget."""
    check_packed_graph_replay(tmp_path, resident, build, **WIDE, hidden_size=64, num_local_experts=16,
                              n_routed_experts=16, num_experts_per_tok=4)
