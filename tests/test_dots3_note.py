"""dots.3 note (engine/models/dots3_note.py) on the CPU backend against transformers'
Dots3NoteForConditionalGeneration (the vision and audio encoders built, saved and skipped) and
Dots3NoteForCausalLM on tiny random models: indexed layers (DSA, an indexer each), sliding MLA
layers with shapes and a RoPE of their own, full MLA layers; the scaled low-rank query and
latent, the rotated key's norm, the heads' output gate; DeepSeek-V3's routing; prefill against
token by token decode, the prefix cache, a packed arena, a bf16 checkpoint; the release's
config.json (its text fields at the top level, its aliases) and what is refused. The cuda
backend refuses the family by name (tests/test_cli.py)."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from conftest import (assert_greedy, bf16_copy, check_prefill_equals_token_by_token, check_state_resumes,
                      hf_logits, index_topk_gap, rel_err, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

# six layers: 0, 1 and 5 indexed (16 indexer heads of 12, the best 4 positions), 2 to 4 sliding
# (a window of 3) with 2 heads of other shapes and their own RoPE; layer 0 dense
TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=12, head_dim=20, v_head_dim=10, max_position_embeddings=256, index_n_heads=16,
            index_head_dim=12, index_topk=4, shared_experts_intermediate_size=24, sliding_window=3,
            swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=20, swa_kv_lora_rank=12,
            swa_head_dim=16, swa_qk_nope_head_dim=10, swa_v_head_dim=8, swa_rope_theta=500.0,
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
              moe_intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, adapter_in_dim=16,
              adapter_out_dim=48, mlp_layer_types=["dense"])
AUDIO = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             downsample_hidden_size=8, adapter_input_size=16, adapter_out_dim=48)
KINDS = ["sliding_attention", "indexed_attention", "full_attention", "sliding_attention", "indexed_attention",
         "sliding_attention"]
# the reference's layer kinds; the embeddings tied (the wrapper's flag), q_a / kv_a / o biases,
# no indexer (use_dsa false: full MLA layers); a text-only folder (Dots3NoteForCausalLM) with
# all three kinds, layer 0 sliding, one YaRN for all, unrenormalized weights scaled, a routed
# layer every other one from layer 0
CASES = [dict(),
         dict(tie_word_embeddings=True, attention_bias=True, use_dsa=False),
         dict(text_only=True, layer_types=KINDS, use_dsa=None, norm_topk_prob=False, routed_scaling_factor=2.0,
              moe_layer_freq=2, first_k_dense_replace=0,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                               "rope_theta": 1000.0})]
IDS = ["defaults", "tied-biases-no-dsa", "text-only-kinds-yarn"]


def build(dst, dtype: str = "float32", **over):
    """A tiny dots.3 note saved into dst (fresh weights, the seed printed): the omni wrapper, or
    the text model alone (text_only); transformers on the saved weights in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"dots3_note weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    text_only, tie = over.pop("text_only", False), over.pop("tie_word_embeddings", False)
    if text_only:
        cls = tf.Dots3NoteForCausalLM
        model = cls(tf.Dots3NoteTextConfig(**{**TEXT, **over}, tie_word_embeddings=tie))
    else:
        cls = tf.Dots3NoteForConditionalGeneration
        model = cls(tf.Dots3NoteConfig(text_config={**TEXT, **over}, vision_config=VISION, audio_config=AUDIO,
                                       tie_word_embeddings=tie))
    widen_init(model)
    with torch.no_grad():   # the selection bias and the projections' biases away from zero
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
        for n, p in model.named_parameters():
            if n.endswith("proj.bias") or n.endswith("mqa.bias"):
                p.normal_(0.0, 0.5)
    save_tiny(model, dst, dtype)
    return cls.from_pretrained(dst, dtype=torch.float32).eval()


def prompt_ids(n: int) -> np.ndarray:
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"prompt seed {seed}", flush=True)
    return np.random.default_rng(seed).integers(0, 300, n)


def check_greedy(ref, m, prompt: list, n: int) -> None:
    """m's greedy continuation is transformers', or parts from it only where an indexer pick
    sat at the top-k boundary between two scores equal to float32 rounding
    (tests/test_glm_moe_dsa.py)."""
    got = m.generate(prompt, max_new_tokens=n).output_ids
    try:
        assert_greedy(ref, prompt, got, n)
    except AssertionError:
        if not m.config.index_layers:
            raise
        gap = index_topk_gap(ref, prompt + got, m.config.index_topk)
        assert gap < 1e-4, f"greedy left the reference, the closest indexer pick {gap:.2e} apart"


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over):
    """16 tokens (4 picked a query past the fourth in an indexed layer, 3 in a sliding one):
    transformers' logits; greedy decoding from below index_topk and from past it."""
    ref = build(tmp_path, **dict(over))
    m = engine.load(tmp_path, device="cpu")
    ids = prompt_ids(16)
    err = rel_err(m.logits(ids), hf_logits(ref, ids))
    print(f"logits rel err {err:.2e}", flush=True)
    assert err < 1e-4
    for n in (3, 8):
        check_greedy(ref, m, ids[:n].tolist(), 16)


def test_layers_state_and_prefix_cache(tmp_path):
    """The layer kinds and shapes read from the saved config; the cache a row a position a layer
    as wide as the widest kind's (12 + 8 = 20 > 12 + 6), indexer keys for the indexed layers; a
    prompt's logits in one prefill equal them one token at a time; the prefix cache and states
    copied, saved and restored continue as a fresh engine."""
    build(tmp_path)
    m = engine.load(tmp_path, device="cpu")
    c = m.config
    assert (c.index_layers, c.sliding_layers, c.layer_windows) == ((0, 1, 5), (2, 3, 4), (0, 0, 3, 3, 3, 0))
    assert c.swa_shape == (2, 20, 12, 10, 6, 8) and c.mla(0) == (4, 24, 16, 12, 8, 10)
    assert (c.rope.theta, c.swa_rope.theta, c.rope.rotary_dim, c.swa_rope.rotary_dim) == (8e7, 500.0, 8, 6)
    assert c.softmax_scale == pytest.approx(20 ** -0.5) and c.swa_scale == pytest.approx(16 ** -0.5)
    st = m.model.new_state(40)
    assert st.k.shape == (6, 40, 1, 16 + 8) and st.ik.shape == (3, 40, 12)
    ids = prompt_ids(14)
    check_prefill_equals_token_by_token(m.model, ids)
    check_state_resumes(tmp_path, ids[:12])


def test_bf16_checkpoint(tmp_path):
    """A bfloat16 checkpoint (the release's dtype): transformers' logits on the same weights."""
    ref = build(tmp_path, "bfloat16")
    ids = prompt_ids(12)
    assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), hf_logits(ref, ids)) < 1e-4


def test_packed(tmp_path):
    """A bf16 arena packed from a checkpoint (its weights bf16 values) gives that checkpoint's
    logits: the experts per (layer, expert), the rest dense."""
    from engine.pack import pack
    build(tmp_path / "f32", **CASES[1])
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = prompt_ids(16)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


# the release's config.json: the text model's fields at the top level, the sliding layers' by
# the reference's defaults (the fields a config.json may leave out left out)
RELEASE = dict(model_type="dots3_note", architectures=["Dots3NoteForConditionalGeneration"], vocab_size=152064,
               hidden_size=5120, intermediate_size=13824, moe_intermediate_size=1536, num_hidden_layers=46,
               num_attention_heads=128, n_routed_experts=256, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128, num_experts_per_tok=8, max_position_embeddings=524288,
               eos_token_id=151668, vision_config=dict(model_type="dots3_note_vision_encoder"),
               audio_config=dict(model_type="dots3_note_audio_encoder"))


def family(**fields):
    return family_of({**RELEASE, **fields})


def test_release_config():
    """The reference's defaults: layers 0, 1 and every fourth from 1 indexed, the rest sliding
    over 512 positions with 64 heads, q / kv ranks 1024, 192 + 64 query dims, RoPE theta 50000
    (the others 8e7, over 64 of 256), the first layer dense, 64 indexer heads of 128, 2048
    picked, a shared expert of 1536, rms_norm_eps 1e-5, untied; the tensors it then reads; the
    release's aliases as the reference reads them."""
    fam = family()
    c = fam.config
    indexed = (0, 1, *range(5, 46, 4))
    assert c.index_layers == indexed and c.sliding_layers == tuple(l for l in range(46) if l not in indexed)
    assert c.swa_shape == (64, 1024, 1024, 192, 64, 128) and c.mla(0) == (128, 1024, 512, 128, 64, 128)
    assert (c.rope.theta, c.rope.rotary_dim, c.swa_rope.theta, c.swa_rope.rotary_dim) == (8e7, 64, 50000.0, 64)
    assert set(c.layer_windows) == {0, 512} and c.moe_layers == tuple(range(1, 46))
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.shared_intermediate) == (64, 128, 2048, 1536)
    assert (c.routing, c.n_group, c.norm_topk_prob, c.routed_scale, c.rms_eps) == ("sigmoid", 1, True, 1.0, 1e-5)
    assert c.head_dim == 1024 + 64 and not c.tie_embeddings and c.eos_token_ids == (151668,)
    spec = fam.dense_spec
    assert spec["model.layers.2.self_attn.kv_b_proj.weight"] == (64 * (192 + 128), 1024)
    assert spec["model.layers.1.self_attn.kv_b_proj.weight"] == (128 * (128 + 128), 512)
    assert spec["model.layers.2.self_attn.g_proj.weight"] == (64, 5120)
    assert spec["model.layers.5.self_attn.indexer.wq_b.weight"] == (64 * 128, 1024)
    assert "model.layers.2.self_attn.indexer.wk.weight" not in spec
    assert spec["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert "model.layers.0.mlp.gate.weight" not in spec and "lm_head.weight" in spec
    assert [p for p, _ in c.ignored_parts] == ["vision_encoder.", "audio_encoder.", "model.layers.46.", "model.mtp."]
    # the aliases: no sliding layers; DSA off (full MLA); the window and the shared expert's
    # width under their release names; a routed layer where moe_layer_freq says
    c = family(use_sliding_window=False).config
    assert c.index_layers == tuple(range(46)) and not c.sliding_layers
    c = family(use_dsa=False, sliding_window_size=128, swa_rope_theta=1e4, moe_shared_expert_intermediate_size=512,
               moe_layer_freq=[0, 1] * 23, swa_num_attention_heads=32,
               swa_num_key_value_heads=32).config
    assert not c.index_layers and set(c.layer_windows) == {0, 128} and c.swa_rope.theta == 1e4
    assert c.shared_intermediate == 512 and c.moe_layers == tuple(range(1, 46, 2)) and c.swa_shape[0] == 32
    # layer_types as given, full_attention read as indexed unless use_dsa says otherwise (or
    # per_layer_config is given, as transformers saves it)
    types = ["full_attention", "sliding_attention"] * 23
    assert family(layer_types=types).config.index_layers == tuple(range(0, 46, 2))
    assert not family(layer_types=types, use_dsa=None).config.index_layers
    assert not family(layer_types=["indexed_attention"] * 46, use_dsa=False).config.index_layers
    # the wrapper as transformers saves it: text_config, the wrapper's tie flag
    text = {k: v for k, v in RELEASE.items() if k not in ("model_type", "architectures", "vision_config",
                                                           "audio_config")}
    c = family_of(dict(model_type="dots3_note", tie_word_embeddings=True,
                       text_config={**text, "model_type": "dots3_note_text", "tie_word_embeddings": False})).config
    assert c.tie_embeddings and c.index_layers == indexed
    assert family_of({**text, "model_type": "dots3_note_text"}).config.swa_shape == (64, 1024, 1024, 192, 64, 128)


@pytest.mark.parametrize("fields,says", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported; dots3_note runs silu"),
    (dict(q_lora_rank=None), "the indexed / full layers without q_lora_rank"),
    (dict(swa_q_lora_rank=None), "sliding_attention layers without q_lora_rank"),
    (dict(num_key_value_heads=8), "num_key_value_heads=8 must equal num_attention_heads=128"),
    (dict(swa_head_dim=200, swa_qk_rope_head_dim=64), "the sliding layers' head_dim=200 must equal"),
    (dict(layer_types=["indexed_attention"] * 45), "layer_types must give each of the 46 layers"),
    (dict(layer_types=["chunked_attention"] * 46), "layer_types must give each of the 46 layers one of"),
    (dict(per_layer_config={"2": {"sliding_window": 64}}), "per_layer_config gives layer 2 sliding_window"),
    (dict(per_layer_config={"0": {"num_attention_heads": 8}}), r"gives layer 0 \(indexed_attention\) shapes"),
    (dict(per_layer_config={"2": {"num_attention_heads": 8}}), "gives sliding layer 3 other shapes than layer 2"),
    (dict(rope_parameters={"indexed_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters has no entry for sliding_attention"),
    (dict(head_dim=98), "indexed_attention's head_dim=98 rotates 63 dims by the reference's count"),
    (dict(sliding_window=0), "sliding_window=0 must be positive"),
    (dict(n_shared_experts=0), "n_shared_experts=0; dots3_note has at least one shared expert"),
    (dict(moe_layer_freq=0), "moe_layer_freq 0 must be positive"),
    (dict(index_head_dim=32), "index_head_dim=32 at least qk_rope_head_dim=64"),
    (dict(n_group=3), "n_group=3 must divide n_routed_experts=256"),
])
def test_config_refused(fields, says):
    with pytest.raises(ConfigError, match=says):
        family(**fields)
