"""IBM Granite MoE (engine/models/granitemoe.py: granitemoe, granitemoeshared, granitemoe_swa) on
the CPU backend against transformers on tiny random models: the four multipliers set away from 1
(random each run), top-k-then-softmax routing, the fused experts and the shared expert's fused
gate / up, under the releases' names and under transformers' own; granitemoe_swa's sliding
layers, sinks and NoPE layers; the cuda decoder (engine/gpu_granitemoe.py) under the simulator
and, marked gpu, on a GPU."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_packed_graph_replay, check_prefill_equals_token_by_token,
                      check_state_resumes, rel_err, run_simulator_decoder, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
CLASSES = {"granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
           "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM"),
           "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM")}
# (model type, overrides): tied embeddings as the releases have them; q / k / v / o biases and
# top-3 with a shared expert; granitemoe_swa with a sliding layer of window 3, a NoPE layer and
# a shared expert
CASES = [("granitemoe", dict(tie_word_embeddings=True)),
         ("granitemoeshared", dict(shared_intermediate_size=24, attention_bias=True, num_experts_per_tok=3)),
         ("granitemoe_swa", dict(shared_intermediate_size=24, sliding_window=3,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                 layer_rope_theta=[10000.0, 0, 10000.0]))]
IDS = ["tied", "shared-biases", "swa"]


def multipliers(rng) -> dict:
    """Granite's four multipliers, each away from 1 (the releases': 12, 1 / 64, 0.22, 6)."""
    return dict(embedding_multiplier=float(rng.uniform(2.0, 12.0)),
                attention_multiplier=float(rng.uniform(0.05, 0.5)),
                residual_multiplier=float(rng.uniform(0.2, 0.7)),
                logits_scaling=float(rng.uniform(2.0, 8.0)))


def build(dst, family: str = "granitemoe", dtype: str = "float32", original: bool = True, **over):
    """A random model of family saved into dst (save_original_format: the releases' tensor names,
    else transformers' own); transformers' model read back in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    print(f"{family} weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    cfg_cls, model_cls = (getattr(tf, n) for n in CLASSES[family])
    model = model_cls(cfg_cls(**{**TINY, **multipliers(rng), **over}))
    widen_init(model)
    with torch.no_grad():   # biases and sinks away from their zero init
        for n, p in model.named_parameters():
            if n.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
    save_tiny(model, dst, dtype, save_original_format=original)
    return model_cls.from_pretrained(dst, dtype=torch.float32).eval()


def tensor_names(folder) -> set:
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return set(f.keys())


@pytest.mark.parametrize("family,over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, family, over):
    ref = build(tmp_path, family, **over)
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref, m, n_ids=14, n_new=20)
    check_prefill_equals_token_by_token(m.model, ids)
    if family != "granitemoe_swa":   # the releases' names, as save_pretrained writes them by default
        assert any(n.endswith("block_sparse_moe.input_linear.weight") for n in tensor_names(tmp_path))
    if family == "granitemoeshared":
        check_state_resumes(tmp_path, ids)


def test_transformers_names(tmp_path):
    """A folder saved under transformers' own names (experts.gate_up_proj, router.weight) reads
    as the release's."""
    ref = build(tmp_path, "granitemoeshared", original=False, shared_intermediate_size=24)
    assert any(n.endswith("block_sparse_moe.experts.gate_up_proj") for n in tensor_names(tmp_path))
    check_against(ref, engine.load(tmp_path, device="cpu"), n_ids=10, n_new=8)


@pytest.mark.parametrize("family,over", CASES, ids=IDS)
def test_packed(tmp_path, family, over):
    """A bf16 arena packed from a checkpoint (its weights bf16 values) gives that checkpoint's
    logits: the fused experts split per expert, the shared expert dense."""
    from engine.pack import pack
    build(tmp_path / "f32", family, **over)
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 12)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_config_read_and_refused():
    c = family_of({"model_type": "granitemoeshared", **TINY, "shared_intermediate_size": 24,
                   "attention_multiplier": 0.125, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                   "logits_scaling": 6.0}).config
    assert (c.qk_scale, c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (0.125, 12.0, 0.22, 6.0)
    assert c.shared_intermediate == 24 and c.norm_topk_prob and not c.sinks
    c = family_of({"model_type": "granitemoe", **TINY}).config   # transformers' defaults: all 1.0
    assert (c.qk_scale, c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (1.0, 1.0, 1.0, 1.0)
    c = family_of({"model_type": "granitemoe_swa", **TINY, "num_hidden_layers": 5, "rope_theta": 500.0}).config
    assert c.layer_windows == (0, 128, 128, 128, 0) and c.nope_layers == () and c.rope.theta == 500.0 and c.sinks
    c = family_of({"model_type": "granitemoe_swa", **TINY, "layer_rope_theta": [0, 300.0, 300.0]}).config
    assert c.nope_layers == (0,) and c.rope.theta == 300.0
    with pytest.raises(ConfigError, match="hidden_act 'gelu' is not supported; granitemoe runs silu"):
        family_of({"model_type": "granitemoe", **TINY, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="logits_scaling is 0"):
        family_of({"model_type": "granitemoe", **TINY, "logits_scaling": 0})
    with pytest.raises(ConfigError, match="has 2 nonzero thetas; granitemoe_swa runs one theta"):
        family_of({"model_type": "granitemoe_swa", **TINY, "layer_rope_theta": [1e4, 0, 5e5]})
    with pytest.raises(ConfigError, match="layer_types must give each of the 3 layers"):
        family_of({"model_type": "granitemoe_swa", **TINY, "layer_types": ["full_attention"] * 2})


def test_missing_expert_named(tmp_path):
    """A release whose fused experts are missing a layer is refused naming the tensor it needs."""
    from safetensors.numpy import load_file, save_file
    build(tmp_path, "granitemoe")
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.1.block_sparse_moe.output_linear.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.block_sparse_moe.experts.0.down_proj.weight not found"):
        engine.load(tmp_path, device="cpu")


SIM = dict(vocab_size=24, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, num_local_experts=4, max_position_embeddings=64)
SIM_CASES = [("granitemoeshared", dict(shared_intermediate_size=8, attention_bias=True)),
             ("granitemoe_swa", dict(shared_intermediate_size=8, sliding_window=1,
                                     layer_types=["sliding_attention", "full_attention"],
                                     layer_rope_theta=[10000.0, 0]))]


@pytest.mark.parametrize("family,over", SIM_CASES, ids=["shared-biases", "swa"])
def test_simulator_decoder(tmp_path, family, over):
    """The eager CUDA decoder (engine/gpu_granitemoe.py) under NUMBA_ENABLE_CUDASIM=1 against the
    CPU backend on a bf16 build: tests/test_families_cuda.py's check, run as a script."""
    build(tmp_path, family, "bfloat16", **SIM, **over)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == family
    run_simulator_decoder(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("family,over", CASES, ids=IDS)
def test_cuda_matches_transformers(tmp_path, family, over):
    ref = build(tmp_path, family, "bfloat16", **over)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("family,over", CASES[1:], ids=IDS[1:])
def test_graph_replay_and_streaming(tmp_path, family, over, resident):
    """Graph replay = eager = the CPU backend on a packed arena (NVFP4 experts, 16 of them),
    resident or streamed under a tiny budget: the multipliers, the shared expert, the biases
    (and granitemoe_swa's windows, sinks and NoPE layer) in every path."""
    check_packed_graph_replay(tmp_path, resident, build, family, hidden_size=64, num_local_experts=16, **over)
