"""Nemotron-H (engine/models/nemotron_h.py) on the CPU backend against transformers on tiny random
models: Mamba-2 mixers (conv with its state, the selective scan with groups, the gated group norm),
attention without RoPE, ungated relu^2 experts with sigmoid routing and a shared expert, dense
relu^2 MLP layers, Super's latent MoE projection; prefill against token-by-token decode, the
prefix cache, an ungated bf16 arena, the Mamba kernels and the relu^2 expert against their
numpy oracles, config refusals. The cuda decoder (engine/gpu_nemotron_h.py): tests/test_gpu_mamba.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_prefill_equals_token_by_token, check_state_resumes,
                      record_prefills, rel_err, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError
from kernels_numba import cpu, reference as ref
from kernels_numba import cpu_mamba as K

TINY = dict(vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=24, mamba_num_heads=8, mamba_head_dim=6, ssm_state_size=8, n_groups=2,
            conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=12, routed_scaling_factor=2.5, layer_norm_epsilon=1e-5,
            max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)
# the reference's cache reads its first layer's length, so each pattern starts with M or *
CASES = [dict(hybrid_override_pattern="M*E-ME"),                          # Nano's kinds, a dense MLP
         dict(hybrid_override_pattern="*EMMEM", moe_latent_size=12, n_group=2, topk_group=1,
              n_groups=4, use_conv_bias=False, norm_topk_prob=False, num_nextn_predict_layers=1),  # Super's
         dict(layers_block_type=["mamba", "moe", "attention", "moe"], n_groups=1)]           # older names
IDS = ["nano-pattern", "latent-groups", "legacy-names"]


def build(dst, dtype: str = "float32", **over):
    """A random transformers Nemotron-H (fresh seed, printed) with its Mamba parameters, norms and
    selection biases away from their init, saved in dtype; returns the reference in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"nemotron_h weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    model = tf.NemotronHForCausalLM(tf.NemotronHConfig(**{**TINY, **over}))
    widen_init(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):     # A = -exp(A_log) from -0.5 to -4
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif n.endswith("dt_bias"):   # softplus(dt + dt_bias) on both sides of 1
                p.normal_(-0.5, 1.0)
            elif n.endswith(".D") or n.endswith("conv1d.bias"):
                p.normal_(0.5, 0.5)
            elif "norm" in n:
                p.normal_(1.0, 0.3)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)
    if "layers_block_type" in over:   # a config.json in the older names, as older releases write it
        cfg = json.loads((dst / "config.json").read_text())
        cfg["layers_block_type"] = [OLD_NAMES.get(k, k) for k in cfg["layers_block_type"]]
        (dst / "config.json").write_text(json.dumps(cfg))
    return tf.NemotronHForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


OLD_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def check_no_rewind(folder, ids) -> None:
    """A prompt that shares only part of the last generation's tokens is not resumed from that
    state (the Mamba state cannot go back): its logits are a fresh engine's."""
    m = engine.load(folder, device="cpu", prefix_cache=True)
    first = m.generate(ids[:8].tolist(), max_new_tokens=6).output_ids
    prompt = ids[:8].tolist() + first[:3] + ids[8:11].tolist()
    prefills = record_prefills(m)
    m.generate(prompt, max_new_tokens=1)
    assert rel_err(prefills[-1], engine.load(folder, device="cpu").logits(prompt)[-1]) < 1e-5


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref_model = build(tmp_path, **over)
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref_model, m, n_ids=14, n_new=16)
    check_prefill_equals_token_by_token(m.model, ids)
    if over is CASES[0]:
        check_state_resumes(tmp_path, ids)
        check_no_rewind(tmp_path, ids)
    if "layers_block_type" in over:
        assert json.loads((tmp_path / "config.json").read_text())["layers_block_type"][0] == "mamba"


@pytest.mark.parametrize("over", [CASES[0], CASES[1]], ids=IDS[:2])
def test_packed_bf16(tmp_path, over):
    """A bf16 arena of ungated experts (up and down alone) gives the logits of the checkpoint
    rounded to bf16; the arena says it is ungated and holds no gate bytes."""
    from engine.pack import pack
    from loader.arena import ArenaFile
    from loader.layout import ExpertLayout
    build(tmp_path / "f32", **over)
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 14)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5
    h = ArenaFile.read_header(tmp_path / "p" / "experts.arena")
    c = family_of(json.loads((src / "config.json").read_text())).config
    assert not h["gated"] and h["hidden"] == c.expert_hidden == (over.get("moe_latent_size") or 32)
    assert h["block_bytes"] == ExpertLayout.build("bf16", c.expert_hidden, c.moe_intermediate, False).block_bytes
    if over is CASES[0]:   # the quantized formats pack ungated blocks too: each expert's up and
        from loader.quant import decode_expert_block   # down come back within the format's error
        for fmt, tol in (("fp8", 0.05), ("nvfp4", 0.2)):
            pack(src, tmp_path / fmt, fmt, progress=False)
            q = engine.load(tmp_path / fmt, device="cpu")
            _, up, down = decode_expert_block(q.experts.get(2, 3), q.experts.arena.layout)
            ck = engine.load(src, device="cpu").checkpoint
            assert rel_err(up, ck.get_f32("backbone.layers.2.mixer.experts.3.up_proj.weight")) < tol
            assert rel_err(down, ck.get_f32("backbone.layers.2.mixer.experts.3.down_proj.weight")) < tol
            assert rel_err(q.logits(ids), want) < 0.5
    lay = ExpertLayout.build("bf16", 1024, 512, False)
    assert lay.gate_q == lay.gate_s == lay.up_q and \
        lay.payload_bytes < ExpertLayout.build("bf16", 1024, 512).payload_bytes


def test_state_bytes_per_token(tmp_path):
    """The sequence state a decode token reads: K and V rows of the attention layers only, the
    Mamba layers' conv and scan state whole (engine.bench's bound counts it)."""
    from test_state_bytes import check_state_bytes
    build(tmp_path, **CASES[0])
    m = engine.load(tmp_path, device="cpu")
    check_state_bytes(m, 2 * 4 * 2 * 8, 4 * 2 * (3 * 80 + 8 * 6 * 8))   # 1 attention, 2 Mamba layers
    # the weights: every dense tensor but the (untied) embedding table, whose one row a token reads
    dense = sum(np.asarray(w).nbytes for w in m._dense.values())
    experts = 2 * m.config.top_k * 2 * 32 * m.config.moe_intermediate * 4   # 2 MoE layers, up and down
    assert m.weight_bytes_per_token() == dense - 300 * 32 * 4 + experts


def test_config_read_and_refused():
    c = family_of({"model_type": "nemotron_h", **TINY, "hybrid_override_pattern": "M-M*E",
                   "num_hidden_layers": 5, "time_step_limit": [0.0, {"__float__": "Infinity"}],
                   "num_nextn_predict_layers": 1, "tie_word_embeddings": True}).config
    assert c.kinds == ("linear_attention", "mlp", "linear_attention", "full_attention", "moe")
    assert c.moe_layers == (4,) and c.linear_layers == (0, 2) and c.full_layers == (3,)
    assert c.ssm_shape == (8, 6, 8) and c.conv_dim == 48 + 2 * 2 * 8 and not c.tie_embeddings
    assert c.ignored_parts[0][0] == "mtp."
    old = family_of({"model_type": "nemotron_h", **TINY, "hybrid_override_pattern": "M*E",
                     "mamba_n_groups": 4, "mamba_d_conv": 3, "mamba_dt_limit": [0.0, float("inf")]}).config
    assert old.n_groups == 4 and old.conv_kernel == 3
    listed = family_of({"model_type": "nemotron_h", **TINY, "n_shared_experts": 0,
                        "layers_block_type": ["mamba", "attention", "moe", "mlp"]}).config
    assert listed.kinds == ("linear_attention", "full_attention", "moe", "mlp") and listed.shared_intermediate == 12

    def refused(match, **over):
        with pytest.raises(ConfigError, match=match):
            family_of({"model_type": "nemotron_h", **TINY, "hybrid_override_pattern": "M*E", **over})
    refused(r"hybrid_override_pattern must be a string of M, \*, E, -", hybrid_override_pattern="M*X")
    refused(r"layers_block_type must give each of the 2 layers one of .*got 'cross' at layer 1",
            layers_block_type=["mamba", "cross"])
    refused(r"mlp_hidden_act='silu' is not supported \(relu2 only\)", mlp_hidden_act="silu")
    refused(r"mamba_hidden_act='gelu' is not supported \(silu only\)", mamba_hidden_act="gelu")
    refused(r"use_bias=true is not supported", use_bias=True)
    refused(r"mlp_bias=true is not supported", mlp_bias=True)
    refused(r"time_step_limit=\[0.0, 0.1\] is not supported", time_step_limit=[0.0, 0.1])
    refused(r"mamba_num_heads=8 is not a multiple of n_groups=3", n_groups=3)
    refused(r"n_group=3 must divide n_routed_experts=8", n_group=3)


# ---- kernels against their oracles --------------------------------------------------------

rng = np.random.default_rng()


def _poisoned(shape):
    return np.full(shape, np.nan, dtype=np.float32)


@pytest.mark.parametrize("t", [1, 7])
def test_conv_scan_and_norm_kernels(t):
    """The conv (with bias, through its rolling state), the scan (state carried in, groups
    shared by heads, a dt clamp that bites) and the gated group norm against reference.py."""
    c_dim, kc, hm, p, g, n = 20, 4, 6, 5, 3, 7
    x = rng.standard_normal((t, c_dim)).astype(np.float32)
    w = rng.standard_normal((c_dim, kc)).astype(np.float32)
    bias = rng.standard_normal(c_dim).astype(np.float32)
    state = rng.standard_normal((kc - 1, c_dim)).astype(np.float32)
    want, want_state = ref.causal_conv1d_silu(x, w, state, bias)
    out, st = _poisoned(x.shape), state.copy()
    K.conv1d_bias_silu(x, w, bias, st, out)
    assert rel_err(out, want) < 1e-6 and rel_err(st, want_state) < 1e-7
    xs = rng.standard_normal((t, hm, p)).astype(np.float32)
    dt = rng.standard_normal((t, hm)).astype(np.float32) * 2
    b, cm = (rng.standard_normal((t, g, n)).astype(np.float32) for _ in range(2))
    a_log, dt_bias, d = (rng.standard_normal(hm).astype(np.float32) for _ in range(3))
    s0 = rng.standard_normal((hm, p, n)).astype(np.float32)
    for limit in ((0.0, np.inf), (0.2, 1.5)):
        want, want_state = ref.mamba2_scan(xs, dt, b, cm, a_log, dt_bias, d, limit, s0)
        out, st = _poisoned(xs.shape), s0.copy()
        K.mamba2_scan(xs, dt, b, cm, -np.exp(a_log), dt_bias, d, np.float32(limit[0]),
                      np.float32(limit[1]), st, out)
        assert rel_err(out, want) < 1e-5 and rel_err(st, want_state) < 1e-5
    z = rng.standard_normal((t, 12)).astype(np.float32)
    y = rng.standard_normal((t, 12)).astype(np.float32)
    wn = rng.standard_normal(12).astype(np.float32)
    out = _poisoned(y.shape)
    K.rmsnorm_group_gated(y, z, wn, 4, np.float32(1e-5), out)
    want = ref.rmsnorm_group_gated(y, z, wn, 4, 1e-5)
    assert rel_err(out, want) < 1e-6
    assert rel_err(ref.rmsnorm_group_gated(y, z, wn, 12, 1e-5), want) > 1e-2   # the groups matter


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("t", [1, 5])
def test_relu2_expert_block(fmt, t):
    """An ungated block (no gate rows) through the block kernel's relu^2 mode, and dense weights,
    against reference.relu2_expert on the block's decoded weights."""
    from loader.layout import ExpertLayout
    from loader.quant import decode_expert_block, encode_expert_block
    h, i = 41, 19
    lay = ExpertLayout.build(fmt, h, i, gated=False)
    up, down = rng.standard_normal((i, h)).astype(np.float32), rng.standard_normal((h, i)).astype(np.float32)
    block = encode_expert_block(fmt, lay, None, up, down)
    dg, du, dd = decode_expert_block(block, lay)
    assert dg.shape == (0, h)
    x = rng.standard_normal((t, h)).astype(np.float32)
    ops = cpu.CpuOps()
    want = ref.relu2_expert(x, du, dd)
    assert rel_err(ops.expert_relu2(x, (fmt, block, lay.as_array())), want) < 1e-5
    assert rel_err(ops.expert_relu2(x, (du, dd)), want) < 1e-5
    r = np.maximum(x @ du.T, 0)
    assert rel_err(r @ dd.T, want) > 1e-2   # squared, not plain relu
