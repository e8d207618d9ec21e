"""IBM Granite 4.0 hybrid (engine/models/granitemoehybrid.py) on the CPU backend against
transformers on tiny random models: Mamba-2 layers (conv with bias, the scan with groups, the gated
group norm; A_log, dt_bias, D and the norms away from their init) beside attention layers with
RoPE or without (NoPE, as released), each followed by Granite MoE's softmax top-k experts and the
shared expert, or the shared MLP alone (num_local_experts 0, -h-micro); Granite's four multipliers
away from 1 (random each run); the releases' tensor and layer-type names; prefill against
token-by-token decode, the prefix cache, a bf16 arena, config refusals. The cuda decoder
(engine/gpu_granite_hybrid.py): tests/test_gpu_mamba.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import (bf16_copy, check_against, check_prefill_equals_token_by_token, check_state_resumes,
                      rel_err, save_tiny, widen_init)
from engine.models import family_of
from engine.models.rope import ConfigError
from test_granitemoe import multipliers, tensor_names

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=16, shared_intermediate_size=24,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
            mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
M, A = "linear_attention", "full_attention"
# the released shape (NoPE, tied embeddings); RoPE with q / k / v / o biases, top-3, one B / C
# group and no conv bias; the dense shared MLP alone (num_local_experts 0)
CASES = [dict(layer_types=[M, A, M, M], position_embedding_type="nope", tie_word_embeddings=True),
         dict(layer_types=[A, M, A], position_embedding_type="rope", attention_bias=True,
              num_experts_per_tok=3, mamba_n_groups=1, mamba_conv_bias=False),
         dict(layer_types=[M, A, M], position_embedding_type="nope", num_local_experts=0)]
IDS = ["nope-tied", "rope-biases", "dense"]
RELEASED = {M: "mamba", A: "attention"}   # the layer-type names config.json has in the releases


def build(dst, dtype: str = "float32", **over):
    """A random transformers Granite 4.0 hybrid (fresh seed, printed) with its multipliers away
    from 1 and its Mamba parameters, norms and biases away from their init, saved in dtype under
    the releases' tensor and layer-type names; returns the reference in float32."""
    import torch
    import transformers as tf
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    print(f"granitemoehybrid weights seed {seed}", flush=True)
    torch.manual_seed(seed)
    over = {**TINY, **multipliers(rng), **over}
    over["num_hidden_layers"] = len(over["layer_types"])
    model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**over))
    widen_init(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):     # A = -exp(A_log) from -0.5 to -4
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif n.endswith("dt_bias"):   # softplus(dt + dt_bias) on both sides of 1
                p.normal_(-0.5, 1.0)
            elif n.endswith(".D") or n.endswith("bias"):
                p.normal_(0.5, 0.5)
            elif "norm" in n:
                p.normal_(1.0, 0.3)
    save_tiny(model, dst, dtype)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["layer_types"] = [RELEASED.get(k, k) for k in cfg["layer_types"]]
    (dst / "config.json").write_text(json.dumps(cfg))
    return tf.GraniteMoeHybridForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tmp_path, over):
    ref = build(tmp_path, **over)
    assert json.loads((tmp_path / "config.json").read_text())["layer_types"][:2] == \
        [RELEASED[k] for k in over["layer_types"][:2]]
    if over.get("num_local_experts") != 0:   # the releases' fused names, as save_pretrained writes them
        assert any(n.endswith("block_sparse_moe.input_linear.weight") for n in tensor_names(tmp_path))
    m = engine.load(tmp_path, device="cpu")
    ids = check_against(ref, m, n_ids=14, n_new=16)
    check_prefill_equals_token_by_token(m.model, ids)
    if over is CASES[0]:
        check_state_resumes(tmp_path, ids)


@pytest.mark.parametrize("over", CASES, ids=IDS)
def test_packed_bf16(tmp_path, over):
    """A bf16 arena (gated experts split from the fused tensors) gives the logits of the
    checkpoint rounded to bf16; a dense model (no experts) is refused by name."""
    from engine.pack import PackError, pack
    build(tmp_path / "f32", **over)
    src = bf16_copy(tmp_path / "f32", tmp_path / "src")
    if over.get("num_local_experts") == 0:   # the dense model runs from its checkpoint folder only
        with pytest.raises(PackError, match="granitemoehybrid without routed experts .* has nothing to pack"):
            pack(src, tmp_path / "p", "bf16", progress=False)
        assert not (tmp_path / "p").exists()
        return
    pack(src, tmp_path / "p", "bf16", progress=False)
    ids = np.random.default_rng().integers(0, 300, 14)
    want = engine.load(src, device="cpu").logits(ids)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-5


def test_config_read_and_refused():
    cfg = {"model_type": "granitemoehybrid", **TINY, "num_hidden_layers": 4,
           "layer_types": ["mamba", "attention", "mamba", "mamba"], "position_embedding_type": "nope",
           "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
           "logits_scaling": 6.0, "time_step_limit": [0.0, {"__float__": "Infinity"}], "tie_word_embeddings": True}
    c = family_of(cfg).config
    assert c.kinds == (M, A, M, M) and c.linear_layers == (0, 2, 3) and c.full_layers == (1,)
    assert c.nope_layers == (0, 1, 2, 3) and c.moe_layers == (0, 1, 2, 3) and c.tie_embeddings
    assert (c.qk_scale, c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (0.0078125, 12.0, 0.22, 6.0)
    assert c.ssm_shape == (8, 8, 8) and c.conv_dim == 64 + 2 * 2 * 8 and c.gated_experts
    assert c.shared_intermediate == 24 and c.moe_intermediate == 16 and c.top_k == 2
    rope = family_of({**cfg, "position_embedding_type": "rope", "rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 500.0}}).config
    assert rope.nope_layers == () and rope.rope.theta == 500.0
    dense = family_of({**cfg, "num_local_experts": 0, "num_experts_per_tok": 0}).config
    assert dense.moe_layers == () and dense.moe_intermediate == 0
    assert not family_of({**cfg, "num_local_experts": 0}).expert_spec
    auto = family_of({**cfg, "layer_types": None}).config   # transformers' default: all Mamba
    assert auto.kinds == (M,) * 4

    def refused(match, **over):
        with pytest.raises(ConfigError, match=match):
            family_of({**cfg, **over})
    refused(r"position_embedding_type 'alibi' is not supported; expected \"rope\", \"nope\" or null",
            position_embedding_type="alibi")
    refused(r"layer_types must give each of the 4 layers one of linear_attention, full_attention; got 'moe' "
            r"at layer 1", layer_types=["mamba", "moe", "mamba", "mamba"])
    refused(r"hidden_act 'gelu' is not supported; granitemoehybrid runs silu", hidden_act="gelu")
    refused(r"mamba_proj_bias=true is not supported", mamba_proj_bias=True)
    refused(r"time_step_limit=\[0.0, 0.1\] is not supported", time_step_limit=[0.0, 0.1])
    refused(r"mamba_n_heads=8 x mamba_d_head=6 must be mamba_expand x hidden_size=64", mamba_d_head=6)
    refused(r"mamba_n_heads=8 .* a multiple of mamba_n_groups=3", mamba_n_groups=3)
    refused(r"num_local_experts=-1; expected 0 \(dense\) or more", num_local_experts=-1)
    refused(r"num_experts_per_tok=9 must be in 1..8", num_experts_per_tok=9)
    refused(r"logits_scaling is 0", logits_scaling=0)
    refused(r"shared_intermediate_size=0; expected a positive size", shared_intermediate_size=0)
