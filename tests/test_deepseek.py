"""DeepSeek-V3 and -V2 beyond parity (tests/test_parity.py, tests/test_packed.py; the cuda
backend: tests/test_families_cuda.py, tests/test_mla_cuda.py, V3.2's tests/test_dsa_cuda.py):
V3.2's sparse attention and its context on cuda (not capped at index_topk); config refusals;
the latent cache's size; the softmax scale at the released shapes."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import build_hf_model, run_simulator_decoder
from engine.models import family_of
from engine.models.rope import ConfigError

# DeepSeek-V3's config.json (the fields the engine reads)
V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
          hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
          num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
          n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
          q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
          topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8,
          first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840,
          rms_norm_eps=1e-6, rope_theta=10000, num_nextn_predict_layers=1,
          rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                        "type": "yarn"}, tie_word_embeddings=False, eos_token_id=1)


# DeepSeek-V2-Lite's
V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
               hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
               n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512,
               q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
               topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6,
               first_k_dense_replace=1, norm_topk_prob=False, max_position_embeddings=163840,
               rms_norm_eps=1e-6, rope_theta=10000, scoring_func="softmax",
               rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                             "type": "yarn"}, tie_word_embeddings=False, eos_token_id=100001)


def test_v2_lite_shapes():
    fam = family_of(V2_LITE)
    c = fam.config
    assert (c.routing, c.n_group, c.norm_topk_prob, c.routed_scale) == ("softmax", 1, False, 1.0)
    assert c.moe_layers == tuple(range(1, 27)) and c.shared_intermediate == 2 * 1408
    m = 0.1 * 0.707 * np.log(40) + 1
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * m * m)
    assert fam.dense_spec["model.layers.0.self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in fam.dense_spec
    with pytest.raises(ConfigError, match="topk_method 'noaux_tc' is not supported"):
        family_of({**V2_LITE, "topk_method": "noaux_tc"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_v3")
    build_hf_model(d, "deepseek_v3")
    return d


def test_released_shapes():
    """One 576-value latent row a token a layer; the query's scale grows by YaRN's mscale
    squared (0.1 ln 40 + 1), as the reference's; the MTP layer is skipped by name; the spec
    names the low-rank projections."""
    fam = family_of(V3)
    c = fam.config
    assert (c.n_kv_heads, c.head_dim, c.kv_tensors) == (1, 576, 1)
    assert c.rope.rotary_dim == 64 and c.rope.kind == "yarn"
    m = 0.1 * np.log(40) + 1
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * m * m)
    assert c.moe_layers == tuple(range(3, 61)) and c.shared_intermediate == 2048
    assert c.ignored_parts == (("model.layers.61.", "the multi-token-prediction (MTP) layer"),)
    spec = fam.dense_spec
    assert spec["model.layers.0.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert spec["model.layers.0.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert spec["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert "model.layers.0.self_attn.k_proj.weight" not in spec


@pytest.mark.parametrize("field,value,says", [
    ("qk_rope_head_dim", 63, "qk_rope_head_dim=63 (even)"),
    ("kv_lora_rank", None, "missing field kv_lora_rank"),
    ("n_group", 3, "n_group=3 must divide n_routed_experts=256"),
    ("scoring_func", "softmax", "scoring_func 'softmax' is not supported for deepseek_v3"),
])
def test_config_refused(field, value, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        family_of({**V3, field: value})


# Kimi-K2-Instruct's config.json (the fields that differ from V3's): DeepSeek-V3's architecture
K2 = dict(V3, model_type="kimi_k2", vocab_size=163840, num_attention_heads=64,
          num_key_value_heads=64, n_routed_experts=384, routed_scaling_factor=2.827, n_group=1,
          topk_group=1, first_k_dense_replace=1, rope_theta=50000.0, num_nextn_predict_layers=0,
          rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                        "type": "yarn"}, bos_token_id=163584, eos_token_id=163585)


def test_kimi_k2_is_deepseek_v3(tmp_path):
    """model_type kimi_k2 runs as deepseek_v3: its released shapes, and a tiny model saved under
    that name gives transformers' DeepSeek-V3 logits."""
    import torch

    from conftest import hf_reference, rel_err
    c = family_of(K2).config
    assert (c.family, c.n_experts, c.n_group, c.moe_layers[0], c.ignored_parts) == \
        ("deepseek_v3", 384, 1, 1, ())
    m = 0.1 * np.log(32) + 1
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * m * m)
    build_hf_model(tmp_path, "deepseek_v3", dtype="bfloat16")
    ref = hf_reference(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    ids = np.random.default_rng().integers(0, 300, 12)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), want) < 1e-4


def kimi_k25_folder(src, dst) -> dict:
    """src (a deepseek_v3 folder) laid out as Kimi-K2.5 is released: the language model's fields
    under text_config (model_type kimi_k2), its tensors under language_model., a vision tower and
    projector beside it. Returns the config."""
    import torch
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    text = json.loads((src / "config.json").read_text())
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": {**text, "model_type": "kimi_k2"}, "vision_config": {"hidden_size": 8}}
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {"language_model." + n: w for n, w in load_file(src / "model.safetensors").items()}
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.randn(24, 8)
    tensors["mm_projector.proj.0.weight"] = torch.randn(16, 8)
    save_file(tensors, dst / "model.safetensors")
    return cfg


def test_kimi_k25_wrapper(tmp_path):
    """Kimi-K2.5 as released (kimi_k25_folder): the vision tower and projector left unread, the
    same logits as transformers' DeepSeek-V3 on the same weights."""
    import torch

    from conftest import hf_reference, rel_err
    src, dst = tmp_path / "src", tmp_path / "k25"
    build_hf_model(src, "deepseek_v3", dtype="bfloat16")
    ref = hf_reference(src)
    cfg = kimi_k25_folder(src, dst)
    text = cfg["text_config"]
    rng = np.random.default_rng()
    c = family_of(cfg).config
    n = text["num_hidden_layers"]
    assert c.family == "kimi_k25" and [p for p, _ in c.ignored_parts] == \
        [f"language_model.model.layers.{n + i}." for i in range(text.get("num_nextn_predict_layers") or 0)] + \
        ["vision_tower.", "mm_projector."]
    ids = rng.integers(0, 300, 12)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(engine.load(dst, device="cpu").logits(ids), want) < 1e-4
    with pytest.raises(ConfigError, match="kimi_k25 without text_config"):
        family_of({"model_type": "kimi_k25"})


def test_kimi_k25_simulator(tmp_path):
    """The cuda backend's MLA decoder on the wrapper's names, in the CUDA simulator, against the
    CPU backend (tests/test_families_cuda.py's script)."""
    build_hf_model(tmp_path / "src", "deepseek_v3", dtype="bfloat16", hidden_size=16,
                   num_attention_heads=2, moe_intermediate_size=8, intermediate_size=8,
                   n_routed_experts=4, n_group=2, topk_group=1, num_hidden_layers=2,
                   kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                   v_head_dim=6, vocab_size=24)
    kimi_k25_folder(tmp_path / "src", tmp_path / "k25")
    run_simulator_decoder(tmp_path / "k25")


def test_v32_sparse_attention(tmp_path):
    """DeepSeek-V3.2's indexer picks 4 positions a query of 12 (and 28 with the continuation):
    the same logits and greedy tokens as transformers; the same weights read densely give other
    logits (the picking is what is checked); a prompt resumed from the previous generation's
    state (its indexer keys carried) gives what a fresh engine gives."""
    import shutil

    import torch

    from conftest import assert_greedy, check_state_resumes, hf_reference, rel_err
    build_hf_model(tmp_path / "m", "deepseek_v32")
    ref = hf_reference(tmp_path / "m")
    ids = np.random.default_rng().integers(0, 300, 12)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    m = engine.load(tmp_path / "m", device="cpu")
    assert rel_err(m.logits(ids), want) < 1e-4
    assert_greedy(ref, ids[:6].tolist(), m.generate(ids[:6].tolist(), max_new_tokens=16).output_ids, 16)
    shutil.copytree(tmp_path / "m", tmp_path / "dense")
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    (tmp_path / "dense" / "config.json").write_text(json.dumps({**cfg, "index_topk": 64}))
    assert rel_err(engine.load(tmp_path / "dense", device="cpu").logits(ids), want) > 1e-3
    check_state_resumes(tmp_path / "m", ids)   # the prefix cache: indexer keys carried


def test_v32_config_refused():
    v32 = dict(V3, model_type="deepseek_v32", index_n_heads=64, index_head_dim=128, index_topk=2048)
    c = family_of(v32).config
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 2048)
    assert family_of(v32).dense_spec["model.layers.0.self_attn.indexer.wq_b.weight"] == (64 * 128, 1536)
    with pytest.raises(ConfigError, match="missing field index_topk"):
        family_of({k: v for k, v in v32.items() if k != "index_topk"})
    with pytest.raises(ConfigError, match="without q_lora_rank"):
        family_of({**v32, "q_lora_rank": None})
    with pytest.raises(ConfigError, match="index_head_dim=32 at least qk_rope_head_dim=64"):
        family_of({**v32, "index_head_dim": 32})


def test_v32_cuda_context_not_capped(capsys):
    """On cuda, DSA runs its indexer on the device (engine/gpu_dsa.py): the context is the
    config's or --max-context, as on the CPU backend, not capped at index_topk."""
    from engine.runtime import context_length
    v32 = family_of(dict(V3, model_type="deepseek_v32", index_n_heads=64, index_head_dim=128,
                         index_topk=2048)).config
    for device in ("cpu", "cuda"):
        assert context_length(v32, device, None) == 4096
        assert context_length(v32, device, 100000) == 100000
    assert "capped" not in capsys.readouterr().err


def test_state_bytes(tiny):
    m = engine.load(tiny, device="cpu")
    cfg = json.loads((tiny / "config.json").read_text())
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    # the mean over positions 1..4 of every layer's rows, 4 bytes a value, one row (not K and V)
    assert m.state_bytes_per_token(0, 4) == 3 * row * 4 * 2.5
    st = m.model.new_state(8)
    assert st.v is st.k and st.k.shape == (3, 8, 1, row)
