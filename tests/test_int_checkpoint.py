"""Integer-quantized checkpoints (4- / 8-bit weights, a scale and a zero point a group),
dequantized on read: compressed-tensors 'pack-quantized' (written and read back by
compressed-tensors' own PackedQuantizationCompressor), GPTQ (AutoGPTQ's 'gptq' format, zero points
stored less one, and 'gptq_v2'; act-order g_idx) and AWQ (GEMM packing). Against transformers
on the same weights dequantized; packed into an arena; bad input refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
from conftest import build_hf_model, check_against, copy_config, hf_reference
from loader.checkpoint import Checkpoint, CheckpointError
from loader.quant import AWQ_ORDER

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 16


def quantized_linears(src):
    """(name prefix "...proj.", float32 weight [N, K]) of each linear layer the recipes quantize,
    and the tensors they leave as they are."""
    raw = load_file(src / "model.safetensors")
    lin = {n[:-len("weight")]: w.float() for n, w in raw.items()
           if n.endswith(".weight") and n.split(".")[-2] in QUANTIZED}
    rest = {n: w for n, w in raw.items() if n[:-len("weight")] not in lin}
    return lin, rest


def int_codes(w, bits, sym, group, rng):
    """w [N, K] -> (codes [N, K] int, zeros [N, G] int, scales [N, G] bf16-exact float32):
    unsigned codes 0 .. 2^bits - 1 around a zero point (the middle one when sym). K need not be
    a multiple of group (the last group is short). Some zero points are 0 (GPTQ's 'gptq'
    format stores a zero point less one: 0 as all ones)."""
    n, k = w.shape
    groups = torch.arange(k) // group
    ng = int(groups[-1]) + 1
    top = (1 << bits) - 1
    lo = torch.stack([w[:, groups == j].amin(-1) for j in range(ng)], 1)
    hi = torch.stack([w[:, groups == j].amax(-1) for j in range(ng)], 1)
    if sym:
        s = torch.maximum(lo.abs(), hi.abs()) / (top // 2)
        z = torch.full(s.shape, (top + 1) // 2)
    else:
        lo[:, ::3] = lo[:, ::3].clamp(min=0)   # zero point 0 in every third group
        s = (hi - lo) / top
        z = torch.round(-lo / s).clamp(0, top).long()
    s = s.to(torch.bfloat16).float()
    q = torch.round(w / s[:, groups] + z[:, groups]).clamp(0, top).long()
    return q, z.long(), s


def dequantized(codes, zeros, scales, groups):
    return ((codes - zeros[:, groups]).float() * scales[:, groups])


def write_folder(src, dst, tensors, qc):
    dst.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    copy_config(src, dst, dtype="bfloat16", quantization_config=qc)


def write_reference(src, dst, weights):
    """src's checkpoint with the given weights rounded to bf16 (as the engine reads a
    dequantized weight, and transformers' integer kernels dequantize to half precision): what
    transformers runs as the reference."""
    _, rest = quantized_linears(src)
    dst.mkdir()
    save_file({**{n: w.float() for n, w in rest.items()},
               **{p + "weight": w.to(torch.bfloat16).float() for p, w in weights.items()}},
              dst / "model.safetensors")
    copy_config(src, dst)


def ct_scheme(bits, sym, group=GROUP):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    args = dict(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=group)
    return args, QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))


def write_ct(src, dst, bits, sym, rng, group=GROUP):
    """compressed-tensors 'pack-quantized', each weight compressed by compressed-tensors itself;
    returns its own decompression of each (the reference)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    lin, rest = quantized_linears(src)
    args, scheme = ct_scheme(bits, sym, group)
    out, want = dict(rest), {}
    for p, w in lin.items():
        codes, zeros, scales = int_codes(w, bits, sym, group, rng)
        off = 1 << (bits - 1)   # compressed-tensors' codes are signed: ours less the offset
        w_q = dequantized(codes, zeros, scales, torch.arange(w.shape[1]) // group)
        local = {"weight": w_q, "weight_scale": scales.to(torch.bfloat16)}
        if not sym:
            local["weight_zero_point"] = (zeros - off).to(torch.int8)
        packed = PackedQuantizationCompressor.compress(local, scheme)
        out.update({p + k: v for k, v in packed.items() if k != "weight"})
        want[p] = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    write_folder(src, dst, out, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                 "config_groups": {"group_0": {"targets": ["Linear"],
                                                               "weights": args}},
                                 "ignore": ["lm_head", "re:.*mlp.gate$"]})
    return want


def pack_words(u, bits, axis):
    """Unsigned codes packed into int32 words along axis, value i at bit i * bits."""
    u = np.moveaxis(np.asarray(u, dtype=np.uint32), axis, -1)
    per = 32 // bits
    u = u.reshape(u.shape[:-1] + (u.shape[-1] // per, per))
    words = np.zeros(u.shape[:-1], dtype=np.uint32)
    for i in range(per):
        words |= u[..., i] << np.uint32(bits * i)
    return torch.from_numpy(np.moveaxis(words.view(np.int32), -1, axis).copy())


def write_gptq(src, dst, bits, fmt, act_order, rng, key="checkpoint_format", group=GROUP):
    """GPTQ as AutoGPTQ stores it: qweight [K bits/32, N] packed along K, qzeros [G, N bits/32]
    (less one in the 'gptq' format), scales [G, N] fp16... here bf16-exact, g_idx [K]."""
    lin, rest = quantized_linears(src)
    out, want = dict(rest), {}
    for p, w in lin.items():
        n, k = w.shape
        groups = torch.arange(k) // group
        if act_order:   # columns quantized in another order: each column's group is g_idx
            groups = groups[torch.from_numpy(rng.permutation(k))]
        wg = w[:, torch.argsort(groups, stable=True)]   # the columns of each group together
        codes_g, zeros, scales = int_codes(wg, bits, False, group, rng)
        codes = torch.empty_like(codes_g)
        codes[:, torch.argsort(groups, stable=True)] = codes_g
        want[p] = dequantized(codes, zeros, scales, groups)
        stored_z = (zeros - (1 if fmt == "gptq" else 0)) & ((1 << bits) - 1)
        out[p + "qweight"] = pack_words(codes.T.numpy(), bits, 0)
        out[p + "qzeros"] = pack_words(stored_z.T.numpy(), bits, 1)
        out[p + "scales"] = scales.T.to(torch.float16)
        out[p + "g_idx"] = groups.to(torch.int32)
    write_folder(src, dst, out, {"quant_method": "gptq", "bits": bits, "group_size": group,
                                 "desc_act": act_order, "sym": False, key: fmt})
    return want


def write_awq(src, dst, rng):
    """AWQ (GEMM): qweight [K, N / 8] and qzeros [G, N / 8], nibble i of a word holding column
    AWQ_ORDER[i] of its 8; scales [G, N] fp16."""
    lin, rest = quantized_linears(src)
    out, want = dict(rest), {}
    for p, w in lin.items():
        n, k = w.shape
        codes, zeros, scales = int_codes(w, 4, False, GROUP, rng)
        want[p] = dequantized(codes, zeros, scales, torch.arange(k) // GROUP)
        order = np.concatenate([8 * c + AWQ_ORDER for c in range(n // 8)])
        out[p + "qweight"] = pack_words(codes.T.numpy()[:, order], 4, 1)
        out[p + "qzeros"] = pack_words(zeros.T.numpy()[:, order], 4, 1)
        out[p + "scales"] = scales.T.to(torch.float16)
    write_folder(src, dst, out, {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                 "version": "gemm", "zero_point": True})
    return want


LAYOUTS = {
    "ct-int4-sym": lambda s, d, rng: write_ct(s, d, 4, True, rng),
    "ct-int4-asym": lambda s, d, rng: write_ct(s, d, 4, False, rng),
    "ct-int8-sym": lambda s, d, rng: write_ct(s, d, 8, True, rng),
    "gptq-int4": lambda s, d, rng: write_gptq(s, d, 4, "gptq", False, rng),
    "gptq-int4-act-order-v2": lambda s, d, rng: write_gptq(s, d, 4, "gptq_v2", True, rng),
    "gptq-int8": lambda s, d, rng: write_gptq(s, d, 8, "gptq", False, rng),
    "gptq-v2-as-format": lambda s, d, rng: write_gptq(s, d, 4, "gptq_v2", False, rng, "format"),
    "gptq-groups-of-20": lambda s, d, rng: write_gptq(s, d, 4, "gptq", False, rng, group=20),
    "awq-int4": lambda s, d, rng: write_awq(s, d, rng),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_int_checkpoint_matches_transformers(tmp_path, layout):
    """Each weight reads as the reference dequantizes it (compressed-tensors: its own
    decompressor, bit for bit in bf16), and the model matches transformers on those weights;
    packed with --experts fp8 it matches transformers on the arena's experts."""
    rng = np.random.default_rng()
    src = tmp_path / "f32"
    build_hf_model(src, "qwen3_moe")
    want = LAYOUTS[layout](src, tmp_path / "q", rng)
    ck = Checkpoint(tmp_path / "q")
    assert len(ck.intq) == len(want)
    assert not any(n.endswith(("qweight", "qzeros", "scales", "g_idx", "weight_packed",
                               "weight_scale", "weight_shape", "weight_zero_point"))
                   for n in ck.tensors)
    for p, w in want.items():
        got = ck.get(p + "weight")
        exact = w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, exact), p
    write_reference(src, tmp_path / "ref", want)
    check_against(hf_reference(tmp_path / "ref"), engine.load(tmp_path / "q", device="cpu"))


def test_int4_wrapper_settings_under_text_config(tmp_path):
    """Kimi-K2.5 as released: an image-text wrapper (kimi_k25) whose language model is INT4
    compressed-tensors with its settings under text_config, its tensors under language_model.:
    read, matched against transformers on the dequantized weights, and packed (the settings gone
    from the packed config, which now holds dequantized experts)."""
    from engine.pack import pack
    rng = np.random.default_rng()
    src = tmp_path / "f32"
    build_hf_model(src, "deepseek_v3")
    want = write_ct(src, tmp_path / "q", 4, True, rng, group=8)   # (o_proj's 40 columns)
    raw = load_file(tmp_path / "q" / "model.safetensors")
    text = json.loads((tmp_path / "q" / "config.json").read_text())
    k25 = tmp_path / "k25"
    k25.mkdir()
    save_file({"language_model." + n: v.contiguous() for n, v in raw.items()}, k25 / "model.safetensors")
    copy_config(tmp_path / "q", k25)
    (k25 / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {**text, "model_type": "kimi_k2"}}))
    write_reference(src, tmp_path / "ref", want)
    ref = hf_reference(tmp_path / "ref")
    check_against(ref, engine.load(k25, device="cpu"))
    pack(k25, tmp_path / "packed", experts="bf16", progress=False)
    packed = json.loads((tmp_path / "packed" / "config.json").read_text())
    assert "quantization_config" not in packed["text_config"]
    check_against(ref, engine.load(tmp_path / "packed", device="cpu"))


def test_ct_unpacked_int8_zero_points(tmp_path):
    """compressed-tensors zero points stored as int8 [N, G] (older releases), not packed: read
    as they are, the same weights as the packed form."""
    src = tmp_path / "f32"
    build_hf_model(src, "qwen3_moe")
    write_ct(src, tmp_path / "q", 4, False, np.random.default_rng())
    raw = load_file(tmp_path / "q" / "model.safetensors")
    ck = Checkpoint(tmp_path / "q")
    from loader.quant import unpack_int32
    for n in [k for k in raw if k.endswith("weight_zero_point")]:
        rows = int(raw[n[:-len("zero_point")] + "shape"][0])
        raw[n] = torch.from_numpy(np.ascontiguousarray(
            unpack_int32(raw[n].numpy(), 4, rows, axis=0).astype(np.int8) - 8))
    (tmp_path / "q8").mkdir()
    save_file(raw, tmp_path / "q8" / "model.safetensors")
    copy_config(tmp_path / "q", tmp_path / "q8")
    ck8 = Checkpoint(tmp_path / "q8")
    for w in ck.intq:
        assert np.array_equal(ck8.get(w), ck.get(w)), w


def test_int_checkpoint_packs(tmp_path):
    from test_packed import dequantized_copy

    from engine.pack import pack
    src = tmp_path / "f32"
    build_hf_model(src, "qwen3_moe")
    want = write_gptq(src, tmp_path / "q", 4, "gptq", False, np.random.default_rng())
    man = pack(tmp_path / "q", tmp_path / "packed", experts="fp8", progress=False)
    assert man["source_quantization"]["quant_method"] == "gptq"
    write_reference(src, tmp_path / "ref", want)
    ref = hf_reference(dequantized_copy(tmp_path / "ref", tmp_path / "packed", tmp_path / "deq"))
    check_against(ref, engine.load(tmp_path / "packed", device="cpu"))


def test_settings_in_an_older_side_file(tmp_path):
    """Older AutoGPTQ / AutoAWQ releases keep their settings in quantize_config.json /
    quant_config.json rather than config.json: read from there, and recorded when packed."""
    from engine.pack import pack
    rng = np.random.default_rng()
    src = tmp_path / "f32"
    build_hf_model(src, "qwen3_moe")
    for write, side, settings in (
            (lambda d: write_gptq(src, d, 4, "gptq", True, rng), "quantize_config.json",
             {"bits": 4, "group_size": GROUP, "desc_act": True, "sym": False}),
            (lambda d: write_awq(src, d, rng), "quant_config.json",
             {"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"})):
        d = tmp_path / side
        want = write(d)
        cfg = json.loads((d / "config.json").read_text())
        del cfg["quantization_config"]
        (d / "config.json").write_text(json.dumps(cfg))
        (d / side).write_text(json.dumps(settings))
        ck = Checkpoint(d)
        for p, w in want.items():
            exact = w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(ck.get(p + "weight"), exact), (side, p)
    man = pack(tmp_path / "quant_config.json", tmp_path / "packed", experts="fp8", progress=False)
    assert man["source_quantization"] == {"quant_method": "awq", **settings}


def test_int_checkpoint_errors(tmp_path):
    rng = np.random.default_rng()
    src = tmp_path / "f32"
    build_hf_model(src, "qwen3_moe")
    write_gptq(src, tmp_path / "q", 4, "gptq", False, rng)
    cfg_path = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for qc, match in (({"bits": 3}, "GPTQ 3-bit, checkpoint_format 'gptq'"),
                      ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
                      ({"is_marlin_format": True}, "checkpoint_format 'marlin'"),
                      ({"dynamic": {"-:.*mlp.gate": {}}}, "quantization_config.dynamic"),
                      ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv'"),
                      ({"quant_method": "bitsandbytes"}, "quant_method is 'bitsandbytes'")):
        cfg_path.write_text(json.dumps({**cfg, "quantization_config":
                                        {**cfg["quantization_config"], **qc}}))
        with pytest.raises(CheckpointError, match=match):
            Checkpoint(tmp_path / "q")
    cfg_path.write_text(json.dumps(cfg))
    raw = load_file(tmp_path / "q" / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.up_proj."
    del raw[name + "qzeros"]
    save_file(raw, tmp_path / "q" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name}qweight needs {name}qzeros beside it"):
        Checkpoint(tmp_path / "q")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["gptq-int4", "awq-int4"])   # (the GPU machine has no
                                                                # compressed-tensors package)
def test_cuda_matches_cpu(tmp_path, layout):
    """cuda on an integer checkpoint, unpacked (experts built as bf16 blocks on read) and packed
    into an fp8 arena: the cpu backend's logits and tokens on the same folder."""
    from conftest import rel_err

    from engine.pack import pack
    src = tmp_path / "f32"
    build_hf_model(src, "qwen3_moe")
    LAYOUTS[layout](src, tmp_path / "q", np.random.default_rng())
    pack(tmp_path / "q", tmp_path / "packed", experts="fp8", progress=False)
    ids = np.random.default_rng().integers(0, 300, 12).tolist()
    for d in (tmp_path / "q", tmp_path / "packed"):
        g, c = engine.load(d, device="cuda"), engine.load(d, device="cpu")
        assert rel_err(g.logits(ids), c.logits(ids)) < 1e-4, d
        assert g.generate(ids[:5], max_new_tokens=16).output_ids == \
            c.generate(ids[:5], max_new_tokens=16).output_ids, d
