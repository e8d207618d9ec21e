"""NVFP4 checkpoints in ModelOpt's layout (uint8 `weight` of packed E2M1 pairs, F8_E4M3
`weight_scale` a 16 values, float32 `weight_scale_2` multiplying) and in compressed-tensors'
("nvfp4-pack-quantized": `weight_packed`, `weight_scale`, `weight_global_scale` dividing): read
directly and packed, against transformers on the same weights dequantized by torch
(transformers reads neither without a GPU or the compressed-tensors package); packed into an
nvfp4 arena the checkpoint's bytes are kept as they are; bad NVFP4 input refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
from conftest import build_hf_model, check_against, copy_config
from engine.names import expert_names
from loader.arena import ARENA_NAME
from loader.checkpoint import Checkpoint, CheckpointError
from loader.layout import ExpertLayout
from loader.quant import decode_expert_block, quantize_nvfp4

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# layout -> (suffix of the values, of the global scale, the quantization_config)
LAYOUTS = {
    "modelopt": ("", "_scale_2", {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                  "group_size": 16, "exclude_modules": ["lm_head"]}),
    "compressed-tensors": ("_packed", "_global_scale", {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                        "group_size": 16, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                  "group_size": 16, "dynamic": "local"}}},
        "ignore": ["lm_head", "re:.*mlp.gate$"]}),
}
SIDE = ("_scale", "_scale_2", "_global_scale", "input_scale", "input_global_scale")


def write_nvfp4(src, dst, drop=None, layout="modelopt"):
    """The float32 checkpoint in src as an NVFP4 checkpoint in dst in the layout named (drop: a
    tensor name left out). compressed-tensors stores the global scale's reciprocal and divides
    by it, as its own dequantize does."""
    vals, glob, qc = LAYOUTS[layout]
    dst.mkdir()
    out = {}
    for name, w in load_file(src / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            q, s, g = quantize_nvfp4(w.numpy(), name)
            out[name + vals] = torch.from_numpy(q)
            out[name + "_scale"] = torch.from_numpy(s).view(torch.float8_e4m3fn)
            inv = layout == "compressed-tensors"
            out[name + glob] = torch.tensor([np.float32(1) / np.float32(g)] if inv else np.float32(g))
            out[name[:-len("weight")] + ("input_global_scale" if inv else "input_scale")] = \
                torch.tensor([100.0] if inv else 0.01)
        else:
            out[name] = w.to(torch.bfloat16)
    for n in [drop] if drop else []:
        del out[n]
    save_file(out, dst / "model.safetensors")
    copy_config(src, dst, dtype="bfloat16", quantization_config=qc)


def torch_dequant(q, s, g, divide=False):
    """An independent oracle: E2M1 pairs (low nibble first) * E4M3 scale a 16, times the global
    scale (ModelOpt) or over it (compressed-tensors)."""
    q = q.to(torch.int64)
    vals = torch.stack([E2M1[q & 0xF], E2M1[q >> 4]], dim=-1).reshape(q.shape[0], -1)
    scale = s.float().repeat_interleave(16, 1)
    return vals * (scale / g.float() if divide else scale * g.float())


def dequantized_copy(src, dst, exact_experts=False):
    """src's weights dequantized into a plain checkpoint: bf16, or the experts' float32 (exact:
    what an nvfp4 arena holding the checkpoint's bytes computes with)."""
    dst.mkdir()
    raw = load_file(src / "model.safetensors")
    out = {}
    for name, t in raw.items():
        if name.endswith(SIDE):
            continue
        if t.dtype == torch.uint8:
            ct = name.endswith("_packed")
            name = name.removesuffix("_packed")
            t = torch_dequant(t, raw[name + "_scale"],
                              raw[name + ("_global_scale" if ct else "_scale_2")], divide=ct)
            t = t if exact_experts and ".experts." in name else t.to(torch.bfloat16)
        out[name] = t
    save_file(out, dst / "model.safetensors")
    copy_config(src, dst, quantization_config=None)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def nvfp4_model(tmp_path_factory, request):
    base = tmp_path_factory.mktemp("nvfp4")
    build_hf_model(base / "f32", "qwen3_moe")
    write_nvfp4(base / "f32", base / "nvfp4", layout=request.param)
    dequantized_copy(base / "nvfp4", base / "bf16")
    dequantized_copy(base / "nvfp4", base / "exact", exact_experts=True)
    import transformers as tf
    load = tf.AutoModelForCausalLM.from_pretrained
    return (base / "nvfp4", load(base / "bf16", dtype=torch.bfloat16).float().eval(),
            load(base / "exact", dtype=torch.float32).eval())


def test_nvfp4_checkpoint_matches_transformers(nvfp4_model):
    path, ref, _ = nvfp4_model
    ck = Checkpoint(path)
    assert ck.nvfp4 and not any(n.endswith(SIDE + ("_packed",)) for n in ck.tensors)
    name = "model.layers.0.self_attn.o_proj.weight"
    assert ck.info(name).shape == (48, 64) and ck.get(name).shape == (48, 64)
    check_against(ref, engine.load(path, device="cpu"))


def test_nvfp4_packed_keeps_the_bytes(nvfp4_model, tmp_path):
    from engine.pack import pack
    path, _, ref = nvfp4_model
    dst = tmp_path / "packed"
    manifest = pack(path, dst, experts="nvfp4", progress=False)
    assert manifest["source_quantization"] == json.loads((path / "config.json").read_text())[
        "quantization_config"]
    ck = Checkpoint(path)
    layout = ExpertLayout.build("nvfp4", 48, 32)
    raw = np.fromfile(dst / ARENA_NAME, np.uint8)
    rec = next(r for r in manifest["blocks"] if (r["layer"], r["expert"]) == (1, 2))
    block = raw[rec["offset"]:rec["offset"] + layout.block_bytes]
    for m, n, got in zip(("gate", "up", "down"), expert_names("qwen3_moe", 1, 2),
                         decode_expert_block(block, layout)):
        q, s, g = ck.nvfp4_parts(n)
        qo, so = getattr(layout, m + "_q"), getattr(layout, m + "_s")
        assert np.array_equal(block[qo:qo + q.nbytes], q.reshape(-1)), m
        assert np.array_equal(block[so:so + s.nbytes], s.reshape(-1)), m
        assert np.array_equal(got, ck.get_f32(n)), m
    check_against(ref, engine.load(dst, device="cpu"))


def test_nvfp4_errors(tmp_path):
    build_hf_model(tmp_path / "f32", "qwen3_moe")
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    write_nvfp4(tmp_path / "f32", tmp_path / "noglobal", drop=name + "_scale_2")
    with pytest.raises(CheckpointError, match=f"NVFP4 tensor {name} needs {name}_scale_2.*"
                                              "missing"):
        Checkpoint(tmp_path / "noglobal")

    write_nvfp4(tmp_path / "f32", tmp_path / "bad")
    raw = load_file(tmp_path / "bad" / "model.safetensors")
    raw[name + "_scale"] = raw[name + "_scale"][:, :1].contiguous()   # one scale a row
    save_file(raw, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{name}_scale has shape \[48, 1\]; expected "
                                              r"\[48, 2\]"):
        Checkpoint(tmp_path / "bad")

    # ModelOpt's older hf_quant_config shape (quant_algo nested under "quantization") reads too
    write_nvfp4(tmp_path / "f32", tmp_path / "nested")
    cfg = json.loads((tmp_path / "nested" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt",
                                  "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    (tmp_path / "nested" / "config.json").write_text(json.dumps(cfg))
    assert Checkpoint(tmp_path / "nested").nvfp4

    # a NaN block scale: refused when read or packed, naming the tensor
    raw = load_file(tmp_path / "nested" / "model.safetensors")
    bad = raw[name + "_scale"].view(torch.uint8).clone()
    bad[3, 1] = 0xFF
    raw[name + "_scale"] = bad.view(torch.float8_e4m3fn)
    save_file(raw, tmp_path / "nested" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name}_scale: 1 NaN E4M3 scale"):
        Checkpoint(tmp_path / "nested").nvfp4_parts(name)

    cfg = json.loads((tmp_path / "noglobal" / "config.json").read_text())
    cfg["quantization_config"]["quant_algo"] = "W4A8_AWQ"
    (tmp_path / "noglobal" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_algo is 'W4A8_AWQ'"):
        Checkpoint(tmp_path / "noglobal")


def test_compressed_tensors_nvfp4_errors(tmp_path):
    build_hf_model(tmp_path / "f32", "qwen3_moe")
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    write_nvfp4(tmp_path / "f32", tmp_path / "noglobal", drop=name + "_global_scale",
                layout="compressed-tensors")
    with pytest.raises(CheckpointError, match=f"NVFP4 tensor {name}_packed needs "
                                              f"{name}_global_scale.*missing"):
        Checkpoint(tmp_path / "noglobal")

    write_nvfp4(tmp_path / "f32", tmp_path / "ct", layout="compressed-tensors")
    ck = Checkpoint(tmp_path / "ct")
    assert name in ck.nvfp4 and ck.info(name).shape == (32, 48)
    raw = load_file(tmp_path / "ct" / "model.safetensors")
    q, s, g = ck.nvfp4_parts(name)   # the arena's global multiplies: the stored one's reciprocal
    assert np.float32(g) == np.float32(1) / raw[name + "_global_scale"].numpy()[0]
    raw[name + "_global_scale"] = torch.tensor([0.0])
    save_file(raw, tmp_path / "ct" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name}_global_scale is 0.0, expected a finite "
                                              "non-zero global scale"):
        Checkpoint(tmp_path / "ct").nvfp4_parts(name)

    cfg = json.loads((tmp_path / "noglobal" / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["weights"]["group_size"] = 32
    (tmp_path / "noglobal" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="group_0.weights.group_size is 32; NVFP4 has one "
                                              "scale a 16 values"):
        Checkpoint(tmp_path / "noglobal")
    group["weights"].update(group_size=128, type="int")   # W4A16 int4 in the nvfp4 format
    (tmp_path / "noglobal" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"group_0.weights is 4-bit int "
                                              r"\(nvfp4-pack-quantized\)"):
        Checkpoint(tmp_path / "noglobal")
    # a mixed-precision checkpoint reads each group by its own format
    cfg["quantization_config"]["format"] = "mixed-precision"
    group["weights"].update(group_size=16, type="float")
    group["format"] = "nvfp4-pack-quantized"
    (tmp_path / "noglobal" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"{name}_global_scale"):   # past the config
        Checkpoint(tmp_path / "noglobal")


def test_compressed_tensors_reads_as_its_own_decompressor(tmp_path):
    """Every NVFP4 weight of a compressed-tensors checkpoint reads as compressed-tensors' own
    NVFP4PackedCompressor decompresses it (its bf16 result: within one bf16 rounding, since it
    divides by the global scale where the engine multiplies by its reciprocal)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    build_hf_model(tmp_path / "f32", "qwen3_moe")
    write_nvfp4(tmp_path / "f32", tmp_path / "ct", layout="compressed-tensors")
    qc = LAYOUTS["compressed-tensors"][2]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=qc["targets"], weights=QuantizationArgs(**qc["weights"]))
    raw = load_file(tmp_path / "ct" / "model.safetensors")
    ck = Checkpoint(tmp_path / "ct")
    names = [n[:-len("_packed")] for n in raw if n.endswith("weight_packed")]
    assert len(names) == len(ck.nvfp4) > 0
    for name in names:
        local = {"weight" + x: raw[name + x] for x in ("_packed", "_scale", "_global_scale")}
        want = NVFP4PackedCompressor.decompress(local, scheme)["weight"].float().numpy()
        got = ck.get_f32(name)
        assert got.shape == want.shape
        assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want)), name


@pytest.mark.gpu
def test_compressed_tensors_packed_on_cuda(nvfp4_model, tmp_path):
    """An NVFP4 checkpoint's bytes in an arena (the compressed-tensors global stored as its
    reciprocal) on cuda: the exact reference's logits and tokens."""
    from engine.pack import pack
    path, _, ref = nvfp4_model
    pack(path, tmp_path / "packed", experts="nvfp4", progress=False)
    check_against(ref, engine.load(tmp_path / "packed", device="cuda"))
