"""python -m engine.synth PRESET DST: a packed model folder with random weights at real shapes.

Written directly (no bf16 checkpoint first) so benchmarks can use 17-45 GB arenas: expert
blocks are random valid bytes of the chosen format (a few distinct blocks, cycled), dense
weights random bf16. Presets with Qwen's 151,936-token vocabulary get the real Qwen tokenizer
when `--tokenizer DIR` (or ../shared/tokenizers/qwen2 beside the checkout) is there.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine.models import family_of
from engine.pack import DENSE, FORMAT_VERSION, MANIFEST, PackError
from loader.arena import ARENA_NAME, HEADER_BYTES, _pack_header, block_offset
from loader.layout import FORMATS, ExpertLayout
from loader.st_write import write_safetensors

_QWEN = {"vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "tie_word_embeddings": False, "eos_token_id": 151645, "bos_token_id": 151643,
         "max_position_embeddings": 40960}

PRESETS = {
    "qwen3-30b-a3b": {
        **_QWEN, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "qwen3-next-80b-a3b": {
        **_QWEN, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "partial_rotary_factor": 0.25, "num_experts": 512, "num_experts_per_tok": 10,
        "norm_topk_prob": True, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 262144,
    },
    # the expert shapes of the issue (2560 x 640, top-10); the rest follows Qwen3-Next
    "qwen3.8-flash-next": {
        **_QWEN, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2560, "intermediate_size": 6400, "moe_intermediate_size": 640,
        "shared_expert_intermediate_size": 640, "num_hidden_layers": 40,
        "num_attention_heads": 20, "num_key_value_heads": 2, "head_dim": 256,
        "partial_rotary_factor": 0.25, "num_experts": 384, "num_experts_per_tok": 10,
        "norm_topk_prob": True, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 262144,
    },
    # gpt-oss-20b's config.json (the 120b: 36 layers, 128 experts, a 64 GB NVFP4 arena); the
    # o200k tokenizer is not shipped, so it gets the byte-level one
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "attention_bias": True, "rms_norm_eps": 1e-5, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "swiglu_limit": 7.0,
        "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0,
                                               "original_max_position_embeddings": 4096,
                                               "truncate": False},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "eos_token_id": 200002, "pad_token_id": 199999,
    },
    # DeepSeek-V2-Lite's config.json (multi-head latent attention, softmax routing; an 8 GB
    # NVFP4 arena); byte-level tokenizer
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": False,
        "scoring_func": "softmax", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                                              "mscale": 0.707, "mscale_all_dim": 0.707,
                                              "original_max_position_embeddings": 4096,
                                              "type": "yarn"},
        "tie_word_embeddings": False, "eos_token_id": 100001, "bos_token_id": 100000,
    },
    # GLM-4.7-Flash's config.json (MLA with DeepSeek-V3's sigmoid routing; a 16 GB NVFP4 arena);
    # byte-level tokenizer
    "glm-4.7-flash": {
        "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
        "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
        "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
        "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64,
        "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "topk_method": "noaux_tc", "partial_rotary_factor": 1.0,
        "rope_theta": 1000000, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "eos_token_id": [154820, 154827, 154829],
    },
    # MiniMax-M2's config.json (230B-A10B: a 126 GB NVFP4 arena; --layers 24 makes 49 GB);
    # byte-level tokenizer
    "minimax-m2": {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064,
        "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64,
        "num_local_experts": 256, "num_experts_per_tok": 8, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
        "shared_intermediate_size": 0, "rope_theta": 5000000, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 196608, "tie_word_embeddings": False,
        "eos_token_id": 200020, "bos_token_id": 200034,
    },
    # Llama-4-Scout-17B-16E's language model (a 54 GB NVFP4 arena beside 20 GB of bf16 dense
    # weights: --layers 24 fits the GPU machine's disk); byte-level tokenizer
    "llama-4-scout": {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "vocab_size": 202048,
        "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
        "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "use_qk_norm": True,
        "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192},
        "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "eos_token_id": [200001, 200007, 200008], "bos_token_id": 200000,
    },
    # Hunyuan-A13B's config.json (80B: a 43 GB NVFP4 arena); byte-level tokenizer
    "hunyuan-a13b": {
        "architectures": ["HunYuanMoEV1ForCausalLM"], "model_type": "hunyuan_v1_moe", "vocab_size": 128167,
        "hidden_size": 4096, "intermediate_size": 3072, "moe_intermediate_size": [3072] * 32,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "num_experts": 64, "moe_topk": [8] * 32, "num_shared_expert": [1] * 32, "use_qk_norm": True,
        "use_mixed_mlp_moe": True, "use_cla": False, "rope_theta": 10000.0,
        "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "eos_token_id": 127960, "bos_token_id": 127959,
    },
    # MiMo-V2-Flash's config.json in the release's spellings (309B: a 170 GB NVFP4 arena;
    # --layers 12 makes 43 GB); byte-level tokenizer
    "mimo-v2-flash": {
        "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "vocab_size": 152576,
        "hidden_size": 4096, "intermediate_size": 16384, "moe_intermediate_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4,
        "swa_num_key_value_heads": 8, "head_dim": 192, "v_head_dim": 128, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": None, "sliding_window_size": 128, "attention_value_scale": 0.707,
        "rope_theta": 5000000.0, "swa_rope_theta": 10000.0, "partial_rotary_factor": 0.334,
        "layernorm_epsilon": 1e-5, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    },
}

DISTINCT_BLOCKS = 16  # random blocks generated, then cycled: speed does not depend on the values


def random_bf16(rng: np.random.Generator, shape) -> np.ndarray:
    """Random bf16 bits of magnitude about 1/sqrt(K) with random signs, fast (no float math)."""
    k = shape[-1]
    top = 127 - int(np.ceil(np.log2(np.sqrt(k)))) + 1     # exponent of 2/sqrt(K)
    r = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    exp = (np.uint16(top - 3) + (r >> np.uint16(7) & np.uint16(3))).astype(np.uint16)
    return (r & np.uint16(0x807F)) | (exp << np.uint16(7))


def random_block(fmt: str, lay: ExpertLayout, rng: np.random.Generator) -> np.ndarray:
    """One valid random block: finite scales, values spread over the format's grid."""
    b = np.zeros(lay.block_bytes, np.uint8)
    h, i = lay.hidden, lay.intermediate
    mats = (("gate", i, lay.hp), ("up", i, lay.hp), ("down", h, lay.ip))
    for name, rows, kp in mats:
        q, s = getattr(lay, name + "_q"), getattr(lay, name + "_s")
        if fmt == "nvfp4":
            nq, ns = rows * kp // 2, rows * kp // 16
            b[q:q + nq] = rng.integers(0, 256, nq, dtype=np.uint8)
            b[s:s + ns] = rng.integers(0x30, 0x40, ns, dtype=np.uint8)  # E4M3 scales near 1
        elif fmt == "fp8":
            nq = rows * kp
            v = rng.integers(0, 0x7F, nq, dtype=np.uint8) & np.uint8(0x3F)  # |x| < 2, never NaN
            b[q:q + nq] = v | (rng.integers(0, 2, nq, dtype=np.uint8) << 7)
            b[s:s + 4 * rows] = np.full(rows, 1.0 / np.sqrt(kp), np.float32).view(np.uint8)
        else:
            w = (rng.standard_normal(rows * kp, dtype=np.float32) / np.float32(np.sqrt(kp)))
            b[q:q + 2 * rows * kp] = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    gs = np.array([1.0 / (np.sqrt(h) * 4)] * 2 + [1.0 / (np.sqrt(i) * 4)], np.float32)
    b[0:12] = (gs if fmt == "nvfp4" else np.ones(3, np.float32)).view(np.uint8)
    return b


def _vector_centres(c) -> dict:
    """name -> the value a 1-D weight is drawn around (default 1.0, a norm's weight). The hybrid
    families' RMSNorms are zero-centred (weight 1 + w), and their DeltaNet decay A_log sits near
    log(8) (the reference draws exp(A_log) from 1..16), so the synthetic model keeps sane scales."""
    from engine.models.hybrid import HybridConfig
    from engine.names import name
    if not isinstance(c, HybridConfig):
        return {}
    f = c.family
    out = {name(f, "final_norm"): 0.0}
    for l in range(c.n_layers):
        keys = ("attn_norm", "mlp_norm") + (("q_norm", "k_norm") if l in c.full_layers else ())
        out.update({name(f, k, l): 0.0 for k in keys})
        if l in c.linear_layers:
            out[name(f, "dn_A_log", l)] = float(np.log(8.0))
    return out


def default_tokenizer_dir() -> Path | None:
    here = Path(__file__).resolve().parents[1]
    for cand in (here / "shared" / "tokenizers" / "qwen2", here.parent / "shared" / "tokenizers" / "qwen2"):
        if cand.is_dir():
            return cand
    return None


def synth(preset: str, dst, experts: str = "nvfp4", force: bool = False, seed: int = 0,
          tokenizer_dir: Path | None = None, progress: bool = True, layers: int | None = None) -> dict:
    if preset not in PRESETS:
        raise PackError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    dst = Path(dst)
    if dst.exists() and not force:
        raise PackError(f"{dst} exists; pass --force to replace it")
    cfg = dict(PRESETS[preset])
    if layers:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:   # the preset's pattern, cut or repeated
            types = cfg["layer_types"]
            cfg["layer_types"] = [types[i % len(types)] for i in range(layers)]
    fam = family_of(cfg)
    c = fam.config
    rng = np.random.default_rng(seed)
    tmp = dst.with_name(f".{dst.name}.synth-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        dense = {}
        centre = _vector_centres(c)
        for n, shape in fam.dense_spec.items():
            if len(shape) == 1:   # a norm's weight near 1; biases and sinks near 0
                c0 = centre.get(n, 0.0 if n.endswith(("bias", "sinks")) else 1.0)
                a = np.float32(c0) + 0.05 * rng.standard_normal(shape, dtype=np.float32)
                dense[n] = (a.view(np.uint32) >> 16).astype(np.uint16)
            else:
                dense[n] = random_bf16(rng, shape)
        write_safetensors(tmp / DENSE, dense, bf16=set(dense), metadata={"synthetic": preset})
        del dense
        lay = ExpertLayout.build(experts, c.hidden, c.moe_intermediate)
        blocks = [random_block(experts, lay, rng) for _ in range(DISTINCT_BLOCKS)]
        crcs = [zlib.crc32(b) for b in blocks]
        keys = [(l, e) for l in c.moe_layers for e in range(c.n_experts)]
        records = []
        bar = tqdm(total=len(keys) * lay.block_bytes, unit="B", unit_scale=True, unit_divisor=1000,
                   desc=f"arena {experts}", disable=not progress)
        with open(tmp / ARENA_NAME, "wb") as f:
            f.write(_pack_header(experts, lay, c.n_layers, len(c.moe_layers), c.n_experts))
            for i, (l, e) in enumerate(keys):
                j = (i * 7 + l) % DISTINCT_BLOCKS
                f.write(blocks[j].data)
                records.append({"layer": l, "expert": e, "offset": block_offset(i, lay.block_bytes),
                                "size": lay.block_bytes, "format": experts, "crc32": crcs[j]})
                bar.update(lay.block_bytes)
        bar.close()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg.get("eos_token_id")}))
        tok = tokenizer_dir or default_tokenizer_dir()
        if cfg["vocab_size"] == 151936 and tok is not None:
            for f in Path(tok).iterdir():
                if f.name.endswith(".gz"):
                    with gzip.open(f, "rb") as src, open(tmp / f.name[:-3], "wb") as out:
                        shutil.copyfileobj(src, out)
                elif f.suffix in (".json", ".jinja"):
                    shutil.copyfile(f, tmp / f.name)
        else:
            from engine.demo import byte_level_tokenizer
            byte_level_tokenizer().save(str(tmp / "tokenizer.json"))
        manifest = {
            "format_version": FORMAT_VERSION, "model_type": c.family, "config": cfg,
            "experts": {"format": experts, "hidden": c.hidden, "intermediate": c.moe_intermediate,
                        "block_bytes": lay.block_bytes, "n_layers": c.n_layers,
                        "n_experts": c.n_experts, "moe_layers": list(c.moe_layers)},
            "blocks": records, "quantization": "synthetic random blocks",
            "dense": {"file": DENSE, "source_dtypes": ["BF16"]}, "source": f"synthetic:{preset}",
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        gb = (HEADER_BYTES + len(keys) * lay.block_bytes) / 1e9
        print(f"synthetic {preset}: {len(keys)} expert blocks ({experts}, {gb:.2f} GB) in "
              f"{time.perf_counter() - t0:.1f} s -> {dst}", file=sys.stderr)
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.synth", description=__doc__.splitlines()[0])
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("dst")
    p.add_argument("--experts", choices=FORMATS, default="nvfp4")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (smoke tests)")
    p.add_argument("--tokenizer", type=Path, default=None, help="folder with the Qwen tokenizer files")
    p.add_argument("--force", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        synth(a.preset, a.dst, a.experts, a.force, a.seed, a.tokenizer, layers=a.layers)
    except (PackError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
