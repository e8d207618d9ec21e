"""NVFP4 expert decode (one token) with the weights brought into shared memory by the copy engine.

The mma kernels (gpu_experts_mma.py) hold their weight loads in registers: at 64-80 registers a
thread an SM keeps about 90 KB of loads in flight and a layer's kernels reach a third of the
device copy's bandwidth (docs/PERF.md: 15.8 us for the 21 MB of a Qwen3-30B-A3B layer), while
a load-only kernel needs ~2048 threads an SM to reach two thirds. Here the copy engine moves the
bytes (cp.async.bulk into shared memory, completing on an mbarrier): no register is held while
they are in flight, so each block asks for its whole share of the layer at its start, and the
warps multiply each piece as it lands, with the tensor-core step of the lean mma kernels ("-c":
scales on D's columns in f32). The steps are summed across warps in another grouping than
theirs, so results match them to rounding (2.5-3.2e-7 relative at the real shapes), not bit for
bit.

    gate_up: persistent blocks (one an SM where shared memory allows); block b takes the tiles
             [b T / nb, (b + 1) T / nb) of the T = K * I / 8 tiles (8 gate rows and the same 8 up
             rows of one expert, every column); warp w takes steps [w SG, w SG + SG) of every
             tile, so its B fragments (x as hi / lo f16) are filled once for all the tiles.
             -> act [K, I] = silu(g) * u
    down:    block = 16 output rows of all K experts (one mbarrier an expert); the copies go out
             before the PDL wait (the weights and the slots are not the launch before's), so
             they land while gate_up still runs where both fit on an SM. -> out [H] (+=)
Without -w, each row is a copy of its own and rows sit in shared memory at a pitch of 64 mod 128
bytes: the two rows a quarter-warp reads (lanes g = 0, 1) fall on different banks. Every copy is
issued by warp 0's lanes.
Shared memory of a block (bytes): [B fragments: steps * 512][mbarriers][partial sums][tiles].
Variant "tma-g<SG>-d<SD>[-w][-m2]" (gpu_experts.parse_variant): steps a warp of gate_up / down;
-w the rows of a tile in one copy, unpadded; -m2 the copies alone (a diagnostic, wrong results).
Needs sm_90, H = Hs and I = Is multiples of 128, and a block's share within shared memory
(supported() says; the launcher falls back to the lean mma kernels). Under the simulator the
copies run synchronously (gpu_util.bulk_copy) and the mma as a numpy emulation.
H200 (docs/PERF.md, seventeenth session), us a layer at Qwen3-30B / Next-80B / 2560x640 shapes:
tma-g1-d2-w 15.9 / 13.7 / 24.2 (21.7 at -d3-w) against the lean mma kernels' 15.8 / 14.5 / 22.2;
a copy a row (no -w) 21.2 / 15.2 / 34.1. The copies alone (-m2) take 12.2 / 9.7 / 14.1 us: at one
layer's size the copy engine reads 0.41-0.47 of the device copy's bandwidth, below the 0.64 of a
load-only kernel, so these kernels are not the default.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from . import gpu_experts_mma as gm
from .gpu_experts_mma import _fscales, _mma, _pairs, _quad_sum
from .gpu_util import (SIM, WARP, bulk_copy, bulk_done, cdiv, lds4, mbar_expect,
                       mbar_fence_init, mbar_init, mbar_wait, pdl_kernel, pdl_trigger, pdl_wait,
                       silu)

STEP = gm.STEP                    # 128 columns a step: 64 bytes of a row
FRAG = 512                        # bytes of B fragments a step
MAX_WARPS = 32
SMEM_MAX = 227 * 1024             # shared bytes a block may opt in to on sm_90 (the simulator's)
U = np.uint32
_S1, _S2, _S3, _S4, _S7 = U(1), U(2), U(3), U(4), U(7)
_M3, _M31, _M16 = U(3), U(31), U(0xFFFF)
_TWO14 = float32(16384.0)         # E2M1 decoded as value * 2^-14 (gpu_experts_mma._pairs)


def pitch(row_bytes: int, wide: int = 0) -> int:
    """Shared-memory pitch of a q row (row_bytes a multiple of 64): 64 mod 128, or the row
    itself when the rows come in one copy (wide)."""
    return row_bytes if wide else row_bytes + (64 - row_bytes % 128) % 128


def _round(n: int, m: int) -> int:
    return cdiv(n, m) * m


def gate_up_smem(hs: int, sg: int, ntm: int, wide: int = 0) -> int:
    """Dynamic shared bytes of a gate_up block of ntm tiles at Hs = hs."""
    nst = hs // STEP
    tb = 16 * pitch(hs // 2, wide) + 16 * (hs // 16)
    return nst * FRAG + _round(8 * ntm, 128) + ntm * (nst // sg) * 64 + ntm * tb


def down_smem(is_: int, k: int, sd: int, wide: int = 0) -> int:
    nst = k * (is_ // STEP)
    eb = 16 * pitch(is_ // 2, wide) + 16 * (is_ // 16)
    return nst * FRAG + _round(8 * k, 128) + (nst // sd) * 64 + k * eb


@cuda.jit(device=True, inline=True)
def _step(mx, bsh, fb, wa, wb, sa, sb, valid, c0, c2):
    """One 128-column step of A rows g (words bsh[wa:wa + 4], scale pair sa) and g + 8 (wb, sb)
    against the B fragments at bsh[fb:] (this lane's, 32 words a word q of the step), added to
    the lane's f32 sums c0 / c2 of rows g and g + 8 over its own scale groups (the quad adds
    them up), in gpu_experts_mma's order."""
    a0, a1, a2, a3 = lds4(bsh, wa)
    b0, b1, b2, b3 = lds4(bsh, wb)
    fa, fz = _fscales(sa)
    ha, hz = _fscales(sb)
    for hg in range(2):                  # words 2 hg, 2 hg + 1: one scale group a lane
        d0 = float32(0.0)
        d1 = float32(0.0)
        d2 = float32(0.0)
        d3 = float32(0.0)
        for qq in range(2):
            q = 2 * hg + qq
            x0, x1, x2, x3 = lds4(bsh, fb + U(32 * q))
            zb = U(0)
            x0 = x0 if valid else zb
            x1 = x1 if valid else zb
            x2 = x2 if valid else zb
            x3 = x3 if valid else zb
            wg = a0 if q == 0 else (a1 if q == 1 else (a2 if q == 2 else a3))
            wu = b0 if q == 0 else (b1 if q == 1 else (b2 if q == 2 else b3))
            p0, p1, p2, p3 = _pairs(wg)
            r0, r1, r2, r3 = _pairs(wu)
            d0, d1, d2, d3 = _mma(mx, p0, r0, p1, r1, x0, x1, d0, d1, d2, d3)
            d0, d1, d2, d3 = _mma(mx, p2, r2, p3, r3, x2, x3, d0, d1, d2, d3)
        c0 += (fa if hg == 0 else fz) * (d0 + d1)
        c2 += (ha if hg == 0 else hz) * (d2 + d3)
    return c0, c2


@cuda.jit(device=True, inline=True)
def _scale_pair(bsh, byte):
    """The two E4M3 scale bytes at shared byte offset `byte` (even) as a uint32."""
    return (bsh[byte >> _S2] >> ((byte & _S2) << _S3)) & _M16


@cuda.jit(device=True, inline=True)
def _init_bars(bar, b0, n, txb):
    """Thread 0: barriers b0 .. b0 + n - 1 ready, each expecting txb bytes (the block barrier
    that publishes them is the caller's)."""
    if cuda.threadIdx.x == 0:
        for j in range(n):
            mbar_init(bar, b0 + U(j), 1)
        mbar_fence_init()
        for j in range(n):
            mbar_expect(bar, b0 + U(j), txb)


@cuda.jit(device=True, inline=True)
def _piece_step(mx, bsh, tt, ps, sbb, g, t, fb, sl, valid, c0, c2, mode):
    """Step sl of the piece (16 rows) at shared byte tt (rows at pitch ps, then 16 scale rows of
    sbb bytes) against the B fragments at bsh[fb:], into c0 / c2 (mode 2: a word read, no math)."""
    col = sl * U(64) + t * U(16)
    if mode == 2:
        return c0 + float32(bsh[(tt + g * ps + col) >> _S2] & U(255)), c2
    sc = tt + U(16) * ps + g * sbb + sl * U(8) + t * U(2)
    return _step(mx, bsh, fb, (tt + g * ps + col) >> _S2, (tt + (g + U(8)) * ps + col) >> _S2,
                 _scale_pair(bsh, sc), _scale_pair(bsh, sc + U(8) * sbb), valid, c0, c2)


@cuda.jit(device=True, inline=True)
def _store_sums(bshf, pi, g, t, c0, c2, inv, red):
    """The quads' sums of rows g and g + 8, times inv, at bshf[pi + g], bshf[pi + 8 + g]
    (every thread of the block calling: the simulator's quad sums are block-wide)."""
    c0 = _quad_sum(c0, red)
    c2 = _quad_sum(c2, red)
    if t == U(0):
        bshf[pi + g] = c0 * inv
        bshf[pi + U(8) + g] = c2 * inv


def _make(SG: int, SD: int, NSI: int, WIDE: int, MODE: int = 0):
    """(gate_up, down) for SG / SD steps a warp; down compiled for NSI = Is / 128. WIDE: the
    rows of a tile (an expert in down) in one copy, unpadded (2-way bank conflicts), not one
    copy a row. MODE 2 (a diagnostic for the sweep, wrong results): no decode or mma, a
    word of each step read once the copies have landed: what the copies alone take."""
    NQ = 2 if WIDE else 16                # q copies a gate_up tile, RPC rows each
    RPC = 8 if WIDE else 1
    NQD = 1 if WIDE else 16               # q copies of an expert in down, RPCD rows each
    RPCD = 16 if WIDE else 1
    NVG, NVD = 8 * cdiv(SG, 2), 8 * cdiv(SD, 2)   # the lane's input values (local arrays)
    _, fill_g, _ = gm._fns(SG, SG, 0, 5, 1, 1)
    _, fill_d, _ = gm._fns(SD, SD, 0, 5, 1, 1)
    x_units = gm._units(SG)[0]
    _, act_units, expert_step = gm._units(SD, NSI)
    # the simulator's scratch of the warp reductions and the mma emulation; the GPU paths
    # ignore theirs, which alias the dynamic memory (no static shared memory ahead of it, so
    # its start is aligned for the copies)
    RED = gm.RED if SIM else 0
    MXS = (gm.MXW, WARP, 6) if SIM else 0

    @cuda.jit
    def gate_up(bank32, bankf, slots, x, act, gq, gsc, uq, usc, I, Hs, T, NTM):
        """x float32 [H = Hs] -> act float32 [K, I]; grid nb blocks of Hs / 128 / SG warps, block
        b the tiles [b T / nb, (b + 1) T / nb) (at most NTM), dynamic shared gate_up_smem."""
        bsh = cuda.shared.array(0, uint32)
        bshf = cuda.shared.array(0, float32)
        bar = cuda.shared.array(0, uint64)
        red = cuda.shared.array(RED, float32)
        mx = cuda.shared.array(MXS, uint32)
        tid = int32(cuda.threadIdx.x)
        nw = U(cuda.blockDim.x) >> U(5)
        wp = U(tid) >> U(5)
        lane = U(tid) & _M31
        g = lane >> _S2
        t = lane & _M3
        nb = int32(cuda.gridDim.x)
        b = int32(cuda.blockIdx.x)
        j0 = b * T // nb
        nt = (b + int32(1)) * T // nb - j0
        nrg = U(I) >> _S3                       # tiles an expert
        rb = U(Hs) >> _S1                       # bytes of a q row
        ps = rb if WIDE else rb + ((U(64) - (rb & U(127))) & U(127))
        sbb = U(Hs) >> _S4                      # bytes of a scale row
        tb = U(16) * ps + U(16) * sbb           # a tile's shared bytes (padded rows)
        txb = U(16) * (rb + sbb)                # the bytes its copies bring
        nst = U(Hs) >> _S7
        boff = nst * U(512)                     # mbarriers (bytes)
        poff = boff + ((U(8) * U(NTM) + U(127)) & ~U(127))
        toff = poff + U(NTM) * nw * U(64)
        pdl_wait()                              # the slots are the router's, just before
        pdl_trigger()
        _init_bars(bar, boff >> _S3, nt, txb)
        cuda.syncthreads()                      # the barriers ready before any copy or wait
        if wp == U(0):
            for c in range(lane, U(nt) * U(NQ + 2), U(32)):
                j = U(c) // U(NQ + 2)
                e = U(c) - j * U(NQ + 2)
                tile = U(j0) + j
                k = tile // nrg
                r0 = (tile - k * nrg) << _S3
                slot = slots[k]
                dst = toff + j * tb
                if e < U(NQ):
                    h = U(NQ // 2)
                    src = (U(gq) if e < h else U(uq)) + (r0 + (e % h) * U(RPC)) * rb
                    dst += e * U(RPC) * ps
                    n = U(RPC) * rb
                else:
                    src = (U(gsc) if e == U(NQ) else U(usc)) + r0 * sbb
                    dst += U(16) * ps + (e - U(NQ)) * U(8) * sbb
                    n = U(8) * sbb
                bulk_copy(bsh, dst >> _S2, bank32, slot, src >> _S2, n, bar,
                          (boff >> _S3) + j)
        bulk_done()
        # the lane's units of x (16 bytes a load), while the copies are on their way
        v = cuda.local.array(NVG, float32)
        x_units(x, v, int32(lane), int32(wp))
        inv = fill_g(bsh, v, red) * _TWO14
        sel = ((((lane >> _S2) & _S1) << _S2) | t) << _S2
        valid = t == (lane >> _S3)
        for j in range(nt):
            mbar_wait(bar, (boff >> _S3) + U(j), 0)
            tt = toff + U(j) * tb
            c0 = float32(0.0)
            c2 = float32(0.0)
            for s in range(SG):
                st = wp * U(SG) + U(s)
                c0, c2 = _piece_step(mx, bsh, tt, ps, sbb, g, t, st * U(128) + sel, st, valid,
                                     c0, c2, MODE)
            _store_sums(bshf, (poff >> _S2) + (U(j) * nw + wp) * U(16), g, t, c0, c2, inv, red)
        cuda.syncthreads()
        for c in range(tid, nt * 8, int32(cuda.blockDim.x)):
            j = U(c) >> _S3
            row = U(c) & U(7)
            tile = U(j0) + j
            k = tile // nrg
            r = ((tile - k * nrg) << _S3) + row
            sg = float32(0.0)
            su = float32(0.0)
            pi = (poff >> _S2) + j * nw * U(16) + row
            for w in range(nw):
                sg += bshf[pi + U(16) * U(w)]
                su += bshf[pi + U(16) * U(w) + U(8)]
            slot = slots[k]
            act[k, r] = silu(sg * bankf[slot, 0]) * (su * bankf[slot, 1])

    _NSI = U(NSI)

    @cuda.jit
    def down(bank32, bankf, slots, weights, act, out, accumulate, dq, dsc, H):
        """act float32 [K, I = 128 NSI] -> out float32 [H] (+= when accumulate); grid H / 16,
        K * NSI / SD warps, dynamic shared down_smem."""
        bsh = cuda.shared.array(0, uint32)
        bshf = cuda.shared.array(0, float32)
        bar = cuda.shared.array(0, uint64)
        red = cuda.shared.array(RED, float32)
        mx = cuda.shared.array(MXS, uint32)
        tid = int32(cuda.threadIdx.x)
        nw = U(cuda.blockDim.x) >> U(5)
        wp = U(tid) >> U(5)
        lane = U(tid) & _M31
        g = lane >> _S2
        t = lane & _M3
        K = U(slots.shape[0])
        rb = _NSI * U(64)
        ps = rb if WIDE else rb + ((U(64) - (rb & U(127))) & U(127))
        sbb = _NSI * U(8)
        eb = U(16) * ps + U(16) * sbb           # an expert's shared bytes (padded rows)
        txb = U(16) * (rb + sbb)                # the bytes its copies bring
        boff = K * _NSI * U(512)
        poff = boff + ((U(8) * K + U(127)) & ~U(127))
        eoff = poff + nw * U(64)
        r0 = U(cuda.blockIdx.x) << _S4
        # the slots are the router's (two launches back) and the weights nobody's: the copies
        # go out before the wait for gate_up's act
        _init_bars(bar, boff >> _S3, K, txb)
        cuda.syncthreads()
        if wp == U(0):
            for c in range(lane, K * U(NQD + 1), U(32)):
                ke = U(c) // U(NQD + 1)
                e = U(c) - ke * U(NQD + 1)
                slot = slots[ke]
                dst = eoff + ke * eb
                if e < U(NQD):
                    src = U(dq) + (r0 + e * U(RPCD)) * rb
                    dst += e * U(RPCD) * ps
                    n = U(RPCD) * rb
                else:
                    src = U(dsc) + r0 * sbb
                    dst += U(16) * ps
                    n = U(16) * sbb
                bulk_copy(bsh, dst >> _S2, bank32, slot, src >> _S2, n, bar, (boff >> _S3) + ke)
        bulk_done()
        pdl_wait()
        pdl_trigger()
        st0 = wp * U(SD)                      # the warp's first step, its expert and step there
        ke0 = U(st0 // _NSI)
        sl0 = U(st0 - ke0 * _NSI)
        v = cuda.local.array(NVD, float32)
        act_units(act, weights, bankf, slots, v, lane, ke0, sl0)
        inv = fill_d(bsh, v, red) * _TWO14
        sel = ((((lane >> _S2) & _S1) << _S2) | t) << _S2
        valid = t == (lane >> _S3)
        c0 = float32(0.0)
        c2 = float32(0.0)
        for s in range(SD):
            ke, sl = expert_step(ke0, sl0, U(s))
            mbar_wait(bar, (boff >> _S3) + ke, 0)
            c0, c2 = _piece_step(mx, bsh, eoff + ke * eb, ps, sbb, g, t,
                                 (st0 + U(s)) * U(128) + sel, sl, valid, c0, c2, MODE)
        _store_sums(bshf, (poff >> _S2) + wp * U(16), g, t, c0, c2, inv, red)
        cuda.syncthreads()
        if tid < 16:
            o = float32(0.0)
            for w in range(nw):
                o += bshf[(poff >> _S2) + U(16) * U(w) + U(tid)]
            rr = r0 + U(tid)
            out[rr] = o + (out[rr] if accumulate else float32(0.0))

    return pdl_kernel(gate_up), pdl_kernel(down)


_KERNELS = {}


def kernels(sg: int, sd: int, nsi: int, wide: int = 0, mode: int = 0):
    key = (sg, sd, nsi, wide, mode)
    if key not in _KERNELS:
        _KERNELS[key] = _make(*key)
    return _KERNELS[key]


def _smem_max() -> int:
    """Dynamic shared bytes a block of these kernels may have on this device (the opt-in
    limit: 227 KB on sm_90, 99 KB on consumer Blackwell), less a KB of slack."""
    if SIM:
        return SMEM_MAX - 1024
    return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) - 1024


def _sm90() -> bool:
    if SIM:
        return True
    try:
        return cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:
        return False


def steps(lay_host, k: int, cfg):
    """(SG, SD) the kernels take for this layout (the variant's, else the nearest counts that
    divide the steps into at most 32 warps; SD at most Is / 128), or None where they cannot run
    it: not sm_90, H != Hs or I != Is, not multiples of 128, or a block's share of the weights
    past shared memory."""
    h, i, hs, is_ = (int(lay_host[j]) for j in (6, 7, 8, 9))
    if not _sm90() or h != hs or i != is_ or hs % STEP or is_ % STEP or \
            any(int(o) % 16 for o in lay_host[:6]):
        return None
    nsg, nsi = hs // STEP, is_ // STEP

    def pick(want, n, most):
        for s in [want] + list(range(want + 1, most + 1)) + list(range(want - 1, 0, -1)):
            if 1 <= s <= most and n % s == 0 and n // s <= MAX_WARPS:
                return s
        return 0
    sg = pick(cfg[1], nsg, nsg)
    sd = pick(cfg[3], k * nsi, nsi)
    wide = cfg[2][0]
    if not sg or not sd or down_smem(is_, k, sd, wide) > _smem_max() or \
            gate_up_smem(hs, sg, 1, wide) > _smem_max():
        return None
    return sg, sd


def supported(lay_host, k: int, cfg, row_bytes: int) -> bool:
    return row_bytes % 16 == 0 and steps(lay_host, k, cfg) is not None


def _sms() -> int:
    return 2 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT


def gate_up_grid(lay_host, k: int, sg: int, wide: int = 0) -> tuple[int, int]:
    """(blocks, tiles a block at most): one block an SM, more where a block's tiles would not
    fit in shared memory (then the tiles run in several waves)."""
    hs, i = int(lay_host[8]), int(lay_host[7])
    tiles = k * (i // 8)
    nb = min(_sms(), tiles)
    while gate_up_smem(hs, sg, cdiv(tiles, nb), wide) > _smem_max():
        nb += _sms()
    nb = min(nb, tiles)
    return nb, cdiv(tiles, nb)


def gate_up(cfg, views, lay, lay_host, slots, x, act, stream):
    """cfg = ("tma", SG, _, SD, _)."""
    from .gpu_experts_lut import _opt_in
    _, b8, bf = views
    b32 = b8.view(np.uint32)
    k = slots.shape[0]
    sg, _ = steps(lay_host, k, cfg)
    L = [int32(v) for v in lay_host]
    hs = int(lay_host[8])
    wide = cfg[2][0]
    nb, ntm = gate_up_grid(lay_host, k, sg, wide)
    tiles = k * (int(lay_host[7]) // 8)
    kern = kernels(sg, 1, 1, wide, cfg[2][1])[0]
    args = (b32, bf, slots, x, act, L[0], L[1], L[2], L[3], L[7], L[8], int32(tiles),
            int32(ntm))
    smem = gate_up_smem(hs, sg, ntm, wide)
    _opt_in(kern, args, smem)[nb, hs // STEP // sg * WARP, stream, smem](*args)


def down(cfg, views, lay, lay_host, slots, weights, act, out, stream, accumulate):
    from .gpu_experts_lut import _opt_in
    _, b8, bf = views
    b32 = b8.view(np.uint32)
    k = slots.shape[0]
    _, sd = steps(lay_host, k, cfg)
    L = [int32(v) for v in lay_host]
    is_, h = int(lay_host[9]), int(lay_host[6])
    nsi = is_ // STEP
    wide = cfg[2][0]
    kern = kernels(1, sd, nsi, wide, cfg[2][1])[1]
    args = (b32, bf, slots, weights, act, out, int32(1 if accumulate else 0), L[4], L[5], L[6])
    smem = down_smem(is_, k, sd, wide)
    _opt_in(kern, args, smem)[cdiv(h, 16), k * nsi // sd * WARP, stream, smem](*args)
