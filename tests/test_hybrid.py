"""Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet + gated attention) on the CPU backend.

The engine against transformers on tiny random fp32 models (logits at every position, greedy
tokens), prefill against token-by-token decode, the Qwen3.5 image-text wrapper, and every
DeltaNet kernel against its numpy oracle in reference.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import engine
from conftest import assert_greedy, assert_same_greedy, rel_err, widen_init
from engine.demo import byte_level_tokenizer
from engine.models import family_of
from engine.models.rope import ConfigError
from engine.names import expert_names
from kernels_numba import cpu_deltanet as K
from kernels_numba import reference as ref

# ---- tiny models ---------------------------------------------------------------------------

BASE = dict(vocab_size=300, hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
              spatial_merge_size=1, temporal_patch_size=1, out_hidden_size=48, num_position_embeddings=16)


def build(dst, family: str, seed: int | None = None, dtype: str = "float32", **over):
    """Save a random transformers model of the family (wider-than-default init) + byte tokenizer.

    family: qwen3_next | qwen3_5_moe_text (Qwen3_5MoeForCausalLM) | qwen3_5_moe (the image-text
    wrapper with a tiny vision tower). Saved in dtype; returns the model in eval mode, in fp32
    (bf16 weights upcast: the reference for a bf16 checkpoint).
    """
    import transformers as tf
    kw = {**BASE, **over}
    if family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{"intermediate_size": 64, **kw}))
    elif family == "qwen3_5_moe_text":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**kw))
    elif family == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeConfig(text_config=kw, vision_config=VISION)
        model = tf.Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        raise ValueError(family)
    if seed is None:   # fresh weights every run; the seed is printed for a failing run
        seed = int(np.random.default_rng().integers(1 << 31))
    print(f"{family} weights: torch seed {seed}")
    torch.manual_seed(seed)
    widen_init(model)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(dst)
    model = model.float()
    exact_rope(model)
    byte_level_tokenizer().save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return model


def exact_rope(model) -> None:
    """Give the reference float32 RoPE frequencies again: casting the module to bf16 rounded its
    inv_freq buffers (0.1 -> 0.1001), which a checkpoint does not store and a loader recomputes."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(m, "inv_freq", None) is None or cfg is None:
            continue
        try:
            fresh = type(m)(config=cfg)
        except TypeError:
            continue
        m.inv_freq = fresh.inv_freq.float()
        if hasattr(m, "original_inv_freq"):
            m.original_inv_freq = fresh.inv_freq.float()


def ids_for(n=16, seed=None):
    """n random prompt ids: fresh every run unless seed is given (printed for a failing run)."""
    if seed is None:
        seed = int(np.random.default_rng().integers(1 << 31))
    print(f"prompt ids: seed {seed}")
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], n)


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)[None]).logits[0].float().numpy()


def assert_matches_reference(got, model, ids, tol=1e-4) -> None:
    """The engine's float32 logits against transformers run in float64 on the same weights.

    Some draws of the widened random weights amplify float32 rounding (a DeltaNet state near
    cancellation): then transformers' own float32 run misses float64 by ~1e-4 as well. The bound
    is tol, or 3x transformers' float32 error on this draw where that is larger, so a real bug
    (errors of 1e-2 and up) still fails and an ill-conditioned draw does not.
    """
    import copy
    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")   # the grouped-mm path has no float64
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids)[None]).logits[0].numpy()
    bound = max(tol, 3 * rel_err(hf_logits(model, ids), want))
    err = rel_err(got, want)
    assert err < bound, f"engine vs transformers (float64): rel err {err:.3g} >= {bound:.3g}"


# ---- the engine against transformers -------------------------------------------------------

L, F = "linear_attention", "full_attention"
CASES = [
    # default pattern (full attention every 4th layer), Nv = 2 Nk, partial rotary 0.25 (the default)
    ("qwen3_next", {}),
    # Nk = Nv, rotary 0.5, explicit layer types, a dense-MLP layer, top-k not renormalized, tied head
    ("qwen3_next", dict(num_hidden_layers=3, layer_types=[F, L, F], linear_num_key_heads=2,
                        linear_num_value_heads=2, mlp_only_layers=[1], norm_topk_prob=False,
                        tie_word_embeddings=True, partial_rotary_factor=0.5)),
    # Nv = 3 Nk, Dk != Dv, full rotary, full attention every 2nd layer
    ("qwen3_5_moe_text", dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16,
                              partial_rotary_factor=1.0, full_attention_interval=2, num_key_value_heads=1)),
    # attention between DeltaNet layers, conv width 2, top-1 (transformers' cache needs one attention layer)
    ("qwen3_5_moe_text", dict(num_hidden_layers=3, layer_types=[L, F, L], linear_conv_kernel_dim=2,
                              num_experts_per_tok=1, partial_rotary_factor=0.75)),
]


@pytest.mark.parametrize("family,over", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_logits_and_greedy_match_transformers(tmp_path, family, over):
    hf = build(tmp_path, family, **over)
    m = engine.load(tmp_path, device="cpu")
    ids = ids_for(16)
    got = m.logits(ids)
    assert got.shape == (len(ids), BASE["vocab_size"])
    assert_matches_reference(got, hf, ids)
    res = m.generate(ids[:5].tolist(), max_new_tokens=32, temperature=0)
    assert_greedy(hf, ids[:5].tolist(), res.output_ids, 32)


def test_prefill_equals_token_by_token_decode(tmp_path):
    """Chunked prefill (prompt longer than a chunk) == recurrent decode == transformers; and a
    prefill in two pieces carries the conv and recurrent state across."""
    hf = build(tmp_path, "qwen3_next", num_hidden_layers=2, layer_types=[L, F])
    m = engine.load(tmp_path, device="cpu")
    ids = ids_for(K.CHUNK + 17)
    model = m.model
    st = model.new_state(len(ids))
    prefill = np.asarray(model.forward(ids, st, all_logits=True))
    st1 = model.new_state(len(ids))
    steps = np.concatenate([np.asarray(model.forward(ids[i:i + 1], st1)) for i in range(len(ids))])
    st2 = model.new_state(len(ids))
    split = np.concatenate([np.asarray(model.forward(ids[:40], st2, all_logits=True)),
                            np.asarray(model.forward(ids[40:], st2, all_logits=True))])
    assert rel_err(steps, prefill) < 1e-5
    assert rel_err(split, prefill) < 1e-5
    # the states too (the projections differ in the last bit: gemm at prefill, matvec per token)
    for a, b in ((st.ssm, st1.ssm), (st.conv, st1.conv), (st.k, st1.k)):
        assert rel_err(a, b) < 1e-5
    assert_matches_reference(prefill, hf, ids)


def test_qwen35_wrapper_skips_vision_and_mtp(tmp_path, capfd):
    """The released layout: Qwen3_5MoeForConditionalGeneration (model.language_model.*, a vision
    tower under model.visual.*) plus MTP tensors, which transformers ignores and so do we."""
    from safetensors.numpy import load_file, save_file
    hf = build(tmp_path, "qwen3_5_moe")
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    assert any(n.startswith("model.visual.") for n in tensors)
    rng = np.random.default_rng(0)
    tensors["mtp.fc.weight"] = rng.standard_normal((48, 96)).astype(np.float32)
    tensors["mtp.layers.0.input_layernorm.weight"] = np.ones(48, np.float32)
    save_file(tensors, str(f), metadata={"format": "pt"})
    capfd.readouterr()
    m = engine.load(tmp_path, device="cpu")
    err = capfd.readouterr().err
    assert "qwen3_5_moe: skipping the vision tower (" in err and "under model.visual.*)" in err
    assert "qwen3_5_moe: skipping the multi-token-prediction (MTP) layers (2 tensors under mtp.*)" in err
    assert m.config.family == "qwen3_5_moe"
    assert not any(n.startswith(("model.visual.", "mtp.")) for n in m.consumed)
    ids = ids_for(16)
    assert_matches_reference(m.logits(ids), hf, ids)


def test_bf16_wrapper_packs_and_streams(tmp_path):
    """A bf16 Qwen3.5 wrapper: the checkpoint matches transformers on the same weights, and its
    packed folder (experts found by expert_names, read from the arena) gives the same tokens."""
    from engine.pack import pack
    src = tmp_path / "src"
    hf = build(src, "qwen3_5_moe", dtype="bfloat16")
    pack(src, tmp_path / "packed", "bf16", progress=False)
    ids = ids_for(16)
    a = engine.load(src, device="cpu")
    assert_matches_reference(a.logits(ids), hf, ids)
    b = engine.load(tmp_path / "packed", device="cpu")
    assert b.experts.stats()["source"] == "arena"
    want = a.generate(ids[:5].tolist(), max_new_tokens=16).output_ids
    assert_same_greedy(a, ids[:5].tolist(), b.generate(ids[:5].tolist(), max_new_tokens=16).output_ids,
                       want, 16)


def test_routed_experts_stream_through_fetch(tmp_path):
    """Routed experts are in expert_spec under expert_names (the packer's contract), never in
    dense_spec, and reach the model only through experts.fetch; the shared expert is dense."""
    build(tmp_path, "qwen3_next", num_hidden_layers=2, layer_types=[L, F], mlp_only_layers=[0])
    fam = family_of(json.loads((tmp_path / "config.json").read_text()))
    c = fam.config
    assert c.moe_layers == (1,)
    assert set(fam.expert_spec) == {n for e in range(c.n_experts) for n in expert_names(c.family, 1, e)}
    assert not any(".experts." in n for n in fam.dense_spec)
    assert "model.layers.1.mlp.shared_expert.gate_proj.weight" in fam.dense_spec
    routed = []
    m = engine.load(tmp_path, device="cpu", on_route=lambda l, ids: routed.append(l))
    m.logits(ids_for(8))
    assert routed == [1] and m.experts.fetched > 0


def test_config_errors_name_the_field(tmp_path):
    build(tmp_path, "qwen3_5_moe_text", num_hidden_layers=2, layer_types=[L, F])
    cfg = json.loads((tmp_path / "config.json").read_text())
    msg = "linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"
    with pytest.raises(ConfigError, match=msg):
        family_of({**cfg, "linear_num_value_heads": 3})
    with pytest.raises(ConfigError, match="layer_types must list 2 entries"):
        family_of({**cfg, "layer_types": [L]})


# ---- kernels against their numpy oracles ---------------------------------------------------

def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def poisoned(*shape):
    return np.full(shape, np.nan, dtype=np.float32)


@pytest.mark.parametrize("t,c,kc", [(1, 20, 4), (7, 33, 4), (70, 16, 2)])
def test_conv1d_silu_kernel(t, c, kc):
    rng = np.random.default_rng()
    x, w, st = rnd(rng, t, c), rnd(rng, c, kc), rnd(rng, kc - 1, c)
    want, want_st = ref.causal_conv1d_silu(x, w, st)
    out = poisoned(t, c)
    K.conv1d_silu(x, w, st, out)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(st, want_st)


def test_deltanet_gates_kernel():
    rng = np.random.default_rng()
    t, nv = 9, 6
    b, a = rnd(rng, t, nv, scale=3), rnd(rng, t, nv, scale=10)      # softplus on both sides of 20
    a_log, dt = rnd(rng, nv), rnd(rng, nv, scale=5)
    beta, g = poisoned(t, nv), poisoned(t, nv)
    K.deltanet_gates(b, a, -np.exp(a_log), dt, beta, g)
    want_beta, want_g = ref.deltanet_gates(b, a, a_log, dt)
    np.testing.assert_allclose(beta, want_beta, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunked", [False, True], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("t,nk,nv,dk,dv", [(1, 2, 4, 8, 12), (5, 1, 3, 16, 8), (K.CHUNK * 2 + 9, 2, 2, 8, 8)])
def test_gated_delta_rule_kernels(chunked, t, nk, nv, dk, dv):
    rng = np.random.default_rng()
    q, k, v = rnd(rng, t, nk, dk), rnd(rng, t, nk, dk), rnd(rng, t, nv, dv)
    g = -np.abs(rnd(rng, t, nv, scale=0.5))
    beta = rng.uniform(0, 1, (t, nv)).astype(np.float32)
    state = rnd(rng, nv, dk, dv, scale=0.3)
    want, want_state = ref.gated_delta_rule(q, k, v, g, beta, state)
    out = poisoned(t, nv, dv)
    if chunked:
        K.gated_delta_chunked(q, k, v, g, beta, state, out, K.CHUNK)
    else:
        K.gated_delta_recurrent(q, k, v, g, beta, state, out)
    assert rel_err(out, want) < 1e-5
    assert rel_err(state, want_state) < 1e-5


def test_rmsnorm_gated_kernel():
    rng = np.random.default_rng()
    x, z, w = rnd(rng, 24, 12), rnd(rng, 24, 12), rnd(rng, 12)
    out = poisoned(24, 12)
    K.rmsnorm_gated(x, z, w, np.float32(1e-6), out)
    np.testing.assert_allclose(out, ref.rmsnorm_gated(x, z, w, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups", [1, 4, 32])
def test_sigmoid_gate_kernel(groups):
    rng = np.random.default_rng()
    x, gate = rnd(rng, 3, 32), rnd(rng, 3, groups, scale=3)
    want = ref.sigmoid_gate(x, gate)
    K.sigmoid_gate_inplace(x, gate)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-7)
