"""Hy3-preview (engine/models/hy_v3.py) on the CPU backend against transformers on tiny random
models: q / k normed a head before RoPE, sigmoid routing with a selection bias renormalized and
times router_scaling_factor, the shared expert (of intermediate_size where num_shared_experts is
0, as the reference), dense layers by mlp_layer_types, tied embeddings, YaRN; the release's
tensor names and transformers' own; the MTP layer skipped; config defaults and refusals; the
cuda decoder (engine/gpu.py's) under the simulator and, marked gpu, on a GPU."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

TINY = dict(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0})
# the reference's defaults (layer 0 dense, one shared expert, scale 2.826); tied embeddings, a
# routed layer before a dense one, two shared experts, top-3 and YaRN; no shared expert count
# (the reference's shared MLP then takes intermediate_size)
CASES = [{},
         dict(tie_word_embeddings=True, mlp_layer_types=["sparse", "dense", "sparse"], num_shared_experts=2,
              num_experts_per_tok=3, router_scaling_factor=1.5,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64}),
         dict(num_shared_experts=0, router_scaling_factor=1.0)]
IDS = ["defaults", "tied-yarn-top3", "shared-at-intermediate"]


def build(dst, dtype: str = "float32", original: bool = True, **over):
    """A random HYV3ForCausalLM saved into dst (save_original_format: the release's names, else
    transformers' own); transformers' model read back in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"hy_v3 weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.HYV3ForCausalLM(tf.HYV3Config(**{**TINY, **over}))
    widen_init(model)
    with torch.no_grad():   # a selection bias that matters (a buffer, zero at init)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype, save_original_format=original)
    return tf.HYV3ForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


def tensor_names(folder) -> set:
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return set(f.keys())


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref = build(tmp_path, **over)
    assert "model.layers.2.mlp.router.gate.weight" in tensor_names(tmp_path)   # the release's names
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref, m, n_ids=14, n_new=20)
    if over is CASES[0]:
        check_prefill_equals_token_by_token(m.model, ids)
        check_state_resumes(tmp_path, ids)


def test_transformers_names(tmp_path):
    """A folder saved under transformers' own names (mlp.gate, e_score_correction_bias,
    shared_experts, the experts fused) reads as the release's."""
    ref = build(tmp_path, original=False)
    names = tensor_names(tmp_path)
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj"} <= names
    check_against(ref, engine.load(tmp_path, device="cpu"), n_ids=10, n_new=8)


def test_mtp_layer_skipped(tmp_path, capsys):
    """The release's MTP layer (model.layers.<num_hidden_layers>.*, an mlp_layer_types entry of its
    own) is skipped by name; the logits are those of the folder without it."""
    from safetensors.numpy import load_file, save_file
    build(tmp_path, num_hidden_layers=2)
    ids = np.random.default_rng().integers(0, 300, 10)
    want = engine.load(tmp_path, device="cpu").logits(ids)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    sd.update({k.replace("model.layers.1.", "model.layers.2."): v for k, v in sd.items()
               if k.startswith("model.layers.1.")})
    save_file(sd, str(f), metadata={"format": "pt"})
    c = json.loads((tmp_path / "config.json").read_text())
    c["mlp_layer_types"] = ["dense", "sparse", "sparse"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    capsys.readouterr()
    got = engine.load(tmp_path, device="cpu").logits(ids)
    assert "hy_v3: skipping the multi-token-prediction (MTP) layer" in capsys.readouterr().err
    assert np.array_equal(got, want)


def test_packed(tmp_path):
    """A bf16 arena packed from a checkpoint (its weights bf16 values) gives that checkpoint's
    logits: the experts per (layer, expert), the router's float32 weight and bias dense."""
    from engine.pack import pack
    build(tmp_path / "f32", **CASES[1])
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 16)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


BARE = dict(model_type="hy_v3", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2)


def test_config_read_and_refused():
    """A config.json that leaves out what transformers' HYV3Config defaults: those defaults (theta
    11158840, 192 experts top-8, one shared expert of 1536, scale 2.826, head_dim 128, eps 1e-5,
    layer 0 dense); the MTP layer's prefix; refusals by field."""
    c = family_of(BARE).config
    assert (c.n_experts, c.top_k, c.moe_intermediate, c.shared_intermediate, c.routed_scale) == \
        (192, 8, 1536, 1536, 2.826)
    assert (c.head_dim, c.rms_eps, c.rope.theta, c.rope.rotary_dim, c.dense_intermediate) == \
        (128, 1e-5, 11158840.0, 128, 96)
    assert c.moe_layers == (1, 2, 3) and c.routing == "sigmoid" and c.norm_topk_prob and c.n_group == 1
    assert c.qk_norm == "head" and not c.tie_embeddings
    assert c.ignored_parts == (("model.layers.4.", "the multi-token-prediction (MTP) layer"),)
    c = family_of({**BARE, "num_local_experts": 16, "num_shared_experts": 0, "rope_theta": 5e5,
                   "mlp_layer_types": ["sparse"] * 4 + ["sparse"]}).config   # an entry for the MTP layer
    assert (c.n_experts, c.shared_intermediate, c.rope.theta, c.moe_layers) == (16, 96, 5e5, (0, 1, 2, 3))
    refused = [
        (dict(attention_bias=True), "attention_bias true is not supported for hy_v3"),
        (dict(mlp_bias=True), "mlp_bias true is not supported for hy_v3"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported; hy_v3 runs silu"),
        (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]),
         "mlp_layer_types must give each of the 4 layers one of dense, sparse; got 'moe' at layer 1"),
        (dict(mlp_layer_types=["dense"]), "mlp_layer_types must give each of the 4 layers"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
         "partial_rotary_factor 0.5 is not supported for hy_v3"),
        (dict(num_experts_per_tok=300), "num_experts_per_tok=300 must be in 1..192"),
    ]
    for over, msg in refused:
        with pytest.raises(ConfigError, match=msg):
            family_of({**BARE, **over})


SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
           max_position_embeddings=64)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu.py's GpuDecoder) under NUMBA_ENABLE_CUDASIM=1 against the
    CPU backend on a bf16 build: tests/test_families_cuda.py's check, run as a script. Layer 0
    dense, layer 1 routed with the bias and the shared expert."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_cuda_matches_transformers(tmp_path, over):
    ref = build(tmp_path, "bfloat16", **over)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them, top-4),
    resident or streamed under a tiny budget."""
    check_packed_graph_replay(tmp_path, resident, build, hidden_size=64, num_experts=16, num_experts_per_tok=4)
