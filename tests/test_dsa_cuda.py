"""DeepSeek Sparse Attention's cuda kernels (kernels_numba/gpu_dsa.py, gpu_mla.attention with
sel) against the numpy oracles in kernels_numba/reference.py, on fresh random inputs with the
outputs poisoned first.

- CPU-only CI: test_simulator() runs this file as a script with NUMBA_ENABLE_CUDASIM=1 at tiny
  shapes: the indexer's keys and queries; its scores (rows past index_topk, rows below it left
  alone, positions past the query's never written); the select over scores full of ties (0 and
  -0, repeated values: the earliest positions win, as the CPU backend's top_positions) and
  with every position picked; the sparse MLA attention against the oracle and, where every
  position is picked, bit for bit the dense kernel's output, for decode and a prefill chunk.
  test_simulator_decoder() runs it with a tiny model's folder: the eager cuda decoder
  (engine/gpu_dsa.py) against the CPU backend with index_topk 4 of an 8-token prompt, prefill
  chunks across index_topk, decode past it, the picks themselves, and the prefix cache's save
  and restore of the indexer keys.
- A GPU (marker gpu): the kernel checks at DeepSeek-V3.2's and GLM-5's indexer shapes;
  transformers' logits past index_topk; graph replay = eager = the CPU backend, resident and
  streamed.
Run directly: NUMBA_ENABLE_CUDASIM=1 python tests/test_dsa_cuda.py [MODEL_DIR]
"""
from __future__ import annotations

import os
import subprocess
import sys
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
from test_gpu_hybrid import _close  # noqa: E402  (relative error against an oracle, poison checked)


def check_index_prep(rng, t, hi, d, r, s_max):
    """The queries' rotary dims rotated in place (the rest untouched); the keys' LayerNorm with
    bias and RoPE into the rows of the tokens' positions, no other row touched."""
    from kernels_numba import gpu_dsa as gdsa
    q = rng.standard_normal((t, hi, d)).astype(np.float32)
    k = (rng.standard_normal((t, d)) * 3 + 1).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(d)).astype(np.float32)
    b = (0.2 * rng.standard_normal(d)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)
    pos = rng.choice(s_max, t, replace=False).astype(np.int32)
    dq = cuda.to_device(q)
    ik = cuda.to_device(np.full((s_max, d), np.nan, np.float32))
    gdsa.index_prep(dq, cuda.to_device(k), cuda.to_device(w), cuda.to_device(b), 1e-6,
                    cuda.to_device(pos), cuda.to_device(inv_freq), 1.3, ik, cuda.stream())
    cuda.synchronize()
    _close(dq.copy_to_host(), ref.rope(q, pos, inv_freq, 1.3), 1e-5, "index_prep q")
    got = ik.copy_to_host()
    _close(got[pos], ref.index_keys(k, w, b, 1e-6, pos, inv_freq, 1.3), 1e-5, "index_prep keys")
    assert np.isnan(np.delete(got, pos, axis=0)).all(), "index_prep wrote rows outside the positions"


def check_index_scores(rng, hi, d, s_max, topk):
    """A decode row past topk, a prefill chunk across topk (its rows below topk untouched) and
    a row at the last position: the oracle's scores at j <= pos, nothing written past it."""
    from kernels_numba import gpu_dsa as gdsa
    keys = rng.standard_normal((s_max, d)).astype(np.float32)
    for pos in (np.array([s_max // 2 + topk // 2], np.int32),
                np.arange(topk - 2, topk + 3, dtype=np.int32), np.array([s_max - 1], np.int32)):
        t = len(pos)
        q = rng.standard_normal((t, hi, d)).astype(np.float32)
        wt = rng.standard_normal((t, hi)).astype(np.float32)
        out = cuda.to_device(np.full((t, s_max), np.nan, np.float32))
        gdsa.index_scores(cuda.to_device(q), cuda.to_device(wt), cuda.to_device(keys),
                          cuda.to_device(pos), d ** -0.5, hi ** -0.5, topk, out, cuda.stream())
        cuda.synchronize()
        got = out.copy_to_host()
        want = ref.index_scores(q, wt, keys, pos, d ** -0.5, hi ** -0.5)
        for i, p in enumerate(pos):
            if p < topk:
                assert np.isnan(got[i]).all(), f"index_scores wrote row {i} (position {p} < topk {topk})"
                continue
            _close(got[i, :p + 1], want[i, :p + 1], 1e-5, f"index_scores position {p}")
            assert np.isnan(got[i, p + 1:]).all(), f"index_scores wrote past position {p}"


def check_index_select(rng, s_max, topk, t):
    """Scores with many ties (0 and -0, a handful of repeated values) and distinct ones: the
    oracle's picks exactly (the earliest of equal scores), ascending; the CPU backend's
    top_positions the same; rows at most topk long pick every position."""
    from engine.models.deepseek_v32 import top_positions
    from kernels_numba import gpu_dsa as gdsa
    pos = np.concatenate([[0, topk - 1], rng.integers(topk, s_max, t - 3), [s_max - 1]]).astype(np.int32)
    for kind in ("ties", "zeros", "distinct"):
        if kind == "ties":
            scores = rng.choice(np.array([-1.5, -0.0, 0.0, 0.25, 2.0], np.float32), (t, s_max))
        elif kind == "zeros":   # a relu'd sum: mostly 0 or -0, a few positive
            scores = np.where(rng.random((t, s_max)) < 0.8, 0.0, rng.random((t, s_max)))
            scores = (scores * rng.choice([-1.0, 1.0], (t, s_max))).astype(np.float32)
        else:
            scores = rng.standard_normal((t, s_max)).astype(np.float32)
        sel = cuda.to_device(np.full((t, topk), -7, np.int32))
        vpos = cuda.to_device(np.full(t, -7, np.int32))
        gdsa.index_select(cuda.to_device(scores), cuda.to_device(pos), topk, sel, vpos, cuda.stream())
        cuda.synchronize()
        got, vp = sel.copy_to_host(), vpos.copy_to_host()
        for i, (p, want) in enumerate(zip(pos, ref.index_select(scores, pos, topk))):
            assert vp[i] == len(want) - 1, f"select {kind}: row {i} vpos {vp[i]}, expected {len(want) - 1}"
            assert np.array_equal(got[i, :len(want)], want), \
                f"select {kind}: row {i} (position {p}) picked {got[i, :len(want)]}, expected {want}"
            if p + 1 > topk:
                assert np.array_equal(top_positions(scores[i, :p + 1], topk), want), f"top_positions {kind}"


def check_sparse_attention(rng, hq, c_dim, r, s_max, split, topk, t_prefill, gh):
    """Each query over its picked rows (ascending, as index_select leaves them): the oracle's
    attention over those rows; where every position is picked (sel[t, j] = j) the dense kernel's
    output bit for bit. Decode and a prefill chunk, both variants (staged: float32 caches)."""
    from kernels_numba import gpu_attention as ga
    from kernels_numba import gpu_mla as gml
    d = c_dim + r
    scale = 0.3
    stream = cuda.stream()
    for bf in (False, True):
        rows = rng.standard_normal((s_max, 1, d)).astype(np.float32)
        if bf:
            from loader.quant import f32_to_bf16
            bits = f32_to_bf16(rows)
            rows, dc = ref.bf16_to_f32(bits), cuda.to_device(bits)
        else:
            dc = cuda.to_device(rows)
        for qp in (np.array([s_max - 1], np.int32), np.array([topk // 2], np.int32),
                   np.arange(s_max - t_prefill, s_max, dtype=np.int32),
                   np.arange(topk - t_prefill // 2, topk - t_prefill // 2 + t_prefill, dtype=np.int32)):
            t = len(qp)
            picked = [np.arange(p + 1) if p + 1 <= topk else np.sort(rng.choice(p + 1, topk, replace=False))
                      for p in qp]
            sel = np.full((t, topk), -1, np.int32)
            for i, keep in enumerate(picked):
                sel[i, :len(keep)] = keep
            vpos = np.array([len(k) - 1 for k in picked], np.int32)
            q = rng.standard_normal((t, hq, d)).astype(np.float32)
            want = ref.attention_picked(q, rows, picked, scale)[:, :, :c_dim]
            parts = ga.alloc_partials(t, hq, d, s_max, split)
            for variant in ("tile",) if bf else gml.ATT_VARIANTS:
                outs = []
                for sparse in (True, False):
                    out = cuda.to_device(np.full((t, hq, c_dim), np.nan, np.float32))
                    gml.attention(cuda.to_device(q), dc, cuda.to_device(vpos if sparse else qp), scale, out,
                                  parts, stream, split=split, gh=gh, variant=variant,
                                  sel=cuda.to_device(sel) if sparse else None)
                    stream.synchronize()
                    outs.append(out.copy_to_host())
                what = f"sparse MLA attention {variant} bf16={bf} positions {qp[0]}..{qp[-1]}"
                _close(outs[0], want, 1e-5, what)
                every = vpos == qp
                assert np.array_equal(outs[0][every], outs[1][every]), what + ": every position picked, not the dense output"


def check_decoder(model) -> None:
    """The eager cuda decoder against the CPU backend on model (index_topk 4): an 8-token prompt
    in prefills of 5 (the first across index_topk) scored SCORE_ROWS = 2 tokens at a time, its
    logits; two greedy decode steps past it, the last indexing layer's scores and picks those
    of the CPU; between them the state saved, written over and restored (the prefix cache's
    round trip, the indexer keys with the latent rows); the state's bytes as state_bytes says.
    Kept this small: each pass through the model costs about 30 s in the simulator."""
    import engine
    from conftest import rel_err
    from engine import gpu_dsa
    from engine.models import deepseek_v32
    gpu_dsa.SCORE_ROWS = 2
    cpu = engine.load(model, device="cpu").model
    dec = engine.load(model, device="cuda").gpu
    dec.use_graphs = False
    dec.prefill_chunk = 5
    assert type(dec).__name__ == "GpuDsaDecoder", type(dec).__name__
    c = cpu.c
    ids = np.random.default_rng().integers(0, c.vocab_size, 8)
    assert c.index_topk == 4
    seen = {}
    top = deepseek_v32.top_positions

    def spy(score, k):   # the CPU's scores of the last query it picks for
        seen["score"] = np.array(score)
        return top(score, k)
    deepseek_v32.top_positions = spy

    def same(lg, lc, what):
        err = rel_err(lg, lc)
        assert err < 1e-4, f"{what}: logits differ from the CPU backend by {err:.3g}"
        assert np.array_equal(np.argmax(lg, -1), np.argmax(lc, -1)), f"{what}: greedy tokens differ"
        return err

    sc, sg = cpu.new_state(16), dec.new_state(16)
    assert sum(a.nbytes for a in sg.k + sg.ik) == gpu_dsa.state_bytes(c, sg.max_context) and len(sg.ik) == len(c.index_layers)
    lc = np.asarray(cpu.forward(ids, sc, all_logits=True))
    errs = [same(dec.forward(ids, sg, all_logits=True), lc, "prefills of 5")]
    for step in range(2):
        if step == 1:
            saved = dec.save_state(sg, sg.pos)
            rng = np.random.default_rng()
            for a in sg.k + sg.ik:   # (as another prompt would)
                a.copy_to_device(rng.standard_normal(a.shape).astype(a.dtype))
            sg = dec.restore_state(saved, 16, sc.pos)
        tok = int(np.argmax(lc[-1]))
        lc = np.asarray(cpu.forward(np.array([tok]), sc))
        errs.append(same(dec.forward(np.array([tok]), sg), lc, f"decode step {step}"))
        want = seen.pop("score")
        _close(dec.one.score.copy_to_host()[0, :len(want)], want, 1e-5, f"decode step {step}: indexer scores")
        want = sc.picked[0]
        got = dec.one.sel.copy_to_host()[0, :dec.one.vpos.copy_to_host()[0] + 1]
        assert len(want) == c.index_topk and np.array_equal(got, want), \
            f"decode step {step}: picked {got}, the CPU {want}"
    print(f"logits rel err {max(errs):.2e}", flush=True)


def run_sim_checks() -> None:
    rng = np.random.default_rng()
    check_index_prep(rng, t=3, hi=3, d=12, r=4, s_max=9)
    check_index_scores(rng, hi=3, d=8, s_max=40, topk=6)       # two blocks of positions
    check_index_select(rng, s_max=80, topk=7, t=6)              # runs of 3 positions a thread
    # 3 heads in tiles of 2; picks in pieces of 2+ keys (the partials' P from s_max)
    check_sparse_attention(rng, hq=3, c_dim=12, r=4, s_max=14, split=2, topk=5, t_prefill=3, gh=2)
    print("SIM DSA CHECKS PASSED", flush=True)


def _simulate(*args) -> str:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, __file__, *map(str, args)], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "SIM DSA CHECKS PASSED" in r.stdout, r.stdout + r.stderr
    return r.stdout


def test_simulator():
    _simulate()


# tiny models for the simulator: 4 indexer heads of 8 dims (4 rotating), 4 of a query's positions
SIM_DSA = dict(vocab_size=24, hidden_size=16, num_attention_heads=2, moe_intermediate_size=8,
               intermediate_size=8, num_experts_per_tok=2, num_hidden_layers=2, n_routed_experts=4,
               n_shared_experts=1, routed_scaling_factor=1.5, kv_lora_rank=8, q_lora_rank=8,
               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, index_n_heads=4,
               index_head_dim=8, index_topk=4)
SIM_DECODERS = {
    # layer 0 dense, layer 1 routed (4 experts in 2 groups, one kept); both run an indexer
    "deepseek_v32": dict(SIM_DSA, n_group=2, topk_group=1, first_k_dense_replace=1),
    # layer 1 routed, dense before it; layer 1 reads layer 0's picks (its interleaved RoPE pairs
    # permuted at upload)
    "glm_moe_dsa": dict(SIM_DSA, mlp_layer_types=["dense", "sparse"], index_topk_pattern="FS"),
}


@pytest.mark.parametrize("family", sorted(SIM_DECODERS))
def test_simulator_decoder(tmp_path, family):
    from conftest import build_hf_model
    build_hf_model(tmp_path, family, dtype="bfloat16", **SIM_DECODERS[family])
    print(_simulate(tmp_path))


_HAVE_GPU = (not SIM) and cuda.is_available()
gpu = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("hi", [64, 32])   # V3.2, GLM-5
def test_dsa_kernels_gpu(hi):
    rng = np.random.default_rng()
    check_index_prep(rng, t=5, hi=hi, d=128, r=64, s_max=64)
    check_index_scores(rng, hi=hi, d=128, s_max=5000, topk=2048)
    check_index_select(rng, s_max=20000, topk=2048, t=6)
    check_sparse_attention(rng, hq=16, c_dim=512, r=64, s_max=4096, split=32, topk=2048, t_prefill=9, gh=8)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_cuda_past_index_topk(tmp_path, family):
    """conftest's tiny model (index_topk 4) on cuda: transformers' logits over 12 tokens and
    the CPU backend's greedy continuation (a pick between two scores equal to float32 rounding
    may go either way: only then may they part); the same weights with index_topk 32 over a
    300-token prompt in prefill chunks of 100 (SCORE_ROWS rows scored at a time, chunks across
    index_topk), the CPU backend's logits."""
    import engine
    from conftest import build_hf_model, copy_config, hf_logits, hf_reference, rel_err
    from test_glm_moe_dsa import index_topk_gap
    build_hf_model(tmp_path / "m", family, dtype="bfloat16")
    ref = hf_reference(tmp_path / "m")
    ids = np.random.default_rng().integers(0, 300, 12).tolist()
    g = engine.load(tmp_path / "m", device="cuda")
    assert type(g.gpu).__name__ == "GpuDsaDecoder"
    assert rel_err(g.logits(ids), hf_logits(ref, ids)) < 1e-4
    got = g.generate(ids[:6], max_new_tokens=24).output_ids
    want = engine.load(tmp_path / "m", device="cpu").generate(ids[:6], max_new_tokens=24).output_ids
    if got != want:
        gap = index_topk_gap(ref, ids[:6] + got, g.config.index_topk)
        assert gap < 1e-5, f"cuda left the CPU backend's greedy tokens, the closest indexer pick {gap:.2e} apart"
    (tmp_path / "k32").mkdir()
    (tmp_path / "k32" / "model.safetensors").write_bytes((tmp_path / "m" / "model.safetensors").read_bytes())
    copy_config(tmp_path / "m", tmp_path / "k32", index_topk=32)
    long = np.random.default_rng().integers(0, 300, 300)
    g = engine.load(tmp_path / "k32", device="cuda", max_context=512)
    g.gpu.prefill_chunk = 100
    err = rel_err(g.logits(long), engine.load(tmp_path / "k32", device="cpu", max_context=512).logits(long))
    print(f"300 tokens, index_topk 32: rel err {err:.2e}", flush=True)
    assert err < 1e-4


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_graph_replay_and_streaming(tmp_path, family, resident):
    """Graph replay = eager = the CPU backend over a 20-token prompt and 20 tokens (index_topk
    4: the indexer's scores, select and the sparse attention inside the graphs, the position
    from device memory), resident (one graph a token) or streamed (a graph segment a layer)."""
    from conftest import build_hf_model, check_packed_graph_replay
    check_packed_graph_replay(tmp_path, resident, build_hf_model, family, num_experts_per_tok=4,
                              num_hidden_layers=3, hidden_size=64, n_routed_experts=16, n_group=4,
                              topk_group=2)


if __name__ == "__main__":
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (or through pytest)")
    if len(sys.argv) > 1:
        check_decoder(Path(sys.argv[1]))
        print("SIM DSA CHECKS PASSED", flush=True)
    else:
        run_sim_checks()
