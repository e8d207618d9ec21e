"""DBRX (engine/models/dbrx.py) on the CPU backend against transformers on tiny random models:
LayerNorms without bias, the fused Wqkv and its clamp (clip_qkv), the top-k weights over their
p-norm (moe_normalize_expert_weights null, 1, 2), the experts fused flat (w2 transposed), the
release's config layout (attn_config.rope_theta, no rope_parameters)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError
from kernels_numba import reference as ref

TINY = dict(vocab_size=300, d_model=32, n_heads=4, n_layers=3, max_seq_len=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
ATTN = dict(kv_n_heads=2, clip_qkv=None, rope_theta=10000.0)
FFN = dict(ffn_hidden_size=16, moe_num_experts=8, moe_top_k=4, moe_normalize_expert_weights=1.0)
# clip_qkv 1.0 bites (the normed rows' projections are about unit-sized); theta the release's
CASES = [dict(attn=dict(clip_qkv=1.0, rope_theta=500000.0), ffn=dict(moe_normalize_expert_weights=1.0)),
         dict(attn=dict(kv_n_heads=1, clip_qkv=1e6), ffn=dict(moe_normalize_expert_weights=None, moe_top_k=2)),
         dict(attn=dict(clip_qkv=0.6, kv_n_heads=4), ffn=dict(moe_normalize_expert_weights=2.0))]
IDS = ["clip-p1-theta5e5", "mqa-no-renorm", "clip-p2"]


def hf_config(attn=None, ffn=None, **over):
    """transformers' DbrxConfig: TINY, ATTN and FFN with overrides (rope_parameters' theta the
    attention config's, as transformers 5.x reads the one and requires the other)."""
    import transformers as tf
    a, f = {**ATTN, **(attn or {})}, {**FFN, **(ffn or {})}
    kw = {**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": a["rope_theta"]}, **over}
    return tf.DbrxConfig(**kw, attn_config=a, ffn_config=f)


def build(dst, dtype: str = "float32", **over):
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"dbrx weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.DbrxForCausalLM(hf_config(**over))
    widen_init(model)
    save_tiny(model, dst, dtype)
    return tf.DbrxForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


def unclamped(folder) -> None:
    """folder's config.json with attn_config.clip_qkv null."""
    c = json.loads((folder / "config.json").read_text())
    c["attn_config"]["clip_qkv"] = None
    (folder / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref_model = build(tmp_path, **over)
    if over is CASES[1]:   # no clamp: transformers 5.25 fails on clip_qkv null (torch.clamp of
        unclamped(tmp_path)   # two Nones), so it ran 1e6, which never bites; the engine reads null
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref_model, m, n_ids=14, n_new=20)
    if over is CASES[0]:
        check_state_resumes(tmp_path, ids)
        check_prefill_equals_token_by_token(m.model, ids)


def test_release_config_layout(tmp_path):
    """The config.json databricks released (transformers 4.38's layout): rope_theta only in
    attn_config (500000), no rope_parameters, moe_normalize_expert_weights and ffn_act_fn left
    to their defaults (1, silu), the sub-configs' model_type "". Against transformers running the
    same weights at that theta (5.x itself reads rope_parameters only, which the release lacks)."""
    ref_model = build(tmp_path, attn=dict(clip_qkv=1.0, rope_theta=500000.0))
    c = json.loads((tmp_path / "config.json").read_text())
    release = {"architectures": ["DbrxForCausalLM"],
               "attn_config": {"clip_qkv": 1.0, "kv_n_heads": 2, "model_type": "", "rope_theta": 500000},
               "d_model": c["d_model"], "emb_pdrop": 0.0,
               "ffn_config": {"ffn_hidden_size": 16, "model_type": "", "moe_jitter_eps": 0.01,
                              "moe_loss_weight": 0.05, "moe_num_experts": 8, "moe_top_k": 4},
               "initializer_range": 0.02, "max_seq_len": 256, "model_type": "dbrx", "n_heads": 4,
               "n_layers": 3, "output_router_logits": False, "resid_pdrop": 0.0, "router_aux_loss_coef": 0.05,
               "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.38.2",
               "use_cache": True, "vocab_size": 300, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(release))
    cfg = family_of(release).config
    assert cfg.rope.theta == 500000.0 and cfg.norm_p == 1 and cfg.clip_qkv == 1.0 and cfg.n_kv_heads == 2
    check_against(ref_model, engine.load(tmp_path, device="cpu"), n_ids=14, n_new=12)


def test_routing_matches_reference():
    """The routing's oracle (reference.router_topk, norm 0 / 1 / 2) on fresh logits against
    transformers' DbrxFFN.route_tokens_to_experts for moe_normalize_expert_weights null, 1, 2."""
    import torch
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN
    logits = (np.random.default_rng().standard_normal((32, 16)) * 2).astype(np.float32)
    for p, norm in ((None, 0), (1.0, 1), (2.0, 2)):
        ffn = DbrxFFN(hf_config(ffn=dict(moe_num_experts=16, moe_top_k=4, moe_normalize_expert_weights=p)))
        w_ref, ids_ref = ffn.route_tokens_to_experts(torch.tensor(logits))
        ids, w = ref.router_topk(logits, 4, norm)
        assert np.array_equal(ids, ids_ref.numpy())
        assert np.allclose(w, w_ref.numpy(), rtol=1e-6, atol=1e-7), p


def test_packed(tmp_path):
    """A packed arena (bf16 expert blocks from the flat fused w1 / v1 / w2) gives the logits of the
    checkpoint it was packed from (its weights bf16 values)."""
    from engine.pack import pack
    build(tmp_path / "f32", **CASES[2])
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 16)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def release_cfg(attn=None, ffn=None, **over) -> dict:
    return {"model_type": "dbrx", **TINY, "attn_config": {**ATTN, **(attn or {})},
            "ffn_config": {**FFN, **(ffn or {})}, **over}


def test_config_read_and_refused():
    c = family_of(release_cfg(ffn=dict(moe_normalize_expert_weights=None))).config
    assert (c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.n_experts, c.top_k, c.moe_intermediate) == \
        (32, 4, 2, 8, 8, 4, 16)
    assert c.norm_p == 0 and not c.norm_topk_prob and c.clip_qkv == 0.0 and c.rms_eps == 1e-5
    # attn_config's theta (the release's field) over rope_parameters' (what transformers 5.x writes)
    c = family_of(release_cfg(attn=dict(rope_theta=500000), rope_parameters={"rope_theta": 10000.0})).config
    assert c.rope.theta == 500000.0
    c = family_of(release_cfg(attn=dict(rope_theta=None), rope_parameters={"rope_theta": 20000.0})).config
    assert c.rope.theta == 20000.0
    refused = [
        (dict(ffn=dict(moe_normalize_expert_weights=3.0)),
         r"ffn_config.moe_normalize_expert_weights=3.0: supported are null \(no renormalization\), 1 and 2"),
        (dict(ffn=dict(ffn_act_fn={"name": "gelu"})), r"ffn_config.ffn_act_fn \{'name': 'gelu'\}: only silu"),
        (dict(attn=dict(clip_qkv=0)), r"attn_config.clip_qkv=0: expected a positive number or null"),
        (dict(tie_word_embeddings=True), r"tie_word_embeddings true: DBRX's lm_head is its own"),
        (dict(n_heads=5), r"d_model=32 is not a multiple of n_heads=5"),
        (dict(attn=dict(kv_n_heads=3)), r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        (dict(attn_config=[1]), r"attn_config must be an object"),
    ]
    for over, msg in refused:
        with pytest.raises(ConfigError, match=msg):
            family_of(release_cfg(**over))
    bad = release_cfg()
    del bad["d_model"]
    with pytest.raises(ConfigError, match="missing field d_model"):
        family_of(bad)


def test_fused_experts_refused_with_a_wrong_expert_count(tmp_path):
    """Flat fused experts whose rows are not a multiple of ffn_config.moe_num_experts: the
    checkpoint names the tensor."""
    from loader.checkpoint import Checkpoint, CheckpointError
    build(tmp_path, n_layers=1)
    c = json.loads((tmp_path / "config.json").read_text())
    c["ffn_config"]["moe_num_experts"] = 7
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=r"fused tensor transformer.blocks.0.ffn.experts.mlp.v1 has shape "
                                              r"\[128, 32\]; expected \[7 experts"):
        Checkpoint(tmp_path)


SIM = dict(vocab_size=24, d_model=16, n_heads=2, n_layers=2, max_seq_len=64)


def test_simulator_decoder(tmp_path):
    """The eager CUDA decoder (engine/gpu_dbrx.py) under NUMBA_ENABLE_CUDASIM=1 against the CPU
    backend on a bf16 build: tests/test_families_cuda.py's check, run as a script. The 2-norm
    routing and the clamp (the other norms' routing is every family's)."""
    build(tmp_path, "bfloat16", attn=dict(kv_n_heads=1, clip_qkv=0.6),
          ffn=dict(ffn_hidden_size=8, moe_num_experts=4, moe_top_k=2, moe_normalize_expert_weights=2.0), **SIM)
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_cuda_matches_transformers(tmp_path, over):
    ref_model = build(tmp_path, "bfloat16", **over)
    if over is CASES[1]:
        unclamped(tmp_path)
    check_against(ref_model, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_and_streaming(tmp_path, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them, top-4),
    resident or streamed under a tiny budget: the LayerNorms, Wqkv's clamp, the 2-norm routing
    with the device slot table in every path."""
    check_packed_graph_replay(tmp_path, resident, build, d_model=64,
                              attn=dict(clip_qkv=1.0), ffn=dict(moe_num_experts=16, moe_normalize_expert_weights=2.0))
