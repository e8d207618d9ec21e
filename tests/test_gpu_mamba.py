"""The Mamba-2 families on the cuda backend: the mixer's kernels (kernels_numba/gpu_mamba.py) and
Nemotron-H's ungated relu^2 experts (gpu_experts.expert_mlp_relu2, relu2_up; gpu_misc.relu2)
against the numpy oracles in kernels_numba/reference.py on fresh random inputs, outputs poisoned
with NaN first; Granite 4.0 hybrid's and Nemotron-H's CUDA decoders (engine/gpu_granite_hybrid.py,
engine/gpu_nemotron_h.py) against the CPU backend and transformers.
- CPU-only CI: test_simulator_kernels() and test_simulator_decoder() run this file as a script
  in a subprocess with NUMBA_ENABLE_CUDASIM=1 (set before numba.cuda is imported), tiny shapes.
- A GPU (marker gpu): the kernels at granite-4.0-h-small's and Nemotron-3-Nano's shapes, and the
  engine end to end on tiny models: cuda = transformers, graph replay = eager, prefill = token by
  token, streamed under a tiny budget = all resident.
Run the simulator checks directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_gpu_mamba.py
[MODEL_DIR] (no argument: the kernels).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":   # run as a script from anywhere
    for p in (ROOT, ROOT / "tests"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))

from numba import cuda  # noqa: E402

from kernels_numba import reference as ref  # noqa: E402
from kernels_numba.gpu_util import SIM  # noqa: E402

from test_gpu_hybrid import _close, _nan, _rnd  # noqa: E402  (the kernel checks' helpers)


# ---- kernel checks (shared by the simulator run and the GPU tests) ---------------------------

def check_conv(rng, t, c, kc):
    """In place on the xBC columns of an in_proj-shaped buffer, as the decoder runs it; the
    state carried into a second call; with a bias and with zeros (a conv without one)."""
    from kernels_numba import gpu_mamba as gmb
    stream = cuda.stream()
    for bias in (_rnd(rng, c), np.zeros(c, np.float32)):
        x, w, st = _rnd(rng, t, 3 + c + 2), _rnd(rng, c, kc), _rnd(rng, kc - 1, c)
        want, want_st = ref.causal_conv1d_silu(x[:, 3:3 + c], w, st, bias)
        dx, dst, db, dw = cuda.to_device(x), cuda.to_device(st), cuda.to_device(bias), cuda.to_device(w)
        gmb.conv1d_silu(dx[:, 3:3 + c], dw, db, dst, dx[:, 3:3 + c], stream)
        stream.synchronize()
        got = dx.copy_to_host()
        _close(got[:, 3:3 + c], want, what=f"conv T={t} C={c} Kc={kc}")
        assert np.array_equal(got[:, :3], x[:, :3]) and np.array_equal(got[:, 3 + c:], x[:, 3 + c:]), \
            "conv wrote outside its columns"
        _close(dst.copy_to_host(), want_st, tol=0, what="conv state")
        x2 = _rnd(rng, 2, c)   # a second call continues from the carried state
        want2, want2_st = ref.causal_conv1d_silu(x2, w, want_st, bias)
        out = _nan((2, c))
        gmb.conv1d_silu(cuda.to_device(x2), dw, db, dst, out, stream)
        stream.synchronize()
        _close(out.copy_to_host(), want2, what="conv continued")
        _close(dst.copy_to_host(), want2_st, tol=0, what="conv state continued")


def _scan_case(rng, t, hm, p, g, n):
    """An in_proj-shaped host buffer [T, 5 | x | B | C | dt | 2] (the scan's inputs are its
    column slices), A_log, dt_bias, D, a nonzero state; and reference.mamba2_scan's (out
    [T, Hm P], state)."""
    inner, gn = hm * p, g * n
    x, b, cm, dt = _rnd(rng, t, hm, p), _rnd(rng, t, g, n), _rnd(rng, t, g, n), _rnd(rng, t, hm, scale=2)
    buf = np.concatenate([_rnd(rng, t, 5), x.reshape(t, inner), b.reshape(t, gn), cm.reshape(t, gn), dt,
                          _rnd(rng, t, 2)], axis=1)
    dt[0, 0] = 100.0   # softplus passes dt + dt_bias through above 20 (a float32 exp overflows on a GPU)
    buf[0, 5 + inner + 2 * gn] = 100.0
    a_log = np.log(rng.uniform(0.5, 4.0, hm)).astype(np.float32)
    dt_bias, d = _rnd(rng, hm, scale=0.5) - 0.5, _rnd(rng, hm)
    dt_bias[0] = 0.0
    state = _rnd(rng, hm, p, n, scale=0.3)
    out, st = ref.mamba2_scan(x, dt, b, cm, a_log, dt_bias, d, (0.0, math.inf), state)
    return (buf, a_log, dt_bias, d, state), (out.reshape(t, inner), st)


def check_scan(rng, t, hm, p, g, n):
    """The scan on column slices of the in_proj-shaped buffer, output poisoned, the state
    updated in place; the input buffer left as it was."""
    from kernels_numba import gpu_mamba as gmb
    (buf, a_log, dt_bias, d, state), (want, want_st) = _scan_case(rng, t, hm, p, g, n)
    c = hm * p + 2 * g * n
    stream = cuda.stream()
    dbuf, dst, out = cuda.to_device(buf), cuda.to_device(state), _nan((t, hm * p))
    gmb.scan(dbuf[:, 5:5 + c], dbuf[:, 5 + c:5 + c + hm], cuda.to_device(-np.exp(a_log)),
             cuda.to_device(dt_bias), cuda.to_device(d), dst, out, stream)
    stream.synchronize()
    what = f"scan T={t} Hm={hm} P={p} G={g} N={n}"
    e = _close(out.copy_to_host(), want, what=what)
    _close(dst.copy_to_host(), want_st, what=what + " state")
    assert np.array_equal(dbuf.copy_to_host(), buf), "scan wrote into its input"
    return e


def check_norm(rng, t, width, group):
    """z a column slice of a wider buffer; into a poisoned output, and in place."""
    from kernels_numba import gpu_mamba as gmb
    stream = cuda.stream()
    x, zz, w = _rnd(rng, t, width), _rnd(rng, t, 7 + width, scale=2), _rnd(rng, width)
    want = ref.rmsnorm_group_gated(x, zz[:, 7:], w, group, 1e-5)
    dx, dz, dw = cuda.to_device(x), cuda.to_device(zz), cuda.to_device(w)
    out = _nan((t, width))
    gmb.rmsnorm_group_gated(dx, dz[:, 7:], dw, group, 1e-5, out, stream)
    gmb.rmsnorm_group_gated(dx, dz[:, 7:], dw, group, 1e-5, dx, stream)
    stream.synchronize()
    _close(out.copy_to_host(), want, what=f"gated group norm T={t} W={width} group={group}")
    _close(dx.copy_to_host(), want, what="gated group norm in place")


def make_ungated_bank(fmt, h, i, slots, rng, scale=0.1):
    """A device slot bank of `slots` random ungated experts (up, down: Nemotron-H's); returns
    (bank, layout, decoded (up, down) of each)."""
    from loader.layout import ExpertLayout
    from loader.quant import decode_expert_block, encode_expert_block
    lay = ExpertLayout.build(fmt, h, i, gated=False)
    blocks, ws = [], []
    for _ in range(slots):
        u, d = _rnd(rng, i, h, scale=scale), _rnd(rng, h, i, scale=scale)
        blocks.append(encode_expert_block(fmt, lay, None, u, d))
        ws.append(decode_expert_block(blocks[-1], lay)[1:])
    return cuda.to_device(np.stack(blocks)), lay, ws


def _relu2_moe(x, ids, slot_of, wts, ws):
    """The oracle: sum_k wts[t, k] reference.relu2_expert(x[t]) of token t's experts."""
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for kk in range(ids.shape[1]):
            out[t] += float(wts[t, kk]) * ref.relu2_expert(x[t:t + 1], *ws[slot_of[int(ids[t, kk])]])[0]
    return out.astype(np.float32)


def check_experts_relu2(fmt, h, i, k, n_exp, rng, variant=""):
    """Ungated experts for one token (expert_mlp_relu2 over kernel_layout's layout: RAW gate_up,
    relu2_up, down), weights by slot, accumulating into out."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_ungated_bank(fmt, h, i, n_exp, rng)
    lh = ge.kernel_layout(lay)
    ge.check_layout(fmt, lay.as_array(), k)
    slot_of = rng.permutation(n_exp).astype(np.int32)
    ids = rng.choice(n_exp, size=k, replace=False).astype(np.int32)
    w = rng.random(k).astype(np.float32)
    x, base = _rnd(rng, h, scale=3.0), _rnd(rng, h)
    out = cuda.to_device(base)
    ge.expert_mlp_relu2(fmt, ge.bank_views(dbank), cuda.to_device(lh), lh, cuda.to_device(slot_of[ids]),
                        cuda.to_device(w), cuda.to_device(x), _nan((2 * k, i)), out, stream,
                        accumulate=True, variant=variant)
    stream.synchronize()
    exp = _relu2_moe(x[None], ids[None], slot_of, w[None], ws)[0]
    return _close(out.copy_to_host(), exp + base, what=f"expert_mlp_relu2 {fmt} {variant}")


def check_grouped_relu2(fmt, h, i, k, t, n_exp, rng):
    """Ungated experts over t tokens: the tiled grouped kernels in two batches of groups (as
    the engine runs them), relu2_up between gate_up and down, then the combine."""
    from kernels_numba import gpu_experts as ge
    stream = cuda.stream()
    dbank, lay, ws = make_ungated_bank(fmt, h, i, n_exp, rng)
    lh = ge.kernel_layout(lay)
    slot_of = rng.permutation(n_exp).astype(np.int32)
    ids, wts = ref.router_topk(_rnd(rng, t, n_exp), k, True)
    ids = ids.astype(np.int32)
    gslot, gstart, order, aw, pos = ge.group_assignments(ids, wts, lambda e: slot_of[e])
    x = _rnd(rng, t, h, scale=3.0)
    a = t * k
    act, y = _nan((2 * a, i)), _nan((a, h))
    d = {n: cuda.to_device(v) for n, v in (("gslot", gslot), ("gstart", gstart), ("order", order), ("aw", aw))}
    n_g = len(np.unique(ids))
    for g0, g1 in ((0, n_g // 2), (n_g // 2, n_g)):
        ge.grouped_gate_up_down(fmt, ge.bank_views(dbank), cuda.to_device(lh), lh, d["gslot"][g0:g1],
                                d["gstart"][g0:g1 + 1], d["order"], d["aw"], cuda.to_device(x), act, y, stream,
                                clamp=lambda a, s, lo=int(gstart[g0]), hi=int(gstart[g1]): ge.relu2_up(a, s, lo, hi))
    out = _nan((t, h))
    ge.combine(y, cuda.to_device(pos), out, stream)
    stream.synchronize()
    return _close(out.copy_to_host(), _relu2_moe(x, ids, slot_of, wts, ws),
                  what=f"grouped relu2 {fmt}")


def check_relu2(rng, n=37):
    """gm.relu2 in place (the dense MLP's and the shared expert's activation)."""
    from kernels_numba import gpu_misc as gm
    stream = cuda.stream()
    x = _rnd(rng, n)
    dx = cuda.to_device(x)
    gm.relu2(dx, stream)
    stream.synchronize()
    _close(dx.copy_to_host(), np.maximum(x.astype(np.float64), 0.0) ** 2, what="relu2")


# ---- simulator (CI) -------------------------------------------------------------------------

def run_sim_kernel_checks() -> None:
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    t0 = time.time()
    for t in (1, 5):
        check_conv(rng, t, 20, 4)
    check_conv(rng, 3, 9, 2)
    print(f"ok conv {time.time() - t0:.0f}s", flush=True)
    check_scan(rng, 1, 4, 3, 2, 8)     # decode; P not a multiple of the warps a block
    check_scan(rng, 4, 2, 4, 1, 40)    # N past a warp (two values a lane, the second partial)
    check_scan(rng, 3, 6, 2, 3, 5)     # three groups of two heads
    print(f"ok scan {time.time() - t0:.0f}s", flush=True)
    check_norm(rng, 1, 24, 24)
    check_norm(rng, 3, 32, 8)
    check_norm(rng, 2, 150, 75)        # a group longer than the block
    print(f"ok norm {time.time() - t0:.0f}s", flush=True)
    # ungated experts: each format's RAW decode kernels (and a flat one for nvfp4), the tiled
    # grouped kernels; H and I not multiples of the tiles
    for fmt, h, i in (("nvfp4", 44, 22), ("fp8", 40, 24), ("bf16", 36, 20)):
        check_experts_relu2(fmt, h, i, 3, 5, rng)
        check_grouped_relu2(fmt, h, i, 2, 7, 5, rng)
    check_experts_relu2("nvfp4", 40, 24, 3, 5, rng, variant="tab-g2j1-d2j1")
    check_relu2(rng)
    print(f"ok relu2 experts {time.time() - t0:.0f}s", flush=True)
    print("SIM KERNELS PASSED", flush=True)


DECODERS = {"granitemoehybrid": "GpuGraniteHybridDecoder", "nemotron_h": "GpuNemotronHDecoder"}


def run_sim_decoder_check(model: Path) -> None:
    """The eager decoder of the model's family (DECODERS) against the CPU backend on a tiny
    model: a 2-token prefill's logits, a greedy step from its state saved and restored (the prefix
    cache's path: conftest.eager_decoder_matches_cpu); greedy tokens of the engine (the device
    sampler); a prefill = the same tokens one at a time, logits and the conv and scan state."""
    import json

    import engine
    from conftest import eager_decoder_matches_cpu, rel_err
    want = DECODERS[json.loads((model / "config.json").read_text())["model_type"]]

    def setup(dec):
        assert type(dec).__name__ == want, type(dec).__name__
    eager_decoder_matches_cpu(model, setup)
    t0 = time.time()
    g = engine.load(model, device="cuda")
    g.gpu.use_graphs = False
    prompt = [3, 17, 5]
    got = g.generate(prompt, max_new_tokens=2).output_ids
    want = engine.load(model, device="cpu").generate(prompt, max_new_tokens=2).output_ids
    assert got == want, (got, want)
    print(f"ok greedy {got} {time.time() - t0:.0f}s", flush=True)
    dec, ids = g.gpu, np.array([7, 1, 12])
    st = dec.new_state(8)
    whole = dec.forward(ids, st, all_logits=True)
    conv, ssm = st.conv.copy_to_host(), st.ssm.copy_to_host()
    st = dec.new_state(8)
    steps = np.concatenate([dec.forward(ids[i:i + 1], st) for i in range(len(ids))])
    assert rel_err(steps, whole) < 1e-5, rel_err(steps, whole)
    _close(st.conv.copy_to_host(), conv, what="conv state, token by token")
    _close(st.ssm.copy_to_host(), ssm, what="scan state, token by token")
    print(f"ok prefill = token by token {time.time() - t0:.0f}s", flush=True)
    print("SIM DECODER PASSED", flush=True)


def _run_sim(*args, timeout=900):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


def test_simulator_kernels():
    r = _run_sim()
    assert r.returncode == 0 and "SIM KERNELS PASSED" in r.stdout, r.stdout + r.stderr


M, A = "linear_attention", "full_attention"
SIM_MODEL = dict(vocab_size=24, hidden_size=16, intermediate_size=8, shared_intermediate_size=8,
                 num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                 mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
# a Mamba layer and an attention layer each: the released shape (NoPE, tied), RoPE with
# q / k / v / o biases, one B / C group and no conv bias, the dense shared MLP alone
SIM_CASES = [dict(layer_types=[M, A], position_embedding_type="nope", tie_word_embeddings=True),
             dict(layer_types=[A, M], position_embedding_type="rope", attention_bias=True,
                  mamba_n_groups=1, mamba_conv_bias=False, tie_word_embeddings=False),
             dict(layer_types=[M, A], position_embedding_type="nope", num_local_experts=0)]
SIM_IDS = ["nope-tied", "rope-biases", "dense"]


# Nemotron-H: a block of each kind (Mamba, attention, MoE with the shared expert, dense MLP)
NEMOTRON_SIM = dict(vocab_size=24, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                    intermediate_size=8, mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=8, n_groups=2,
                    conv_kernel=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    moe_shared_expert_intermediate_size=8, hybrid_override_pattern="M*E-", n_group=2, topk_group=1)


@pytest.mark.parametrize("family,over", [("granitemoehybrid", o) for o in SIM_CASES] + [("nemotron_h", {})],
                         ids=SIM_IDS + ["nemotron_h"])
def test_simulator_decoder(tmp_path, family, over):
    # bf16, as the cuda backend builds bf16 expert blocks from a checkpoint
    if family == "nemotron_h":
        from test_nemotron_h import build
        build(tmp_path, "bfloat16", **{**NEMOTRON_SIM, **over})
    else:
        from test_granitemoehybrid import build
        build(tmp_path, "bfloat16", **{**SIM_MODEL, **over})
    r = _run_sim(str(tmp_path))
    assert r.returncode == 0 and "SIM DECODER PASSED" in r.stdout, r.stdout + r.stderr


def test_latent_experts_run_on_the_cpu(monkeypatch):
    """Nemotron-3-Super's latent experts: --device cuda refuses them by name, auto runs them on
    the CPU (saying why) with a GPU that works; the cuda decoder refuses them too."""
    from engine import runtime
    from engine.models import family_of
    from test_nemotron_h import TINY
    monkeypatch.setattr(runtime, "cuda_status", lambda: (True, ""))
    cfg = {"model_type": "nemotron_h", **TINY, "hybrid_override_pattern": "M*E"}
    c, latent = family_of(cfg).config, family_of({**cfg, "moe_latent_size": 12}).config
    assert runtime.pick_device("cuda", "nemotron_h", c) == "cuda"
    why = "the cuda backend does not run nemotron_h's latent experts (moe_latent_size) yet"
    with pytest.raises(RuntimeError, match=rf"--device cuda: {re.escape(why)}"):
        runtime.pick_device("cuda", "nemotron_h", latent)
    assert runtime.pick_device("auto", "nemotron_h", latent) == "cpu"
    from engine.gpu_nemotron_h import GpuNemotronHDecoder
    with pytest.raises(ValueError, match=re.escape(why + "; --device cpu runs it")):
        GpuNemotronHDecoder(latent, None, None, None, None)


# ---- real GPU -------------------------------------------------------------------------------

_HAVE_GPU = (not SIM) and cuda.is_available()
gpu = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 77])
def test_kernels_gpu_release_shapes(t):
    """granite-4.0-h-small: Hm 128, P 64, one group, N 128, conv 4 (C = 8448); Nemotron-3-Nano:
    Hm 64, P 64, 8 groups, N 128 (the gated norm over 8 groups of 512)."""
    rng = np.random.default_rng(3 + t)
    for hm, p, g, n in ((128, 64, 1, 128), (64, 64, 8, 128)):
        check_conv(rng, t, hm * p + 2 * g * n, 4)
        check_scan(rng, t, hm, p, g, n)
        check_norm(rng, t, hm * p, hm * p // g)


def _build(dst, **over):
    from test_granitemoehybrid import build
    return build(dst, "bfloat16", **over)


def _packed(tmp_path, **over):
    """A tiny model (the released shape, hidden 64, 16 experts, top-4) packed with NVFP4 experts."""
    from engine.pack import pack
    from test_granitemoehybrid import CASES
    _build(tmp_path / "src", **{**CASES[0], "hidden_size": 64, "num_local_experts": 16, "num_experts_per_tok": 4,
                                **over})
    pack(tmp_path / "src", tmp_path / "p", "nvfp4", progress=False)
    return tmp_path / "p"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", range(3), ids=["nope-tied", "rope-biases", "dense"])
def test_cuda_matches_transformers(tmp_path, case):
    """tests/test_granitemoehybrid.py's cases (Mamba and attention layers, NoPE or RoPE with
    biases, the dense shared MLP alone) on cuda: logits and greedy tokens of transformers."""
    import engine
    from conftest import check_against
    from test_granitemoehybrid import CASES
    over = CASES[case]
    ref = _build(tmp_path, **over)
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_equals_eager(tmp_path, resident):
    """Graph replay (one graph a token, the recurrent state put back after capture) = eager =
    the CPU backend, every expert resident or streamed at the VRAM minimum."""
    from conftest import check_graph_replay_equals_eager
    ids = np.random.default_rng().integers(0, 300, 20).tolist()
    check_graph_replay_equals_eager(_packed(tmp_path), ids, resident)


@pytest.mark.gpu
@gpu
def test_graph_replay_dense(tmp_path):
    """-h-micro's shape (no routed experts, from the checkpoint folder): graph replay = eager =
    the CPU backend."""
    import engine
    from test_granitemoehybrid import CASES
    _build(tmp_path, **CASES[2])
    ids = np.random.default_rng().integers(0, 300, 12).tolist()
    g = engine.load(tmp_path, device="cuda")
    a = g.generate(ids, max_new_tokens=16)
    assert g.gpu._graphs is not None
    g.gpu.use_graphs = False
    assert g.generate(ids, max_new_tokens=16).output_ids == a.output_ids
    assert engine.load(tmp_path, device="cpu").generate(ids, max_new_tokens=16).output_ids == a.output_ids


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("resident", [True, False])
def test_device_sampling_equals_host_sampling(tmp_path, resident):
    from conftest import check_device_sampling_equals_host
    ids = np.random.default_rng().integers(0, 300, 9).tolist()
    check_device_sampling_equals_host(_packed(tmp_path), ids, resident)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("prefill_chunk", [16, 64])
def test_prefill_equals_token_by_token(tmp_path, prefill_chunk):
    """45 tokens in prefill chunks (the GEMM path: 16 or more tokens a chunk) == one token at a
    time through the graphs, logits and the conv and scan state."""
    import engine
    from conftest import rel_err
    from test_granitemoehybrid import CASES
    _build(tmp_path, **{**CASES[1], "layer_types": [M, A, M, M]})
    ids = np.random.default_rng().integers(0, 300, 45)
    dec = engine.load(tmp_path, device="cuda").gpu
    dec.prefill_chunk = prefill_chunk
    st = dec.new_state(64)
    pre = dec.forward(ids, st, all_logits=True)
    conv, ssm = st.conv.copy_to_host(), st.ssm.copy_to_host()
    st = dec.new_state(64)
    steps = np.concatenate([dec.forward(ids[i:i + 1], st) for i in range(len(ids))])
    assert rel_err(steps, pre) < 1e-4
    assert rel_err(st.conv.copy_to_host(), conv) < 1e-4
    assert rel_err(st.ssm.copy_to_host(), ssm) < 1e-4


@pytest.mark.gpu
@gpu
def test_streaming_under_tiny_vram_same_tokens(tmp_path):
    """Streamed under a tiny VRAM budget (one graph a token, the host serving the layers that
    miss; then the per-layer segments) = every expert resident."""
    import engine
    packed = _packed(tmp_path)
    prompt = np.random.default_rng().integers(0, 300, 40).tolist()
    big = engine.load(packed, device="cuda")
    assert big.plan.all_resident
    a = big.generate(prompt, max_new_tokens=24)
    bb = big.gpu.res.block_bytes
    small = engine.load(packed, device="cuda", ram_gb=4 * 5 * bb / 1e9,
                        vram_gb=(big.plan.vram_used - big.plan.hot_slots * bb) / 1e9, prefill_batch=4)
    assert small.plan.hot_slots == 0
    b = small.generate(prompt, max_new_tokens=24)
    assert a.output_ids == b.output_ids
    assert b.stats["vram"]["disk_reads"] > 0
    assert small.gpu._devres and b.stats["vram"]["h2d_wait_s"] > 0
    small.gpu.device_resolve = False
    assert small.generate(prompt, max_new_tokens=24).output_ids == a.output_ids


@pytest.mark.gpu
@gpu
def test_prefix_cache_resumes(tmp_path):
    """cuda, prefix cache on: a prompt that extends the last generation resumes from the saved
    conv and scan state and decodes a fresh engine's tokens; the same prompt again prefills
    nothing."""
    import engine
    packed = _packed(tmp_path)
    m = engine.load(packed, device="cuda", prefix_cache=True)
    fresh = engine.load(packed, device="cuda")
    rng = np.random.default_rng()
    p1 = rng.integers(0, 300, 12).tolist()
    out1 = m.generate(p1, max_new_tokens=5).output_ids
    p2 = p1 + out1 + rng.integers(0, 300, 4).tolist()
    r2 = m.generate(p2, max_new_tokens=6)
    assert r2.stats["prefill_cached_tokens"] > 0
    assert r2.output_ids == fresh.generate(p2, max_new_tokens=6).output_ids
    r3 = m.generate(p2, max_new_tokens=6)
    assert r3.stats["prefill_cached_tokens"] == len(p2) and r3.output_ids == r2.output_ids


NEMOTRON_GPU = ["nano-pattern", "legacy-names"]   # tests/test_nemotron_h.py's CASES but Super's latent one


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", NEMOTRON_GPU)
def test_nemotron_h_cuda_matches_transformers(tmp_path, case):
    """Nemotron-H on cuda (every block kind, ungated relu^2 experts from a checkpoint's bf16
    blocks): logits and greedy tokens of transformers."""
    import engine
    from conftest import check_against
    from test_nemotron_h import CASES, IDS, build
    ref = build(tmp_path, "bfloat16", **CASES[IDS.index(case)])
    check_against(ref, engine.load(tmp_path, device="cuda"), n_ids=24)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("resident", [True, False])
def test_nemotron_h_graph_replay_and_streaming(tmp_path, resident):
    """An ungated NVFP4 arena (16 experts, top-4): graph replay = eager = the CPU backend, every
    expert resident or streamed at the VRAM minimum."""
    from conftest import check_packed_graph_replay
    from test_nemotron_h import CASES, build
    check_packed_graph_replay(tmp_path, resident, build, "bfloat16", **CASES[0], hidden_size=64,
                              n_routed_experts=16, num_experts_per_tok=4)


@pytest.mark.gpu
@gpu
def test_nemotron_h_prefill_equals_token_by_token(tmp_path):
    """45 tokens in prefill chunks of 16 (the GEMM and tiled grouped expert paths) == one token
    at a time through the graphs, logits and the conv and scan state."""
    import engine
    from conftest import rel_err
    from test_nemotron_h import CASES, build
    build(tmp_path, "bfloat16", **CASES[0])
    ids = np.random.default_rng().integers(0, 300, 45)
    dec = engine.load(tmp_path, device="cuda").gpu
    dec.prefill_chunk = 16
    st = dec.new_state(64)
    pre = dec.forward(ids, st, all_logits=True)
    ssm = st.ssm.copy_to_host()
    st = dec.new_state(64)
    steps = np.concatenate([dec.forward(ids[i:i + 1], st) for i in range(len(ids))])
    assert rel_err(steps, pre) < 1e-4
    assert rel_err(st.ssm.copy_to_host(), ssm) < 1e-4


if __name__ == "__main__":
    if not SIM:
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    if len(sys.argv) > 1:
        run_sim_decoder_check(Path(sys.argv[1]))
    else:
        run_sim_kernel_checks()
