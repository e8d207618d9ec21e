"""Shared fixtures: tiny random models of each family, built by transformers (no download)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.demo import byte_level_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")


def gpu_available() -> bool:
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


BASE = dict(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def hf_config(family: str, **over):
    """A transformers config of the family, tiny, with overrides."""
    import transformers as tf
    kw = dict(BASE)
    if family == "qwen3_moe":
        kw.update(intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        cls = tf.Qwen3MoeConfig
    elif family == "mixtral":
        kw.update(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
        kw.pop("head_dim")
        cls = tf.MixtralConfig
    elif family == "qwen2_moe":
        kw.update(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, shared_expert_intermediate_size=40)
        kw.pop("head_dim")
        cls = tf.Qwen2MoeConfig
    elif family == "dots1":
        kw.update(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  num_hidden_layers=3)
        cls = tf.Dots1Config
    elif family == "glm4_moe":
        kw.update(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  num_hidden_layers=3, attention_bias=True, n_group=1, topk_group=1)
        cls = tf.Glm4MoeConfig
    elif family == "exaone_moe":
        # layers 0 and 1 sliding (window 4, RoPE), layer 2 full without RoPE; layer 0 dense
        kw.update(intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  num_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3, n_group=2,
                  topk_group=1, sliding_window=4, sliding_window_pattern=3)
        cls = tf.ExaoneMoeConfig
    elif family == "deepseek_v3":
        # MLA: low-rank q (q_lora_rank), a 16-wide latent, 8 rotary dims, 12 + 8 query dims
        kw.update(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  num_hidden_layers=3, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                  qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)
        kw.pop("head_dim")
        kw.pop("num_key_value_heads")
        cls = tf.DeepseekV3Config
    elif family == "deepseek_v32":
        # V3 with the DSA indexer: 16 heads of 12 (8 rotating; enough heads that no two positions
        # tie at a score of 0), the best 4 positions a query
        kw.update(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  num_hidden_layers=3, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                  qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, index_n_heads=16,
                  index_head_dim=12, index_topk=4)
        kw.pop("head_dim")
        kw.pop("num_key_value_heads")
        cls = tf.DeepseekV32Config
    elif family == "glm_moe_dsa":
        # GLM-5: V3.2's indexer (its RoPE over interleaved pairs) in layers 0 and 2; layer 1 reads
        # layer 0's picks (index_topk_pattern FSF); layers dense or routed by mlp_layer_types
        kw.update(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  num_hidden_layers=3, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                  qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, index_n_heads=16,
                  index_head_dim=12, index_topk=4, index_topk_pattern="FSF")
        kw.pop("head_dim")
        kw.pop("num_key_value_heads")
        cls = tf.GlmMoeDsaConfig
    elif family == "deepseek_v2":
        kw.update(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  num_hidden_layers=3, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                  qk_nope_head_dim=12, v_head_dim=10)
        kw.pop("head_dim")
        kw.pop("num_key_value_heads")
        cls = tf.DeepseekV2Config
    elif family == "glm4_moe_lite":
        # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE, dense / routed layers by mlp_layer_types
        kw.update(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, num_hidden_layers=3,
                  kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12,
                  v_head_dim=20)
        kw.pop("head_dim")
        kw.pop("num_key_value_heads")
        cls = tf.Glm4MoeLiteConfig
    elif family == "minimax_m2":
        # q/k norms over all heads, 8 of 16 dims rotating, sigmoid routing with a bias
        kw.update(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8)
        cls = tf.MiniMaxM2Config
    elif family == "ernie4_5_moe":
        # interleaved RoPE pairs, softmax routing chosen with a bias, shared experts, layer 0 dense
        kw.update(intermediate_size=64, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                  moe_num_shared_experts=1, moe_layer_start_index=1, num_hidden_layers=3,
                  tie_word_embeddings=False)
        kw.pop("head_dim")
        cls = tf.Ernie4_5_MoeConfig
    elif family == "gpt_oss":
        # a window of 3 within the tests' 12-token sequences; a small limit so the clamps bite
        kw.update(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                  num_hidden_layers=3, sliding_window=3, swiglu_limit=1.0,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        cls = tf.GptOssConfig
    elif family == "solar_open":
        # q_dim 64 beside a 48 hidden (head_dim 16 of 4 heads), sigmoid routing in groups
        kw.update(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  n_group=2, topk_group=1, routed_scaling_factor=1.5)
        cls = tf.SolarOpenConfig
    elif family == "hunyuan_v1_moe":
        # the release's fixed-alpha NTK RoPE; q / k normed after RoPE
        kw.update(intermediate_size=32, num_experts=4, moe_topk=2,
                  rope_parameters={"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})
        cls = tf.HunYuanMoEV1Config
    elif family == "olmoe":
        kw.update(intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        kw.pop("head_dim")
        cls = tf.OlmoeConfig
    else:
        raise ValueError(family)
    kw.update(over)
    if family == "minimax_m2" and "rotary_dim" in kw:
        # the released field, and the factor transformers before 5.2x read instead (it dropped
        # rotary_dim): both, so any version rotates the same dims
        kw.setdefault("partial_rotary_factor", kw["rotary_dim"] / kw["head_dim"])
    kw.setdefault("eos_token_id", None)
    kw.setdefault("bos_token_id", None)
    kw.setdefault("pad_token_id", None)
    return cls(**kw)


def widen_init(model) -> None:
    """A wider-than-default random init, so logits and routing are not all flat."""
    import torch
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
            elif "norm" in n:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)


def build_hf_model(dst: Path, family: str, dtype: str = "float32", max_shard_size=None, seed=None,
                   **over):
    """Save a randomly initialised transformers model + a byte-level tokenizer into dst."""
    import torch
    import transformers as tf
    cfg = hf_config(family, **over)
    torch.manual_seed(np.random.default_rng(seed).integers(1 << 31))
    cls = {"qwen3_moe": tf.Qwen3MoeForCausalLM, "mixtral": tf.MixtralForCausalLM,
           "olmoe": tf.OlmoeForCausalLM, "glm4_moe": tf.Glm4MoeForCausalLM,
           "qwen2_moe": tf.Qwen2MoeForCausalLM, "dots1": tf.Dots1ForCausalLM,
           "gpt_oss": tf.GptOssForCausalLM, "deepseek_v3": tf.DeepseekV3ForCausalLM,
           "deepseek_v2": tf.DeepseekV2ForCausalLM, "deepseek_v32": tf.DeepseekV32ForCausalLM,
           "glm_moe_dsa": tf.GlmMoeDsaForCausalLM, "glm4_moe_lite": tf.Glm4MoeLiteForCausalLM,
           "minimax_m2": tf.MiniMaxM2ForCausalLM, "ernie4_5_moe": tf.Ernie4_5_MoeForCausalLM,
           "exaone_moe": tf.ExaoneMoeForCausalLM, "solar_open": tf.SolarOpenForCausalLM,
           "hunyuan_v1_moe": tf.HunYuanMoEV1ForCausalLM}[family]
    model = cls(cfg)
    widen_init(model)
    with torch.no_grad():   # a buffer, not a parameter: a selection bias that matters
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
        for n, p in model.named_parameters():   # gpt-oss: sinks and router biases that matter
            if n.endswith((".sinks", "router.bias")):
                p.normal_(0.0, 1.0)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    return save_tiny(model, dst, dtype, **kw)


def save_tiny(model, dst: Path, dtype="float32", **save):
    """model, cast to dtype (a torch dtype or its name) in place and put in eval mode, saved
    into dst with a byte-level tokenizer: a checkpoint folder the engine reads. save:
    save_pretrained's keywords. Returns model."""
    import torch
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model.to(dtype).eval().save_pretrained(dst, **save)
    byte_level_tokenizer().save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return model


def hf_reference(dst: Path):
    """Load the saved folder back with transformers, in float32 (bf16 weights upcast)."""
    import torch
    import transformers as tf
    cfg = json.loads((Path(dst) / "config.json").read_text())
    m = tf.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    if cfg["model_type"] == "gpt_oss":
        # transformers before 5.2x clamps gpt-oss's experts at 7.0 whatever the config says (its
        # experts read self.limit / self.alpha): the config's values, on any version
        for mod in m.modules():
            if type(mod).__name__ == "GptOssExperts":
                mod.limit = float(cfg.get("swiglu_limit", 7.0))
                mod.alpha = float(cfg.get("swiglu_alpha", 1.702))
    return m.eval()


def hf_logits(ref, ids):
    """transformers' logits of one sequence of ids, [len(ids), vocab] float32."""
    import torch
    with torch.no_grad():
        return ref(input_ids=torch.tensor(ids)[None]).logits[0].numpy()


def hf_greedy(ref, ids, n: int) -> list:
    """transformers' greedy continuation of ids (n tokens, no EOS stop)."""
    import torch
    with torch.no_grad():
        out = ref.generate(torch.tensor(list(ids))[None], max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


TIE = 1e-4   # a greedy step whose reference top-2 logits are closer than this is a tie


def _eos_ids(ref) -> set:
    """The end-of-text ids of a transformers model (its generation config's and its text config's)."""
    ids = set()
    for v in (ref.generation_config.eos_token_id, ref.config.get_text_config().eos_token_id):
        ids |= set(v) if isinstance(v, (list, tuple)) else ({v} if v is not None else set())
    return ids


def assert_greedy(ref, prompt, got, n: int) -> None:
    """got must be transformers' greedy continuation of prompt, token for token. Random-weight
    models have near-ties; where got leaves the reference's argmax, the reference must rate the
    two tokens within TIE (relative to its largest logit), and the sequences may differ after."""
    want = hf_greedy(ref, prompt, n)
    if got == want:
        return
    if len(got) < n:   # the engine stops at an end-of-text token; the reference runs on
        assert got and got[-1] in _eos_ids(ref), (got, want)
    else:
        assert len(got) == n, (got, want)
    logits = hf_logits(ref, list(prompt) + list(got))
    for i, tok in enumerate(got):
        row = logits[len(prompt) + i - 1]
        best = int(np.argmax(row))
        if tok != best:
            gap = float(row[best] - row[tok])
            assert gap <= TIE * max(1.0, float(np.abs(row).max())), (
                f"step {i}: got {tok}, reference greedy {best} by a margin of {gap:.3g}")
            return


def assert_same_greedy(ref_engine, prompt, got, want, n: int) -> None:
    """got must be want, ref_engine's greedy continuation of prompt (two CPU paths whose expert
    sums round differently, ~1e-5: a checkpoint's dense experts, an arena's blocks); where got
    leaves it, ref_engine must rate the two tokens within TIE at that step."""
    if got == want:
        return
    assert len(got) == n, (got, want)
    i = next(k for k in range(n) if got[k] != want[k])
    row = np.asarray(ref_engine.logits(list(prompt) + list(got[:i]))[-1])
    gap = float(row[want[i]] - row[got[i]])
    assert gap <= TIE * max(1.0, float(np.abs(row).max())), (
        f"step {i}: got {got[i]}, the reference engine's greedy {want[i]} by a margin of {gap:.3g}")


def index_topk_gap(ref, ids, k: int) -> float:
    """transformers' indexer picks over ids (a DSA family: deepseek_v32, glm_moe_dsa,
    mistral_large4): the smallest gap between the k-th and the next score of a query that has
    more than k keys, relative to the query's largest score. Every Tensor.topk(k) over more than
    k values is taken for the indexer's: the model's other top-k calls must use another k."""
    import torch
    gaps, topk = [], torch.Tensor.topk

    def spy(t, n, *a, **kw):
        if n == k and t.shape[-1] > k:
            s = t.detach().reshape(-1, t.shape[-1]).float().sort(dim=-1, descending=True).values
            live = s[:, k] > -1e30       # (masked keys sit at the dtype's minimum)
            gaps.extend(((s[:, k - 1] - s[:, k]) / s[:, 0].abs().clamp(min=1e-30))[live].tolist())
        return topk(t, n, *a, **kw)
    torch.Tensor.topk = spy
    try:
        with torch.no_grad():
            ref(torch.tensor(ids)[None])
    finally:
        torch.Tensor.topk = topk
    assert gaps, "no indexer pick seen"
    return min(gaps)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_against(ref, m, n_ids: int = 12, n_new: int = 24, n_prompt: int = 5):
    """The engine model m (either backend) against the transformers model ref: logits of n_ids
    random tokens and an n_new-token greedy continuation of the first n_prompt. Returns the ids."""
    ids = np.random.default_rng().integers(0, 300, n_ids)
    assert rel_err(m.logits(ids), hf_logits(ref, ids)) < 1e-4
    prompt = ids[:n_prompt].tolist()
    assert_greedy(ref, prompt, m.generate(prompt, max_new_tokens=n_new).output_ids, n_new)
    return ids


def check_prefill_equals_token_by_token(model, ids, first: int = 3, tol: float = 1e-5) -> None:
    """The decoder model (either backend's) on ids: the first `first` as one chunk, then one at a
    time on the same state, gives the logits of all of them at once (to tol)."""
    whole = model.forward(ids, model.new_state(32), all_logits=True)
    st = model.new_state(32)
    parts = [model.forward(ids[:first], st, all_logits=True)] + [model.forward(ids[i:i + 1], st)
                                                                for i in range(first, len(ids))]
    assert rel_err(np.concatenate(parts), whole) < tol


def check_state_resumes(folder, ids) -> None:
    """The CPU engine on folder, 12 prompt ids: a prompt that extends the last generation's is
    resumed from its saved state (the prefix cache) and gives what a fresh engine gives; a
    state copied into a smaller one, and one saved and restored into a larger one, continue
    exactly as the original."""
    import engine
    m = engine.load(folder, device="cpu", prefix_cache=True)
    first = m.generate(ids[:8].tolist(), max_new_tokens=6).output_ids
    m.generate(ids[::-1].tolist(), max_new_tokens=2)   # another prompt: the first one's state saved
    prompt = ids[:8].tolist() + first + ids[8:].tolist()
    fresh = engine.load(folder, device="cpu")
    assert m.generate(prompt, max_new_tokens=6).output_ids == \
        fresh.generate(prompt, max_new_tokens=6).output_ids
    st = m.model.new_state(40)
    m.model.forward(np.asarray(prompt[:10]), st)
    small = m.model.new_state(12)
    st.copy_into(small, 10)
    big = m.model.restore_state(m.model.save_state(st, 10), 40, 10)
    tail = np.asarray(prompt[10:12])
    a = m.model.forward(tail, small)
    assert np.array_equal(a, m.model.forward(tail, big))
    assert np.array_equal(a, m.model.forward(tail, st))


def record_prefills(m) -> list:
    """From now on, the last logits of each prefill m's model runs (its forward wrapped; decode
    steps, one id at a time, are not kept)."""
    prefills, forward = [], m.model.forward

    def recorded(ids, st, all_logits=False):
        out = forward(ids, st, all_logits)
        if len(ids) > 1:
            prefills.append(np.array(out[-1]))
        return out
    m.model.forward = recorded
    return prefills


def copy_config(src: Path, dst: Path, **changes) -> None:
    """src's config.json into dst with changes (a None value removes the key), and its
    tokenizer files: the rest of a checkpoint folder whose weights a test rewrote."""
    cfg = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, dst / f)


def bf16_copy(src: Path, dst: Path) -> Path:
    """src (a float32 checkpoint folder) copied into dst with every float32 tensor rounded to
    bfloat16's values: a bf16 arena packed from it holds the same numbers, so the two must agree
    to float32's rounding (a tolerance for bf16's rounding lets a flipped top-k fail at random)."""
    from safetensors.numpy import load_file, save_file
    from kernels_numba.reference import round_bf16
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        sd = {k: round_bf16(v) if v.dtype == np.float32 else v for k, v in load_file(str(f)).items()}
        save_file(sd, str(f), metadata={"format": "pt"})
    return dst


@pytest.fixture
def tiny_qwen(tmp_path):
    build_hf_model(tmp_path / "m", "qwen3_moe")
    return tmp_path / "m"


def load_streamed(packed, **load):
    """engine.load (cuda) at the VRAM minimum, two banks of top-k and nothing hot, so decode
    streams experts from the first token on (a plan edited after loading would have them all
    in VRAM already)."""
    import engine
    big = engine.load(packed, device="cuda", **load)
    bb = big.gpu.res.block_bytes
    vram = (big.plan.vram_used - big.plan.hot_slots * bb) / 1e9
    del big
    g = engine.load(packed, device="cuda", vram_gb=vram, **load)
    assert g.plan.hot_slots == 0 and not g.plan.all_resident
    return g


def check_graph_replay_equals_eager(packed, prompt, resident: bool, **load) -> None:
    """cuda backend on a packed folder: decode replayed as CUDA graphs (one per token, resident
    or streamed; and the streamed path's per-layer segments) gives the eager path's tokens and
    the CPU backend's. load: engine.load keywords for both backends."""
    import engine
    g = engine.load(packed, device="cuda", **load) if resident else load_streamed(packed, **load)
    a = g.generate(prompt, max_new_tokens=20)
    # one graph a token both ways: every expert resident, or streamed with the host serving
    # the layers that miss VRAM while the graph runs
    assert g.gpu._graphs is not None and "token" in g.gpu._graphs and g.gpu._devres != resident
    if not resident:   # layers were served; the per-layer graph segments give the same tokens
        assert a.stats["vram"]["h2d_wait_s"] > 0
        g.gpu.device_resolve = False
        assert g.generate(prompt, max_new_tokens=20).output_ids == a.output_ids
        assert "token" not in g.gpu._graphs
    g.gpu.use_graphs = False
    b = g.generate(prompt, max_new_tokens=20)
    assert a.output_ids == b.output_ids
    cpu = engine.load(packed, device="cpu", **load).generate(prompt, max_new_tokens=20)
    assert cpu.output_ids == a.output_ids


def check_packed_graph_replay(tmp_path: Path, resident: bool, build, *args, **over) -> None:
    """check_graph_replay_equals_eager on a random 20-token prompt over tmp_path / "p": the
    model build(tmp_path / "src", *args, **over) saves, packed with NVFP4 experts."""
    from engine.pack import pack
    build(tmp_path / "src", *args, **over)
    pack(tmp_path / "src", tmp_path / "p", "nvfp4", progress=False)
    check_graph_replay_equals_eager(tmp_path / "p", np.random.default_rng().integers(0, 300, 20).tolist(),
                                    resident)


SAMPLED = (dict(temperature=0.0), dict(temperature=0.7, top_p=0.9, seed=7),
           dict(temperature=0.9, top_k=20, seed=3), dict(temperature=1.0, seed=2))


def check_device_sampling_equals_host(packed, prompt, resident: bool, n: int = 24) -> None:
    """cuda backend: decode tokens drawn on the device (graph tail, only the id read back) with
    a fixed seed give the host sampler's stream from the logits, greedy and sampled; so does the
    eager decode step."""
    import engine
    g = engine.load(packed, device="cuda") if resident else load_streamed(packed)
    for kw in SAMPLED:
        g.sample_on_device = True
        a = g.generate(prompt, max_new_tokens=n, **kw)
        assert g.gpu._devres != resident and ("sample", 0) in g.gpu._graphs
        g.sample_on_device = False
        b = g.generate(prompt, max_new_tokens=n, **kw)
        assert a.output_ids == b.output_ids, kw
        assert a.stats["decode_tokens"] == b.stats["decode_tokens"]
    g.gpu.use_graphs = False
    g.sample_on_device = True
    c = g.generate(prompt, max_new_tokens=n, **SAMPLED[1])
    g.sample_on_device = False
    assert c.output_ids == g.generate(prompt, max_new_tokens=n, **SAMPLED[1]).output_ids


def eager_decoder_matches_cpu(model, setup=None, cpu_setup=None, **load) -> None:
    """The cuda backend's eager decoder (the simulator has no CUDA graphs) against the CPU
    backend on model: a 2-token prefill (the T > 1 path: grouped experts) and a greedy decode
    step (the T = 1 path the graphs capture) from the prefill's state saved to the host, written
    over by another prompt and restored (the prefix cache's path), logits compared at each.
    setup(decoder) and cpu_setup(cpu model) run first; load: engine.load keywords for both.
    Kept this small: the simulator costs about 0.1 s per 64-thread block."""
    import engine
    cpu = engine.load(model, device="cpu", **load).model
    dec = engine.load(model, device="cuda", **load).gpu
    dec.use_graphs = False
    if setup is not None:
        setup(dec)
    if cpu_setup is not None:
        cpu_setup(cpu)
    sc, sg = cpu.new_state(8), dec.new_state(8)
    ids, toks, errs = np.array([3, 17]), [], []
    lc = np.asarray(cpu.forward(ids, sc, all_logits=True))
    lg = dec.forward(ids, sg, all_logits=True)
    for step in range(2):
        errs.append(rel_err(lg, lc))
        assert errs[-1] < 1e-4, f"step {step}: logits differ from the CPU backend by {errs[-1]:.3g}"
        tok = int(np.argmax(lc[-1]))
        assert int(np.argmax(lg[-1])) == tok, f"step {step}: greedy token differs"
        toks.append(tok)
        if step == 0:
            # the prefix cache's round trip: a host copy, another prompt through the one
            # preallocated state, the copy back
            saved = dec.save_state(sg, sg.pos)
            dec.forward(np.array([5, 9]), dec.new_state(8))
            sg = dec.restore_state(saved, 8, len(ids))
            lc = np.asarray(cpu.forward(np.array([tok]), sc))
            lg = dec.forward(np.array([tok]), sg)
    print(f"logits rel err {max(errs):.2e}, tokens {toks}", flush=True)


def run_simulator_decoder(folder) -> None:
    """tests/test_families_cuda.py run as a script in a subprocess under NUMBA_ENABLE_CUDASIM=1:
    the cuda backend's eager decoder (the one the folder's model_type names there) against the
    CPU backend on the model in folder (eager_decoder_matches_cpu)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "test_families_cuda.py"), str(folder)],
                       env=env, capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert r.returncode == 0 and "SIM DECODER PASSED" in r.stdout, r.stdout + r.stderr
