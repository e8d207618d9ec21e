"""Planner arithmetic and refusals; routing profile round trip."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.planner import GB, RESERVE_BYTES, PlanError, plan
from engine.profile import ProfileError, RoutingProfile

BLOCK = 2_654_208   # an NVFP4 Qwen3-30B-A3B expert block


def base(**kw):
    d = dict(vram_gb=8, ram_gb=16, dense_bytes=int(1.9 * GB), kv_bytes=int(0.4 * GB),
             run_state_bytes=64 << 20, block_bytes=BLOCK, top_k=8, total_experts=48 * 128)
    d.update(kw)
    return d


def test_plan_fills_vram_with_hot_experts():
    p = plan(**base())
    fixed = RESERVE_BYTES + int(1.9 * GB) + int(0.4 * GB) + (64 << 20)
    assert p.bank_slots == 16
    assert p.hot_slots == (8 * 10**9 - fixed - 16 * BLOCK) // BLOCK
    assert p.vram_used <= p.vram_budget < p.vram_used + BLOCK
    assert p.ram_slots == 16 * 10**9 // BLOCK
    assert not p.all_resident
    text = p.describe()
    assert f"hot set {p.hot_slots} of 6144 experts" in text and "streamed" in text


def test_plan_all_resident_when_it_fits():
    p = plan(**base(vram_gb=40))
    assert p.all_resident and p.hot_slots == 6144


def test_plan_hot_limit():
    assert plan(**base(hot_limit=100)).hot_slots == 100


def test_plan_refuses_with_the_minimum():
    with pytest.raises(PlanError) as e:
        plan(**base(vram_gb=2))
    need = (RESERVE_BYTES + int(1.9 * GB) + int(0.4 * GB) + (64 << 20) + 16 * BLOCK) / GB
    assert f"minimum of {need:.2f} GB" in str(e.value) and "--vram-gb 2" in str(e.value)
    assert "--kv-cache bf16" not in str(e.value)
    with pytest.raises(PlanError, match=r"lower --max-context or pass --kv-cache bf16 to shrink"):
        plan(**base(vram_gb=2, kv_halvable=True))


def test_plan_refuses_ram_below_one_layer():
    with pytest.raises(PlanError, match="--ram-gb 0.01 holds 3 expert blocks"):
        plan(**base(ram_gb=0.01))


def test_profile_round_trip_and_rank(tmp_path):
    prof = RoutingProfile(3, 6)
    prof(0, np.array([[5, 1], [5, 2]]))
    prof(2, np.array([[4, 5]]))
    prof.save(tmp_path / "p.json")
    back = RoutingProfile.load(tmp_path / "p.json", 3, 6)
    assert np.array_equal(back.counts, prof.counts)
    # by count, never by index: (0, 5) routed twice comes first
    assert back.hot_set(3) == [(0, 5), (0, 1), (0, 2)]
    assert back.ranked() == [(0, 5), (0, 1), (0, 2), (2, 4), (2, 5)]
    with pytest.raises(ProfileError, match="3 layers x 6 experts, this model has 4 x 6"):
        RoutingProfile.load(tmp_path / "p.json", 4, 6)


def test_profile_skips_slots_without_a_block():
    """-1, a slot routed to no expert block (LongCat-Flash's zero experts), is not counted (nor
    taken for the last expert)."""
    prof = RoutingProfile(2, 4)
    prof(1, np.array([[3, -1], [-1, -1], [0, 3]]))
    assert prof.counts.tolist() == [[0, 0, 0, 0], [1, 0, 0, 2]]


def test_profile_out_from_generate(tiny_qwen, tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--model", str(tiny_qwen), "--prompt-ids",
                        "1,2,3,4", "--max-new-tokens", "5", "--device", "cpu", "--json",
                        "--profile-out", str(tmp_path / "prof.json")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    prof = RoutingProfile.load(tmp_path / "prof.json", 2, 4)
    # every token routes top-2 in each of 2 layers: (4 prompt + 4 decoded) x 2 per layer
    assert prof.counts.sum(axis=1).tolist() == [16, 16]


def test_plan_streams_dense_layers_that_do_not_fit():
    layers = {l: 100 << 20 for l in range(48)}          # 4.8 GB of per-layer dense weights
    glob = int(0.7 * GB)                                # lm_head, norms: always resident
    dense = glob + sum(layers.values())
    kw = base(dense_bytes=dense, dense_layer_bytes=layers, vram_gb=4)
    p = plan(**kw)
    fixed = RESERVE_BYTES + int(0.4 * GB) + (64 << 20) + 16 * BLOCK
    n = len(p.dense_streamed)
    # the fewest layers: one fewer would not fit beside the two slots
    assert p.dense_slot_bytes == 100 << 20
    assert fixed + dense - n * (100 << 20) + 2 * (100 << 20) <= 4 * 10**9
    assert fixed + dense - (n - 1) * (100 << 20) + 2 * (100 << 20) > 4 * 10**9
    assert p.dense_streamed == tuple(range(48 - n, 48)) and not p.all_resident
    assert p.vram_used <= p.vram_budget
    assert "stream from host RAM" in p.describe()
    # the streamed layers stay pinned in host RAM: they come out of the RAM budget
    assert p.dense_host_bytes == n * (100 << 20)
    assert p.ram_slots == (16 * 10**9 - n * (100 << 20)) // BLOCK
    tight = (n * (100 << 20) + 7 * BLOCK) / GB          # room for 7 blocks beside them, not 8
    with pytest.raises(PlanError, match=r"holds 7 expert blocks beside the .* GB of dense layers"):
        plan(**{**kw, "ram_gb": tight})
    # nothing streams when it fits
    assert plan(**base(dense_bytes=dense, dense_layer_bytes=layers, vram_gb=8)).dense_streamed == ()
    # below the floor (every layer streamed) the refusal names that minimum
    with pytest.raises(PlanError, match="streaming every layer's dense weights would need"):
        plan(**base(dense_bytes=dense, dense_layer_bytes=layers, vram_gb=1))
