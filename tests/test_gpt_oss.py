"""gpt-oss beyond parity (tests/test_parity.py): the cpu backend only, by name; config refusals;
the per-expert copies of its fused, transposed expert tensors."""
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


def test_cuda_refused_auto_picks_cpu(tiny, capfd):
    d, _ = tiny
    with pytest.raises(RuntimeError, match="--device cuda: the cuda backend does not run gpt_oss: "
                                           "its expert biases and clamped SwiGLU"):
        engine.load(d, device="cuda")
    m = engine.load(d, device="auto")
    assert m.device == "cpu"
    assert "device auto: using cpu (the cuda backend does not run gpt_oss" in capfd.readouterr().err


def test_pack_refused(tiny, tmp_path):
    from engine.pack import PackError, pack
    d, _ = tiny
    with pytest.raises(PackError, match="gpt_oss cannot be packed: its expert biases"):
        pack(d, tmp_path / "packed", experts="bf16", progress=False)
    assert not (tmp_path / "packed").exists()


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


def test_mxfp4_checkpoint_matches_transformers(tmp_path):
    """A tiny model with its experts in MXFP4 (random blocks and scales) against transformers
    holding convert_moe_packed_tensors' weights; a NaN scale is refused by name."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from conftest import check_against, copy_config, hf_reference
    from loader.st_write import write_safetensors
    src = tmp_path / "f32"
    hf = build_hf_model(src, "gpt_oss", hidden_size=64, intermediate_size=32)   # K: 32s
    c = hf.config
    e, h, i = c.num_local_experts, c.hidden_size, c.intermediate_size
    rng = np.random.default_rng()
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
    dst = tmp_path / "mxfp4"
    dst.mkdir()
    write_safetensors(dst / "model.safetensors", tensors)
    copy_config(src, dst, quantization_config={"quant_method": "mxfp4"})
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
