"""Block-scaled FP8 checkpoints (quant_method "fp8": an F8_E4M3 weight beside a float32
`weight_scale_inv` a block, the layout of Qwen's -FP8 releases) against transformers loading the
same FP8 folder (without a GPU it dequantizes to the model dtype): logits and greedy tokens, read
directly and packed; the dequantizer against torch's float8 on fresh random bits; bad FP8 input
refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
from conftest import build_hf_model, check_against, copy_config
from loader.checkpoint import Checkpoint, CheckpointError
from loader.quant import dequant_fp8_blocks

# the projections Qwen's and MiniMax's FP8 releases quantize (MiniMax's experts: w1 / w2 / w3);
# router, norms, embedding and head stay bf16
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "w1", "w2", "w3")


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w float32 [R, K] (R, K multiples of the block) -> (float8_e4m3fn [R, K], scale_inv
    float32 [R / bn, K / bk]) with w ~ q * scale_inv, scale_inv = max|block| / 448."""
    r, k = w.shape
    blocks = w.reshape(r // bn, bn, k // bk, bk)
    s = blocks.abs().amax(dim=(1, 3)) / 448.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = (blocks / s[:, None, :, None]).reshape(r, k).to(torch.float8_e4m3fn)
    return q, s.float()


def write_fp8(src, dst, block=(16, 16), scale_dtype=torch.float32, drop_scale=None,
              scheme="block"):
    """The float32 checkpoint in src as an FP8 checkpoint in dst: scheme "block" (quant_method
    fp8, weight_scale_inv a block), "channel" (compressed-tensors, weight_scale [N, 1]) or
    "tensor" (AutoFP8's quant_method fp8: one weight_scale, and an input_scale)."""
    dst.mkdir()
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            r, k = w.shape
            q, s = quantize_blocks(w, *{"block": block, "channel": (1, k),
                                        "tensor": (r, k)}[scheme])
            tensors[name] = q
            suffix = "_scale_inv" if scheme == "block" else "_scale"
            if scheme == "tensor":
                s = s.reshape(())
                tensors[name[:-len("weight")] + "input_scale"] = torch.tensor(0.02)
            if name != drop_scale:
                tensors[name + suffix] = s.to(scale_dtype)
        else:
            tensors[name] = w.to(torch.bfloat16)
    save_file(tensors, dst / "model.safetensors")
    copy_config(src, dst, dtype="bfloat16", quantization_config={
        "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": list(block)},
        "tensor": {"quant_method": "fp8", "activation_scheme": "static"},
        "channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                    "symmetric": True, "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float",
                                              "strategy": "token", "dynamic": True}}},
                    "ignore": ["lm_head", "re:.*mlp.gate$"]},
    }[scheme])


def dequantized_copy(src, dst):
    """src (an FP8 folder) as a bf16 checkpoint in dst, dequantized here by torch: q * scale
    broadcast over its block, rounded to bf16."""
    dst.mkdir()
    raw = load_file(src / "model.safetensors")
    out = {}
    for name, t in raw.items():
        if name.endswith(("_scale", "_scale_inv", "input_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = raw.get(name + "_scale_inv", raw.get(name + "_scale")).float()
            s = s.reshape((1, 1) if s.dim() == 0 else s.shape)
            bn, bk = -(-t.shape[0] // s.shape[0]), -(-t.shape[1] // s.shape[1])
            s = s.repeat_interleave(bn, 0)[:t.shape[0]].repeat_interleave(bk, 1)[:, :t.shape[1]]
            t = (t.float() * s).to(torch.bfloat16)
        out[name] = t
    save_file(out, dst / "model.safetensors")
    copy_config(src, dst, quantization_config=None)


def tf_reference(path):
    """transformers on the folder in bf16 (an FP8 one dequantized to bf16 on load), run in
    float32."""
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().eval()


fp8_reference = tf_reference


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    build_hf_model(base / "f32", "qwen3_moe")
    write_fp8(base / "f32", base / "fp8")
    return base / "fp8"


def test_fp8_checkpoint_matches_transformers(fp8_model):
    ck = Checkpoint(fp8_model)
    assert ck.fp8 and not any(n.endswith("_scale_inv") for n in ck.tensors)
    check_against(fp8_reference(fp8_model), engine.load(fp8_model, device="cpu"))


def test_minimax_m2_fp8_release_matches_transformers(tmp_path):
    """MiniMax-M2's release layout: Mixtral-named experts (w1 / w2 / w3) in 128-blocks of FP8."""
    build_hf_model(tmp_path / "f32", "minimax_m2", hidden_size=128, intermediate_size=256,
                   head_dim=32, num_key_value_heads=4)
    write_fp8(tmp_path / "f32", tmp_path / "fp8", block=(128, 128))
    assert Checkpoint(tmp_path / "fp8").fp8
    check_against(fp8_reference(tmp_path / "fp8"), engine.load(tmp_path / "fp8", device="cpu"))


def test_fp8_checkpoint_packed_matches_transformers(fp8_model, tmp_path):
    from engine.pack import pack
    dst = tmp_path / "packed"
    manifest = pack(fp8_model, dst, experts="bf16", progress=False)
    assert manifest["source_quantization"]["quant_method"] == "fp8"
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    check_against(fp8_reference(fp8_model), engine.load(dst, device="cpu"))


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_fp8_scaled_checkpoints_match_transformers(tmp_path, scheme):
    """compressed-tensors FP8 (a scale a channel) and AutoFP8 (a scale a tensor, static input
    scales): against transformers on the same weights dequantized by torch (transformers reads
    these only through the compressed-tensors package or a GPU)."""
    build_hf_model(tmp_path / "f32", "qwen3_moe")
    write_fp8(tmp_path / "f32", tmp_path / "fp8", scheme=scheme)
    dequantized_copy(tmp_path / "fp8", tmp_path / "bf16")
    ck = Checkpoint(tmp_path / "fp8")
    assert ck.fp8 and not any(n.endswith(("_scale", "input_scale")) for n in ck.tensors)
    ref = tf_reference(tmp_path / "bf16")
    check_against(ref, engine.load(tmp_path / "fp8", device="cpu"))


def test_fp8_block_oracle_agrees_with_transformers(fp8_model, tmp_path):
    """The torch dequantization the scale tests rely on gives transformers' own weights."""
    dequantized_copy(fp8_model, tmp_path / "bf16")
    a, b = fp8_reference(fp8_model), tf_reference(tmp_path / "bf16")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


@pytest.mark.parametrize("r,k,bn,bk", [(48, 64, 16, 16), (50, 70, 16, 32), (7, 5, 128, 128)])
def test_dequant_blocks_against_torch(r, k, bn, bk):
    rng = np.random.default_rng()
    bits = rng.integers(0, 256, (r, k), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C   # no NaN codes
    gr, gk = -(-r // bn), -(-k // bk)
    s = (rng.random((gr, gk)) * 0.1 + 1e-3).astype(np.float32)
    want = torch.from_numpy(bits).view(torch.float8_e4m3fn).float()
    scale = torch.from_numpy(s).repeat_interleave(bn, 0)[:r].repeat_interleave(bk, 1)[:, :k]
    got = dequant_fp8_blocks(bits, s, (bn, bk))
    assert got.dtype == np.float32 and np.array_equal(got, (want * scale).numpy())


def test_fp8_bf16_scales_read(tmp_path):
    build_hf_model(tmp_path / "f32", "qwen3_moe")
    write_fp8(tmp_path / "f32", tmp_path / "fp8", block=(8, 16), scale_dtype=torch.bfloat16)
    ck = Checkpoint(tmp_path / "fp8")
    name = "model.layers.0.self_attn.q_proj.weight"
    raw = load_file(tmp_path / "fp8" / "model.safetensors")
    q = raw[name].float()
    s = raw[name + "_scale_inv"].float()
    want = q * s.repeat_interleave(8, 0).repeat_interleave(16, 1)
    assert np.array_equal(ck.get_f32(name), want.numpy())
    assert np.array_equal(ck.get(name), want.to(torch.bfloat16).view(torch.int16).numpy()
                          .view(np.uint16))


def test_fp8_errors(tmp_path):
    build_hf_model(tmp_path / "f32", "qwen3_moe")
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    write_fp8(tmp_path / "f32", tmp_path / "noscale", drop_scale=name)
    with pytest.raises(CheckpointError, match=fr"{name} is FP8.*_scale\) is missing"):
        Checkpoint(tmp_path / "noscale")

    write_fp8(tmp_path / "f32", tmp_path / "grid", block=(16, 16))
    cfg = json.loads((tmp_path / "grid" / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [32, 16]   # disagrees with the scales
    (tmp_path / "grid" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"_scale_inv has shape \[\d+, \d+\]; expected"):
        Checkpoint(tmp_path / "grid")

    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "marlin-24",
                                  "config_groups": {"group_0": {"weights": {"num_bits": 4,
                                                                            "type": "int"}}}}
    (tmp_path / "grid" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization_config.format is 'marlin-24'"):
        Checkpoint(tmp_path / "grid")
    cfg["quantization_config"]["format"] = "float-quantized"
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"
    (tmp_path / "grid" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config_groups.group_0.weights is 4-bit float "
                                              r"\(float-quantized\)"):
        Checkpoint(tmp_path / "grid")

    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mixed-precision",
                                  "config_groups": {}}
    (tmp_path / "grid" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization_config.format is 'mixed-precision'"):
        Checkpoint(tmp_path / "grid")

    cfg["quantization_config"] = {"quant_method": "hqq", "bits": 4}
    (tmp_path / "grid" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: quantization_config.quant_method is "
                                              "'hqq'"):
        Checkpoint(tmp_path / "grid")

    # a NaN code in the stored weight: refused when read, naming the tensor
    write_fp8(tmp_path / "f32", tmp_path / "nan")
    raw = load_file(tmp_path / "nan" / "model.safetensors")
    bad = raw[name].view(torch.uint8).clone()
    bad[0, 0] = 0x7F
    raw[name] = bad.view(torch.float8_e4m3fn)
    save_file(raw, tmp_path / "nan" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name}: 1 NaN"):
        Checkpoint(tmp_path / "nan").get(name)
