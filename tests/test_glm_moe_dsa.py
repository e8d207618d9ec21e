"""GLM-5 (glm_moe_dsa): DeepSeek-V3.2's sparse attention with the indexer's RoPE over interleaved
pairs and its top-k shared across layers. A tiny random model (tests/conftest.py: layers 0 and 2
run an indexer, layer 1 reads layer 0's picks) against transformers; prefill against token by
token decode; the prefix cache; which layers' indexer keys are cached; how indexer_types is
derived from config.json and what is refused; on cuda, the context not capped at index_topk
(the cuda decoder's checks: tests/test_dsa_cuda.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (assert_greedy, build_hf_model, check_state_resumes, copy_config, hf_reference,
                      index_topk_gap, rel_err)
from engine.models import family_of
from engine.models.rope import ConfigError

# GLM-5's config.json (the fields the engine reads)
GLM5 = dict(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880,
            hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
            num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, head_dim=64,
            n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
            q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192,
            topk_method="noaux_tc", scoring_func="sigmoid", n_group=1, topk_group=1,
            num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
            max_position_embeddings=202752, rms_norm_eps=1e-5, num_nextn_predict_layers=1,
            rope_parameters={"rope_theta": 1000000, "rope_type": "default"}, rope_interleave=True,
            indexer_rope_interleave=True, index_topk=2048, index_head_dim=128, index_n_heads=32,
            tie_word_embeddings=False, eos_token_id=[154820, 154827, 154829])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's folder and transformers on it; fresh weights each run, the seed printed."""
    d = tmp_path_factory.mktemp("glm_moe_dsa")
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"glm_moe_dsa weights seed {seed}", flush=True)
    build_hf_model(d, "glm_moe_dsa", seed=seed)
    return d, hf_reference(d)


def prompt_ids(n: int) -> np.ndarray:
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"prompt seed {seed}", flush=True)
    return np.random.default_rng(seed).integers(0, 300, n)


def test_logits_and_greedy(tiny, tmp_path):
    """16 tokens, 4 picked a query past the fourth, layer 1 on layer 0's picks: the logits and
    greedy tokens of transformers; the same weights read densely give other logits (the picking
    is what is checked)."""
    import torch
    d, ref = tiny
    cfg = json.loads((d / "config.json").read_text())
    c = family_of(cfg).config
    assert (c.index_layers, c.moe_layers, c.index_rope_pairs) == ((0, 2), (1, 2), True)
    # the same layers from the fields a release may write instead
    bare = {k: v for k, v in cfg.items() if k not in ("indexer_types", "index_topk_pattern", "mlp_layer_types")}
    assert family_of({**bare, "index_topk_freq": 2, "index_skip_topk_offset": 1}).config == c
    ids = prompt_ids(16)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    m = engine.load(d, device="cpu")
    err = rel_err(m.logits(ids), want)
    print(f"logits rel err {err:.2e}", flush=True)
    assert err < 1e-4
    for n in (6, 12):   # decode from below index_topk and from past it
        prompt = ids[:n].tolist()
        got = m.generate(prompt, max_new_tokens=16).output_ids
        try:
            assert_greedy(ref, prompt, got, 16)
        except AssertionError:
            # a pick at the indexer's top-k boundary between two scores equal to float32
            # rounding (about 1 in 3000 picks of these weights within 1e-4) goes either way, and
            # one other pick moves the logits far past any tie; only then may greedy part
            gap = index_topk_gap(ref, prompt + got, c.index_topk)
            assert gap < 1e-4, f"greedy left the reference, the closest indexer pick {gap:.2e} apart"
    (tmp_path / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    copy_config(d, tmp_path, index_topk=64)
    assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), want) > 1e-3


def test_bf16_checkpoint(tmp_path):
    """A bfloat16 checkpoint (the release's dtype): transformers' logits on the same weights."""
    import torch
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"glm_moe_dsa bf16 weights seed {seed}", flush=True)
    build_hf_model(tmp_path, "glm_moe_dsa", dtype="bfloat16", seed=seed)
    ref = hf_reference(tmp_path)   # the same bf16 weights, upcast to float32
    ids = prompt_ids(12)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(engine.load(tmp_path, device="cpu").logits(ids), want) < 1e-4


def test_prefill_equals_decode(tiny):
    """A 14-token prompt's logits in one prefill, in prefills of 5, and one token at a time."""
    d, _ = tiny
    model = engine.load(d, device="cpu").model
    ids = prompt_ids(14)
    whole = np.asarray(model.forward(ids, model.new_state(16), all_logits=True))
    for step in (5, 1):
        st = model.new_state(16)
        parts = np.concatenate([np.asarray(model.forward(ids[i:i + step], st, all_logits=True))
                                for i in range(0, len(ids), step)])
        err = rel_err(parts, whole)
        print(f"prefills of {step}: rel err {err:.2e}", flush=True)
        assert err < 1e-5


def test_state_and_prefix_cache(tiny):
    """Indexer keys are cached for the two full layers only; a prompt resumed from the previous
    generation's state gives what a fresh engine gives; a saved state restored and a live state
    copied into a smaller one continue as the original."""
    d, _ = tiny
    st = engine.load(d, device="cpu").model.new_state(40)
    assert st.ik.shape == (2, 40, 12) and st.k.shape == (3, 40, 1, 16 + 8)
    check_state_resumes(d, prompt_ids(12))



def test_state_bytes(tiny):
    """The bench's sequence-state bytes a decode token reads: every layer's latent rows up to
    index_topk (the picked ones past it), and past index_topk every position's indexer key of
    the full layers, both against the arrays the run state allocates."""
    d, _ = tiny
    m = engine.load(d, device="cpu")
    s = int(np.random.default_rng().integers(9, 40))
    st = m.model.new_state(s)
    row, key = st.k.nbytes / s, st.ik.nbytes / s   # one position: every layer's latent row; its keys
    topk = m.config.index_topk
    assert m.state_bytes_per_token(s - 1, 1) == pytest.approx(row * topk + key * s)
    assert m.state_bytes_per_token(0, 1) == pytest.approx(row)   # no choice yet: no keys read
    mean_rows = np.mean([min(p + 1, topk) for p in range(s)])
    mean_keys = np.mean([p + 1 if p + 1 > topk else 0 for p in range(s)])
    assert m.state_bytes_per_token(0, s) == pytest.approx(row * mean_rows + key * mean_keys)

def full_layers(**fields) -> tuple:
    return family_of({**GLM5, **fields}).config.index_layers


def test_released_shapes():
    """GLM-5 as released: every layer runs its indexer, the first three dense, the MTP layer
    skipped by name; index_topk_freq / index_skip_topk_offset and index_topk_pattern as
    transformers derives them; indexer_types as given wins; shared layers name no indexer
    weights."""
    fam = family_of(GLM5)
    c = fam.config
    assert c.index_layers == tuple(range(78)) and c.moe_layers == tuple(range(3, 78))
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.index_rope_pairs) == (32, 128, 2048, True)
    assert c.rms_eps == 1e-5 and c.softmax_scale == pytest.approx(256 ** -0.5)
    assert c.ignored_parts == (("model.layers.78.", "the multi-token-prediction (MTP) layer"),)
    assert fam.dense_spec["model.layers.77.self_attn.indexer.wq_b.weight"] == (32 * 128, 2048)
    # full at 0, 1, 2, then every fourth from 6
    assert full_layers(index_topk_freq=4, index_skip_topk_offset=3) == (0, 1, 2, *range(6, 78, 4))
    assert full_layers(index_topk_freq=2) == (0, 1, *range(3, 78, 2))   # offset 2 by default
    assert full_layers(index_topk_freq=0, index_skip_topk_offset=5) == tuple(range(78))
    assert full_layers(index_topk_pattern="F" + "S" * 76 + "F", index_topk_freq=4) == (0, 77)
    types = ["full", "shared", "shared"] * 26
    assert full_layers(indexer_types=types, index_topk_pattern="F" * 78) == tuple(range(0, 78, 3))
    assert full_layers(index_topk_pattern=types) == tuple(range(0, 78, 3))
    assert full_layers(index_topk_pattern="F" * 78 + "S") == tuple(range(78))   # an MTP layer's entry too
    fam = family_of({**GLM5, "indexer_types": types, "mlp_layer_types": ["dense", "sparse"] * 39})
    assert fam.config.moe_layers == tuple(range(1, 78, 2))
    # an MTP layer's entry past the decoder's layers is read past, as transformers reads it
    assert family_of({**GLM5, "mlp_layer_types": ["dense"] + ["sparse"] * 78}).config.moe_layers == tuple(range(1, 78))
    assert family_of({**GLM5, "first_k_dense_replace": 99}).config.moe_layers == ()
    assert "model.layers.1.self_attn.indexer.wk.weight" not in fam.dense_spec
    assert "model.layers.3.self_attn.indexer.wk.weight" in fam.dense_spec


@pytest.mark.parametrize("fields,says", [
    (dict(index_topk_pattern="SF" + "F" * 76), "index_topk_pattern makes layer 0 shared; it must be full"),
    (dict(index_topk_pattern="FSF"), "index_topk_pattern gives 3 layers; expected at least num_hidden_layers=78"),
    (dict(index_topk_pattern="F" * 40 + "X" + "F" * 37), "index_topk_pattern 'FFF.*' has 'X' at layer 40; "
                                                          r"expected F \(full\) or S \(shared\)"),
    (dict(indexer_types=["full"] * 77 + ["dense"]), "indexer_types has 'dense' at layer 77; expected "
                                                    "'full' or 'shared'"),
    (dict(indexer_types=["shared"] + ["full"] * 77), "indexer_types makes layer 0 shared"),
    (dict(index_topk_freq=2, index_skip_topk_offset=0),
     "index_topk_freq / index_skip_topk_offset makes layer 0 shared"),
    (dict(index_topk_freq="4"), "index_topk_freq '4' must be an integer"),
    (dict(index_skip_topk_offset=2.5), "index_skip_topk_offset 2.5 must be an integer"),
    (dict(indexer_rope_interleave=False), "indexer_rope_interleave False is not supported for glm_moe_dsa"),
    (dict(rope_interleave=False), "rope_interleave False is not supported for glm_moe_dsa"),
    (dict(mlp_layer_types=["dense"] * 3), "mlp_layer_types must list 'dense' or 'sparse' for each of the 78"),
    (dict(q_lora_rank=None), "glm_moe_dsa without q_lora_rank"),
])
def test_config_refused(fields, says):
    with pytest.raises(ConfigError, match=says):
        family_of({**GLM5, **fields})


def test_cuda_context_not_capped(monkeypatch, capfd):
    """On cuda GLM-5 runs its indexer and sparse attention on the device (engine/gpu_dsa.py):
    the context is the config's or --max-context, not capped at index_topk; a family the cuda
    backend lacks is still refused there by name."""
    from engine import runtime
    monkeypatch.setattr(runtime, "cuda_status", lambda: (True, ""))
    assert runtime.pick_device("cuda", "glm_moe_dsa") == "cuda"
    c = family_of(GLM5).config
    assert runtime.context_length(c, "cuda", None) == 4096
    assert runtime.context_length(c, "cuda", 100000) == 100000
    assert "capped" not in capfd.readouterr().err
    with pytest.raises(RuntimeError, match="--device cuda: the cuda backend does not run grok yet"):
        runtime.pick_device("cuda", "grok")
    assert runtime.pick_device("auto", "grok") == "cpu"
    assert "device auto: using cpu (the cuda backend does not run grok yet)" in capfd.readouterr().err
