"""Prompt prefix reuse (Engine(prefix_cache=True), on in engine.serve): a prompt that begins with
the ids the last generation ran through the model resumes from its run state.

Tiny random models on the CPU backend: qwen3_moe (KV cache only: the state goes back to any
shared prefix) and qwen3_next (a DeltaNet recurrent state: resumed only where the prompt
extends everything the state holds). Each resumed generation must be the greedy continuation
that a fresh engine computes for the whole prompt."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from engine.demo import DEMO_CONFIG, build_random_model
from engine.runtime import GenerationParams

MOE = dict(DEMO_CONFIG, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           num_experts=4, max_position_embeddings=512)
HYBRID = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=300,
              hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
              shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
              intermediate_size=64, eos_token_id=299)
TIE = 1e-4


def fresh_greedy_ok(fresh, prompt, got) -> None:
    """got is the greedy continuation of prompt by an engine without reuse: equal argmax at each
    step, or a near-tie (top-2 within TIE of the largest logit) after which the two may part."""
    logits = fresh.logits(list(prompt) + list(got))
    for i, tok in enumerate(got):
        row = logits[len(prompt) + i - 1]
        best = int(np.argmax(row))
        if tok != best:
            assert row[best] - row[tok] <= TIE * max(1.0, float(np.abs(row).max())), (i, tok, best)
            return


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"weights seed {seed}")
    d = tmp_path_factory.mktemp("prefix")
    return {name: build_random_model(d / name, cfg, seed=seed)
            for name, cfg in (("moe", MOE), ("hybrid", HYBRID))}


def test_kv_cache_state_goes_back_to_the_shared_prefix(models):
    m = engine.load(models["moe"], device="cpu", prefix_cache=True)
    fresh = engine.load(models["moe"], device="cpu")
    rng = np.random.default_rng()
    p1 = rng.integers(0, 250, 12).tolist()
    r1 = m.generate(p1, max_new_tokens=6)
    assert r1.stats["prefill_cached_tokens"] == 0
    # a chat's next turn: the prompt, 4 of the 5 generated ids the model took in (the sixth
    # was never fed), new ids; the state (12 + 6 rows) is too small and grows, keeping 16
    p2 = p1 + r1.output_ids[:4] + rng.integers(0, 250, 5).tolist()
    r2 = m.generate(p2, max_new_tokens=8)
    assert r2.stats["prefill_cached_tokens"] == 16
    assert r2.stats["prefill_tokens"] == len(p2)
    fresh_greedy_ok(fresh, p2, r2.output_ids)
    # an earlier turn edited: back to the 7 ids still shared, in the same (large enough) state
    p3 = p2[:7] + [(p2[7] + 1) % 250] + p2[8:12]
    r3 = m.generate(p3, max_new_tokens=6)
    assert r3.stats["prefill_cached_tokens"] == 7
    fresh_greedy_ok(fresh, p3, r3.output_ids)
    # the same prompt again: all but its last id (whose logits start the generation)
    r4 = m.generate(p3, max_new_tokens=6)
    assert r4.stats["prefill_cached_tokens"] == len(p3) - 1
    fresh_greedy_ok(fresh, p3, r4.output_ids)


def test_recurrent_state_resumes_only_at_its_end(models):
    m = engine.load(models["hybrid"], device="cpu", prefix_cache=True)
    fresh = engine.load(models["hybrid"], device="cpu")
    rng = np.random.default_rng()
    p1 = rng.integers(0, 250, 10).tolist()
    r1 = m.generate(p1, max_new_tokens=5)
    p2 = p1 + r1.output_ids[:4] + rng.integers(0, 250, 3).tolist()   # extends all 14 it holds
    r2 = m.generate(p2, max_new_tokens=6)
    assert r2.stats["prefill_cached_tokens"] == 14
    fresh_greedy_ok(fresh, p2, r2.output_ids)
    p3 = p2[:5] + [(p2[5] + 1) % 250]   # shares 5, but the recurrent state cannot go back
    r3 = m.generate(p3, max_new_tokens=4)
    assert r3.stats["prefill_cached_tokens"] == 0
    fresh_greedy_ok(fresh, p3, r3.output_ids)


def test_off_by_default_and_forgotten(models):
    m = engine.load(models["moe"], device="cpu")
    p = list(range(20, 32))
    m.generate(p, max_new_tokens=3)
    assert m.generate(p, max_new_tokens=3).stats["prefill_cached_tokens"] == 0
    m.prefix_cache = True
    m.generate(p, max_new_tokens=3)
    assert m.generate(p, max_new_tokens=3).stats["prefill_cached_tokens"] == len(p) - 1
    m.logits(p[:4])          # another sequence went through the model: nothing to resume
    assert m.generate(p, max_new_tokens=3).stats["prefill_cached_tokens"] == 0
    m.release_state()
    assert m.generate(p, max_new_tokens=3).stats["prefill_cached_tokens"] == 0


def test_stopped_early_keeps_what_went_in(models):
    """A caller that stops reading (a stop string, a client gone) leaves the state holding the
    prompt and the ids fed so far; an error leaves nothing to resume."""
    m = engine.load(models["moe"], device="cpu", prefix_cache=True)
    p = list(range(40, 52))
    gen = m.stream(p, GenerationParams(max_new_tokens=10))
    got = [next(gen) for _ in range(4)]
    gen.close()
    r = m.generate(p + got + [5], max_new_tokens=2)
    assert r.stats["prefill_cached_tokens"] == len(p) + 3   # the fourth id never went in

    def broken(*a, **k):
        raise RuntimeError("expert fetch failed")
    m.model.forward, forward = broken, m.model.forward
    with pytest.raises(RuntimeError):
        m.generate(p + [1, 2], max_new_tokens=3)
    m.model.forward = forward
    assert m.generate(p, max_new_tokens=2).stats["prefill_cached_tokens"] == 0
