"""Core pinning: flag parsing and its errors, the default choice, reader threads on their cores,
the decode thread pinned only while it generates."""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest

from engine import affinity as A

linux_only = pytest.mark.skipif(not A.CAN_PIN, reason="no os.sched_setaffinity on this platform")


# ---- parsing and the plan (no threads) ------------------------------------------------------------

def test_parse_cores_lists_and_ranges():
    assert A.parse_cores("0-3,6", allowed=range(8)) == (0, 1, 2, 3, 6)
    assert A.parse_cores(" 5 ,1", allowed=range(8)) == (1, 5)
    assert A.format_cores((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"


@pytest.mark.parametrize("text, msg", [
    ("x", "--reader-cores 'x': expected core ids and ranges like 0-3,6"),
    ("3-1", "--reader-cores '3-1': bad range '3-1'"),
    ("", "--reader-cores '': expected core ids and ranges like 0-3,6"),
    ("6-9", "--reader-cores 8-9: not among the cores this process may run on (allowed: 0-7)"),
])
def test_parse_cores_errors(text, msg):
    with pytest.raises(ValueError) as e:
        A.parse_cores(text, allowed=range(8))
    assert str(e.value) == msg


def test_parse_decode_core():
    assert A.parse_decode_core("auto") == "auto"
    assert A.parse_decode_core("none") is None and A.parse_decode_core("-1") is None
    assert A.parse_decode_core(-1) is None and A.parse_decode_core("3", allowed=range(4)) == 3
    with pytest.raises(ValueError, match=r"^--decode-core 4: not among the cores this process may "
                                         r"run on \(allowed: 0-3\)$"):
        A.parse_decode_core(4, allowed=range(4))
    with pytest.raises(ValueError, match="expected a core id, 'auto' or 'none'"):
        A.parse_decode_core("fast")


def test_plan_defaults():
    p = A.plan_cores("auto", None, "cuda", allowed=range(16))
    assert (p.decode, p.readers) == (15, tuple(range(15)))
    assert p.reader_mask == tuple(range(15))
    p = A.plan_cores("auto", None, "cpu", allowed=range(16))   # the cpu backend uses every core
    assert (p.decode, p.readers, p.reader_mask) == (None, tuple(range(16)), None)
    p = A.plan_cores("auto", None, "cuda", allowed=[0, 1])      # CI's two cores
    assert (p.decode, p.readers) == (1, (0,))
    p = A.plan_cores("auto", None, "cuda", allowed=[3])         # one core: readers share it
    assert (p.decode, p.readers) == (3, (3,)) and "shared" in p.why
    p = A.plan_cores("auto", "8-15", "cuda", allowed=range(16))  # decode avoids the reader cores
    assert (p.decode, p.readers) == (7, tuple(range(8, 16)))
    p = A.plan_cores(None, None, "cuda", allowed=range(4))
    assert (p.decode, p.reader_mask) == (None, None)
    p = A.plan_cores(2, [0, 1], "cpu", allowed=range(4))
    assert (p.decode, p.readers) == (2, (0, 1))
    assert p.as_dict() == {"decode_core": 2, "reader_cores": [0, 1], "allowed_cores": [0, 1, 2, 3],
                           "why": "as asked"}
    assert p.describe() == "cores: decode on core 2, readers on 0-1 (of 0-3; as asked)"
    with pytest.raises(ValueError, match=r"^--reader-cores 9: not among"):
        A.plan_cores("auto", [0, 9], "cuda", allowed=range(4))


def test_plan_without_affinity_notes_once(capsys):
    A._noted.clear()
    p = A.plan_cores(3, None, "cuda", allowed=None)
    A.plan_cores(3, None, "cuda", allowed=None)
    assert (p.decode, p.readers) == (None, None)
    err = capsys.readouterr().err
    assert err.count("cannot pin threads to cores") == 1


def test_cli_flag_errors(capsys):
    from engine.generate import parse_args
    allowed = A.format_cores(A.allowed_cores()) if A.CAN_PIN else None
    a = parse_args(["--decode-core", "none", "--reader-cores", "0"] if A.CAN_PIN and 0 in A.allowed_cores()
                   else ["--decode-core", "none"])
    assert a.decode_core is None
    if not A.CAN_PIN:
        return
    with pytest.raises(SystemExit) as e:
        parse_args(["--decode-core", "100000"])
    assert e.value.code == 2
    assert (f"error: argument --decode-core: 100000: not among the cores this process may run on "
            f"(allowed: {allowed})") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--reader-cores", "0,x"])
    assert "error: argument --reader-cores: '0,x': expected core ids" in capsys.readouterr().err


# ---- threads --------------------------------------------------------------------------------------

def _mask(tid: int) -> set:
    return os.sched_getaffinity(tid)


@linux_only
def test_reader_threads_run_on_their_cores(tmp_path):
    from loader.reader import ReaderPool
    core = A.allowed_cores()[0]
    path = tmp_path / "experts.arena"
    np.zeros(4 * 4096, np.uint8).tofile(path)
    seen = []

    class Probe(ReaderPool):
        def _pread(self, req):
            seen.append(os.sched_getaffinity(0))   # the reader thread's own mask
            super()._pread(req)

    main_mask = os.sched_getaffinity(0)
    with Probe(path, n_threads=3, cores=[core]) as pool:
        bufs = [np.frombuffer(mmap.mmap(-1, 4096), np.uint8) for _ in range(8)]
        for f in [pool.read(0, i, (i % 4) * 4096, 4096, bufs[i]) for i in range(8)]:
            f.result(timeout=10)
        assert pool.cores == (core,)
    assert seen and all(m == {core} for m in seen)
    assert os.sched_getaffinity(0) == main_mask
    with pytest.raises(ValueError, match="reader cores"):
        ReaderPool(path, n_threads=1, cores=[100000])


@linux_only
def test_decode_thread_pinned_while_generating_only():
    import engine
    from engine.demo import demo_model_dir
    from engine.runtime import GenerationParams
    allowed = A.allowed_cores()
    decode, readers = allowed[-1], (allowed[:-1] or allowed)
    m = engine.load(demo_model_dir(), device="cpu", decode_core=decode, reader_cores=list(readers))
    main_mask = os.sched_getaffinity(0)
    reader_tids = {t.native_id for t in m.experts.reader._threads}
    got = {}

    def run():
        before = os.sched_getaffinity(0)
        stats = {}
        gen = m.stream([1, 2, 3], GenerationParams(max_new_tokens=4), stats)
        next(gen)
        got["during"] = os.sched_getaffinity(0)
        me = threading.get_native_id()
        # numba's workers were started before the pin: only this thread is held to the decode core
        got["pinned_tasks"] = {int(t) for t in os.listdir("/proc/self/task")
                               if int(t) != me and _mask(int(t)) == {decode}} - reader_tids
        got["readers"] = {frozenset(_mask(t)) for t in reader_tids}
        list(gen)
        got["after"] = os.sched_getaffinity(0)
        got["before"], got["stats"] = before, stats

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=900)   # (a first run compiles the CPU kernels: minutes on a loaded 2-core machine)
    assert not t.is_alive(), "the generation did not finish in 900 s"
    assert got["during"] == {decode}
    assert got["after"] == got["before"]
    if len(allowed) > 1:
        assert not got["pinned_tasks"]
    assert got["readers"] == {frozenset(readers)}
    assert got["stats"]["cores"]["decode_core"] == decode
    assert got["stats"]["cores"]["reader_cores"] == list(readers)
    # a generator closed early restores too; the caller's thread is never left pinned
    gen = m.stream([1, 2, 3], GenerationParams(max_new_tokens=4))
    next(gen)
    assert os.sched_getaffinity(0) == {decode}
    gen.close()
    assert os.sched_getaffinity(0) == main_mask
    m.generate([1, 2], max_new_tokens=2)
    assert os.sched_getaffinity(0) == main_mask
    m.experts.close()
