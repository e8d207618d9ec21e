"""MiMo-V2-Flash (engine/models/mimo_v2_flash.py) on the CPU backend against transformers on
tiny random models: 7 layers (full attention at 0 and 5, sliding windows of 5 with sinks and
twice the KV heads elsewhere), q / k heads of 12 and v heads of 8, the values scaled, each layer
kind its RoPE over a third of a head, DeepSeek-V3's routing without shared experts, a dense
first layer. The release's config.json spellings (hybrid_layer_pattern, sliding_window_size...)
read as the reference reads its own fields."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, hf_logits, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=7,
            num_attention_heads=4, num_key_value_heads=1, head_dim=12, v_head_dim=8, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, sliding_window=5,
            max_position_embeddings=256)
# the release's config.json: its spellings, the reference's defaults where it ignores them
RELEASED = dict(hybrid_layer_pattern=[0, 1, 1, 1, 1, 0, 1], moe_layer_freq=[0, 1, 1, 1, 1, 1, 1],
                sliding_window_size=4, swa_num_key_value_heads=2, rope_theta=5_000_000.0, swa_rope_theta=10_000.0,
                partial_rotary_factor=0.334, layernorm_epsilon=1e-5, routed_scaling_factor=None,
                add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False)


def build(dst, dtype: str = "float32", **over):
    """A random tiny MiMoV2FlashForCausalLM (TINY with overrides, sinks and selection biases
    that matter) saved into dst in dtype; transformers on it in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"mimo_v2_flash weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.MiMoV2FlashForCausalLM(tf.MiMoV2FlashConfig(**{**TINY, **over}))
    widen_init(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
        for n, p in model.named_parameters():
            if n.endswith(".sinks"):
                p.normal_(0.0, 1.0)
    save_tiny(model, dst, dtype)
    return tf.MiMoV2FlashForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("mimo")
    return d, build(d)


def test_logits_and_greedy_match_transformers(tiny):
    d, ref = tiny
    check_against(ref, engine.load(d, device="cpu"), n_ids=17, n_new=20)


def test_full_layers_kv_heads_repeated(tmp_path):
    """Two KV heads in full layers, four in sliding ones: each full-layer head serves its four
    query heads after the repeat (a tiled order would not)."""
    ref = build(tmp_path, num_attention_heads=8, num_key_value_heads=2, attention_value_scale=None)
    ids = np.random.default_rng().integers(0, 300, 12)
    assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), hf_logits(ref, ids)) < 1e-4


def test_released_config_fields(tiny, tmp_path):
    import shutil
    d, ref = tiny
    shutil.copytree(d, tmp_path / "r")
    p = tmp_path / "r" / "config.json"
    cfg = json.loads(p.read_text())
    for k in ("layer_types", "mlp_layer_types", "rope_parameters", "sliding_window", "rms_norm_eps"):
        cfg.pop(k, None)
    p.write_text(json.dumps({**cfg, **RELEASED, "routed_scaling_factor": 1.5}))
    ids = np.random.default_rng().integers(0, 300, 12)
    assert rel_err(engine.load(tmp_path / "r", device="cpu").logits(ids), hf_logits(ref, ids)) < 1e-4


def test_prefill_equals_token_by_token(tiny):
    m = engine.load(tiny[0], device="cpu").model
    ids = np.random.default_rng().integers(0, 300, 15)
    check_prefill_equals_token_by_token(m, ids)


def test_state_resumes_and_packed(tiny, tmp_path):
    """The prefix cache resumes; a bf16 checkpoint packed with bf16 experts gives its logits (the
    same bits in the arena: routing cannot flip)."""
    from engine.pack import pack
    check_state_resumes(tiny[0], np.random.default_rng().integers(0, 300, 12))
    ids = np.random.default_rng().integers(0, 300, 16)
    build(tmp_path / "src", "bfloat16")
    pack(tmp_path / "src", tmp_path / "p", "bf16", progress=False)
    want = engine.load(tmp_path / "src", device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_fp8_release_layout(tmp_path):
    """The release's block-FP8 layout (every projection an F8_E4M3 weight beside its
    weight_scale_inv; router, bias and sinks float32): the engine on it equals the engine and
    transformers on the same weights dequantized by torch."""
    from test_fp8_checkpoint import dequantized_copy, tf_reference, write_fp8
    build(tmp_path / "f32")
    write_fp8(tmp_path / "f32", tmp_path / "fp8", block=(4, 8))
    dequantized_copy(tmp_path / "fp8", tmp_path / "bf16")
    ids = np.random.default_rng().integers(0, 300, 12)
    got = engine.load(tmp_path / "fp8", device="cpu").logits(ids)
    assert rel_err(got, engine.load(tmp_path / "bf16", device="cpu").logits(ids)) < 1e-5
    check_against(tf_reference(tmp_path / "bf16"), engine.load(tmp_path / "fp8", device="cpu"))


def test_config_read(tiny):
    c = family_of(json.loads((tiny[0] / "config.json").read_text())).config
    assert c.n_kv_heads == 2 and c.full_kv_heads == 1 and (c.head_dim, c.v_head_dim) == (12, 8)
    assert c.sink_layers == (1, 2, 3, 4, 6) and c.layer_windows == (0, 5, 5, 5, 5, 0, 5)
    assert c.moe_layers == tuple(range(1, 7)) and c.shared_intermediate == 0 and c.routed_scale == 1.5
    assert [r.theta for r in c.layer_ropes[:2]] == [5e6, 1e4] and c.layer_ropes[0].rotary_dim == 4


@pytest.mark.parametrize("fields,says", [
    (dict(swa_num_key_value_heads=3), "swa_num_key_value_heads=3"),
    (dict(v_head_dim=16), "v_head_dim=16 exceeds head_dim=12"),
    (dict(layer_types=["full_attention"] * 3), "layer_types must give each of the 7 layers"),
    (dict(add_full_attention_sink_bias=True), "add_full_attention_sink_bias"),
    (dict(attention_bias=True), "attention_bias true is not supported for mimo_v2_flash"),
])
def test_config_refused(fields, says):
    with pytest.raises(ConfigError, match=says):
        family_of({"model_type": "mimo_v2_flash", **TINY, **fields})


# the simulator's model: a full layer with a dense MLP, a sliding one (window 2, sinks, two KV
# heads) with 4 experts; v heads of 4 beside q / k heads of 8
SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=12, moe_intermediate_size=8, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=1, head_dim=8, v_head_dim=4, n_routed_experts=4, n_group=1,
           topk_group=1, sliding_window=2, layer_types=["full_attention", "sliding_attention"],
           max_position_embeddings=64,   # whole heads rotate (four pairs): each layer kind's theta shows
           rope_parameters={k: dict(rope_type="default", rope_theta=t, partial_rotary_factor=1.0)
                            for k, t in (("full_attention", 5e6), ("sliding_attention", 1e4))})


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_mimo.py) under NUMBA_ENABLE_CUDASIM=1 against the CPU
    backend on a bf16 build: tests/test_families_cuda.py's check, run as a script."""
    build(tmp_path, "bfloat16", **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", [{}, dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, v_head_dim=16)])
def test_cuda_matches_transformers(tmp_path, over):
    ref = build(tmp_path, "bfloat16", **over)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them),
    resident or streamed under a tiny budget."""
    check_packed_graph_replay(tmp_path, resident, build, hidden_size=64, n_routed_experts=16, num_experts_per_tok=4)
