"""The hybrid families (Qwen3-Next, Qwen3.5-MoE) on the cuda backend.

Kernels (kernels_numba/gpu_deltanet.py, and the gated-attention pieces built from gpu_dense)
against the numpy oracles in kernels_numba/reference.py on fresh random inputs, outputs poisoned
with NaN first; the whole GpuHybridDecoder against the CPU backend and transformers.
- CPU-only CI: test_simulator_kernels(), test_simulator_delta_rule() and test_simulator_decoder()
  run this file as a script in a subprocess with NUMBA_ENABLE_CUDASIM=1 (set before numba.cuda
  is imported), tiny shapes.
- A GPU (marker gpu): the kernels at Qwen3-Next-80B shapes, and the engine end to end on tiny
  models: cuda = cpu = transformers, graph replay = eager, prefill = token by token, streamed
  under a tiny VRAM budget = all resident.
Run the simulator checks directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_gpu_hybrid.py
[delta | MODEL_DIR] (no argument: the other kernels; delta: both delta-rule kernels).
"""
from __future__ import annotations

import os
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

TOL = 1e-5


def _close(got, exp, tol=TOL, what=""):
    got = np.asarray(got, dtype=np.float64)
    exp = np.asarray(exp, dtype=np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (poison left?)"
    err = np.abs(got - exp).max() / max(np.abs(exp).max(), 1e-30)
    assert err <= tol, f"{what}: max error {err:.3g} of max |ref| exceeds {tol}"
    return err


def _nan(shape):
    return cuda.to_device(np.full(shape, np.nan, dtype=np.float32))


def _rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- kernel checks (shared by the simulator run and the GPU tests) ---------------------------

def check_conv(rng, t, c, kc):
    """In place on a column slice of a wider buffer, as the decoder runs it; state carried."""
    from kernels_numba import gpu_deltanet as gdn
    stream = cuda.stream()
    x, w, st = _rnd(rng, t, c + 5), _rnd(rng, c, kc), _rnd(rng, kc - 1, c)
    want, want_st = ref.causal_conv1d_silu(x[:, :c], w, st)
    dx, dst = cuda.to_device(x), cuda.to_device(st)
    gdn.conv1d_silu(dx[:, :c], cuda.to_device(w), dst, dx[:, :c], stream)
    stream.synchronize()
    got = dx.copy_to_host()
    _close(got[:, :c], want, what=f"conv1d_silu T={t}")
    assert np.array_equal(got[:, c:], x[:, c:]), "conv wrote outside its columns"
    _close(dst.copy_to_host(), want_st, tol=0, what="conv state")
    # a second call continues from the carried state
    x2 = _rnd(rng, 2, c)
    want2, _ = ref.causal_conv1d_silu(x2, w, want_st)
    out = _nan((2, c))
    gdn.conv1d_silu(cuda.to_device(x2), cuda.to_device(w), dst, out, stream)
    stream.synchronize()
    _close(out.copy_to_host(), want2, what="conv1d_silu continued")


def check_gates(rng, t, nv):
    from kernels_numba import gpu_deltanet as gdn
    stream = cuda.stream()
    ba = np.concatenate([_rnd(rng, t, nv, scale=3), _rnd(rng, t, nv, scale=10)], axis=1)
    a_log, dt = _rnd(rng, nv), _rnd(rng, nv, scale=5)
    dba = cuda.to_device(ba)
    beta, g = _nan((t, nv)), _nan((t, nv))
    gdn.gates(dba[:, :nv], dba[:, nv:], cuda.to_device(-np.exp(a_log)), cuda.to_device(dt), beta, g,
              stream)
    stream.synchronize()
    wb, wg = ref.deltanet_gates(ba[:, :nv], ba[:, nv:], a_log, dt)
    _close(beta.copy_to_host(), wb, what="beta")
    _close(g.copy_to_host(), wg, what="g")


def _delta_case(rng, t, nk, nv, dk, dv, a_scale=0.5):
    """A conv-output-shaped [T, q | k | v | 3 more] host input, gate inputs [T, b | a], A_log,
    dt_bias, a nonzero initial state; and reference.deltanet_gates + reference.gated_delta_rule's
    (out [T, Nv, Dv], state). a_scale: spread of A_log (larger, faster decay)."""
    kd = nk * dk
    q, k, v = _rnd(rng, t, nk, dk), _rnd(rng, t, nk, dk), _rnd(rng, t, nv, dv)
    qkvz = np.concatenate([q.reshape(t, kd), k.reshape(t, kd), v.reshape(t, nv * dv),
                           _rnd(rng, t, 3)], axis=1)
    ba = np.concatenate([_rnd(rng, t, nv, scale=2), _rnd(rng, t, nv, scale=2)], axis=1)
    a_log, dt = _rnd(rng, nv, scale=a_scale), _rnd(rng, nv)
    state = _rnd(rng, nv, dk, dv, scale=0.3)
    beta, g = ref.deltanet_gates(ba[:, :nv], ba[:, nv:], a_log, dt)
    return (qkvz, ba, a_log, dt, state), ref.gated_delta_rule(q, k, v, g, beta, state)


def _run_delta(rule, case, nk):
    """A delta-rule launcher on fresh device copies of a case, the output poisoned, fed the
    [T, q | k | v] column slice -> (out [T, Nv, Dv], state), on the host."""
    qkvz, ba, a_log, dt, state = case
    nv, dk, dv = state.shape
    t, c = qkvz.shape[0], 2 * nk * dk + nv * dv
    stream = cuda.stream()
    dq, dstate, out = cuda.to_device(qkvz), cuda.to_device(state), _nan((t, nv * dv))
    rule(dq[:, :c], cuda.to_device(ba), cuda.to_device(-np.exp(a_log)), cuda.to_device(dt), nk,
         dstate, out, stream)
    stream.synchronize()
    assert np.array_equal(dq.copy_to_host(), qkvz), "delta rule wrote into its input"
    return out.copy_to_host().reshape(t, nv, dv), dstate.copy_to_host()


def check_delta_rule(rng, t, nk, nv, dk, dv):
    """The token-scan kernel (gates folded in, state updated in place) against the oracle."""
    from kernels_numba import gpu_deltanet as gdn
    case, (want, want_state) = _delta_case(rng, t, nk, nv, dk, dv)
    got, got_state = _run_delta(gdn.delta_rule, case, nk)
    what = f"delta rule T={t} Nk={nk} Nv={nv} Dk={dk} Dv={dv}"
    e = _close(got, want, tol=1e-4, what=what)
    _close(got_state, want_state, tol=1e-4, what=what + " state")
    return e


def check_delta_rule_chunked(rng, t, nk, nv, dk, dv, a_scale=0.5):
    """The chunked kernel against the oracle and against the token scan on the same inputs,
    outputs and final state."""
    from kernels_numba import gpu_deltanet as gdn
    case, (want, want_state) = _delta_case(rng, t, nk, nv, dk, dv, a_scale)
    got, got_state = _run_delta(gdn.delta_rule_chunked, case, nk)
    scan, scan_state = _run_delta(gdn.delta_rule, case, nk)
    what = f"chunked delta rule T={t} (chunk {gdn.CH_T}) Nk={nk} Nv={nv} Dk={dk} Dv={dv}"
    e = _close(got, want, tol=1e-4, what=what)
    _close(got_state, want_state, tol=1e-4, what=what + " state")
    _close(got, scan, tol=1e-4, what=what + " vs the scan")
    _close(got_state, scan_state, tol=1e-4, what=what + " state vs the scan")
    return e


def check_rmsnorm_gated(rng, t, heads, n):
    """In place, z a column slice of a wider buffer (the [q | k | v | z] projection)."""
    from kernels_numba import gpu_deltanet as gdn
    stream = cuda.stream()
    x, zz, w = _rnd(rng, t, heads * n), _rnd(rng, t, 7 + heads * n), _rnd(rng, n)
    dx, dz = cuda.to_device(x), cuda.to_device(zz)
    gdn.rmsnorm_gated(dx, dz[:, 7:], cuda.to_device(w), 1e-6, dx, stream)
    stream.synchronize()
    want = ref.rmsnorm_gated(x.reshape(t, heads, n), zz[:, 7:].reshape(t, heads, n), w, 1e-6)
    _close(dx.copy_to_host(), want.reshape(t, heads * n), what="rmsnorm_gated")


def check_sigmoid_gate(rng, t, n):
    from kernels_numba import gpu_deltanet as gdn
    stream = cuda.stream()
    for groups in (1, n // 4, n):
        x, gate = _rnd(rng, t, n), _rnd(rng, t, groups, scale=3)
        dx = cuda.to_device(x)
        gdn.sigmoid_gate(dx, cuda.to_device(gate), stream)
        stream.synchronize()
        _close(dx.copy_to_host(), ref.sigmoid_gate(x, gate), what=f"sigmoid_gate G={groups}")


def check_gated_attention_pieces(rng, t, h, hq, hkv, d, partial):
    """The gated attention's projections through the fused [q | gate | k | v] weight that
    HybridWeights builds (query and gate rows interleaved per head in the checkpoint), per-head
    q/k RMSNorm with 1 + w, partial RoPE (gd.rope rotates 2 len(inv_freq) dims), attention,
    sigmoid output gate: against the oracles applied as the reference model does."""
    from engine.gpu_hybrid import HybridWeights
    from engine.models.rope import RopeConfig
    from kernels_numba import gpu_attention as ga
    from kernels_numba import gpu_deltanet as gdn
    from kernels_numba import gpu_dense as gd

    class C:   # the config fields HybridWeights reads
        n_heads, n_kv_heads, head_dim, fused_qkvz = hq, hkv, d, False

    stream = cuda.stream()
    raw = {"q": _rnd(rng, 2 * hq * d, h, scale=h ** -0.5), "k": _rnd(rng, hkv * d, h, scale=h ** -0.5),
           "v": _rnd(rng, hkv * d, h), "q_norm": _rnd(rng, d, scale=0.1), "k_norm": _rnd(rng, d, scale=0.1)}
    hw = HybridWeights(C, lambda key, layer: raw[key])
    x = _rnd(rng, t, h)
    pos = np.arange(t, dtype=np.int32)
    inv_freq = RopeConfig(theta=1e6, rotary_dim=int(d * partial)).inv_freq()
    # the reference's order of operations
    qg = ref.linear(x, raw["q"]).reshape(t, hq, 2 * d)
    rq = ref.rope(ref.rmsnorm(qg[:, :, :d], 1 + raw["q_norm"], 1e-6), pos, inv_freq)
    rk = ref.rope(ref.rmsnorm(ref.linear(x, raw["k"]).reshape(t, hkv, d), 1 + raw["k_norm"], 1e-6),
                  pos, inv_freq)
    rv = ref.linear(x, raw["v"]).reshape(t, hkv, d)
    want = ref.sigmoid_gate(ref.attention(rq, rk, rv, pos, d ** -0.5).reshape(t, hq * d),
                            qg[:, :, d:].reshape(t, hq * d))
    # the device path
    fused = cuda.to_device(hw("attn_qgkv", 0))
    qd, kv = hq * d, hkv * d
    dx = cuda.to_device(x)
    outs = [_nan((t, n)) for n in (qd, qd, kv, kv)]
    for (r0, r1), y in zip(((0, qd), (qd, 2 * qd), (2 * qd, 2 * qd + kv), (2 * qd + kv, 2 * qd + 2 * kv)),
                           outs):
        gd.linear(fused[r0:r1], dx, y, stream)
    q, gate, k, v = outs
    gd.rmsnorm(q.reshape(t * hq, d), cuda.to_device(hw("q_norm", 0)), 1e-6, q.reshape(t * hq, d), stream)
    gd.rmsnorm(k.reshape(t * hkv, d), cuda.to_device(hw("k_norm", 0)), 1e-6, k.reshape(t * hkv, d), stream)
    dpos, dinv = cuda.to_device(pos), cuda.to_device(inv_freq)
    gd.rope(q.reshape(t, hq, d), dpos, dinv, stream)
    gd.rope(k.reshape(t, hkv, d), dpos, dinv, stream)
    stream.synchronize()
    _close(q.copy_to_host().reshape(t, hq, d), rq, tol=1e-4, what="q: split, norm, partial rope")
    _close(k.copy_to_host().reshape(t, hkv, d), rk, tol=1e-4, what="k: norm, partial rope")
    att = _nan((t, hq, d))
    ga.attention(q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d), dpos, d ** -0.5,
                 att, ga.alloc_partials(t, hq, d, t), stream)
    gdn.sigmoid_gate(att.reshape(t, qd), gate, stream)
    stream.synchronize()
    _close(att.copy_to_host().reshape(t, qd), want, tol=1e-4, what="gated attention")


def check_qkvz_rows(rng):
    """Qwen3-Next's per-key-head fused rows, permuted at upload, give the [q | k | v | z] and
    [b | a] layouts the CPU backend gets by gathering columns of the output."""
    from engine.gpu_hybrid import HybridWeights
    from engine.models.hybrid import qkvz_order

    class C:
        lin_k_heads, lin_v_heads, lin_k_dim, lin_v_dim = 2, 6, 4, 3
        n_heads, n_kv_heads, head_dim, fused_qkvz = 1, 1, 4, True

    n = 2 * 2 * 4 + 2 * 6 * 3
    raw = {"dn_qkvz": _rnd(rng, n, 8), "dn_ba": _rnd(rng, 12, 8)}
    hw = HybridWeights(C, lambda key, layer: raw[key])
    x = _rnd(rng, 3, 8)
    cols, bcols = qkvz_order(C)
    assert np.array_equal(x @ hw("dn_qkvz", 0).T, (x @ raw["dn_qkvz"].T)[:, cols])
    assert np.array_equal(x @ hw("dn_ba", 0).T, (x @ raw["dn_ba"].T)[:, bcols])


# ---- simulator (CI) -------------------------------------------------------------------------

def run_sim_kernel_checks() -> None:
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    t0 = time.time()
    check_qkvz_rows(rng)
    for t in (1, 5):
        check_conv(rng, t, 20, 4)
    check_conv(rng, 3, 9, 2)
    check_gates(rng, 4, 6)
    print(f"ok conv, gates {time.time() - t0:.0f}s", flush=True)
    check_rmsnorm_gated(rng, 3, 4, 12)
    check_sigmoid_gate(rng, 2, 16)
    check_gated_attention_pieces(rng, t=4, h=16, hq=2, hkv=1, d=8, partial=0.5)
    print(f"ok norm, gates, attention {time.time() - t0:.0f}s", flush=True)
    print("SIM KERNELS PASSED", flush=True)


def run_sim_delta_checks() -> None:
    """Both delta-rule kernels; the chunked one at chunk 8 here (CH_T under the simulator)."""
    from kernels_numba import gpu_deltanet as gdn
    assert gdn.CH_T == 8 and gdn.CH_COLS == 4 and gdn.CH_DK == 32
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
    t0 = time.time()
    check_delta_rule(rng, 1, 2, 4, 8, 12)
    check_delta_rule(rng, 5, 1, 3, 16, 8)
    check_delta_rule(rng, 3, 2, 2, 10, 6)       # Dk not a multiple of the split, Dv < a tile
    print(f"ok delta rule {time.time() - t0:.0f}s", flush=True)
    check_delta_rule_chunked(rng, 1, 2, 2, 8, 4)
    check_delta_rule_chunked(rng, 5, 1, 3, 16, 8)         # T < chunk; 3 value heads on one key head
    check_delta_rule_chunked(rng, 8, 2, 4, 8, 6)          # T = chunk; Dv not a multiple of CH_COLS
    check_delta_rule_chunked(rng, 21, 2, 4, 10, 6)        # 3 chunks, the last partial; odd Dk
    check_delta_rule_chunked(rng, 16, 1, 2, 32, 4, a_scale=2.0)   # Dk = CH_DK, fast decay
    print(f"ok chunked delta rule {time.time() - t0:.0f}s", flush=True)
    print("SIM DELTA PASSED", flush=True)


def run_sim_decoder_check(model: Path) -> None:
    """The eager GpuHybridDecoder against the CPU backend (conftest.eager_decoder_matches_cpu),
    the chunked delta rule's threshold lowered so the 2-token prefill takes it."""
    from conftest import eager_decoder_matches_cpu

    def setup(dec):
        assert type(dec).__name__ == "GpuHybridDecoder"
        dec.chunked_min_t = 2
    eager_decoder_matches_cpu(model, setup)
    print("SIM DECODER PASSED", flush=True)


def _run_sim(*args, timeout=600):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


def test_simulator_kernels():
    r = _run_sim()
    assert r.returncode == 0 and "SIM KERNELS PASSED" in r.stdout, r.stdout + r.stderr


def test_simulator_delta_rule():
    r = _run_sim("delta")
    assert r.returncode == 0 and "SIM DELTA PASSED" in r.stdout, r.stdout + r.stderr


def test_simulator_decoder(tmp_path):
    from test_hybrid import L, F, build
    # DeltaNet + dense MLP, then gated attention + experts + shared expert (two value heads share
    # a key head); bf16, as the cuda backend builds bf16 expert blocks from a checkpoint
    build(tmp_path, "qwen3_next", num_hidden_layers=2, layer_types=[L, F], dtype="bfloat16",
          vocab_size=24, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
          linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
          linear_value_head_dim=4, moe_intermediate_size=8, shared_expert_intermediate_size=8,
          intermediate_size=8, mlp_only_layers=[0])
    r = _run_sim(str(tmp_path))
    assert r.returncode == 0 and "SIM DECODER PASSED" in r.stdout, r.stdout + r.stderr


# ---- real GPU -------------------------------------------------------------------------------

_HAVE_GPU = (not SIM) and cuda.is_available()
gpu = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 31, 32, 77, 300, 2048])
def test_delta_rule_chunked_gpu_qwen3_next_shapes(t):
    """The chunked delta rule at Qwen3-Next-80B shapes (Nk 16, Nv 32, Dk = Dv = 128; chunk 32
    here) against the oracle and the token scan: T below, at, across chunks, a long prefill."""
    rng = np.random.default_rng(11 + t)
    check_delta_rule_chunked(rng, t, 16, 32, 128, 128)
    check_delta_rule_chunked(rng, t, 16, 32, 128, 128, a_scale=2.0)


@pytest.mark.gpu
@gpu
def test_kernels_gpu_qwen3_next_shapes():
    """Qwen3-Next-80B: hidden 2048, Nk 16, Nv 32, Dk = Dv = 128, conv 4; attention 16 q heads,
    2 kv heads, head dim 256, partial rotary 0.25."""
    rng = np.random.default_rng(7)
    nk, nv, dk, dv = 16, 32, 128, 128
    c = 2 * nk * dk + nv * dv
    for t in (1, 77):
        check_conv(rng, t, c, 4)
        check_gates(rng, t, nv)
        check_delta_rule(rng, t, nk, nv, dk, dv)
        check_rmsnorm_gated(rng, t, nv, dv)
        check_sigmoid_gate(rng, t, 16 * 256)
    check_gated_attention_pieces(rng, t=37, h=2048, hq=16, hkv=2, d=256, partial=0.25)
    check_qkvz_rows(rng)


def _tiny(tmp_path, family, **over):
    from test_hybrid import build
    return build(tmp_path, family, dtype="bfloat16", **over)


E2E = [("qwen3_next", {}),
       ("qwen3_next", dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention",
                                                             "full_attention"],
                           mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True,
                           partial_rotary_factor=0.5)),
       ("qwen3_5_moe_text", dict(linear_num_key_heads=1, linear_num_value_heads=3,
                                 linear_key_head_dim=16, full_attention_interval=2)),
       ("qwen3_5_moe", {})]


@pytest.mark.gpu
@pytest.mark.parametrize("family,over", E2E, ids=[f"{f}-{i}" for i, (f, _) in enumerate(E2E)])
def test_cuda_matches_cpu_and_transformers(tmp_path, family, over):
    import engine
    from conftest import assert_greedy, rel_err
    from test_hybrid import hf_logits, ids_for
    hf = _tiny(tmp_path, family, **over)
    ids = ids_for(16).tolist()
    g = engine.load(tmp_path, device="cuda")
    c = engine.load(tmp_path, device="cpu")
    want = hf_logits(hf, ids)
    assert rel_err(g.logits(ids), want) < 1e-4
    assert rel_err(c.logits(ids), want) < 1e-4
    got = g.generate(ids[:5], max_new_tokens=24).output_ids
    assert_greedy(hf, ids[:5], got, 24)
    assert_greedy(hf, ids[:5], c.generate(ids[:5], max_new_tokens=24).output_ids, 24)


@pytest.mark.gpu
def test_prefix_cache_resumes_at_the_prompt_end(tmp_path):
    """cuda, prefix cache on: a next prompt that leaves the generated ids early (a template that
    rewrites the last reply) resumes from the copy of the recurrent state kept at the last
    prompt's end, put back into the one device state: its logits are those of the two prompts'
    pieces prefilled one after the other on a fresh engine, its tokens a fresh engine's."""
    import engine
    from conftest import record_prefills
    from engine.pack import pack
    _tiny(tmp_path / "src", "qwen3_next", num_experts=8, num_experts_per_tok=2)
    pack(tmp_path / "src", tmp_path / "p", "nvfp4", progress=False)
    m = engine.load(tmp_path / "p", device="cuda", prefix_cache=True)
    fresh = engine.load(tmp_path / "p", device="cuda")
    prefills = record_prefills(m)
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"ids seed {seed}")
    rng = np.random.default_rng(seed)
    p1 = rng.integers(0, 250, 12).tolist()
    out1 = m.generate(p1, max_new_tokens=5).output_ids
    p2 = p1 + [(out1[0] + 1) % 250] + rng.integers(0, 250, 4).tolist()
    r2 = m.generate(p2, max_new_tokens=6)
    assert (r2.stats["prefill_cached_tokens"], r2.stats["prefill_cached_from"]) == (12, "saved")
    st = fresh.model.new_state(64)
    fresh.model.forward(np.array(p1), st)
    want = fresh.model.forward(np.array(p2[12:]), st)[-1]
    assert np.abs(prefills[-1] - want).max() <= 1e-5 * np.abs(want).max()
    assert r2.output_ids == fresh.generate(p2, max_new_tokens=6).output_ids


@pytest.mark.gpu
def test_same_prompt_again_prefills_nothing(tmp_path):
    """cuda, prefix cache on: the same prompt again (regenerate) resumes all of it from the
    prompt-end copy and its logits, with no prefill pass, and decodes a fresh engine's greedy
    and seeded tokens."""
    import engine
    from conftest import record_prefills
    from engine.pack import pack
    from engine.runtime import GenerationParams
    _tiny(tmp_path / "src", "qwen3_next", num_experts=8, num_experts_per_tok=2)
    pack(tmp_path / "src", tmp_path / "p", "nvfp4", progress=False)
    m = engine.load(tmp_path / "p", device="cuda", prefix_cache=True)
    fresh = engine.load(tmp_path / "p", device="cuda")
    p1 = np.random.default_rng().integers(0, 250, 12).tolist()
    out1 = m.generate(p1, max_new_tokens=6).output_ids
    prefills = record_prefills(m)
    r2 = m.generate(p1, max_new_tokens=6)
    assert (r2.stats["prefill_cached_tokens"], r2.stats["prefill_cached_from"]) == (12, "saved")
    assert prefills == [] and r2.output_ids == out1 == fresh.generate(p1, max_new_tokens=6).output_ids
    params = GenerationParams(max_new_tokens=6, temperature=1.0, seed=3, stop_ids=())
    assert list(m.stream(p1, params, {})) == list(fresh.stream(p1, params, {}))


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_equals_eager(tmp_path, resident):
    from conftest import check_graph_replay_equals_eager
    from engine.pack import pack
    from test_hybrid import ids_for
    _tiny(tmp_path / "src", "qwen3_next", num_experts=8, num_experts_per_tok=2)
    pack(tmp_path / "src", tmp_path / "p", "nvfp4", progress=False)
    check_graph_replay_equals_eager(tmp_path / "p", ids_for(9).tolist(), resident)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [True, False])
def test_device_sampling_equals_host_sampling(tmp_path, resident):
    """Seeded decode sampled on the device == the host sampler's stream (the graph capture puts
    the recurrent state back, so the sampled tail changes nothing there either)."""
    from conftest import check_device_sampling_equals_host
    from engine.pack import pack
    from test_hybrid import ids_for
    _tiny(tmp_path / "src", "qwen3_next", seed=5, num_experts=8, num_experts_per_tok=2)
    pack(tmp_path / "src", tmp_path / "p", "nvfp4", progress=False)
    check_device_sampling_equals_host(tmp_path / "p", ids_for(9, seed=1).tolist(), resident)


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_chunk,chunked_min_t", [(16, None), (40, 8)],
                         ids=["scan", "chunked"])
def test_prefill_equals_token_by_token(tmp_path, prefill_chunk, chunked_min_t):
    """A prompt longer than the prefill chunk, in chunks, == one token at a time (graphs), and
    the recurrent state ends the same; the prefill's delta rule the token scan, or chunked (45
    tokens: a 40-token pass over two of its chunks, the last partial, then 5 tokens scanned)."""
    import engine
    from conftest import rel_err
    from test_hybrid import ids_for
    _tiny(tmp_path, "qwen3_next", num_hidden_layers=4)
    ids = ids_for(45, seed=1)
    m = engine.load(tmp_path, device="cuda")
    dec = m.gpu
    dec.prefill_chunk = prefill_chunk
    dec.chunked_min_t = chunked_min_t
    st = dec.new_state(64)
    pre = dec.forward(ids, st, all_logits=True)
    ssm = st.ssm.copy_to_host()
    st = dec.new_state(64)
    steps = np.concatenate([dec.forward(ids[i:i + 1], st) for i in range(len(ids))])
    assert rel_err(steps, pre) < 1e-4
    assert rel_err(st.ssm.copy_to_host(), ssm) < 1e-4


@pytest.mark.gpu
def test_streaming_under_tiny_vram_same_tokens(tmp_path):
    import engine
    from engine.pack import pack
    from test_hybrid import ids_for
    _tiny(tmp_path / "src", "qwen3_5_moe_text", num_experts=16, num_experts_per_tok=4)
    pack(tmp_path / "src", tmp_path / "p", "nvfp4", progress=False)
    prompt = ids_for(40).tolist()
    big = engine.load(tmp_path / "p", device="cuda")
    assert big.plan.all_resident
    a = big.generate(prompt, max_new_tokens=24)
    bb = big.gpu.res.block_bytes
    small = engine.load(tmp_path / "p", device="cuda", ram_gb=4 * 5 * bb / 1e9,
                        vram_gb=(big.plan.vram_used - big.plan.hot_slots * bb) / 1e9, prefill_batch=4)
    assert small.plan.hot_slots == 0
    b = small.generate(prompt, max_new_tokens=24)
    assert a.output_ids == b.output_ids
    assert b.stats["vram"]["disk_reads"] > 0
    # one graph a token, layers served by the host; the per-layer path gives the same tokens
    assert small.gpu._devres and b.stats["vram"]["h2d_wait_s"] > 0
    small.gpu.device_resolve = False
    assert small.generate(prompt, max_new_tokens=24).output_ids == a.output_ids


if __name__ == "__main__":
    if not SIM:
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    if sys.argv[1:] == ["delta"]:
        run_sim_delta_checks()
    elif len(sys.argv) > 1:
        run_sim_decoder_check(Path(sys.argv[1]))
    else:
        run_sim_kernel_checks()
