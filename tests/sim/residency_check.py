"""VRAM tier logic under NUMBA_ENABLE_CUDASIM=1 (run by tests/test_residency.py)."""
import ctypes
import enum

import numpy as np
from numba import cuda

from engine.residency import ResidencyError, VramResidency

B = 64
rng = np.random.default_rng()
BLOCKS = {(l, e): rng.integers(0, 256, B, dtype=np.uint8) for l in range(64) for e in range(8)}


class Host:
    def __init__(self, in_ram):
        self.in_ram = set(in_ram)
        self.calls = []

    def contains(self, l, e):
        return (l, e) in self.in_ram

    def get_many(self, layer, experts):
        self.calls.append((layer, tuple(experts)))
        for e in experts:
            self.in_ram.add((layer, e))
        return [BLOCKS[(layer, e)] for e in experts]


def bank_matches(r):
    bank = r.bank.copy_to_host()
    for key, slot in r.slot_of.items():
        assert np.array_equal(bank[slot], BLOCKS[key]), key


def main():
    xs, cs = cuda.stream(), cuda.stream()
    host = Host(in_ram={(0, 1)})
    r = VramResidency(4, B, host, xs, cs)
    s = r.resolve(0, [1, 2])
    assert len(set(s)) == 2 and r.stats.ram_hits == 1 and r.stats.disk_reads == 1
    assert host.calls == [(0, (1, 2))]          # one concurrent host read for the layer
    s2 = r.resolve(0, [1, 3])
    assert s2[0] == s[0] and r.stats.vram_hits == 1
    assert list(r.lru) == [(0, 2), (0, 1), (0, 3)]
    r.resolve(1, [5, 6])                        # one free slot, then evict the oldest: (0, 2)
    assert (0, 2) not in r.slot_of and {(1, 5), (1, 6)} <= set(r.slot_of)
    r.resolve(1, [7], protect={(0, 1)})         # (0, 1) is protected: (0, 3) goes
    assert (0, 1) in r.slot_of and (0, 3) not in r.slot_of
    bank_matches(r)
    try:
        r.resolve(2, [0, 1, 2, 3, 4])           # more experts than slots
    except ResidencyError as e:
        assert "VRAM expert slots" in str(e)
    else:
        raise AssertionError("no error for a batch larger than the bank")

    # hot experts are never evicted
    host = Host(in_ram=set())
    r = VramResidency(3, B, host, xs, cs)
    assert r.pin_hot([(0, 0), (1, 0)]) == 2
    for e in range(1, 8):
        r.resolve(2, [e])
    assert {(0, 0), (1, 0)} <= set(r.slot_of) and len(r.lru) == 1
    bank_matches(r)

    # speculation: predicted experts already in RAM are copied, and counted at resolve
    host = Host(in_ram={(1, 2), (1, 3)})
    r = VramResidency(6, B, host, xs, cs)
    r.resolve(0, [0, 1])
    r.speculate(1, [2, 3, 4], protect={(0, 0), (0, 1)})
    assert {(1, 2), (1, 3)} <= set(r.slot_of) and (1, 4) not in r.slot_of
    r.resolve(1, [2, 5])
    st = r.stats.as_dict()
    assert st["spec_routed"] == 2 and st["spec_predicted"] == 1 and st["spec_copies"] == 2
    assert st["spec_wasted_bytes"] == B and abs(st["spec_accuracy"] - 0.5) < 1e-9
    bank_matches(r)

    # predictions that keep missing stop costing copies, but are still scored, and copying
    # resumes once they hit again
    host = Host(in_ram={(l, e) for l in range(40) for e in range(8)})
    r = VramResidency(12, B, host, xs, cs)
    layer = 0
    while r.spec_useful:
        r.speculate(layer, [6, 7])
        r.resolve(layer, [0, 1])
        layer += 1
    copies = r.stats.spec_copies
    assert 0 < layer < 30 and copies == 2 * layer
    r.speculate(layer, [6, 7])
    assert r.stats.spec_copies == copies and (layer, 6) not in r.slot_of
    r.resolve(layer, [6, 7])
    while not r.spec_useful:
        layer += 1
        r.speculate(layer, [0, 1])
        r.resolve(layer, [0, 1])
    assert r.stats.spec_routed == 2 * (layer + 1) and r.stats.spec_copies == copies
    bank_matches(r)
    device_table_and_gate(xs, cs)
    driver_path(xs, cs)
    token_tiers(xs, cs)
    print("OK")


def table_matches(r, table):
    want = np.full(table.shape, -1, np.int32)
    for (l, e), slot in r.slot_of.items():
        want[l, e] = slot
    assert np.array_equal(table.copy_to_host(), want)


def device_table_and_gate(xs, cs):
    """The streamed token graph's pieces: the device slot table kept equal to slot_of through
    placements and evictions, the slots and flag writes, and the gate kernel's request."""
    from engine.residency import DeviceWriter
    from kernels_numba import gpu_misc as gm
    host = Host(in_ram=set())
    r = VramResidency(5, B, host, xs, cs)
    r.pin_hot([(0, 0)])
    r.resolve(1, [3, 4])
    table = cuda.to_device(np.zeros((3, 8), np.int32))
    r.attach_table(table)
    table_matches(r, table)
    for layer, ids in [(2, [1, 2]), (1, [5]), (2, [6, 7]), (0, [0, 3])]:
        r.resolve(layer, ids, wait=False)   # evictions of older keys on the way
        table_matches(r, table)
    assert (0, 0) in r.slot_of and len(r.slot_of) == 5
    # many changes at once (after a token): the host copy takes them, one copy of the table
    with r.batched_table():
        r.resolve(1, [6, 7], wait=False)
        got = r.reserve(1, keep={(1, 6), (1, 7)})      # a staging slot: the oldest other entry
        assert got[0] not in r.slot_of.values()
        r.adopt((2, 4), got[0])                        # (its block written by the device)
        assert r.lru[(2, 4)] == got[0]
    table_matches(r, table)
    r.resolve(1, [3], wait=False)
    table_matches(r, table)                            # entry by entry again
    w = DeviceWriter(xs)
    slots = cuda.to_device(np.zeros(4, np.int32))
    w.put(slots, np.array([3, -1, 2, 7], np.int32))
    flag = cuda.to_device(np.full(3, -1, np.int32))
    w.set(flag, 2, 41)
    assert list(slots.copy_to_host()) == [3, -1, 2, 7] and list(flag.copy_to_host()) == [-1, -1, 41]

    # the gate: every slot valid -> no request; one missing -> the ids and the request go out,
    # and it returns once the flag holds the token number (set beforehand here: the simulator
    # runs a launch to its end)
    req = cuda.mapped_array(1, np.int64)
    req[0] = -1
    ids_out = cuda.mapped_array((3, 8), np.int32)
    ids_out[:] = 0
    ids = cuda.to_device(np.array([9, 4, 6, 1], np.int32))
    seq = cuda.to_device(np.array([41], np.int32))
    held = cuda.to_device(np.full(10, -1, np.int32))      # nothing in host RAM
    nostage = cuda.to_device(np.full(4, -1, np.int32))    # no gather
    gm.expert_gate(cuda.to_device(np.array([3, 0, 2, 7], np.int32)), ids, held, nostage, seq,
                   flag, req, ids_out, 2, cs)
    cs.synchronize()
    assert req[0] == -1 and not ids_out.any()
    gm.expert_gate(slots, ids, held, nostage, seq, flag, req, ids_out, 2, cs)
    cs.synchronize()
    assert req[0] == (41 << gm.REQ_SHIFT) | 2
    assert list(ids_out[2]) == [9, 4, 6, 1, 3, -1, 2, 7]   # the ids, then the slots (-1: missing)
    assert not ids_out[:2].any()
    assert list(slots.copy_to_host()) == [3, 0, 2, 7]   # a slot left missing is clamped

    # the gate waits: another thread plays the host, writes the slots, then the flag
    import threading
    import time
    slots = cuda.to_device(np.array([-1, 5], np.int32))
    seq = cuda.to_device(np.array([42], np.int32))

    seen = []

    def host():
        time.sleep(0.3)
        seen.append(int(req[0]))                       # asked before the host answered
        slots.copy_to_device(np.array([4, 5], np.int32))
        flag[1:2].copy_to_device(np.array([42], np.int32))
    th = threading.Thread(target=host)
    t0 = time.perf_counter()
    th.start()
    gm.expert_gate(slots, ids[:2], held, nostage[:2], seq, flag, req, ids_out, 1, cs)
    cs.synchronize()
    th.join()
    assert seen == [(42 << gm.REQ_SHIFT) | 1]
    assert time.perf_counter() - t0 >= 0.3 and list(slots.copy_to_host()) == [4, 5]
    assert list(ids_out[1][:4]) == [9, 4, -1, 5]
    gather_and_uniform_routes(cs)


class Driver:
    """cuda.bindings.driver's two writes over the simulator's arrays, whose host memory stands
    in for device memory (addresses as DeviceWriter.ptr gives them, patched below: simulated
    arrays have no __cuda_array_interface__); fail=N: the Nth call returns an error."""
    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    def __init__(self, fail=None):
        self.calls, self.fail = 0, fail

    def _status(self):
        self.calls += 1
        ok = self.calls != self.fail
        return self.CUresult.CUDA_SUCCESS if ok else self.CUresult.CUDA_ERROR_INVALID_VALUE

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        err = self._status()
        if err is self.CUresult.CUDA_SUCCESS:
            ctypes.memmove(dst, src, n)
        return (err,)

    def cuMemsetD32Async(self, dst, v, n, stream):
        err = self._status()
        if err is self.CUresult.CUDA_SUCCESS:
            (ctypes.c_uint32 * n).from_address(dst)[:] = [v] * n
        return (err,)


class PoolHost(Host):
    """A host tier whose blocks are rows of one buffer, their addresses known (buffer_addresses,
    as the RAM cache's pinned pool gives them), except the experts in loose: fresh arrays."""
    def __init__(self, loose=()):
        super().__init__(in_ram=set())
        self.rows = np.zeros((8, 2 * B), np.uint8)   # (longer than a block, as the pool's)
        self.views = [self.rows[i] for i in range(8)]
        self.loose = set(loose)

    def buffer_addresses(self):
        return [(v, self.rows.ctypes.data + i * self.rows.shape[1]) for i, v in enumerate(self.views)]

    def get_many(self, layer, experts):
        super().get_many(layer, experts)
        out = []
        for i, e in enumerate(experts):
            if (layer, e) in self.loose:
                out.append(BLOCKS[(layer, e)].copy())
            else:
                self.views[i][:B] = BLOCKS[(layer, e)]
                out.append(self.views[i])
        return out


def driver_path(xs, cs):
    """The copies and table writes as they go to the CUDA driver (not the simulator's copies):
    the blocks land in their slots, from the host tier's known buffers and from loose arrays,
    the table stays equal to slot_of entry by entry and batched, the slots / flag writes at
    kept addresses land, and a failed driver call is an error that names the copy."""
    from engine.residency import DeviceWriter
    ptr = DeviceWriter.ptr
    DeviceWriter.ptr = staticmethod(lambda a: a.ctypes.data)
    try:
        drv = Driver()
        r = VramResidency(5, B, PoolHost(loose={(1, 2), (2, 5)}), xs, cs, driver=drv)
        table = cuda.to_device(np.zeros((3, 8), np.int32))
        r.attach_table(table)
        for layer, ids in [(0, [1, 2, 3]), (1, [2, 4]), (2, [5, 6, 7]), (0, [1, 7]), (1, [0, 1])]:
            r.resolve(layer, ids, wait=False)
            bank_matches(r)
            table_matches(r, table)
        n = drv.calls
        with r.batched_table():
            r.resolve(2, [0, 1, 2], wait=False)
            r.resolve(0, [4], wait=False, protect={(2, 0), (2, 1), (2, 2)})
        assert drv.calls == n + 4 + 1       # the four blocks, then one copy of the table
        bank_matches(r)
        table_matches(r, table)
        w = DeviceWriter(xs, drv)
        slots_d = cuda.to_device(np.zeros((3, 4), np.int32))
        slots_h = np.arange(12, dtype=np.int32).reshape(3, 4)
        row = 4 * 4 * 1
        w.copy(DeviceWriter.ptr(slots_d) + row, slots_h.ctypes.data + row, 16)
        flag = cuda.to_device(np.full(3, -1, np.int32))
        w.set(flag, 1, 7, DeviceWriter.ptr(flag))
        assert np.array_equal(slots_d.copy_to_host(), [[0] * 4, [4, 5, 6, 7], [0] * 4])
        assert list(flag.copy_to_host()) == [-1, 7, -1]
        r = VramResidency(2, B, PoolHost(), xs, cs, driver=Driver(fail=2))
        try:
            r.resolve(0, [1, 2])
        except ResidencyError as e:
            assert "into VRAM slot" in str(e) and "CUDA_ERROR_INVALID_VALUE" in str(e), e
        else:
            raise AssertionError("no error for a failed copy")
    finally:
        DeviceWriter.ptr = ptr


def token_tiers(xs, cs):
    """GpuDecoder._count_token_tiers after a streamed token: every routed expert that neither a
    served layer missed nor a gather staged is a VRAM hit, made recent in the order used."""
    from types import SimpleNamespace

    from engine.gpu import GpuDecoder
    L, K, E = 5, 3, 8
    moe = [1, 2, 4]
    for staged in (False, True):
        r = VramResidency(40, B, Host(in_ram=set()), xs, cs)
        r.pin_hot([(1, 0), (2, 0)])
        r.resolve(0, [0])
        for l in moe:
            r.resolve(l, list(range(1, E)))
        ids = np.array([rng.permutation(E)[:K] for _ in range(L)], np.int32)
        slots = rng.integers(0, 40, (L, K)).astype(np.int32)
        stage = np.full((L, K), -1, np.int32)
        if staged:
            stage[moe] = rng.integers(40, 50, (len(moe), K))
            slots[2, 1] = stage[2, 0]
            slots[4, 2] = stage[4, 2]
        missing = {2: {int(ids[2, 0])}, 4: set()}
        promoted = []
        d = SimpleNamespace(c=SimpleNamespace(moe_layers=moe), res=r, ids_all_h=ids, slots_all_h=slots,
                            _moe_rows=np.array(moe), _moe_row_of={l: i for i, l in enumerate(moe)},
                            _served_missing=missing, _stage_h=stage if staged else None,
                            _stage_dirty=False, _promote_gathered=lambda l, i, s: promoted.append(l))
        want = [(l, int(e)) for l in moe for e, s in zip(ids[l], slots[l])
                if int(e) not in missing.get(l, ()) and not (staged and s in stage[l])]
        order = [k for k in r.lru if k not in want] + [k for k in dict.fromkeys(want) if k in r.lru]
        n = r.stats.vram_hits
        GpuDecoder._count_token_tiers(d)
        assert r.stats.vram_hits - n == len(want) and list(r.lru) == order, (staged, want)
        assert promoted == (moe if staged else [])


def gather_and_uniform_routes(cs):
    """expert_gather copies exactly the routed blocks that miss VRAM and that the host RAM
    cache holds into their staging slots, and the gate then takes those slots (asking the host
    only for the rest); route_uniform draws distinct experts and their slots."""
    from kernels_numba import gpu_misc as gm
    rng = np.random.default_rng()
    W = 4 * gm.GATHER_UNROLL * 3 * gm.THREADS * gm.GATHER_BLOCKS + 16 * 5   # a ragged tail
    pool = rng.integers(0, 2 ** 32, (6, W + 16), dtype=np.uint32)         # buffers are wider
    bank0 = rng.integers(0, 2 ** 32, (9, W), dtype=np.uint32)
    bank = cuda.to_device(bank0)
    # experts 2, 5, 7, 3: 2 in VRAM (slot 1); 5 and 7 in host buffers 4 and 0; 3 nowhere
    ids = cuda.to_device(np.array([2, 5, 7, 3], np.int32))
    slots = cuda.to_device(np.array([1, -1, -1, -1], np.int32))
    held_h = np.full(8, -1, np.int32)
    held_h[5], held_h[7], held_h[2] = 4, 0, 3
    held = cuda.to_device(held_h)
    stage = cuda.to_device(np.array([5, 6, 7, 8], np.int32))
    gm.expert_gather(slots, ids, held, stage, pool, bank, cs)
    cs.synchronize()
    want = bank0.copy()
    want[6], want[7] = pool[4, :W], pool[0, :W]
    assert np.array_equal(bank.copy_to_host(), want)
    seq = cuda.to_device(np.array([7], np.int32))
    flag = cuda.to_device(np.full(3, 7, np.int32))     # answered beforehand (see above)
    req = cuda.mapped_array(1, np.int64)
    req[0] = -1
    ids_out = cuda.mapped_array((3, 8), np.int32)
    ids_out[:] = 0
    gm.expert_gate(slots, ids, held, stage, seq, flag, req, ids_out, 0, cs)
    cs.synchronize()
    assert req[0] == 7 << gm.REQ_SHIFT
    assert list(ids_out[0]) == [2, 5, 7, 3, 1, 6, 7, -1]
    # all found: no request
    slots = cuda.to_device(np.array([1, -1, -1], np.int32))
    req[0] = -1
    gm.expert_gather(slots, ids[:3], held, stage[:3], pool, bank, cs)
    gm.expert_gate(slots, ids[:3], held, stage[:3], seq, flag, req, ids_out, 1, cs)
    cs.synchronize()
    assert req[0] == -1 and list(slots.copy_to_host()) == [1, 6, 7]

    # the same in one launch (the gate's block beside the gather's): the same blocks staged,
    # the same request, and no request where everything is found
    bank = cuda.to_device(bank0)
    slots = cuda.to_device(np.array([1, -1, -1, -1], np.int32))
    req[0] = -1
    ids_out[:] = 0
    done = cuda.to_device(np.zeros(3, np.int32))
    gm.expert_gate_gather(slots, ids, held, stage, pool, bank, seq, flag, req, ids_out, 2, done, cs)
    cs.synchronize()
    assert np.array_equal(bank.copy_to_host(), want)
    assert req[0] == (7 << gm.REQ_SHIFT) | 2
    assert list(ids_out[2]) == [2, 5, 7, 3, 1, 6, 7, -1]
    bank = cuda.to_device(bank0)
    slots = cuda.to_device(np.array([1, -1, -1], np.int32))
    req[0] = -1
    gm.expert_gate_gather(slots, ids[:3], held, stage[:3], pool, bank, seq, flag, req, ids_out, 1,
                          done, cs)
    cs.synchronize()
    assert req[0] == -1 and list(slots.copy_to_host()) == [1, 6, 7]
    assert np.array_equal(bank.copy_to_host(), want)
    assert not done.copy_to_host().any()       # the gate set the count back for the next token

    slot_of_h = rng.permutation(16).astype(np.int32)
    slot_of = cuda.to_device(slot_of_h)
    seen = set()
    for s in range(3):
        for layer in range(2):
            ids = cuda.to_device(np.zeros(6, np.int32))
            slots = cuda.to_device(np.zeros(6, np.int32))
            gm.route_uniform(ids, slots, slot_of, cuda.to_device(np.array([s], np.int32)),
                             layer, 16, cs)
            cs.synchronize()
            got = ids.copy_to_host()
            assert len(set(got.tolist())) == 6 and got.min() >= 0 and got.max() < 16
            assert np.array_equal(slots.copy_to_host(), slot_of_h[got])
            seen.add(tuple(got.tolist()))
    assert len(seen) == 6          # every (token, layer) draws its own


main()
