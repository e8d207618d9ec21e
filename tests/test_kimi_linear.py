"""Kimi-Linear (engine/models/kimi_linear.py) on the CPU backend against transformers on tiny
random models: KDA layers (per-channel decay, separate q / k / v convs, low-rank forget and output
gates) beside MLA layers without RoPE, DeepSeek-V3's routing with groups, a selection bias and
shared experts, dense layers. Checkpoints are saved in the release's layout (the dense layers'
MLP under mlp., the config's 1-based linear_attn_config); transformers reads it too."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_prefill_equals_token_by_token, check_state_resumes,
                      hf_logits, rel_err, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError
from kernels_numba import cpu_deltanet as K
from kernels_numba import reference as ref

L, F = "linear_attention", "full_attention"
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1,
            routed_scaling_factor=1.7, rms_norm_eps=1e-6, first_k_dense_replace=1,
            linear_attn_config=dict(kda_layers=[1, 2, 4], full_attn_layers=[3], head_dim=8, num_heads=2,
                                    short_conv_kernel_size=4),
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
CASES = [
    # the release's shape: 1-based layer lists only (layer_types dropped from config.json), q_proj
    # straight from the hidden state, layer 0 dense, two groups of experts
    dict(release=True),
    # full attention first and third, low-rank q (q_lora_rank), attention biases, a dense layer in
    # the middle (mlp_layer_types), top-k weights not renormalized, two shared experts, 3 heads
    # of 6 with a conv of 2, one group
    dict(num_hidden_layers=3, layer_types=[F, L, F], mlp_layer_types=["sparse", "dense", "sparse"],
         q_lora_rank=24, attention_bias=True, norm_topk_prob=False, n_shared_experts=2, n_group=1,
         linear_attn_config=dict(head_dim=6, num_heads=3, short_conv_kernel_size=2)),
]
# config.json keys transformers writes that the release's config does not have
_SAVED_ONLY = ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
               "head_dim", "qk_head_dim")

# the chunked KDA prefill against the one-token steps, whole-model logits: float32's rounding in the
# chunk's forward substitution, carried through the MoE layers, reached 1.6e-5 in 1 of 20 random
# models (3e-6 typically); a wrong decay or gate gives errors of 1e-2 and more
PREFILL_TOL = 1e-4

def build(dst, dtype: str = "float32", release: bool = False, **over):
    """A random transformers Kimi-Linear (decays, gates, norms and the selection bias away from
    their init) saved into dst in the release's tensor layout; returns transformers' model read
    back from dst in float32."""
    import torch
    import transformers as tf
    from safetensors.numpy import load_file, save_file
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"kimi_linear weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**{**TINY, **over}))
    widen_init(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):          # decay rates exp(A_log) in 0.3..3
                p.uniform_(-1.2, 1.1)
            elif n.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)
    # transformers saves a dense layer's MLP under block_sparse_moe.; the release has it under mlp.
    # (transformers reads both)
    for f in dst.glob("*.safetensors"):
        sd = load_file(str(f))
        sd = {re.sub(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1.", k): v
              for k, v in sd.items()}
        save_file(sd, str(f), metadata={"format": "pt"})
    if release:
        cfg = json.loads((dst / "config.json").read_text())
        for k in _SAVED_ONLY:
            cfg.pop(k, None)
        (dst / "config.json").write_text(json.dumps(cfg))
    return tf.KimiLinearForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("over", CASES, ids=["release", "mla-first-qlora"])
def test_logits_and_greedy_match_transformers(tmp_path, over):
    hf = build(tmp_path, **over)
    m = engine.load(tmp_path, device="cpu")
    types = hf.config.layer_types
    assert m.config.layer_types == tuple(types) and L in types and F in types
    assert m.config.moe_layers == tuple(l for l, t in enumerate(hf.config.mlp_layer_types) if t == "sparse")
    ids = check_against(hf, m, n_ids=14, n_new=20)
    if over is CASES[0]:
        check_state_resumes(tmp_path, ids)
        check_prefill_equals_token_by_token(m.model, ids, tol=PREFILL_TOL)


def test_chunked_prefill(tmp_path):
    """A prompt longer than a chunk: the chunked prefill (two chunks), one token at a time, and
    a prefill in two pieces agree, states included, and match transformers' logits."""
    hf = build(tmp_path)
    model = engine.load(tmp_path, device="cpu").model
    ids = np.random.default_rng().integers(0, 300, K.CHUNK + 17)
    st = model.new_state(len(ids))
    prefill = np.asarray(model.forward(ids, st, all_logits=True))
    st1 = model.new_state(len(ids))
    steps = np.concatenate([np.asarray(model.forward(ids[i:i + 1], st1)) for i in range(len(ids))])
    st2 = model.new_state(len(ids))
    split = np.concatenate([np.asarray(model.forward(ids[:40], st2, all_logits=True)),
                            np.asarray(model.forward(ids[40:], st2, all_logits=True))])
    assert rel_err(steps, prefill) < PREFILL_TOL
    assert rel_err(split, prefill) < PREFILL_TOL
    for a, b in ((st.ssm, st1.ssm), (st.conv, st1.conv), (st.k, st1.k)):
        assert rel_err(a, b) < 1e-5
    assert rel_err(prefill, hf_logits(hf, ids)) < 1e-4


def test_transformers_runs_its_torch_kda(tmp_path, monkeypatch):
    """The reference's KDA is its torch code on CPU (no fla): its l2norm, which only the torch
    forms call, runs in both the chunked and the recurrent form."""
    import importlib.util

    import torch
    from transformers.models.kimi_linear import modeling_kimi_linear as M
    assert importlib.util.find_spec("fla") is None
    calls = []
    l2 = M.l2norm
    monkeypatch.setattr(M, "l2norm", lambda x, **kw: calls.append(x.shape[-3]) or l2(x, **kw))
    hf = build(tmp_path)
    with torch.no_grad():
        hf.generate(torch.tensor([[5, 7, 9]]), max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert calls   # both forms take q then k; chunked [B, H, T, D] and recurrent [B, T, H, D]


def test_packed_bf16(tmp_path):
    """A bf16 arena packed from a bf16-rounded copy of the checkpoint gives that copy's logits."""
    from engine.pack import pack
    build(tmp_path / "f32", release=True)
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 16)
    packed = engine.load(tmp_path / "p", device="cpu")
    assert packed.experts.stats()["source"] == "arena"
    assert rel_err(packed.logits(ids), engine.load(src, device="cpu").logits(ids)) < 1e-5


# ---- the KDA kernels against their numpy oracle, the oracle against the reference's ----------

def _rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("chunked", [False, True], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("t,nk,nv,dk,dv", [(1, 2, 2, 8, 8), (7, 1, 3, 16, 8), (K.CHUNK * 2 + 9, 2, 2, 8, 12)])
def test_kda_kernels(chunked, t, nk, nv, dk, dv):
    rng = np.random.default_rng()
    q, k, v = _rnd(rng, t, nk, dk), _rnd(rng, t, nk, dk), _rnd(rng, t, nv, dv)
    g = -np.abs(_rnd(rng, t, nv, dk, scale=0.5))
    beta = rng.uniform(0, 1, (t, nv)).astype(np.float32)
    state = _rnd(rng, nv, dk, dv, scale=0.3)
    want, want_state = ref.gated_delta_rule(q, k, v, g, beta, state)
    out = np.full((t, nv, dv), np.nan, np.float32)
    (K.kda_chunked(q, k, v, g, beta, state, out, K.CHUNK) if chunked else
     K.kda_recurrent(q, k, v, g, beta, state, out))
    assert rel_err(out, want) < 1e-5
    assert rel_err(state, want_state) < 1e-5


def test_kda_gates_kernel():
    rng = np.random.default_rng()
    t, nh, dk = 9, 3, 4
    b, f = _rnd(rng, t, nh, scale=3), _rnd(rng, t, nh * dk, scale=10)   # softplus on both sides of 20
    a_log, dt = np.repeat(_rnd(rng, nh), dk), _rnd(rng, nh * dk, scale=5)
    beta, g = np.full((t, nh), np.nan, np.float32), np.full((t, nh * dk), np.nan, np.float32)
    K.deltanet_gates(b, f, -np.exp(a_log), dt, beta, g)
    want_beta, want_g = ref.deltanet_gates(b, f, a_log, dt)
    np.testing.assert_allclose(beta, want_beta, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [1, 5, 70])
def test_oracle_matches_reference_kda(t):
    """reference.gated_delta_rule with a decay a key channel is transformers' KDA (both forms)."""
    import torch
    from transformers.models.kimi_linear import modeling_kimi_linear as M
    rng = np.random.default_rng()
    h, dk, dv = 2, 8, 6
    q, k, v = _rnd(rng, t, h, dk), _rnd(rng, t, h, dk), _rnd(rng, t, h, dv)
    g = -np.abs(_rnd(rng, t, h, dk, scale=0.5))
    beta = rng.uniform(0, 1, (t, h)).astype(np.float32)
    state = _rnd(rng, h, dk, dv, scale=0.3)
    want, want_state = ref.gated_delta_rule(q, k, v, g, beta, state)
    args = [torch.tensor(a)[None] for a in (q, k, v, g, beta)]
    for fn in (M.recurrent_kimi_delta_attention, M.chunk_kimi_delta_attention):
        o, s = fn(*args[:3], g=args[3], beta=args[4], initial_state=torch.tensor(state)[None],
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert rel_err(o[0].numpy(), want) < 1e-5 and rel_err(s[0].numpy(), want_state) < 1e-5


# ---- config.json -----------------------------------------------------------------------------

RELEASE = dict(model_type="kimi_linear", vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=5,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
               qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, mla_use_nope=True,
               num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=16,
               moe_renormalize=True, moe_router_activation_func="sigmoid", routed_scaling_factor=2.446,
               first_k_dense_replace=1, moe_layer_freq=1, use_grouped_topk=True, num_expert_group=2,
               topk_group=1, model_max_length=1048576, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
               tie_word_embeddings=False, num_nextn_predict_layers=0,
               linear_attn_config=dict(full_attn_layers=[4], kda_layers=[1, 2, 3, 5], head_dim=8, num_heads=2,
                                       short_conv_kernel_size=4))


def test_config_read():
    c = family_of(RELEASE).config
    assert c.layer_types == (L, L, L, F, L) and c.full_layers == (3,) and c.moe_layers == (1, 2, 3, 4)
    assert (c.n_experts, c.top_k, c.n_group, c.topk_group, c.shared_intermediate) == (8, 2, 2, 1, 16)
    assert c.norm_topk_prob and c.routed_scale == 2.446 and c.max_position == 1048576
    assert (c.lin_k_heads, c.lin_k_dim, c.conv_kernel, c.conv_dim) == (2, 8, 4, 48)
    assert c.nope_layers == tuple(range(5)) and c.softmax_scale == pytest.approx(20 ** -0.5)
    # no layer lists: the reference's default (full attention at 4, 8, ... counted from 0)
    bare = dict(RELEASE, num_hidden_layers=9, linear_attn_config=dict(head_dim=8, num_heads=2))
    assert family_of(bare).config.full_layers == (4, 8)


@pytest.mark.parametrize("change,msg", [
    (dict(hidden_act="situ"), "hidden_act='situ' is not supported for kimi_linear; expected 'silu'"),
    (dict(mla_use_nope=False), "mla_use_nope=False is not supported for kimi_linear; expected true"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings=True is not supported"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax' is not supported"),
    (dict(mla_use_output_gate=True), "mla_use_output_gate=True is not supported"),
    (dict(routed_expert_hidden_size=16), "routed_expert_hidden_size=16 is not supported"),
    (dict(linear_attn_config={**RELEASE["linear_attn_config"], "gate_lower_bound": -5.0}),
     "linear_attn_config.gate_lower_bound=-5.0 is not supported"),
    (dict(linear_attn_config={**RELEASE["linear_attn_config"], "kda_layers": [1, 2, 3]}),
     r"kda_layers \[1, 2, 3\] and full_attn_layers \[4\] must list each of the layers 1..5 once"),
    (dict(layer_types=[L, F]), "layer_types must give each of the 5 layers one of"),
])
def test_config_refused(change, msg):
    with pytest.raises(ConfigError, match=msg):
        family_of({**RELEASE, **change})
