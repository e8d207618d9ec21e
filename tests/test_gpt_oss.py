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
