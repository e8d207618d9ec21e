"""LFM2-MoE (engine/models/lfm2_moe.py) on the CPU backend against transformers on tiny random
models: gated short conv layers (with and without biases, widths 3 and 4) beside attention layers
(q / k norms a head, RoPE), dense first layers, sigmoid routing with and without expert_bias,
renormalized or not, scaled; the release's config spellings (tie_embedding, a top-level
rope_theta) and tensor names; prefill against token-by-token decode, the prefix cache (resumed
only where a prompt extends the whole state), a bf16 arena, the state's bytes, config refusals,
the cuda refusal; the short conv kernel against its numpy oracle, and the oracle against
transformers' Lfm2MoeShortConv with its conv cache."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_prefill_equals_token_by_token, check_state_resumes,
                      rel_err, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError
from kernels_numba import cpu_shortconv as K
from kernels_numba import reference as ref
from test_granitemoe import tensor_names
from test_nemotron_h import check_no_rewind

rng = np.random.default_rng()
C, A = "conv", "full_attention"
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            norm_eps=1e-5, pad_token_id=None, bos_token_id=None, eos_token_id=None)
CASES = [
    # the release's shape: conv layers first, two dense layers, expert_bias, renormalized top-k,
    # tied embeddings; config.json in the release's spellings (tie_embedding, rope_theta)
    dict(layer_types=[C, C, A, C, A, C], num_dense_layers=2, release=True),
    # attention first, no dense layer, conv biases, a width of 4, top-3 on the scores alone, not
    # renormalized, lm_head apart
    dict(layer_types=[A, C, C, A], num_dense_layers=0, conv_bias=True, conv_L_cache=4, num_experts_per_tok=3,
         use_expert_bias=False, norm_topk_prob=False, tie_word_embeddings=False),
]
IDS = ["release", "biases-no-expert-bias"]


def build(dst, dtype: str = "float32", release: bool = False, **over):
    """A random transformers LFM2-MoE (fresh seed, printed; routed_scaling_factor and RoPE's
    theta random too) with its expert_bias away from zero, saved in dtype; release: config.json
    in the release's spellings. Returns transformers' model read back from dst in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"lfm2_moe weights seed {seed}", flush=True)
    r = np.random.default_rng(seed)
    torch.manual_seed(seed)
    theta = float(r.uniform(1e4, 1e6))   # not the reference's default: each side reads the config's
    over = {**TINY, "routed_scaling_factor": float(r.uniform(0.5, 3.0)),
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, **over}
    over["num_hidden_layers"] = len(over["layer_types"])
    model = tf.Lfm2MoeForCausalLM(tf.Lfm2MoeConfig(**over))
    widen_init(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):   # against sigmoid scores in (0, 1)
                b.normal_(0.0, 0.2)
    save_tiny(model, dst, dtype)
    if release:
        cfg = json.loads((dst / "config.json").read_text())
        del cfg["rope_parameters"], cfg["tie_word_embeddings"]
        cfg.update(rope_theta=theta, tie_embedding=True)
        (dst / "config.json").write_text(json.dumps(cfg))
    return tf.Lfm2MoeForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


def check_prefill_in_pieces(model, ids) -> None:
    """ids prefilled in pieces on one state (one shorter than the conv's window, then chunks that
    start from the state the last one left) give the logits of all of them at once."""
    whole = model.forward(ids, model.new_state(32), all_logits=True)
    st = model.new_state(32)
    parts = [model.forward(ids[a:b], st, all_logits=True) for a, b in ((0, 2), (2, 9), (9, len(ids)))]
    assert rel_err(np.concatenate(parts), whole) < 1e-5


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over):
    hf = build(tmp_path, **over)
    names = tensor_names(tmp_path)   # the release's names, as save_pretrained writes them
    assert {"model.layers.3.feed_forward.experts.7.w1.weight", "model.layers.1.conv.conv.weight"} <= names
    assert ("model.layers.3.feed_forward.expert_bias" in names) == over.get("use_expert_bias", True)
    m = engine.load(tmp_path, device="cpu")
    assert m.config.layer_types == tuple(hf.config.layer_types)
    assert m.config.rope.theta == hf.config.rope_parameters["rope_theta"]
    assert m.config.tie_embeddings == hf.config.tie_word_embeddings == over.get("release", False)
    ids = check_against(hf, m, n_ids=14, n_new=16)
    check_prefill_equals_token_by_token(m.model, ids)
    check_prefill_in_pieces(m.model, ids)
    if over is CASES[0]:
        check_state_resumes(tmp_path, ids)
        check_no_rewind(tmp_path, ids)


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_packed_bf16(tmp_path, over):
    """A bf16 arena of the routed experts (w1 / w3 / w2) gives the logits of the checkpoint
    rounded to bf16."""
    from engine.pack import pack
    build(tmp_path / "f32", **over)
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 14)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_state_bytes_per_token(tmp_path):
    """The sequence state a decode token reads: K and V rows of the attention layers only, the
    conv layers' conv state whole (engine.bench's bound counts it)."""
    from test_state_bytes import check_state_bytes
    build(tmp_path, **CASES[0])
    m = engine.load(tmp_path, device="cpu")
    check_state_bytes(m, 2 * 4 * 2 * 8 * 2, 4 * 4 * 2 * 32)   # 2 attention, 4 conv layers of 2 x 32


# ---- config.json ---------------------------------------------------------------------------

# LFM2-8B-A1B's config.json (the fields the reference reads)
RELEASE = dict(model_type="lfm2_moe", architectures=["Lfm2MoeForCausalLM"], vocab_size=65536, hidden_size=2048,
               intermediate_size=7168, moe_intermediate_size=1792, num_hidden_layers=24, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5, conv_bias=False,
               conv_L_cache=3, rope_theta=1000000.0, num_dense_layers=2, num_experts=32, num_experts_per_tok=4,
               norm_topk_prob=True, use_expert_bias=True, routed_scaling_factor=1.0, tie_embedding=True,
               bos_token_id=1, eos_token_id=7, pad_token_id=0,
               layer_types=[C, C, A, C, C, C, A, C, C, C, A, C, C, C, A, C, C, C, A, C, C, A, C, C])


def test_config_read():
    fam = family_of(RELEASE)
    c = fam.config
    assert c.full_layers == (2, 6, 10, 14, 18, 21) and len(c.linear_layers) == 18
    assert c.moe_layers == tuple(range(2, 24)) and (c.n_experts, c.top_k, c.routed_scale) == (32, 4, 1.0)
    assert (c.head_dim, c.n_kv_heads, c.conv_kernel, c.conv_dim) == (64, 8, 3, 2048)
    assert (c.dense_intermediate, c.moe_intermediate, c.rms_eps, c.rope.theta) == (7168, 1792, 1e-5, 1e6)
    assert c.tie_embeddings and c.expert_bias and c.norm_topk_prob and not c.conv_bias and c.eos_token_ids == (7,)
    spec = fam.dense_spec
    assert spec["model.layers.0.conv.conv.weight"] == (2048, 1, 3) and spec["model.embedding_norm.weight"] == (2048,)
    assert spec["model.layers.0.conv.in_proj.weight"] == (3 * 2048, 2048)
    assert spec["model.layers.2.self_attn.out_proj.weight"] == (2048, 2048)
    assert spec["model.layers.2.self_attn.q_layernorm.weight"] == (64,)
    assert spec["model.layers.1.feed_forward.w3.weight"] == (7168, 2048)
    assert spec["model.layers.2.feed_forward.expert_bias"] == (32,) and "lm_head.weight" not in spec
    assert fam.expert_spec["model.layers.23.feed_forward.experts.31.w2.weight"] == (2048, 1792)
    assert len(fam.expert_spec) == 22 * 32 * 3
    # the reference's defaults where config.json has none; tie_word_embeddings where it has no
    # tie_embedding
    bare = {k: v for k, v in RELEASE.items() if k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                                      "num_attention_heads", "layer_types")}
    d = family_of({**bare, "tie_word_embeddings": False}).config
    assert (d.n_experts, d.top_k, d.n_kv_heads, d.conv_kernel, d.max_position) == (32, 4, 8, 3, 128000)
    assert d.moe_layers == tuple(range(2, 24)) and d.rope.theta == 1e6 and not d.tie_embeddings
    assert family_of(bare).config.tie_embeddings
    assert not family_of({**RELEASE, "tie_embedding": False, "tie_word_embeddings": True}).config.tie_embeddings


@pytest.mark.parametrize("change,msg", [
    (dict(layer_types=None), "missing field layer_types"),
    (dict(layer_types=[C, "sliding_attention"] * 12),
     "layer_types must give each of the 24 layers one of conv, full_attention; got 'sliding_attention' at layer 1"),
    (dict(layer_types=[C, A]), "layer_types must give each of the 24 layers one of .*got 2 entries"),
    (dict(conv_L_cache=0), "conv_L_cache=0; expected a conv width of 1 or more"),
    (dict(num_dense_layers=25), r"num_dense_layers=25 must be in 0..24"),
    (dict(num_experts_per_tok=33), r"num_experts_per_tok=33 must be in 1..32"),
    (dict(num_key_value_heads=5), "num_attention_heads=32 is not a multiple of num_key_value_heads=5"),
    (dict(rope_parameters={"rope_type": "su"}), "rope type 'su' is not supported"),
])
def test_config_refused(change, msg):
    with pytest.raises(ConfigError, match=msg):
        family_of({**RELEASE, **change})


def _rnd(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- the short conv kernel against its oracle, the oracle against the reference's ------------

@pytest.mark.parametrize("t,kc,bias", [(1, 3, False), (7, 3, True), (2, 4, False), (5, 1, True)])
def test_gated_short_conv_kernel(t, kc, bias):
    """The kernel through its rolling state (carried in, fewer tokens than the state's rows too)
    against reference.gated_short_conv, output poisoned first."""
    h = 20
    bcx, w, state = _rnd(t, 3 * h), _rnd(h, kc), _rnd(kc - 1, h)
    b = _rnd(h) if bias else np.zeros(h, np.float32)
    want, want_state = ref.gated_short_conv(bcx, w, b if bias else None, state)
    out, st = np.full((t, h), np.nan, np.float32), state.copy()
    K.gated_short_conv(bcx, w, b, st, out)
    assert rel_err(out, want) < 1e-6
    if kc > 1:
        assert rel_err(st, want_state) < 1e-7


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_oracle_matches_reference_short_conv(bias):
    """reference.gated_short_conv (between in_proj and out_proj) is transformers' Lfm2MoeShortConv
    over a prompt and then token by token, its conv cache carried between the calls."""
    import torch
    import transformers as tf
    from transformers.models.lfm2_moe import modeling_lfm2_moe as M
    h, kc = 16, 3
    cfg = tf.Lfm2MoeConfig(vocab_size=32, hidden_size=h, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, layer_types=["conv", "full_attention"], conv_L_cache=kc,
                           conv_bias=bias, num_dense_layers=2)
    torch.manual_seed(int(rng.integers(1 << 31)))
    conv = M.Lfm2MoeShortConv(cfg, 0).eval()
    with torch.no_grad():
        for p in conv.parameters():
            p.normal_(0.0, 0.5)
    cache = tf.DynamicCache(config=cfg)
    xs = _rnd(9, h)
    state = np.zeros((kc - 1, h), np.float32)
    wi, wo = conv.in_proj.weight.detach().numpy(), conv.out_proj.weight.detach().numpy()
    wc = conv.conv.weight.detach().numpy().reshape(h, kc)
    bi, bc, bo = ((m.bias.detach().numpy() if bias else None) for m in (conv.in_proj, conv.conv, conv.out_proj))
    for lo, hi in ((0, 2), (2, 3), (3, 4), (4, 9)):   # a prompt shorter than the window, steps, a chunk
        with torch.no_grad():
            got = conv(torch.tensor(xs[lo:hi])[None], cache=cache)[0].numpy()
        bcx = xs[lo:hi].astype(np.float64) @ wi.T + (0 if bi is None else bi)
        y, state = ref.gated_short_conv(bcx.astype(np.float32), wc, bc, state)
        want = y.astype(np.float64) @ wo.T + (0 if bo is None else bo)
        assert rel_err(got, want) < 1e-5, (lo, hi)
