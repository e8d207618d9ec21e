"""Decode tokens sampled on the device against the host sampler (CpuOps.sample) on the same
logits and draws, under NUMBA_ENABLE_CUDASIM=1 (run by tests/test_device_sampling.py with a tiny
model folder). The simulator has no CUDA graphs: this runs the decoder's sampler segment, the
runtime's device path (the eager forward_sample), and the pipelined decode_stream with its
segments launched one by one; the graphs run on a GPU (tests/test_gpu_engine.py)."""
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import engine  # noqa: E402
from engine.runtime import GenerationParams  # noqa: E402
from test_cuda_kernels import near_cdf_step  # noqa: E402

SETTINGS = ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.9), (0.8, 5, 1.0), (1.2, 8, 0.8))


def main(model: Path) -> None:
    m = engine.load(model, device="cuda", max_context=16)
    dec = m.gpu
    dec.use_graphs = False
    assert m._samples_on_device(GenerationParams()) and dec.plan.all_resident
    # "auto": greedy and uncut draws on the device, top-k / top-p cuts on the host
    assert m._samples_on_device(GenerationParams(temperature=1.0))
    assert not m._samples_on_device(GenerationParams(temperature=0.7, top_p=0.9))
    assert not m._samples_on_device(GenerationParams(temperature=0.7, top_k=20))
    prompt = [3, 5, 7]
    # the decoder's sampler segment on the logits the head just made (logits_d row 0)
    st = dec.new_state(8)
    logits = dec.forward(np.array(prompt), st)[-1]
    n = 0
    for temp, top_k, top_p in SETTINGS:
        u = next(u for u in (0.15, 0.5, 0.8) if not near_cdf_step(logits, temp, top_k, top_p, u))
        dec.samp_h[1] = (temp, top_k, top_p, u)
        dec._seg_sample(1)
        dec.cs.synchronize()
        want = m.ops.sample(logits, temp, top_k, top_p, u)
        assert int(dec.tok_out_h[1]) == want, (temp, top_k, top_p, u, int(dec.tok_out_h[1]), want)
        n += 1
    print(f"decoder: {n} draws match", flush=True)
    # the runtime: a seeded stream through either path (without graphs: forward_sample)
    kw = dict(temperature=0.7, top_p=0.9, seed=11)
    m.sample_on_device = True
    a = m.generate(prompt, max_new_tokens=3, **kw)
    m.sample_on_device = False
    b = m.generate(prompt, max_new_tokens=3, **kw)
    assert a.output_ids == b.output_ids, (a.output_ids, b.output_ids)
    assert a.stats["decode_tokens"] == b.stats["decode_tokens"] == 2
    print(f"runtime: {a.output_ids}", flush=True)
    # pipelined: token i + 1 launched before token i is read, its input and position from the
    # device; closed after two ids (as at a stop id) with a third in flight
    st = dec.new_state(16)
    rng = np.random.default_rng(11)
    first = m.ops.sample(dec.forward(np.array(prompt), st)[-1], 0.7, 0, 0.9, rng.random())
    assert first == b.output_ids[0]
    gen = dec.decode_stream(first, st, 0.7, 0, 0.9, rng.random, 3)
    got = [next(gen), next(gen)]
    gen.close()
    assert got == b.output_ids[1:], (got, b.output_ids)
    assert st.pos == len(prompt) + 2, st.pos
    assert int(dec.one.pos.copy_to_host()[0]) == st.pos + 1   # the extra token's position + 1
    print(f"pipelined: {got}", flush=True)
    print("OK", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
