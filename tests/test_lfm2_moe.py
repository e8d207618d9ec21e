"""LFM2-MoE (engine/models/lfm2_moe.py) on the CPU backend: the gated short conv kernel against its
numpy oracle, and the oracle against transformers' Lfm2MoeShortConv with its conv cache."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_err
from kernels_numba import cpu_shortconv as K
from kernels_numba import reference as ref

rng = np.random.default_rng()


def _rnd(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- the short conv kernel against its oracle, the oracle against the reference's ------------

@pytest.mark.parametrize("t,kc,bias", [(1, 3, False), (7, 3, True), (2, 4, False), (5, 1, True)])
def test_gated_short_conv_kernel(t, kc, bias):
    """The kernel through its rolling state (carried in, fewer tokens than the state's rows too)
    against reference.gated_short_conv, output poisoned first."""
    h = 20
    bcx, w, state = _rnd(t, 3 * h), _rnd(h, kc), _rnd(kc - 1, h)
    b = _rnd(h) if bias else np.zeros(h, np.float32)
    want, want_state = ref.gated_short_conv(bcx, w, b if bias else None, state)
    out, st = np.full((t, h), np.nan, np.float32), state.copy()
    K.gated_short_conv(bcx, w, b, st, out)
    assert rel_err(out, want) < 1e-6
    if kc > 1:
        assert rel_err(st, want_state) < 1e-7


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_oracle_matches_reference_short_conv(bias):
    """reference.gated_short_conv (between in_proj and out_proj) is transformers' Lfm2MoeShortConv
    over a prompt and then token by token, its conv cache carried between the calls."""
    import torch
    import transformers as tf
    from transformers.models.lfm2_moe import modeling_lfm2_moe as M
    h, kc = 16, 3
    cfg = tf.Lfm2MoeConfig(vocab_size=32, hidden_size=h, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, layer_types=["conv", "full_attention"], conv_L_cache=kc,
                           conv_bias=bias, num_dense_layers=2)
    torch.manual_seed(int(rng.integers(1 << 31)))
    conv = M.Lfm2MoeShortConv(cfg, 0).eval()
    with torch.no_grad():
        for p in conv.parameters():
            p.normal_(0.0, 0.5)
    cache = tf.DynamicCache(config=cfg)
    xs = _rnd(9, h)
    state = np.zeros((kc - 1, h), np.float32)
    wi, wo = conv.in_proj.weight.detach().numpy(), conv.out_proj.weight.detach().numpy()
    wc = conv.conv.weight.detach().numpy().reshape(h, kc)
    bi, bc, bo = ((m.bias.detach().numpy() if bias else None) for m in (conv.in_proj, conv.conv, conv.out_proj))
    for lo, hi in ((0, 2), (2, 3), (3, 4), (4, 9)):   # a prompt shorter than the window, steps, a chunk
        with torch.no_grad():
            got = conv(torch.tensor(xs[lo:hi])[None], cache=cache)[0].numpy()
        bcx = xs[lo:hi].astype(np.float64) @ wi.T + (0 if bi is None else bi)
        y, state = ref.gated_short_conv(bcx.astype(np.float32), wc, bc, state)
        want = y.astype(np.float64) @ wo.T + (0 if bo is None else bo)
        assert rel_err(got, want) < 1e-5, (lo, hi)
