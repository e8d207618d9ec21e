"""gpt-oss beyond parity (tests/test_parity.py): the cpu backend only, by name; config refusals;
the per-expert copies of its fused, transposed expert tensors; packed arenas (bf16, fp8, NVFP4,
and MXFP4 experts kept exactly in NVFP4) against transformers."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from conftest import build_hf_model
from loader.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    return d, build_hf_model(d, "gpt_oss")


def test_auto_picks_cuda_where_a_gpu_works(monkeypatch, capfd):
    """gpt-oss runs on the cuda backend (its simulator check: tests/test_families_cuda.py)."""
    from engine import runtime
    monkeypatch.setattr(runtime, "cuda_status", lambda: (True, ""))
    assert runtime.pick_device("auto", "gpt_oss") == "cuda"
    assert runtime.pick_device("cuda", "gpt_oss") == "cuda"
    monkeypatch.setattr(runtime, "cuda_status", lambda: (False, "no working CUDA GPU found"))
    assert runtime.pick_device("auto", "gpt_oss") == "cpu"
    assert "device auto: using cpu (no working CUDA GPU found)" in capfd.readouterr().err


def fused_from_arena(ref, packed):
    """ref (a transformers gpt-oss) with each expert's gate / up / down replaced by what the
    packed arena holds, decoded, written back into the fused transposed tensors."""
    import torch

    from loader.arena import ArenaFile
    from loader.quant import decode_expert_block
    arena = ArenaFile.from_manifest(json.loads((packed / "manifest.json").read_text()), packed)
    with torch.no_grad():
        for rec in arena.records:
            l, e = rec["layer"], rec["expert"]
            g, u, d = decode_expert_block(arena.read_block(l, e), arena.layout)
            ex = ref.model.layers[l].mlp.experts
            ex.gate_up_proj[e, :, 0::2] = torch.from_numpy(g.T)
            ex.gate_up_proj[e, :, 1::2] = torch.from_numpy(u.T)
            ex.down_proj[e] = torch.from_numpy(d.T)
    arena.close()
    return ref


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_packed_matches_transformers(tiny, tmp_path, fmt):
    """Packed into each arena format (biases and sinks with the dense weights), against
    transformers holding the arena's decoded experts; bf16 keeps the float32 checkpoint's
    tokens to within bf16 (so the reference there is the checkpoint itself, rounded)."""
    from conftest import check_against, hf_reference
    from engine.pack import pack
    d, _ = tiny
    man = pack(d, tmp_path / "packed", experts=fmt, progress=False)
    assert man["model_type"] == "gpt_oss" and man["experts"]["format"] == fmt
    m = engine.load(tmp_path / "packed", device="cpu")
    assert m.device == "cpu"
    check_against(fused_from_arena(hf_reference(d), tmp_path / "packed"), m)


def test_mxfp4_packed_into_nvfp4_exactly(tmp_path):
    """An MXFP4 checkpoint packed with --experts nvfp4 keeps its E2M1 bytes, and every expert
    decodes to exactly transformers' dequantized weights (so the arena model matches the
    unpacked one); scales more than 17 binades apart cannot be kept so."""
    from conftest import check_against
    from engine.names import expert_names
    from engine.pack import pack
    from loader.quant import dequant_mxfp4, nvfp4_from_mxfp4
    src = tmp_path / "mxfp4"
    ref, _ = write_mxfp4_model(tmp_path, src, np.random.default_rng())
    man = pack(src, tmp_path / "packed", experts="nvfp4", progress=False)
    assert man["source_quantization"] == {"quant_method": "mxfp4"}
    ck = Checkpoint(src)
    from loader.arena import ArenaFile
    from loader.quant import decode_expert_block
    arena = ArenaFile.from_manifest(man, tmp_path / "packed")
    for rec in arena.records:
        l, e = rec["layer"], rec["expert"]
        for n, got in zip(expert_names("gpt_oss", l, e),
                          decode_expert_block(arena.read_block(l, e), arena.layout)):
            blocks, scales = ck.mxfp4_parts(n)
            assert np.array_equal(got, dequant_mxfp4(blocks, scales)), (l, e, n)
    arena.close()
    check_against(ref, engine.load(tmp_path / "packed", device="cpu"))

    rng = np.random.default_rng()
    blocks, scales = random_mxfp4(rng, 1, 6, 64, 118, 126)
    scales[0, :, 0] = 126
    scales[0, 2, 1], scales[0, 3, 1] = 100, 109          # 26 binades under the largest; 17
    blocks[0, 2, 1, 0] = blocks[0, 3, 1, 0] = 0x61       # non-zero values in both groups
    assert nvfp4_from_mxfp4(blocks[0], scales[0]) is None
    blocks[0, 2, 1] = 0                                  # all zeros: any scale will do
    q, s, g = nvfp4_from_mxfp4(blocks[0], scales[0])
    assert s[3, 2] == 0x01                               # 2^-9, E4M3's least subnormal
    from loader.quant import dequant_nvfp4
    assert np.array_equal(dequant_nvfp4(q, s, g, 64), dequant_mxfp4(blocks[0], scales[0]))


def test_expert_copies_match_the_fused_tensors(tiny):
    """gate / up: the even / odd columns of gate_up_proj [E, H, 2I], transposed to [I, H]."""
    d, hf = tiny
    ck = Checkpoint(d)
    experts = hf.model.layers[1].mlp.experts
    gu, gub = experts.gate_up_proj.detach().numpy(), experts.gate_up_proj_bias.detach().numpy()
    dn, dnb = experts.down_proj.detach().numpy(), experts.down_proj_bias.detach().numpy()
    e = int(np.random.default_rng().integers(gu.shape[0]))
    p = f"model.layers.1.mlp.experts.{e}."
    assert np.array_equal(ck.get(p + "gate_proj.weight"), gu[e][:, 0::2].T)
    assert np.array_equal(ck.get(p + "up_proj.weight"), gu[e][:, 1::2].T)
    assert np.array_equal(ck.get(p + "down_proj.weight"), dn[e].T)
    assert np.array_equal(ck.get(p + "gate_proj.bias"), gub[e][0::2])
    assert np.array_equal(ck.get(p + "up_proj.bias"), gub[e][1::2])
    assert np.array_equal(ck.get(p + "down_proj.bias"), dnb[e])


def test_config_refusals(tiny):
    from engine.models import family_of
    from engine.models.rope import ConfigError
    d, _ = tiny
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(ConfigError, match="layer_types must list 3 of sliding_attention"):
        family_of({**cfg, "layer_types": ["sliding_attention", "chunked_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="sliding_window is None"):
        family_of({**cfg, "sliding_window": None})
    c = family_of({**cfg, "layer_types": None}).config   # transformers' default: odd layers full
    assert c.layer_windows == (3, 0, 3)
    # fields left out take transformers' GptOssConfig defaults
    import transformers as tf
    bare = {k: v for k, v in cfg.items() if k not in ("head_dim", "sliding_window")}
    c, hf = family_of(bare).config, tf.GptOssConfig(**bare)
    assert c.head_dim == hf.head_dim and max(c.layer_windows) == hf.sliding_window


def random_mxfp4(rng, e, n, k, lo=0, hi=254):
    """Random MXFP4 blocks uint8 [e, n, k / 32, 16] and E8M0 scales uint8 [e, n, k / 32]."""
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    return blocks, rng.integers(lo, hi + 1, (e, n, k // 32), dtype=np.uint8)


def test_mxfp4_dequant_matches_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from loader.quant import dequant_mxfp4
    rng = np.random.default_rng()
    blocks, scales = random_mxfp4(rng, 3, 10, 96)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()          # [E, K, N]
    got = np.stack([dequant_mxfp4(blocks[e], scales[e]) for e in range(3)])  # [E, N, K]
    assert np.array_equal(got, want.transpose(0, 2, 1))
    bf = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert np.array_equal(got, bf.float().numpy().transpose(0, 2, 1))   # exact in bf16 too


def write_mxfp4_model(tmp_path, dst, rng):
    """A tiny gpt-oss with its experts in MXFP4 (random blocks, scales 2^-5 .. 2^-1) in dst;
    returns transformers holding convert_moe_packed_tensors' weights of them."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from conftest import copy_config, hf_reference
    from loader.st_write import write_safetensors
    src = tmp_path / "f32"
    hf = build_hf_model(src, "gpt_oss", hidden_size=64, intermediate_size=32)   # K: 32s
    c = hf.config
    e, h, i = c.num_local_experts, c.hidden_size, c.intermediate_size
    tensors = {n: p.detach().numpy() for n, p in hf.state_dict().items()
               if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    ref = hf_reference(src)
    for l, layer in enumerate(ref.model.layers):
        for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks, scales = random_mxfp4(rng, e, n, k, 122, 126)
            tensors[f"model.layers.{l}.mlp.experts.{proj}_blocks"] = blocks
            tensors[f"model.layers.{l}.mlp.experts.{proj}_scales"] = scales
            w = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                           dtype=torch.float32)
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(w)
    dst.mkdir()
    write_safetensors(dst / "model.safetensors", tensors)
    copy_config(src, dst, quantization_config={"quant_method": "mxfp4"})
    return ref, tensors


def test_mxfp4_checkpoint_matches_transformers(tmp_path):
    """A tiny model with its experts in MXFP4 (random blocks and scales) against transformers
    holding convert_moe_packed_tensors' weights; a NaN scale is refused by name."""
    from conftest import check_against
    from loader.st_write import write_safetensors
    dst = tmp_path / "mxfp4"
    ref, tensors = write_mxfp4_model(tmp_path, dst, np.random.default_rng())
    check_against(ref, engine.load(dst, device="cpu"))

    tensors["model.layers.2.mlp.experts.down_proj_scales"][1, 5, 0] = 0xFF
    write_safetensors(dst / "model.safetensors", tensors)
    ck = Checkpoint(dst)
    with pytest.raises(Exception, match="down_proj_scales: NaN E8M0 scale"):
        ck.get("model.layers.2.mlp.experts.1.down_proj.weight")


def test_mxfp4_refused_for_other_families(tmp_path):
    from loader.checkpoint import CheckpointError
    build_hf_model(tmp_path, "mixtral")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config":
                                                      {"quant_method": "mxfp4"}}))
    with pytest.raises(CheckpointError, match="'mxfp4' is read for gpt_oss checkpoints only"):
        Checkpoint(tmp_path)


def test_rope_of_the_released_config():
    """The released models' RoPE (transformers' defaults: yarn, factor 32, truncate false,
    theta 150000, head_dim 64) against GptOssRotaryEmbedding."""
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from engine.models import family_of
    hf = tf.GptOssConfig(num_hidden_layers=2, num_local_experts=4)
    emb = GptOssRotaryEmbedding(hf)
    cfg = {**hf.to_dict(), "model_type": "gpt_oss"}
    c = family_of(cfg).config
    assert c.rope.kind == "yarn" and not c.rope.truncate
    assert np.allclose(c.rope.inv_freq(), emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert abs(c.rope.attention_factor - emb.attention_scaling) < 1e-6
    # config.json without rope fields: transformers' defaults apply
    bare = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    assert np.allclose(family_of(bare).config.rope.inv_freq(), emb.inv_freq.numpy(), rtol=1e-6)
    # the hub's config.json spelling: rope_theta beside rope_scaling
    hub = {**bare, "rope_theta": 150000, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}}
    assert np.allclose(family_of(hub).config.rope.inv_freq(), emb.inv_freq.numpy(), rtol=1e-6)


def test_mxfp4_scales_too_far_apart_are_requantized(tmp_path, capfd):
    """An expert whose MXFP4 scales span more than E4M3's 17 binades is re-quantized from its
    values (said on stderr, naming it); the others keep their bytes."""
    from engine.pack import pack
    from loader.arena import ArenaFile
    from loader.quant import encode_matrix
    from loader.st_write import write_safetensors
    src = tmp_path / "mxfp4"
    _, tensors = write_mxfp4_model(tmp_path, src, np.random.default_rng())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name + "_scales"][1, 0, 0], tensors[name + "_scales"][1, 2, 0] = 100, 126
    tensors[name + "_blocks"][1, 0, 0, 0] = tensors[name + "_blocks"][1, 2, 0, 0] = 0x61
    write_safetensors(src / "model.safetensors", tensors)
    man = pack(src, tmp_path / "packed", experts="nvfp4", progress=False)
    assert ("1 MXFP4 expert(s) (first: layer 0, expert 1) hold scales more than 17 binades "
            "apart") in capfd.readouterr().err
    ck = Checkpoint(src)
    arena = ArenaFile.from_manifest(man, tmp_path / "packed")
    lay = arena.layout
    gate = "model.layers.0.mlp.experts.1.gate_proj.weight"
    q, s, g = encode_matrix("nvfp4", ck.get_f32(gate))
    block = arena.read_block(0, 1)
    assert np.array_equal(block[lay.gate_q:lay.gate_q + q.size], q)
    assert np.array_equal(block[lay.gate_s:lay.gate_s + s.size], s)
    blocks, _ = ck.mxfp4_parts("model.layers.0.mlp.experts.0.gate_proj.weight")
    assert np.array_equal(arena.read_block(0, 0)[lay.gate_q:lay.gate_q + blocks.size],
                          blocks.reshape(-1))
    arena.close()
