"""LongCat-Flash (engine/models/longcat_flash.py) on the CPU backend against transformers on tiny
random models: two MLA sublayers and two dense MLPs a layer with the shortcut MoE beside them, the
MLA scales, zero ("identity") experts among the routed ones (and none), softmax routing chosen with
the selection bias, scaled; YaRN with mscale_all_dim, attention biases, tied embeddings; the
release's config spellings and tensor names, its MTP tensors skipped; the MoE alone against
LongcatFlashMoE on many rows (zero experts read no weights); prefill against token-by-token
decode, the prefix cache, a bf16 arena of the real experts only, the state's bytes, config
refusals, the cuda refusal."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import bf16_copy, check_against, check_prefill_equals_token_by_token, check_state_resumes, rel_err, \
    save_tiny, widen_init
from engine.models import family_of
from engine.models.rope import ConfigError
from test_granitemoe import tensor_names

TINY = dict(vocab_size=300, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40, q_lora_rank=24,
            kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, head_dim=8, v_head_dim=10,
            expert_ffn_hidden_size=16, n_routed_experts=6, zero_expert_num=3, moe_topk=3, max_position_embeddings=256,
            rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None, eos_token_id=None)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}
CASES = [
    # the release's layout: 3 zero experts beside 6 real ones, top-3; config.json in the release's
    # spellings (a top-level rope_theta, the MLA scale flags, zero_expert_type), MTP tensors beside
    dict(num_layers=2, release=True),
    # no zero experts, top-4 of 8; YaRN whose mscale_all_dim scales the scores (and its
    # attention factor cos and sin); q_a / kv_a / o biases; tied embeddings; three layers
    dict(num_layers=3, n_routed_experts=8, zero_expert_num=0, moe_topk=4, attention_bias=True,
         tie_word_embeddings=True, yarn=True),
]
IDS = ["release-zero-experts", "no-zero-experts-yarn-biases-tied"]
MTP_TENSORS = ("model.mtp.layers.0.eh_proj.weight", "model.mtp.norm.weight")


def build(dst, dtype: str = "float32", release: bool = False, yarn: bool = False, **over):
    """A random transformers LongCat-Flash (fresh seed, printed; routed_scaling_factor and RoPE's
    theta random too) with its selection biases away from zero, saved in dtype; release: config.json
    in the release's spellings and two MTP tensors added. Returns transformers' model read back
    from dst in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"longcat_flash weights seed {seed}", flush=True)
    r = np.random.default_rng(seed)
    torch.manual_seed(seed)
    theta = float(r.uniform(1e4, 1e7))   # not the reference's default: each side reads the config's
    rope = {**(YARN if yarn else {"rope_type": "default"}), "rope_theta": theta}
    over = {**TINY, "routed_scaling_factor": float(r.uniform(0.5, 6.0)), "rope_parameters": rope, **over}
    model = tf.LongcatFlashForCausalLM(tf.LongcatFlashConfig(**over))
    widen_init(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):   # against softmax scores of about 1 / (E + Z)
                b.normal_(0.0, 0.03)
    save_tiny(model, dst, dtype)
    if release:
        cfg = json.loads((dst / "config.json").read_text())
        del cfg["rope_parameters"], cfg["qk_head_dim"]
        cfg.update(rope_theta=theta, mla_scale_q_lora=True, mla_scale_kv_lora=True, zero_expert_type="identity",
                   router_bias=False)
        (dst / "config.json").write_text(json.dumps(cfg))
        add_tensors(dst, {n: np.ones((4, 4), np.float32) for n in MTP_TENSORS})
    return tf.LongcatFlashForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


def add_tensors(folder, extra: dict) -> None:
    from safetensors.numpy import load_file, save_file
    f = str(folder / "model.safetensors")
    save_file({**load_file(f), **extra}, f, metadata={"format": "pt"})


def routes_seen(m, ids) -> np.ndarray:
    """The ids every MoE layer's on_route saw over m.logits(ids), [layers, T, K]."""
    seen = []
    m.model.on_route = lambda l, got: seen.append(np.array(got))
    try:
        m.logits(ids)
    finally:
        m.model.on_route = None
    return np.stack(seen)


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over, capsys):
    hf = build(tmp_path, **over)
    cfg = hf.config
    e, z, n = cfg.n_routed_experts, cfg.zero_expert_num, cfg.num_layers
    names = tensor_names(tmp_path)   # the release's names, as save_pretrained writes them
    assert {f"model.layers.{n - 1}.self_attn.1.kv_b_proj.weight", f"model.layers.{n - 1}.mlps.1.down_proj.weight",
            f"model.layers.{n - 1}.mlp.experts.{e - 1}.gate_proj.weight",
            "model.layers.0.post_attention_layernorm.1.weight"} <= names
    assert f"model.layers.0.mlp.experts.{e}.gate_proj.weight" not in names   # zero experts: no weights
    m = engine.load(tmp_path, device="cpu")
    c = m.config
    assert (c.n_layers, c.n_experts, c.zero_experts, c.top_k, c.kv_tensors) == (n, e, z, cfg.moe_topk, 2)
    assert c.routed_scale == pytest.approx(cfg.routed_scaling_factor) and c.rope.theta == cfg.rope_parameters["rope_theta"]
    assert c.tie_embeddings == cfg.tie_word_embeddings and c.attention_bias == cfg.attention_bias
    if over.get("release"):
        assert f"skipping the multi-token-prediction (MTP) layer ({len(MTP_TENSORS)} tensors under model.mtp.*)" \
            in capsys.readouterr().err
    else:
        assert c.rope.kind == "yarn" and c.rope.attention_factor != 1.0
    ids = check_against(hf, m, n_ids=14, n_new=16)
    check_prefill_equals_token_by_token(m.model, ids)
    seen = routes_seen(m, ids)
    assert seen.shape == (n, len(ids), cfg.moe_topk) and seen.max() < e
    assert (seen == -1).any() == bool(z) and (seen >= 0).any()   # zero experts' slots reported as -1
    if over.get("release"):
        check_state_resumes(tmp_path, ids)


def test_moe_matches_reference_moe(tmp_path):
    """The MoE alone on 512 random rows against LongcatFlashMoE, top-2 of 4 real and 4 zero
    experts: rows routed to real and zero experts, to zero experts only, to real ones only; the
    zero experts' ids never fetched."""
    import torch
    hf = build(tmp_path, num_layers=2, n_routed_experts=4, zero_expert_num=4, moe_topk=2)
    m = engine.load(tmp_path, device="cpu")
    fetched, fetch = [], m.model.experts.fetch
    m.model.experts.fetch = lambda l, ids: (fetched.extend(int(i) for i in ids), fetch(l, ids))[1]
    h = np.random.default_rng().standard_normal((512, 32)).astype(np.float32)
    for l in range(2):
        zero = m.model.route(l, h)[0] >= 4
        assert zero.all(axis=1).any() and (~zero).all(axis=1).any() and (zero.any(axis=1) & ~zero.all(axis=1)).any()
        with torch.no_grad():
            want = hf.model.layers[l].mlp(torch.tensor(h)).numpy()
        assert rel_err(m.model.moe(l, h), want) < 1e-5
    assert fetched and max(fetched) < 4


def test_packed_bf16(tmp_path):
    """A bf16 arena holds the real experts alone (6 a layer) and gives the logits of the
    checkpoint rounded to bf16."""
    from engine.pack import pack
    build(tmp_path / "f32", **CASES[0])
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    man = pack(src, tmp_path / "p", "bf16", progress=False)
    assert (man["experts"]["n_experts"], len(man["blocks"])) == (6, 2 * 6)
    ids = np.random.default_rng().integers(0, 300, 14)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_state_bytes_per_token(tmp_path):
    """One latent row (kv_lora_rank + qk_rope_head_dim floats) a token a sublayer: 2 a layer."""
    build(tmp_path, **CASES[0])
    m = engine.load(tmp_path, device="cpu")
    s = int(np.random.default_rng().integers(9, 40))
    st = m.model.new_state(s)
    assert st.k.shape == (4, s, 1, 16 + 8) and st.v is st.k
    assert m.state_bytes_per_token(s - 1, 1) == pytest.approx(st.k.nbytes)
    assert m.state_bytes_per_token(0, s) == pytest.approx(st.k.nbytes / s * (s + 1) / 2)


# ---- config.json ---------------------------------------------------------------------------

# LongCat-Flash-Chat's config.json (the fields the reference reads)
RELEASE = dict(model_type="longcat_flash", architectures=["LongcatFlashForCausalLM"], vocab_size=131072,
               hidden_size=6144, ffn_hidden_size=12288, expert_ffn_hidden_size=2048, num_layers=28,
               num_attention_heads=64, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
               v_head_dim=128, n_routed_experts=512, zero_expert_num=256, zero_expert_type="identity", moe_topk=12,
               routed_scaling_factor=6.0, mla_scale_q_lora=True, mla_scale_kv_lora=True, router_bias=False,
               max_position_embeddings=131072, rope_theta=10000000.0, rms_norm_eps=1e-5, attention_bias=False,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def test_config_read():
    fam = family_of(RELEASE)
    c = fam.config
    assert (c.n_layers, c.n_experts, c.zero_experts, c.router_experts, c.top_k) == (28, 512, 256, 768, 12)
    assert c.moe_layers == tuple(range(28)) and (c.moe_intermediate, c.dense_intermediate) == (2048, 12288)
    assert (c.n_kv_heads, c.head_dim, c.kv_tensors, c.routing, c.routed_scale) == (1, 576, 2, "softmax_bias", 6.0)
    assert not c.norm_topk_prob and not c.shared_intermediate and c.rope.theta == 1e7 and c.rope.rotary_dim == 64
    assert c.softmax_scale == pytest.approx(192 ** -0.5)
    assert (c.q_scale, c.kv_scale) == pytest.approx((2.0, 12 ** 0.5))
    assert c.ignored_parts == (("model.mtp.", "the multi-token-prediction (MTP) layer"),)
    spec = fam.dense_spec
    assert spec["model.layers.27.mlp.router.classifier.weight"] == (768, 6144)
    assert spec["model.layers.27.mlp.router.e_score_correction_bias"] == (768,)
    assert spec["model.layers.0.self_attn.1.q_b_proj.weight"] == (64 * 192, 1536)
    assert spec["model.layers.0.self_attn.0.kv_a_proj_with_mqa.weight"] == (576, 6144)
    assert spec["model.layers.0.self_attn.0.kv_b_proj.weight"] == (64 * 256, 512)
    assert spec["model.layers.3.mlps.1.gate_proj.weight"] == (12288, 6144)
    assert spec["model.layers.3.input_layernorm.1.weight"] == (6144,) and "lm_head.weight" in spec
    assert len(spec) == 3 + 28 * (2 + 2 * 12)
    assert fam.expert_spec["model.layers.27.mlp.experts.511.down_proj.weight"] == (6144, 2048)
    assert len(fam.expert_spec) == 28 * 512 * 3
    # the latent norms scaled at load, the rest as stored
    w = np.full(512, 0.5, np.float32)
    assert np.allclose(fam.dense_view(c, "model.layers.5.self_attn.1.kv_a_layernorm.weight", w), 0.5 * 12 ** 0.5)
    assert np.allclose(fam.dense_view(c, "model.layers.5.self_attn.0.q_a_layernorm.weight", w), 1.0)
    assert fam.dense_view(c, "model.layers.5.input_layernorm.0.weight", w) is w
    # transformers' generic names (attribute_map) and num_hidden_layers (2 a layer); the
    # reference's defaults where config.json has none
    alias = {k: v for k, v in RELEASE.items() if k not in ("n_routed_experts", "moe_topk", "ffn_hidden_size",
                                                           "expert_ffn_hidden_size", "num_layers")}
    d = family_of({**alias, "num_local_experts": 64, "num_experts_per_tok": 8, "intermediate_size": 96,
                   "moe_intermediate_size": 32, "num_hidden_layers": 6}).config
    assert (d.n_experts, d.top_k, d.dense_intermediate, d.moe_intermediate, d.n_layers) == (64, 8, 96, 32, 3)
    assert family_of({"model_type": "longcat_flash", "num_layers": 28, "eos_token_id": 2}).config == c
    y = family_of({**RELEASE, "rope_scaling": {**YARN, "factor": 40.0, "mscale_all_dim": 1.0}}).config
    assert y.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)


@pytest.mark.parametrize("change,msg", [
    (dict(zero_expert_type="zero"), "zero_expert_type='zero' is not supported for longcat_flash; expected 'identity'"),
    (dict(mla_scale_q_lora=False), "mla_scale_q_lora=False is not supported .* always scales"),
    (dict(mla_scale_kv_lora=False), "mla_scale_kv_lora=False is not supported"),
    (dict(router_bias=True), "router_bias=True is not supported .* never adds the classifier's bias"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported for longcat_flash; expected 'silu'"),
    (dict(attention_method="DSA"), "attention_method='DSA' is not supported"),
    (dict(moe_topk=769), r"moe_topk=769 must be in 1..768 \(n_routed_experts \+ zero_expert_num\)"),
    (dict(head_dim=128), "head_dim=128 must equal qk_rope_head_dim=64"),
    (dict(qk_head_dim=256), "qk_head_dim=256 must be qk_nope_head_dim \\+ qk_rope_head_dim = 192"),
    (dict(qk_rope_head_dim=63, head_dim=63), r"qk_rope_head_dim=63 \(even\)"),
    (dict(q_lora_rank=None), "missing field q_lora_rank"),
    (dict(num_layers=None), "missing field num_layers"),
    (dict(num_layers=None, num_hidden_layers=55), "num_hidden_layers=55 must be even"),
    (dict(rope_scaling={"rope_type": "su"}), "rope type 'su' is not supported"),
])
def test_config_refused(change, msg):
    with pytest.raises(ConfigError, match=msg):
        family_of({**RELEASE, **change})
