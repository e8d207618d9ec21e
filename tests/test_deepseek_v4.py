"""DeepSeek-V4 (engine/models/deepseek_v4.py) on the CPU backend against transformers. A tiny
random model with every layer kind (sliding, compressed sparse with an indexer that has to
choose, heavily compressed), hash routing in the first layer, three hyper-connection streams,
saved under the released checkpoint's names (transformers loads it through its own renaming,
which checks the names). Prompts long enough that windows close in prefill and in decode."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import assert_greedy, byte_level_tokenizer, check_state_resumes, rel_err, widen_init
from engine.models import family_of
from engine.models.rope import ConfigError

TINY = dict(vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
            q_lora_rank=16, qk_rope_head_dim=8, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, o_groups=2, o_lora_rank=8, sliding_window=6, index_n_heads=8,
            index_head_dim=16, index_topk=3, hc_mult=3, swiglu_limit=1.5,
            layer_types=["sliding_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention", "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"], max_position_embeddings=256,
            rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def released_names(sd: dict, n_experts: int) -> dict:
    """transformers' state dict -> the released checkpoint's names (its conversion, backwards),
    the fused experts split into w1 / w3 / w2 a expert."""
    out = {}
    ren = [(".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
           (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
           (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
           (".self_attn.", ".attn."), (".mlp.", ".ffn."), (".input_layernorm.", ".attn_norm."),
           (".post_attention_layernorm.", ".ffn_norm."), (".attn_hc.fn", ".hc_attn_fn"),
           (".attn_hc.base", ".hc_attn_base"), (".attn_hc.scale", ".hc_attn_scale"),
           (".ffn_hc.fn", ".hc_ffn_fn"), (".ffn_hc.base", ".hc_ffn_base"),
           (".ffn_hc.scale", ".hc_ffn_scale"), (".sinks", ".attn_sink"), (".kv_norm.", ".norm."),
           (".position_bias", ".ape"), (".q_a_proj.", ".wq_a."), (".q_b_proj.", ".wq_b."),
           (".kv_proj.", ".wkv."), (".gate_proj.", ".wgate."), (".o_a_proj.", ".wo_a."),
           (".o_b_proj.", ".wo_b."), (".q_a_norm.", ".q_norm."),
           (".gate.e_score_correction_bias", ".gate.bias"),
           (".shared_experts.wgate.", ".shared_experts.w1."),
           (".shared_experts.up_proj.", ".shared_experts.w3."),
           (".shared_experts.down_proj.", ".shared_experts.w2.")]
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
           "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    for k, v in sd.items():
        v = v.contiguous()
        if k in top:
            out[top[k]] = v
            continue
        k = "." + k.removeprefix("model.")
        for a, b in ren:
            k = k.replace(a, b)
        k = k[1:]
        if k.endswith(".experts.gate_up_proj"):
            i = v.shape[1] // 2
            for e in range(n_experts):
                out[k.replace("gate_up_proj", f"{e}.w1.weight")] = v[e, :i].contiguous()
                out[k.replace("gate_up_proj", f"{e}.w3.weight")] = v[e, i:].contiguous()
        elif k.endswith(".experts.down_proj"):
            for e in range(n_experts):
                out[k.replace("down_proj", f"{e}.w2.weight")] = v[e].contiguous()
        else:
            out[k] = v
    return out


def build(dst, seed=None, repeats=False, **over):
    """The tiny model saved into dst under the released names; transformers' model on it.
    repeats: hash tables that may route a token to one expert twice."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file
    cfg = tf.DeepseekV4Config(**{**TINY, **over})
    torch.manual_seed(np.random.default_rng(seed).integers(1 << 31))
    model = tf.DeepseekV4ForCausalLM(cfg)
    widen_init(model)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
            elif n.endswith("tid2eid") and repeats:
                b.copy_(torch.tensor(rng.integers(0, cfg.n_routed_experts, tuple(b.shape))))
            elif n.endswith("tid2eid"):   # each token its own distinct experts
                b.copy_(torch.tensor(np.argsort(rng.random((b.shape[0], cfg.n_routed_experts)),
                                                axis=1)[:, :b.shape[1]]))
        for n, p in model.named_parameters():
            if n.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.normal_(0.0, 1.0)
            elif n.endswith((".scale", "hc_scale")):
                p.normal_(0.0, 0.5)
    model.eval()
    dst.mkdir(parents=True, exist_ok=True)
    tensors = released_names(model.state_dict(), cfg.n_routed_experts)
    if cfg.tie_word_embeddings:
        del tensors["head.weight"]
    tensors["mtp.0.attn.wq_a.weight"] = torch.zeros(cfg.q_lora_rank, cfg.hidden_size)   # skipped
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps({**cfg.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}))
    byte_level_tokenizer().save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The folder, transformers' model built, and transformers' model loaded from the folder."""
    import torch
    import transformers as tf
    d = tmp_path_factory.mktemp("deepseek_v4")
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"deepseek_v4 weights seed {seed}", flush=True)
    built = build(d, seed)
    loaded = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, built, loaded


def test_released_names_load_in_transformers(tiny):
    """transformers renames the released names as it loads: every weight comes back."""
    _, built, loaded = tiny
    want, got = built.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert np.array_equal(want[k].numpy(), got[k].numpy()), k


def test_logits_and_greedy_match_transformers(tiny, capfd):
    import torch
    d, _, ref = tiny
    ids = np.random.default_rng().integers(0, 300, 27)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    m = engine.load(d, device="cpu")
    assert "skipping the multi-token-prediction (MTP) layers (1 tensors under mtp.*)" in capfd.readouterr().err
    assert rel_err(m.logits(ids), want) < 1e-4
    prompt = ids[:9].tolist()   # decode closes CSA and HCA windows and lets the indexer choose
    assert_greedy(ref, prompt, m.generate(prompt, max_new_tokens=24).output_ids, 24)


def test_other_settings_match_transformers(tmp_path):
    """Four streams, tied embeddings, a 4-row window, more picks than entries, no swiglu_limit
    in config.json (transformers' 10 then), hash tables that repeat an expert; a prompt that
    wraps every ring several times, in one forward and in uneven pieces."""
    import torch
    import transformers as tf
    over = dict(hc_mult=4, tie_word_embeddings=True, sliding_window=4, index_topk=50,
                swiglu_limit=10.0, routed_scaling_factor=1.5)
    build(tmp_path, repeats=True, **over)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                      if k not in ("swiglu_limit", "routed_scaling_factor")}))
    ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = np.random.default_rng().integers(0, 300, 61)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    m = engine.load(tmp_path, device="cpu").model
    assert rel_err(m.forward(ids, m.new_state(64), all_logits=True), want) < 1e-4
    st, parts, at = m.new_state(64), [], 0
    for n in (3, 7, 13, 1, 17, 20):
        parts.append(m.forward(ids[at:at + n], st, all_logits=True))
        at += n
    assert rel_err(np.concatenate(parts), want) < 1e-4


def test_prefill_equals_token_by_token(tiny):
    """One forward over the prompt = the prompt a token at a time (windows closing in either)."""
    d = tiny[0]
    m = engine.load(d, device="cpu").model
    ids = np.random.default_rng().integers(0, 300, 21)
    whole = m.forward(ids, m.new_state(32), all_logits=True)
    st = m.new_state(32)
    parts = [m.forward(ids[:5], st, all_logits=True)]
    parts += [m.forward(ids[i:i + 1], st) for i in range(5, 21)]
    assert rel_err(np.concatenate(parts), whole) < 1e-5


def test_state_resumes(tiny):
    check_state_resumes(tiny[0], np.random.default_rng().integers(0, 300, 12))


def test_config_read():
    c = family_of({**TINY, "model_type": "deepseek_v4"}).config
    assert c.layer_types[1] == "compressed_sparse_attention" and c.rates == (0, 4, 8, 4)
    assert c.hash_layers == (0,) and c.int_tensors == ("layers.0.ffn.gate.tid2eid",)
    assert c.rope.rotary_dim == 8 and c.compress_rope.theta == 160000.0
    # the released config's legacy fields: compress_ratios a layer, num_hash_layers
    legacy = {k: v for k, v in TINY.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    c = family_of({**legacy, "model_type": "deepseek_v4", "compress_ratios": [0, 4, 128, 4],
                   "num_hash_layers": 2}).config
    assert c.rates == (0, 4, 128, 4) and c.hash_layers == (0, 1)


@pytest.mark.parametrize("fields,says", [
    (dict(compress_ratios=[0, 4, 64, 4], layer_types=None), "compress_ratios has 64; expected 0, 4 or 8"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types must give each of the 4 layers"),
    (dict(mlp_layer_types=["moe", "dense", "moe", "moe"]), "mlp_layer_types must give each of the 4"),
    (dict(scoring_func="sigmoid"), "scoring_func 'sigmoid' is not supported for deepseek_v4"),
    (dict(o_groups=3), "o_groups=3 does not divide num_attention_heads \\* head_dim = 128"),
    (dict(num_key_value_heads=4), "num_key_value_heads=4; expected 1"),
    (dict(index_head_dim=4), "index_head_dim=4 must be at least qk_rope_head_dim=8"),
])
def test_config_refused(fields, says):
    with pytest.raises(ConfigError, match=says):
        family_of({**TINY, "model_type": "deepseek_v4", **fields})


def test_packed_nvfp4_matches_transformers_on_dequantized_weights(tiny, tmp_path):
    """A packed arena (NVFP4 experts: the clamped SwiGLU in the CPU block kernel) against
    transformers on the weights the arena holds."""
    import torch
    import transformers as tf

    from engine.pack import pack
    from test_packed import dequantized_copy
    pack(tiny[0], tmp_path / "p", "nvfp4", progress=False)
    ref = tf.AutoModelForCausalLM.from_pretrained(dequantized_copy(tiny[0], tmp_path / "p", tmp_path / "dq"),
                                                  dtype=torch.float32).eval()
    ids = np.random.default_rng().integers(0, 300, 20)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    m = engine.load(tmp_path / "p", device="cpu")
    assert rel_err(m.logits(ids), want) < 1e-4
    assert_greedy(ref, ids[:8].tolist(), m.generate(ids[:8].tolist(), max_new_tokens=16).output_ids, 16)


# ---- the release's format: FP8 layers (E8M0 a block), MXFP4 routed experts ---------------------

FP8_LAYERS = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight",
              ".attn.wo_b.weight", ".shared_experts.w1.weight", ".shared_experts.w2.weight",
              ".shared_experts.w3.weight", ".attn.indexer.wq_b.weight")
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def fp8_blocks(w: np.ndarray, b: int):
    """w [N, K] -> (E4M3 tensor, E8M0 tensor [N / b, K / b] rounded up, the values they hold)."""
    import torch
    n, k = w.shape
    pad = np.zeros((-(-n // b) * b, -(-k // b) * b), np.float32)
    pad[:n, :k] = w
    amax = np.abs(pad.reshape(pad.shape[0] // b, b, -1, b)).max(axis=(1, 3))
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / 448)).astype(np.int32)
    scale = np.repeat(np.repeat(np.exp2(e).astype(np.float32), b, 0), b, 1)[:n, :k]
    q = torch.tensor(w / scale).to(torch.float8_e4m3fn)
    return q, torch.tensor((e + 127).astype(np.uint8)).view(torch.float8_e8m0fnu), q.float().numpy() * scale


def mxfp4(w: np.ndarray):
    """w [N, K] -> (int8 [N, K / 2] E2M1 pairs, low nibble first; E8M0 [N, K / 32]; the values)."""
    import torch
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    e = np.ceil(np.log2(np.maximum(np.abs(g).max(-1), 1e-30) / 6)).astype(np.int32)
    x = g / np.exp2(e)[..., None]
    idx = np.abs(x[..., None] - E2M1).argmin(-1).astype(np.uint8).reshape(n, k)
    vals = (E2M1[idx].reshape(n, k // 32, 32) * np.exp2(e)[..., None]).reshape(n, k)
    packed = (idx[:, 0::2] | (idx[:, 1::2] << 4)).astype(np.uint8)
    return (torch.tensor(packed.view(np.int8)), torch.tensor((e + 127).astype(np.uint8)).view(torch.float8_e8m0fnu),
            vals.astype(np.float32))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny model (experts 32 wide: MXFP4 groups) in the release's format with its config's
    older fields (compress_ratios a layer and one for the MTP layer, num_hash_layers,
    qk_rope_head_dim, YaRN in rope_scaling), and transformers on the values it holds."""
    import torch
    import transformers as tf
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("v4_release")
    yarn = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16, "beta_fast": 32,
            "beta_slow": 1}
    build(d / "src", moe_intermediate_size=32, rope_parameters=None, rope_scaling=yarn)
    tensors = {k: v.numpy() for k, v in load_file(d / "src" / "model.safetensors").items()}
    cfg = json.loads((d / "src" / "config.json").read_text())
    held, out = {}, {}
    for k, v in tensors.items():
        if k.endswith(FP8_LAYERS):
            out[k], out[k[:-len("weight")] + "scale"], held[k] = fp8_blocks(v, 16)
        elif ".ffn.experts." in k:
            out[k], out[k[:-len("weight")] + "scale"], held[k] = mxfp4(v)
        else:
            out[k], held[k] = torch.tensor(v), v
    (d / "dq").mkdir()
    save_file({k: torch.tensor(v) for k, v in held.items()}, str(d / "dq" / "model.safetensors"))
    (d / "dq" / "config.json").write_text(json.dumps(cfg))
    (d / "rel").mkdir()
    save_file(out, str(d / "rel" / "model.safetensors"))
    older = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                       "rope_parameters", "partial_rotary_factor")}
    older.update(compress_ratios=[0, 4, 8, 4, 0], compress_rate_hca=8, num_hash_layers=1,
                 qk_rope_head_dim=8, rope_scaling=yarn, expert_dtype="fp4",
                 quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "scale_fmt": "ue8m0", "weight_block_size": [16, 16]})
    (d / "rel" / "config.json").write_text(json.dumps(older))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / "rel" / f).write_bytes((d / "src" / f).read_bytes())
    ref = tf.AutoModelForCausalLM.from_pretrained(d / "dq", dtype=torch.float32).eval()
    return d / "rel", ref


def test_release_format_matches_transformers(release, tmp_path, capfd):
    """FP8 layers and MXFP4 experts dequantized on read; packed, the experts' E2M1 bytes kept."""
    import torch

    from engine.pack import pack
    rel, ref = release
    c = family_of(json.loads((rel / "config.json").read_text())).config
    assert c.rates == (0, 4, 8, 4) and c.hash_layers == (0,) and c.compress_rope.kind == "yarn"
    ids = np.random.default_rng().integers(0, 300, 25)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    m = engine.load(rel, device="cpu")
    assert "MXFP4 experts are built when first read" in capfd.readouterr().err
    assert rel_err(m.logits(ids), want) < 1e-4
    pack(rel, tmp_path / "p", "nvfp4", progress=False)
    assert rel_err(engine.load(tmp_path / "p", device="cpu").logits(ids), want) < 1e-4


def test_mxfp4_scale_shape_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from loader.checkpoint import Checkpoint, CheckpointError
    save_file({"w.weight": torch.zeros(4, 32, dtype=torch.int8),
               "w.scale": torch.zeros(4, 3, dtype=torch.uint8).view(torch.float8_e8m0fnu)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tensor w.scale has shape \[4, 3\]; expected \[4, 2\] "
                                              r"\(one E8M0 scale a 32 values of w.weight, 4 x 64 in MXFP4\)"):
        Checkpoint(tmp_path)


def test_bf16_cache_rounds_the_key_rows(tiny):
    """kv_cache="bf16": the key (= value) rows stored rounded, as the other families' are."""
    from kernels_numba.cpu import round_bf16
    m = engine.load(tiny[0], device="cpu", kv_cache="bf16").model
    st = m.new_state(16)
    m.forward(np.random.default_rng().integers(0, 300, 9), st)
    assert np.array_equal(st.k, round_bf16(st.k)) and np.all(np.any(st.k, axis=-1))


def test_state_bytes_per_token(tiny):
    """A token at position 15 (16 positions): 6 window rows a layer; layer 1 (CSA, m 4) its 3
    picks of 4 entries and 4 indexer keys; layer 2 (HCA, m 8) both entries; layer 3 as layer 1."""
    m = engine.load(tiny[0], device="cpu")
    d, di = 32, 16
    want = 4 * (4 * 6 * d + 2 * (3 * d + 4 * di) + 2 * d)
    assert m.state_bytes_per_token(15, 1) == want


def test_builtin_chat_template(tiny):
    """The release ships no Jinja template: the built-in one renders its encoder's format."""
    from engine.tokenizer import TemplateError
    tok = engine.load(tiny[0], device="cpu").tokenizer
    bos, eos, user, asst = ("<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
                            "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    head = f"{bos}S{user}Hi{asst}</think>Hello{eos}{user}Bye"
    assert tok.apply_chat_template(msgs) == head + f"{asst}</think>"
    assert tok.apply_chat_template(msgs, enable_thinking=True) == head + f"{asst}<think>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == head
    # a run of user / tool messages is one turn; an answer after the last one keeps its reasoning
    more = msgs + [{"role": "tool", "content": "R"}, {"role": "assistant", "content": "A",
                                                     "reasoning_content": "why"}]
    assert tok.apply_chat_template(more, add_generation_prompt=False, enable_thinking=True) == \
        head + f"\n\n<tool_result>R</tool_result>{asst}<think>why</think>A{eos}"
    with pytest.raises(TemplateError, match="tool definitions are not rendered"):
        tok.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "f"}}])
