"""The cuda backend end to end (GPU machine, marker gpu): same greedy tokens as the CPU backend
and transformers (bf16 experts), and streaming under tiny budgets never changes the result."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from conftest import (assert_greedy, build_hf_model, check_device_sampling_equals_host,
                      check_graph_replay_equals_eager, hf_reference, load_streamed,
                      record_prefills, rel_err)
from engine.pack import pack

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family,over", [
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=8, norm_topk_prob=False, mlp_only_layers=[1])),
    ("mixtral", dict(sliding_window=5)),
    ("olmoe", dict(clip_qkv=0.6)),
])
def test_cuda_matches_cpu_and_transformers(tmp_path, family, over):
    build_hf_model(tmp_path, family, dtype="bfloat16", **over)
    ref = hf_reference(tmp_path)
    ids = np.random.default_rng().integers(0, 300, 12).tolist()
    g = engine.load(tmp_path, device="cuda")
    c = engine.load(tmp_path, device="cpu")
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert rel_err(g.logits(ids), want) < 1e-4
    assert_greedy(ref, ids[:5], g.generate(ids[:5], max_new_tokens=32).output_ids, 32)
    assert_greedy(ref, ids[:5], c.generate(ids[:5], max_new_tokens=32).output_ids, 32)


def packed_on_cuda(tmp_path, fmt="nvfp4", prompt_len=40, experts=16, top_k=4, layers=3):
    """A small qwen3_moe packed as fmt, a random prompt, and the model loaded on cuda with every
    budget left at its default."""
    build_hf_model(tmp_path / "src", "qwen3_moe", num_experts=experts, num_experts_per_tok=top_k,
                   num_hidden_layers=layers, hidden_size=64)
    pack(tmp_path / "src", tmp_path / "p", fmt, progress=False)
    prompt = np.random.default_rng().integers(0, 300, prompt_len).tolist()
    return tmp_path / "p", prompt, engine.load(tmp_path / "p", device="cuda")


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
def test_streaming_under_tiny_budgets_same_tokens(tmp_path, fmt):
    folder, prompt, big = packed_on_cuda(tmp_path, fmt)
    assert big.plan.all_resident
    a = big.generate(prompt, max_new_tokens=24)
    bb = big.gpu.res.block_bytes
    # VRAM: the minimum (two banks of top-k); RAM: 5 blocks per layer of 16 experts
    small = engine.load(folder, device="cuda", ram_gb=3 * 5 * bb / 1e9,
                        vram_gb=(big.plan.vram_used - big.plan.hot_slots * bb) / 1e9,
                        prefill_batch=4)
    assert small.plan.hot_slots == 0
    b = small.generate(prompt, max_new_tokens=24)
    assert a.output_ids == b.output_ids
    # one graph a token, the host serving the layers that route to experts not in VRAM; the
    # per-layer path (every layer's ids through the host) gives the same tokens
    assert small.gpu._devres and b.stats["vram"]["h2d_wait_s"] > 0
    small.gpu.device_resolve = False
    assert small.generate(prompt, max_new_tokens=24).output_ids == a.output_ids
    assert not small.gpu._devres
    cpu = engine.load(folder, device="cpu").generate(prompt, max_new_tokens=24)
    assert cpu.output_ids == a.output_ids
    st = b.stats["vram"]
    assert st["disk_reads"] > 0 and b.stats["experts"]["evictions"] > 0


@pytest.mark.parametrize("fold", [False, True])
def test_gathered_from_ram_same_tokens(tmp_path, monkeypatch, fold):
    """VRAM room for more than the banks: the streamed token graph copies the routed experts
    that host RAM holds into VRAM itself (gm.expert_gather, no host round trip) and keeps them
    as LRU entries; tokens as with every expert resident, and as with the host copying them.
    fold: the gather and the gate in one launch (gm.expert_gate_gather)."""
    import engine.gpu
    monkeypatch.setattr(engine.gpu, "GATE_FOLD", fold)
    folder, prompt, big = packed_on_cuda(tmp_path)
    a = big.generate(prompt, max_new_tokens=24)
    bb = big.gpu.res.block_bytes
    # banks + 3 layers of staging + 8 LRU slots; RAM: 10 blocks a layer of 16
    vram = big.plan.vram_used - (big.plan.hot_slots - 4 * 3 - 8) * bb
    small = engine.load(folder, device="cuda", ram_gb=3 * 10 * bb / 1e9,
                        vram_gb=vram / 1e9, prefill_batch=4)
    # routing drawn on the device from the token number (which restarts at each capture)
    small.gpu.device_route, small.gpu.device_gather = "uniform", True
    b = small.generate(prompt, max_new_tokens=24)
    st = b.stats["vram"]
    assert small.gpu._devres and small.gpu._gather is not None
    assert st["gathered"] > 0 and st["disk_reads"] > 0
    small.gpu.device_gather = False      # the same routing, the host copying every miss
    small.gpu._drop_graphs()
    c = small.generate(prompt, max_new_tokens=24)
    assert small.gpu._gather is None and c.output_ids == b.output_ids
    # and with the model's own routing, against every expert resident
    small.gpu.device_gather, small.gpu.device_route = True, None
    small.gpu._drop_graphs()
    assert small.generate(prompt, max_new_tokens=24).output_ids == a.output_ids


@pytest.mark.parametrize("resident", [True, False])
def test_graph_replay_equals_eager(tmp_path, resident):
    src = tmp_path / "src"
    build_hf_model(src, "qwen3_moe", num_experts=8, num_experts_per_tok=2, hidden_size=64)
    pack(src, tmp_path / "p", "nvfp4", progress=False)
    prompt = np.random.default_rng().integers(0, 300, 9).tolist()
    check_graph_replay_equals_eager(tmp_path / "p", prompt, resident)


@pytest.mark.parametrize("resident", [True, False])
def test_device_sampling_equals_host_sampling(tmp_path, resident):
    """Seeded decode sampled on the device (greedy; temperature 0.7, top_p 0.9; top-k; plain
    temperature) == the host sampler from the logits, token for token."""
    src = tmp_path / "src"
    build_hf_model(src, "qwen3_moe", seed=5, num_experts=8, num_experts_per_tok=2, hidden_size=64)
    pack(src, tmp_path / "p", "nvfp4", progress=False)
    prompt = np.random.default_rng(1).integers(0, 300, 9).tolist()
    check_device_sampling_equals_host(tmp_path / "p", prompt, resident)


def test_pipelined_decode_leaves_a_consistent_state(tmp_path):
    """Resident decode launches token i + 1 before reading token i: ended at a stop id or by
    the caller, st.pos counts the ids read (the last one not fed), and feeding that id next
    gives the host path's logits (the extra token's KV row is simply overwritten)."""
    from itertools import islice

    from engine.runtime import GenerationParams
    src = tmp_path / "src"
    build_hf_model(src, "qwen3_moe", seed=5, num_experts=8, num_experts_per_tok=2, hidden_size=64)
    pack(src, tmp_path / "p", "nvfp4", progress=False)
    g = engine.load(tmp_path / "p", device="cuda")
    assert g.gpu.can_pipeline()
    prompt = np.random.default_rng(1).integers(0, 300, 9).tolist()
    full = g.generate(prompt, max_new_tokens=16, temperature=0.7, top_p=0.9, seed=7).output_ids
    stop = full[5]

    def run(on_device, params, take):
        g.sample_on_device = on_device
        gen = g.stream(prompt, params)
        ids = list(islice(gen, take))
        gen.close()
        pos = g.state.pos
        return ids, pos, g.model.forward(np.array([ids[-1]]), g.state)

    for params, take in ((GenerationParams(16, 0.7, 0, 0.9, 7, stop_ids=(stop,)), None),
                         (GenerationParams(16, 0.7, 0, 0.9, 7), 4)):
        ids, pos, logits = run(True, params, take)
        assert ids == full[:len(ids)] and ids[-1] == (stop if take is None else full[3])
        assert pos == len(prompt) + len(ids) - 1
        want = run(False, params, take)
        assert want[:2] == (ids, pos)
        assert rel_err(logits, want[2]) < 1e-5


def test_dense_layers_streamed_same_tokens(tmp_path):
    """A VRAM budget below the dense weights: the layers that don't fit stream from host RAM
    through two device slots, and the tokens stay the same."""
    folder, prompt, big = packed_on_cuda(tmp_path, prompt_len=12, experts=8, top_k=2, layers=6)
    assert big.plan.dense_streamed == ()
    a = big.generate(prompt, max_new_tokens=16)
    bb = big.gpu.res.block_bytes
    need = big.plan.vram_used - big.plan.hot_slots * bb     # the minimum with every layer resident
    small = engine.load(folder, device="cuda", vram_gb=(need - 1) / 1e9)
    assert len(small.plan.dense_streamed) >= 2 and not small.plan.all_resident
    # with --ram-gb set, their pinned host copies come out of it: the expert cache shrinks
    ram = engine.load(folder, device="cuda", vram_gb=(need - 1) / 1e9, ram_gb=0.01)
    assert ram.plan.dense_streamed == small.plan.dense_streamed and ram.plan.dense_host_bytes > 0
    assert ram.experts.budget == ram.plan.ram_slots * bb
    assert ram.experts.budget <= 0.01e9 - ram.plan.dense_host_bytes
    b = small.generate(prompt, max_new_tokens=16)
    assert a.output_ids == b.output_ids
    assert b.stats["vram"]["dense_h2d_bytes"] > 0
    small.gpu.use_graphs = False   # the eager path streams the same way
    assert small.generate(prompt, max_new_tokens=16).output_ids == a.output_ids


@pytest.mark.parametrize("resident", [True, False])
def test_prefix_cache_resumes_the_last_state(tmp_path, resident):
    """Engine(prefix_cache=True) on the cuda backend (the one preallocated state, its position
    set back, a copy of it in host RAM put back): a chat's next turn resumes what the last
    generation fed although a title request came between (from the copy saved before that
    request took the state), and an edited earlier turn goes back to the shared prefix. The
    resumed prefill's logits are those of the same passes replayed on a fresh engine's state
    (prefill, one decode step an id, then the rest), and the tokens are a fresh engine's for
    the whole prompt."""
    src = tmp_path / "src"
    build_hf_model(src, "qwen3_moe", num_experts=8, num_experts_per_tok=2, hidden_size=64)
    pack(src, tmp_path / "p", "nvfp4", progress=False)
    load = (lambda **kw: engine.load(tmp_path / "p", device="cuda", **kw)) if resident else \
        (lambda **kw: load_streamed(tmp_path / "p", **kw))
    m, fresh = load(prefix_cache=True), load()
    prefills = record_prefills(m)

    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"ids seed {seed}")
    rng = np.random.default_rng(seed)
    p1 = rng.integers(0, 300, 12).tolist()
    out1 = m.generate(p1, max_new_tokens=6).output_ids
    title = [(p1[0] + 1) % 300] + p1[1:5]
    out_t = m.generate(title, max_new_tokens=3).output_ids
    p2 = p1 + out1[:4] + [(out1[4] + 1) % 300] + rng.integers(0, 300, 4).tolist()
    r2 = m.generate(p2, max_new_tokens=8)
    assert (r2.stats["prefill_cached_tokens"], r2.stats["prefill_cached_from"]) == (16, "saved")
    p3 = p2[:7] + [(p2[7] + 1) % 300] + p2[8:12]
    r3 = m.generate(p3, max_new_tokens=6)
    assert (r3.stats["prefill_cached_tokens"], r3.stats["prefill_cached_from"]) == (7, "live")
    # the title request's state, copied out just before turn 2's copy was put in its place
    p4 = title + out_t[:2] + [1, 2]
    r4 = m.generate(p4, max_new_tokens=4)
    assert (r4.stats["prefill_cached_tokens"], r4.stats["prefill_cached_from"]) == (7, "saved")

    fm = fresh.model
    st = fm.new_state(64)
    fm.forward(np.array(p1), st)
    for t in out1[:4]:
        fm.forward(np.array([t]), st)
    want2 = fm.forward(np.array(p2[16:]), st)[-1]
    st.pos = 7
    want3 = fm.forward(np.array(p3[7:]), st)[-1]
    st = fm.new_state(64)
    fm.forward(np.array(title), st)
    for t in out_t[:2]:
        fm.forward(np.array([t]), st)
    want4 = fm.forward(np.array(p4[7:]), st)[-1]
    for got, want in ((prefills[-3], want2), (prefills[-2], want3), (prefills[-1], want4)):
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert r2.output_ids == fresh.generate(p2, max_new_tokens=8).output_ids
    assert r3.output_ids == fresh.generate(p3, max_new_tokens=6).output_ids
    assert r4.output_ids == fresh.generate(p4, max_new_tokens=4).output_ids
