"""Mistral Large 4 (engine/models/mistral_large4.py) on the CPU backend against transformers'
MistralLarge4ForConditionalGeneration on tiny random models (the vision tower built, saved and
skipped): GLM-5's sparse attention without a low-rank q, the queries scaled a head by ln(pos + 1),
LeRoPE's learned alpha, NoPE layers (attention and indexer), latent rows shared across layers,
shared indexer picks, soft-capped logits, softmax routing in groups; prefill against token by
token decode, the prefix cache, a packed arena, a bf16 checkpoint; the release's defaults read
from config.json and what is refused. The cuda backend refuses the family by name
(tests/test_cli.py)."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import (assert_greedy, bf16_copy, check_prefill_equals_token_by_token, check_state_resumes,
                      hf_logits, index_topk_gap, rel_err, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

# 4 layers (the fourth NoPE by default, the first dense), 16 indexer heads of 12 (enough that no
# two positions tie at a score of 0), the best 4 positions a query, the logits capped at 3
TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12,
            v_head_dim=10, max_position_embeddings=256, index_n_heads=16, index_head_dim=12, index_topk=4,
            final_logit_softcapping=3.0, pad_token_id=None, bos_token_id=None, eos_token_id=None)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
              patch_size=4, image_size=16)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# the reference's defaults (its YaRN, the fourth layer NoPE, every layer indexing); five layers:
# layer 2 reads layer 1's latent rows, layer 4 (NoPE) layer 3's (NoPE), layers 1 and 4 read the
# picks of the indexer before them, YaRN with mscale_all_dim (the softmax scale), two shared
# experts, scaled; q / kv_a / o biases, the embeddings tied (the wrapper's flag), RoPE default,
# layer 0 NoPE (its indexer too), layer 1 dense by mlp_layer_types, one group
CASES = [dict(),
         dict(num_hidden_layers=5, kv_source_layers=[0, 1, 1, 3, 3], no_rope_layers=[1, 1, 1, 0, 0],
              index_topk_pattern="FSFFS", rope_parameters=YARN, n_shared_experts=2, routed_scaling_factor=1.5),
         dict(attention_bias=True, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1000.0},
              no_rope_layers=[0, 1, 1, 1], mlp_layer_types=["sparse", "dense", "sparse", "sparse"], n_group=1)]
IDS = ["defaults", "shared-kv-picks-yarn", "biases-tied-nope-first"]


def build(dst, dtype: str = "float32", **over):
    """A tiny MistralLarge4ForConditionalGeneration saved into dst (fresh weights, the seed
    printed); transformers on the saved weights in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"mistral_large4 weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    tie = over.pop("tie_word_embeddings", False)
    cfg = tf.MistralLarge4Config(text_config={**TEXT, **over}, vision_config=VISION, tie_word_embeddings=tie)
    model = tf.MistralLarge4ForConditionalGeneration(cfg)
    widen_init(model)
    with torch.no_grad():   # the queries' scales by position, LeRoPE's alpha, biases: away from their init
        for n, p in model.named_parameters():
            if n.endswith("softmax_scaling.scale") or n.endswith("rotary_emb.alpha"):
                p.normal_(0.0, 0.3)
            elif n.endswith("softmax_scaling.bias"):
                p.normal_(1.0, 0.3)
            elif n.endswith("proj.bias"):
                p.normal_(0.0, 0.5)
    save_tiny(model, dst, dtype)
    return tf.MistralLarge4ForConditionalGeneration.from_pretrained(dst, dtype=torch.float32).eval()


def prompt_ids(n: int) -> np.ndarray:
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"prompt seed {seed}", flush=True)
    return np.random.default_rng(seed).integers(0, 300, n)


def check_greedy(ref, m, prompt: list, n: int) -> None:
    """m's greedy continuation is transformers', or parts from it only where an indexer pick
    sat at the top-k boundary between two scores equal to float32 rounding (then one other pick
    moves the logits far past any tie: tests/test_glm_moe_dsa.py)."""
    got = m.generate(prompt, max_new_tokens=n).output_ids
    try:
        assert_greedy(ref, prompt, got, n)
    except AssertionError:
        gap = index_topk_gap(ref, prompt + got, m.config.index_topk)
        assert gap < 1e-4, f"greedy left the reference, the closest indexer pick {gap:.2e} apart"


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over):
    """16 tokens, 4 picked a query past the fourth: transformers' logits; greedy decoding from
    below index_topk and from past it."""
    ref = build(tmp_path, **over)
    m = engine.load(tmp_path, device="cpu")
    ids = prompt_ids(16)
    err = rel_err(m.logits(ids), hf_logits(ref, ids))
    print(f"logits rel err {err:.2e}", flush=True)
    assert err < 1e-4
    for n in (3, 8):
        check_greedy(ref, m, ids[:n].tolist(), 16)


def test_prefill_state_and_prefix_cache(tmp_path):
    """On the shared-rows model: the cache holds rows for the layers that make their own and
    indexer keys for the layers that run one; a prompt's logits in one prefill equal them one
    token at a time; a prompt resumed from the last generation's state, a state copied into a
    smaller one and one saved and restored continue as a fresh engine."""
    build(tmp_path, **CASES[1])
    m = engine.load(tmp_path, device="cpu")
    c = m.config
    assert (c.cache_layers, c.index_layers, c.nope_layers) == ((0, 1, 3), (0, 2, 3), (3, 4))
    st = m.model.new_state(40)
    assert st.k.shape == (3, 40, 1, 16 + 8) and st.ik.shape == (3, 40, 12)
    ids = prompt_ids(14)
    check_prefill_equals_token_by_token(m.model, ids)
    check_state_resumes(tmp_path, ids[:12])


def test_bf16_checkpoint(tmp_path):
    """A bfloat16 checkpoint (the release's dtype; kv_b widened once for the absorbed form):
    transformers' logits on the same weights."""
    ref = build(tmp_path, "bfloat16", **CASES[1])
    ids = prompt_ids(12)
    assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), hf_logits(ref, ids)) < 1e-4


def test_packed(tmp_path):
    """A bf16 arena packed from a checkpoint (its weights bf16 values) gives that checkpoint's
    logits: the experts per (layer, expert), the rest dense."""
    from engine.pack import pack
    build(tmp_path / "f32", **CASES[2])
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = prompt_ids(16)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


# the wrapper's config.json with the text model's shapes (transformers' defaults: the release's)
SHAPES = dict(vocab_size=204800, hidden_size=6144, intermediate_size=24576, moe_intermediate_size=6144,
              num_hidden_layers=72, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=128,
              kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=64, num_experts_per_tok=4,
              max_position_embeddings=1048576, eos_token_id=2)
RELEASE = dict(model_type="mistral_large4", architectures=["MistralLarge4ForConditionalGeneration"],
               text_config=dict(model_type="mistral_large4_text", **SHAPES),
               vision_config=dict(model_type="pixtral"))


def family(**text):
    return family_of({**RELEASE, "text_config": {**RELEASE["text_config"], **text}})


def test_config_defaults():
    """Where config.json leaves them out, transformers' defaults: YaRN 2048 over 512 (attention
    factor 1, no mscale: the softmax scale 128^-0.5), every fourth layer NoPE, the first dense,
    every layer indexing 2048 positions with 32 heads of 128, one group, renormalized, a shared
    expert, rms_norm_eps 1e-5, the logits capped at 30, untied; the tensors it then reads."""
    fam = family()
    c = fam.config
    assert (c.routing, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scale) == ("softmax_grouped", 1, 1,
                                                                                      True, 1.0)
    assert (c.q_lora_rank, c.kv_lora_rank, c.head_dim, c.rms_eps, c.logit_softcap) == (0, 512, 576, 1e-5, 30.0)
    assert (c.rope.kind, c.rope.factor, c.rope.original_max_position, c.rope.attention_factor) == ("yarn", 2048.0,
                                                                                                   512, 1.0)
    assert c.softmax_scale == pytest.approx(128 ** -0.5) and not c.tie_embeddings and c.eos_token_ids == (2,)
    assert c.nope_layers == tuple(range(3, 72, 4)) and c.moe_layers == tuple(range(1, 72))
    assert c.index_layers == tuple(range(72)) and c.cache_layers == tuple(range(72))
    assert (c.index_topk, c.index_n_heads, c.index_head_dim, c.shared_intermediate) == (2048, 32, 128, 6144)
    spec = fam.dense_spec
    assert spec["layers.0.attention.wkv_a_with_mqa.weight"] == (512 + 64, 6144)
    assert spec["layers.3.attention.wkv_a_with_mqa.weight"] == (512, 6144)           # NoPE: the latent alone
    assert spec["layers.3.attention.wkv_b.weight"] == (64 * (128 + 128), 512)
    assert spec["layers.4.attention.wkv_b.weight"] == (64 * (64 + 128), 512)
    assert spec["layers.0.attention.wq.weight"] == (64 * 128, 6144) and spec["lerope.alpha"] == (32,)
    assert spec["layers.5.attention.indexer.wq_b.weight"] == (32 * 128, 6144)
    assert "layers.0.gate.weight" not in spec and spec["layers.1.gate.weight"] == (128, 6144)
    assert "output.weight" in spec and not any(n.startswith("vision") for n in spec)
    assert [p for p, _ in c.ignored_parts] == ["vision_encoder.", "patch_merger.", "pre_mm_projector_norm.",
                                               "vision_language_adapter.", "mtp_dspark."]
    # the fields a config.json may give instead: NoPE every other layer, the indexer's pattern,
    # the wrapper's tie (the text config's not read), KV sharing
    c = family(no_rope_layer_interval=2, index_topk_pattern="FS" * 36, tie_word_embeddings=True).config
    assert c.nope_layers == tuple(range(1, 72, 2)) and c.index_layers == tuple(range(0, 72, 2))
    assert not c.tie_embeddings and family_of({**RELEASE, "tie_word_embeddings": True}).config.tie_embeddings
    src = list(range(72))
    src[2], src[6] = 0, 5
    fam = family(kv_source_layers=src)
    assert fam.config.cache_layers == tuple(l for l in range(72) if l not in (2, 6))
    assert "layers.2.attention.wkv_a_with_mqa.weight" not in fam.dense_spec
    assert "layers.2.attention.kv_a_norm.weight" not in fam.dense_spec
    assert fam.dense_spec["layers.2.attention.wkv_b.weight"] == (64 * (64 + 128), 512)
    with pytest.raises(ConfigError, match="mistral_large4 without text_config"):
        family_of({k: v for k, v in RELEASE.items() if k != "text_config"})


def sources(**moved) -> list:
    """kv_source_layers of 72 layers, each its own but the ones given (layer=source)."""
    src = list(range(72))
    for k, v in moved.items():
        src[int(k[1:])] = v
    return src


@pytest.mark.parametrize("text,says", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported; mistral_large4 runs silu"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor 0.5 is not supported for mistral_large4"),
    (dict(final_logit_softcapping=0.0), "final_logit_softcapping=0.0 must be positive"),
    (dict(no_rope_layers=[1, 0] * 20), "no_rope_layers must give each of the 72 layers 1 .RoPE. or 0"),
    (dict(no_rope_layer_interval=0), "no_rope_layer_interval=0 must be positive"),
    (dict(kv_source_layers=[0, 1, 2]), "kv_source_layers must give each of the 72 layers a layer index"),
    (dict(kv_source_layers=sources(l1=2)), "kv_source_layers has 2 at layer 1; expected an earlier layer"),
    (dict(kv_source_layers=sources(l1=0, l2=1)), "kv_source_layers has 1 at layer 2"),
    (dict(kv_source_layers=sources(l3=2)), r"makes layer 3 \(NoPE\) read layer 2's latent rows \(RoPE\)"),
    (dict(kv_source_layers=sources(l2=1, l4=0)), "makes layer 4 read layer 0's latent rows, but the reference "
                                                 "gives it layer 1's"),
    (dict(index_topk=0), "index_n_heads=32, index_topk=0 must be positive"),
    (dict(index_topk_pattern="S" + "F" * 71), "index_topk_pattern makes layer 0 shared"),
    (dict(n_group=3), "n_group=3 must divide n_routed_experts=128"),
    (dict(mlp_layer_types=["dense"] * 3), "mlp_layer_types must list 'dense' or 'sparse' for each of the 72"),
])
def test_config_refused(text, says):
    with pytest.raises(ConfigError, match=says):
        family(**text)
