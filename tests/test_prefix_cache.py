"""Prompt prefix reuse (Engine(prefix_cache=True), on in engine.serve): a prompt that begins with
the ids the last generation ran through the model resumes from its run state.

Tiny random models on the CPU backend: qwen3_moe (KV cache only: the state goes back to any
shared prefix) and qwen3_next (a DeltaNet recurrent state: resumed only where the prompt
extends everything the state holds). Every forward pass of a resumed generation must give the
logits of the same passes replayed on a fresh model in one state that is never given back
(the state the cache kept is the one those passes would leave), and the greedy continuation
must be a fresh engine's for the whole prompt (up to near-ties)."""
from __future__ import annotations

from types import SimpleNamespace

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
MLA = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=300,
           hidden_size=48, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
           rms_norm_eps=1e-6, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
           qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, intermediate_size=64, first_k_dense_replace=1,
           n_group=1, topk_group=1, eos_token_id=299)
TIE = 1e-3


class Recorder:
    """Wraps an engine's model.forward: keeps the logits of each call of the current generation
    (the first is its prefill), every call's ids and the position it began at, and can make the
    call numbered fail_at raise."""

    def __init__(self, m, fail_at: int | None = None):
        self.m, self.forward, self.fail_at = m, m.model.forward, fail_at
        self.calls, self.logits, self.history = 0, [], []
        m.model.forward = self

    def __call__(self, ids, st, all_logits=False):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("expert fetch failed")
        self.history.append((np.array(ids), st.pos))
        out = self.forward(ids, st, all_logits)
        self.logits.append(np.array(out[-1]))
        return out


def run(m, rec, prompt, n) -> tuple[list, dict]:
    """n greedy ids after prompt (no stop id: a random model may draw its EOS early)."""
    stats: dict = {}
    rec.logits.clear()
    out = list(m.stream(prompt, GenerationParams(max_new_tokens=n, stop_ids=()), stats))
    return out, stats


def gen(m, prompt, n) -> SimpleNamespace:
    """m.generate with no stop id: a random model may draw its EOS early, and these tests count
    the ids each generation fed."""
    stats: dict = {}
    out = list(m.stream(prompt, GenerationParams(max_new_tokens=n, stop_ids=()), stats))
    return SimpleNamespace(output_ids=out, stats=stats)


def replay(fresh, history) -> list:
    """The last logits of each recorded pass, replayed in order on fresh's model: a new state
    where a pass began at position 0, else the replay's one state set to the recorded position
    (a KV cache going back). Same ids, same kernels, same order: the same numbers, unless the
    engine resumed from a state other than the one those passes leave."""
    model, st, out = fresh.model, None, []
    for ids, pos in history:
        if pos == 0:
            st = model.new_state(256)
        assert st.pos >= pos   # the engine never resumes past what the state holds
        st.pos = pos
        out.append(np.array(model.forward(ids, st)[-1]))
    return out


def check_fresh(fresh, rec, prompt, got) -> None:
    """Each pass of the last generation gives the replay's logits; got is the greedy
    continuation of the fresh engine's whole-prompt prefill: the same argmax each step, or a
    near-tie after which the two may part (that prefill takes other kernel paths than the
    resumed one, and a near-tie in a router may pick another expert: no tight bound there)."""
    want = replay(fresh, rec.history)[-len(rec.logits):]
    for i, (a, b) in enumerate(zip(rec.logits, want)):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), i
    want = fresh.logits(list(prompt) + list(got))
    for i, tok in enumerate(got):
        row = want[len(prompt) + i - 1]
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
            for name, cfg in (("moe", MOE), ("hybrid", HYBRID), ("mla", MLA))}


def other(t: int) -> int:
    return (t + 1) % 250


def first_turn(models, name, n_prompt, n_new):
    """(engine with the cache, fresh engine, its recorder, rng, prompt, generated ids)."""
    m = engine.load(models[name], device="cpu", prefix_cache=True)
    fresh = engine.load(models[name], device="cpu")
    rec = Recorder(m)
    rng = np.random.default_rng()
    p1 = rng.integers(0, 250, n_prompt).tolist()
    out1, s1 = run(m, rec, p1, n_new)
    assert s1["prefill_cached_tokens"] == 0
    return m, fresh, rec, rng, p1, out1


def test_kv_cache_state_goes_back_to_the_shared_prefix(models):
    m, fresh, rec, rng, p1, out1 = first_turn(models, "moe", 12, 6)
    # a chat's next turn: the prompt, 4 of the 5 generated ids the model took in (the sixth
    # never went in), then an id that is not the fifth; the state (12 + 6 rows) is too small
    # and grows, keeping 16
    p2 = p1 + out1[:4] + [other(out1[4])] + rng.integers(0, 250, 4).tolist()
    out2, s2 = run(m, rec, p2, 8)
    assert (s2["prefill_cached_tokens"], s2["prefill_tokens"]) == (16, len(p2))
    check_fresh(fresh, rec, p2, out2)
    # an earlier turn edited: back to the 7 ids still shared, in the same (large enough) state
    p3 = p2[:7] + [other(p2[7])] + p2[8:12]
    out3, s3 = run(m, rec, p3, 6)
    assert s3["prefill_cached_tokens"] == 7
    check_fresh(fresh, rec, p3, out3)
    # the same prompt again: all but its last id (whose logits start the generation)
    out4, s4 = run(m, rec, p3, 6)
    assert s4["prefill_cached_tokens"] == len(p3) - 1
    check_fresh(fresh, rec, p3, out4)


def test_recurrent_state_resumes_only_at_its_end(models):
    m, fresh, rec, rng, p1, out1 = first_turn(models, "hybrid", 10, 5)
    p2 = p1 + out1[:4] + rng.integers(0, 250, 3).tolist()   # extends all 14 ids it holds
    out2, s2 = run(m, rec, p2, 6)
    assert s2["prefill_cached_tokens"] == 14
    check_fresh(fresh, rec, p2, out2)
    p3 = p2[:5] + [other(p2[5])]   # shares 5, but the recurrent state cannot go back
    out3, s3 = run(m, rec, p3, 4)
    assert s3["prefill_cached_tokens"] == 0
    check_fresh(fresh, rec, p3, out3)


def test_a_request_between_turns_changes_nothing(models):
    """A UI's title request between two turns of a chat takes the live state; the chat's next
    turn resumes from the copy saved before it did, exactly as if the request had not come:
    the same ids resumed, the same prefill logits (bit for bit), the same tokens. Without
    room for copies (prefix_cache_gb=0) the turn starts from nothing."""
    rng = np.random.default_rng()
    p1 = rng.integers(0, 250, 14).tolist()
    title = [other(p1[0])] + rng.integers(0, 250, 9).tolist()
    for name in ("moe", "hybrid", "mla"):   # a KV cache, a recurrent state, a latent cache
        runs = {}
        for between in (False, True):
            m = engine.load(models[name], device="cpu", prefix_cache=True)
            rec = Recorder(m)
            out1, _ = run(m, rec, p1, 5)
            if between:
                run(m, rec, title, 3)
            # the next turn leaves the 16 ids turn 1 fed at the fourth generated one
            p2 = (p1 + out1[:3] + [other(out1[3])] + rng.integers(0, 250, 3).tolist()
                  if not runs else runs[False][2])
            out2, s2 = run(m, rec, p2, 6)
            runs[between] = (out2, s2, p2, rec.logits[0])
        (a, sa, _, la), (b, sb, _, lb) = runs[False], runs[True]
        if name == "hybrid":   # the recurrent state: back to the copy at turn 1's prompt end
            assert sa["prefill_cached_tokens"] == sb["prefill_cached_tokens"] == len(p1)
            assert sa["prefill_cached_from"] == sb["prefill_cached_from"] == "saved"
        else:                  # a cache: back to the 15 shared ids, of the live state or a copy
            assert sa["prefill_cached_tokens"] == sb["prefill_cached_tokens"] == len(p1) + 3, name
            assert (sa["prefill_cached_from"], sb["prefill_cached_from"]) == ("live", "saved")
        assert a == b and np.array_equal(la, lb), name
        m = engine.load(models[name], device="cpu", prefix_cache=True, prefix_cache_gb=0)
        out1 = gen(m, p1, 5).output_ids
        gen(m, title, 3)
        r = gen(m, p1 + out1[:4] + [1, 2], 2)
        assert r.stats["prefill_cached_tokens"] == 0 and not m.saved.items


def test_copies_within_a_small_budget(models):
    """A budget that holds one copy: saving the live state evicts the copy the prompt resumes
    from, which still serves it; a recurrent live state that a longer copy extends is saved
    before that copy replaces it (a prompt extending the live ids finds them later)."""
    m = engine.load(models["moe"], device="cpu", prefix_cache=True)
    m.saved.budget = m.model.new_state(32).save_nbytes(20)
    p1 = list(range(10, 22))
    a = gen(m, p1, 6).output_ids
    gen(m, [200, 201, 202, 203, 204], 3)
    r = gen(m, p1 + a[:5] + [5, 6], 3)
    assert (r.stats["prefill_cached_tokens"], r.stats["prefill_cached_from"]) == (17, "saved")
    assert [len(s.ids) for s in m.saved.items] == [7]   # the title request's, which evicted it

    h = engine.load(models["hybrid"], device="cpu", prefix_cache=True)
    x = [10, 11, 12, 13, 14, 15]
    o = gen(h, x, 2).output_ids
    p = x + [o[0], 20, 21, 22]
    gen(h, p, 3)
    gen(h, x, 2)   # live: x and o[0], which the copy at p's end extends
    r = gen(h, p + [99], 2)
    assert (r.stats["prefill_cached_tokens"], r.stats["prefill_cached_from"]) == (len(p), "saved")
    r = gen(h, x + [o[0], 98, 97], 2)
    assert (r.stats["prefill_cached_tokens"], r.stats["prefill_cached_from"]) == (7, "saved")


def test_recurrent_state_kept_at_the_prompt_end(models):
    """A chat template that rewrites the last reply in the history (Qwen3 drops the reasoning)
    gives a next prompt that leaves the generated ids early: a recurrent model resumes at the
    end of the last prompt, from the copy kept there; its logits are those of the two prompts'
    pieces prefilled one after the other."""
    m, fresh, rec, rng, p1, out1 = first_turn(models, "hybrid", 12, 5)
    p2 = p1 + [other(out1[0])] + rng.integers(0, 250, 4).tolist()
    out2, s2 = run(m, rec, p2, 4)
    assert (s2["prefill_cached_tokens"], s2["prefill_cached_from"]) == (len(p1), "saved")
    st = fresh.model.new_state(64)
    fresh.model.forward(np.asarray(p1), st)
    want = np.asarray(fresh.model.forward(np.asarray(p2[len(p1):]), st))[-1]
    assert np.array_equal(rec.logits[0], want)
    m.release_state()
    assert not m.saved.items
    assert run(m, rec, p2, 2)[1]["prefill_cached_tokens"] == 0


def test_same_prompt_again_starts_decoding_at_once(models):
    """A recurrent model given the same prompt again (a retry, a UI's "regenerate") resumes all
    of it from the copy kept at its end, with that copy's last logits: no forward pass prefills
    anything, and the greedy continuation is the first run's (seeded sampling draws the same
    ids too); the prompt-end copy is not saved a second time (the first run's live state is, for
    a next turn that extends what it generated)."""
    m, fresh, rec, rng, p1, out1 = first_turn(models, "hybrid", 12, 6)
    calls = len(rec.history)
    out2, s2 = run(m, rec, p1, 6)
    assert (s2["prefill_cached_tokens"], s2["prefill_cached_from"]) == (len(p1), "saved")
    assert out2 == out1
    assert [len(ids) for ids, _ in rec.history[calls:]] == [1] * 5   # decode steps only
    assert [len(c.ids) for c in m.saved.items if c.logits is not None] == [len(p1)]
    params = GenerationParams(max_new_tokens=6, temperature=1.0, seed=7, stop_ids=())
    a = list(m.stream(p1, params, {}))
    b = list(m.stream(p1, params, {}))
    assert a == b == list(fresh.stream(p1, params, {}))


def test_store_keeps_what_serves_and_fits():
    """PrefixStore: the copy a prompt goes furthest into; a copy whose ids another begins with
    goes (KV cache) or stays (recurrent: it serves other prompts); least recently used out
    first within the budget; one larger than the budget is refused."""
    from engine.prefix import PrefixStore, usable
    a = {"k": np.zeros(10, np.float32)}   # 40 bytes
    kv = PrefixStore(100, rewinds=True)
    assert kv.add([1, 2, 3], a) and kv.add([1, 2, 3, 4, 5], a)
    assert [s.ids for s in kv.items] == [[1, 2, 3, 4, 5]]   # holds all the first one did
    assert kv.covers([1, 2]) and not kv.covers([1, 2, 9])
    kv.add([7, 8], a)
    assert kv.best([1, 2, 3, 4, 9, 9], 5)[1] == 4 and kv.best([1, 2], 1)[1] == 1
    kv.touch(kv.items[0])                 # [1..5] used last: [7, 8] goes first
    kv.add([9], a)
    assert [s.ids for s in kv.items] == [[1, 2, 3, 4, 5], [9]]
    assert not kv.add([5], {"k": np.zeros(30, np.float32)}) and kv.nbytes == 80
    rec = PrefixStore(100, rewinds=False)
    rec.add([1, 2, 3], a)
    rec.add([1, 2, 3, 4, 5], a)
    assert len(rec.items) == 2 and not rec.covers([1, 2])
    assert rec.best([1, 2, 3, 4, 9], 4) == (rec.items[0], 3)
    assert usable([1, 2, 3], [1, 2, 9], 2, False) == 0 and usable([1, 2, 3], [1, 2, 9], 2, True) == 2


def test_off_by_default_and_forgotten(models):
    m = engine.load(models["moe"], device="cpu")
    p = list(range(20, 32))
    gen(m, p, 3)
    assert gen(m, p, 3).stats["prefill_cached_tokens"] == 0
    m.prefix_cache = True
    gen(m, p, 3)
    assert gen(m, p, 3).stats["prefill_cached_tokens"] == len(p) - 1
    m.logits(p[:4])          # another sequence went through the model: nothing live to resume,
    r = gen(m, p, 3)   # but the copy saved when the second run began
    assert (r.stats["prefill_cached_tokens"], r.stats["prefill_cached_from"]) == (len(p) - 1, "saved")
    m.logits(p[:4])
    m.saved.clear()
    assert gen(m, p, 3).stats["prefill_cached_tokens"] == 0
    m.release_state()
    assert gen(m, p, 3).stats["prefill_cached_tokens"] == 0


def test_stopped_early_keeps_what_went_in(models):
    """A caller that stops reading (a stop string, a client gone) leaves the state holding the
    prompt and the ids fed so far; a generator closed after another generation took the state
    leaves it alone; a failed decode step leaves nothing live to resume (the hybrid: its
    recurrent state has moved), only the copy kept at the prompt's end."""
    m = engine.load(models["moe"], device="cpu", prefix_cache=True)
    p = list(range(40, 52))
    it = m.stream(p, GenerationParams(max_new_tokens=10, stop_ids=()))
    got = [next(it) for _ in range(4)]
    it.close()
    r = gen(m, p + got + [5], 2)
    assert r.stats["prefill_cached_tokens"] == len(p) + 3   # the fourth id never went in
    old = m.stream(p, GenerationParams(max_new_tokens=10, stop_ids=()))
    next(old)
    q = list(range(60, 70))
    gen(m, q, 3)
    old.close()              # must not claim that the state holds p
    assert gen(m, q + [1], 2).stats["prefill_cached_tokens"] == len(q)

    h = engine.load(models["hybrid"], device="cpu", prefix_cache=True)
    rec = Recorder(h, fail_at=3)   # the prefill, one decode step, then a failure
    with pytest.raises(RuntimeError):
        run(h, rec, p, 5)
    rec.fail_at = None
    s = run(h, rec, p + [1], 2)[1]   # not the live state: the copy kept at the prompt's end
    assert (s["prefill_cached_tokens"], s["prefill_cached_from"]) == (len(p), "saved")
    h = engine.load(models["hybrid"], device="cpu", prefix_cache=True, prefix_cache_gb=0)
    rec = Recorder(h, fail_at=3)
    with pytest.raises(RuntimeError):
        run(h, rec, p, 5)
    rec.fail_at = None
    assert run(h, rec, p + [1], 2)[1]["prefill_cached_tokens"] == 0
