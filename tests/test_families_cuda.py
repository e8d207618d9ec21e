"""The llama-like families whose pieces only they use, on the cuda backend: glm4_moe (sigmoid
routing with a selection bias, ungated shared experts, partial RoPE with per-head q/k norms,
q/k/v biases, a first dense layer), dots1 (the same MoE beside Qwen3's attention), qwen2_moe
(a sigmoid-gated shared expert, q/k/v biases) and gpt_oss (attention sinks, sliding and full
layers, q/k/v/o biases, a biased router, biased experts with a clamped SwiGLU, YaRN),
deepseek_v3 / deepseek_v2 / glm4_moe_lite (multi-head latent attention: engine/gpu_mla.py;
deepseek_v32 / glm_moe_dsa's sparse attention: tests/test_dsa_cuda.py),
minimax_m2 (q/k norms over all heads, partial RoPE, sigmoid routing over all experts),
ernie4_5_moe (interleaved RoPE pairs, softmax routing chosen with a bias), exaone_moe (sliding
layers with RoPE, full ones without: engine/gpu.py no_freq), hunyuan_v1_moe (q / k normed after
RoPE), solar_open (glm4_moe's MoE, q_dim beside a smaller hidden).
- CPU-only CI: test_simulator_decoder() runs this file as a script in a subprocess with
  NUMBA_ENABLE_CUDASIM=1: the eager decoder against the CPU backend on a tiny model.
- A GPU (marker gpu): cuda = cpu = transformers, graph replay = eager, streamed under tiny
  budgets = all resident.
Run the simulator check directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_families_cuda.py MODEL_DIR
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":   # run as a script from anywhere
    for p in (ROOT, ROOT / "tests"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))

from conftest import (assert_greedy, build_hf_model, check_packed_graph_replay,  # noqa: E402
                      eager_decoder_matches_cpu, hf_logits, hf_reference, rel_err, run_simulator_decoder)

TINY = dict(vocab_size=24, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
            moe_intermediate_size=8, intermediate_size=8, num_experts_per_tok=2,
            num_hidden_layers=2)
SIM_CASES = {
    # layer 0 dense, layer 1 routed (4 experts in 2 groups, one kept) + shared expert; no q/k
    # norms (GLM-4.5-Air's setting): partial RoPE through the plain rope kernel (the hybrid
    # check covers it fused with the norms)
    "glm4_moe": dict(TINY, head_dim=8, n_routed_experts=4, n_group=2, topk_group=1,
                     use_qk_norm=False, routed_scaling_factor=1.5),
    # layer 0 dense, layer 1 routed + gated shared expert
    "qwen2_moe": dict(TINY, num_experts=4, shared_expert_intermediate_size=8, mlp_only_layers=[0]),
    # a sliding layer (window 1: the token alone, beside its sink) and a full one; q/k/v/o
    # biases, sinks, the biased router, biased experts with a clamp that bites
    "gpt_oss": dict(vocab_size=24, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=8, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                    num_hidden_layers=2, sliding_window=1, swiglu_limit=1.0,
                    layer_types=["sliding_attention", "full_attention"]),
    # MLA (engine/gpu_mla.py): layer 0 dense, layer 1 routed + shared expert; V3 with low-rank q
    # and grouped sigmoid routing, biases on q_a / kv_a / o, V2 with q_proj and softmax routing times its scaling factor
    "deepseek_v3": dict(vocab_size=24, hidden_size=16, num_attention_heads=2,
                        moe_intermediate_size=8, intermediate_size=8, num_experts_per_tok=2,
                        num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1,
                        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5,
                        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=6, attention_bias=True),
    "deepseek_v2": dict(vocab_size=24, hidden_size=16, num_attention_heads=2,
                        moe_intermediate_size=8, intermediate_size=8, num_experts_per_tok=2,
                        num_hidden_layers=2, n_routed_experts=4, first_k_dense_replace=1,
                        n_shared_experts=1, routed_scaling_factor=2.0, kv_lora_rank=8,
                        q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6),
    # V2 / V2.5's group-limited softmax routing: 8 experts in 4 groups, 2 kept
    "deepseek_v2-grouped": dict(vocab_size=24, hidden_size=16, num_attention_heads=2,
                                moe_intermediate_size=8, intermediate_size=8, num_experts_per_tok=3,
                                num_hidden_layers=2, n_routed_experts=8, first_k_dense_replace=1,
                                n_shared_experts=1, routed_scaling_factor=16.0, kv_lora_rank=8,
                                q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                v_head_dim=6, topk_method="group_limited_greedy", n_group=4,
                                topk_group=2),
    # GLM-4.7-Flash: MLA with V3's MoE, a routed layer before a dense one (mlp_layer_types)
    "glm4_moe_lite": dict(vocab_size=24, hidden_size=16, num_attention_heads=2,
                          moe_intermediate_size=8, intermediate_size=8, num_experts_per_tok=2,
                          num_hidden_layers=2, n_routed_experts=4, n_shared_experts=1,
                          mlp_layer_types=["sparse", "dense"], routed_scaling_factor=1.8,
                          kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                          v_head_dim=8),
    # K-EXAONE: layer 0 sliding (window 1: the token alone) with RoPE and dense, layer 1 full
    # without RoPE and routed (4 experts in 2 groups) + shared expert
    "exaone_moe": dict(TINY, head_dim=8, num_experts=4, n_group=2, topk_group=1, sliding_window=1,
                       sliding_window_pattern=2, intermediate_size=8),
    # MiniMax-M2: q/k norms over all heads, 4 of 8 dims rotating, sigmoid routing with a bias
    # over all experts
    "minimax_m2": dict(TINY, head_dim=8, num_local_experts=4, rotary_dim=4),
    # ERNIE-4.5: interleaved RoPE pairs (q / k rows reordered at upload), softmax routing chosen
    # with a bias ([1, E]), a shared expert, layer 0 dense
    "ernie4_5_moe": dict(TINY, moe_num_experts=4, moe_num_shared_experts=1, moe_layer_start_index=1,
                         tie_word_embeddings=False),
    # Hunyuan-A13B: q / k normed a head after RoPE (rope, norms, store: three launches), the
    # fixed-alpha base
    "hunyuan_v1_moe": dict(TINY, head_dim=8, num_experts=4, moe_topk=2),
}
DECODERS = {"deepseek_v3": "GpuMlaDecoder", "deepseek_v2": "GpuMlaDecoder",
            "glm4_moe_lite": "GpuMlaDecoder", "kimi_k25": "GpuMlaDecoder",
            "deepseek_v32": "GpuDsaDecoder", "glm_moe_dsa": "GpuDsaDecoder",   # tests/test_dsa_cuda.py
            "step3p5": "GpuStepDecoder", "step3p7": "GpuStepDecoder",   # tests/test_step3p5.py
            "cohere2_moe": "GpuCohereDecoder",   # tests/test_cohere2_moe.py
            "minimax_m3_vl": "GpuM3Decoder",     # tests/test_minimax_m3.py
            "llama4": "GpuLlama4Decoder", "llama4_text": "GpuLlama4Decoder",   # tests/test_llama4.py
            "mimo_v2_flash": "GpuMimoDecoder",   # tests/test_mimo_v2_flash.py
            "afmoe": "GpuAfmoeDecoder",          # tests/test_afmoe.py
            "granitemoe": "GpuGraniteMoeDecoder", "granitemoeshared": "GpuGraniteMoeDecoder",   # tests/test_granitemoe.py
            "granitemoe_swa": "GpuGraniteMoeDecoder",
            "minicpm5_moe": "GpuMinicpmDecoder",   # tests/test_minicpm5.py
            "flex_olmo": "GpuFlexOlmoDecoder",     # tests/test_flex_olmo.py
            "phimoe": "GpuPhimoeDecoder",          # tests/test_phimoe.py
            "dbrx": "GpuDbrxDecoder",              # tests/test_dbrx.py
            "mistral4": "GpuMlaDecoder"}           # tests/test_mistral4.py


@pytest.mark.parametrize("family", sorted(SIM_CASES))
def test_simulator_decoder(tmp_path, family):
    # bf16, as the cuda backend builds bf16 expert blocks from a checkpoint
    build_hf_model(tmp_path, family.split("-")[0], dtype="bfloat16", **SIM_CASES[family])
    run_simulator_decoder(tmp_path)


# ---- real GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("family,over", [
    ("glm4_moe", {}),
    ("glm4_moe", dict(n_group=4, topk_group=2, num_experts_per_tok=3, use_qk_norm=True,
                      first_k_dense_replace=0, routed_scaling_factor=2.5, n_shared_experts=2)),
    ("qwen2_moe", {}),
    ("qwen2_moe", dict(mlp_only_layers=[1], qkv_bias=False, norm_topk_prob=True)),
    ("dots1", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.0)),
    ("gpt_oss", {}),
    ("gpt_oss", dict(hidden_size=64, intermediate_size=64, num_local_experts=16,
                     num_experts_per_tok=4, sliding_window=4, swiglu_limit=7.0)),
    ("deepseek_v3", {}),
    ("deepseek_v3", dict(hidden_size=64, n_routed_experts=16, n_group=4, topk_group=2,
                         num_experts_per_tok=3, kv_lora_rank=64, q_lora_rank=32,
                         qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)),
    ("deepseek_v2", {}),
    ("deepseek_v2", dict(routed_scaling_factor=2.0, attention_bias=True)),
    ("deepseek_v2", dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
                         n_group=4, topk_group=2, routed_scaling_factor=16.0)),
    ("glm4_moe_lite", dict(num_attention_heads=20, mlp_layer_types=["dense", "sparse", "sparse"])),
    ("exaone_moe", {}),
    ("exaone_moe", dict(layer_types=["full_attention", "sliding_attention", "full_attention"],
                        num_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)),
    ("ernie4_5_moe", {}),
    ("ernie4_5_moe", dict(moe_num_experts=16, moe_k=4, moe_layer_start_index=0, hidden_size=64,
                          num_attention_heads=4, num_key_value_heads=1)),
    ("minimax_m2", {}),
    ("minimax_m2", dict(hidden_size=64, num_local_experts=16, num_experts_per_tok=4, head_dim=32,
                        rotary_dim=16)),
    ("solar_open", {}),
    ("hunyuan_v1_moe", {}),
    ("hunyuan_v1_moe", dict(hidden_size=64, num_experts=16, moe_topk=4, tie_word_embeddings=True)),
])
def test_cuda_matches_cpu_and_transformers(tmp_path, family, over):
    import engine
    build_hf_model(tmp_path, family, dtype="bfloat16", **over)
    ref = hf_reference(tmp_path)
    ids = np.random.default_rng().integers(0, 300, 12).tolist()
    g = engine.load(tmp_path, device="cuda")
    assert rel_err(g.logits(ids), hf_logits(ref, ids)) < 1e-4
    assert_greedy(ref, ids[:5], g.generate(ids[:5], max_new_tokens=32).output_ids, 32)
    cpu = engine.load(tmp_path, device="cpu").generate(ids[:5], max_new_tokens=32)
    assert_greedy(ref, ids[:5], cpu.output_ids, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("family", ["glm4_moe", "qwen2_moe", "gpt_oss", "deepseek_v3", "minimax_m2",
                                    "exaone_moe", "hunyuan_v1_moe", "solar_open"])
def test_graph_replay_and_streaming(tmp_path, family, resident):
    """Graph replay = eager = the CPU backend, resident (one graph a token, the router's slot
    path) or streamed (per-layer segments, the shared expert's own, the host resolve)."""
    over = {"glm4_moe": dict(n_routed_experts=16, n_group=4, topk_group=2),
            "deepseek_v3": dict(n_routed_experts=16, n_group=4, topk_group=2),
            "exaone_moe": dict(num_experts=16, n_group=4, topk_group=2),
            "solar_open": dict(n_routed_experts=16, n_group=4, topk_group=2),
            "hunyuan_v1_moe": dict(num_experts=16, moe_topk=4),
            "gpt_oss": dict(num_local_experts=16),
            "minimax_m2": dict(num_local_experts=16)}.get(family, dict(num_experts=16))
    check_packed_graph_replay(tmp_path, resident, build_hf_model, family, num_experts_per_tok=4,
                              num_hidden_layers=3, hidden_size=64, **over)


if __name__ == "__main__":
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    import json
    family = json.loads((Path(sys.argv[1]) / "config.json").read_text())["model_type"]
    want = DECODERS.get(family, "GpuDecoder")
    eager_decoder_matches_cpu(Path(sys.argv[1]),
                              lambda dec: None if type(dec).__name__ == want else
                              sys.exit(f"expected {want}, got {type(dec).__name__}"))
    if family == "gpt_oss":
        # a host-side routing override (benchmarks) moves the biases with the experts it picks:
        # the same shift on the CPU model's routing gives the same logits
        def shifted(route, e):
            def route2(l, h):
                ids, w = route(l, h)
                return (ids + 1) % e, w
            return route2

        def on_cpu(m):
            m.route = shifted(m.route, m.c.n_experts)

        def on_gpu(dec):
            dec.route_override = lambda l, ids: (ids + 1) % dec.c.n_experts
        eager_decoder_matches_cpu(Path(sys.argv[1]), on_gpu, on_cpu)
    print("SIM DECODER PASSED", flush=True)
