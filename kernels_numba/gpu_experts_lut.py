"""NVFP4 expert decode (one token) with the input premultiplied into a shared-memory table.

The q / p kernels of gpu_experts.py decode each E2M1 nibble and multiply it by x: about 9
instructions a weight, and x held in registers pins them at ~254 registers (low occupancy).
Here a block first fills tab[n * NCP + c] = E2M1(n) * x[c] (16 rows of the input, NCP columns a
row), so a weight costs a nibble extract, one shared load and one add (~4 instructions), and a
thread needs few registers.

    gate_up: persistent blocks of GW warps; the table holds x (16 x Hs floats: 128 KB at
             H = 2048, 160 KB at 2560, so one block an SM, with the opt-in to large shared
             memory); a warp takes (expert, row) items: gate row and up row together, lane l
             owns chunks l + 32 u of both -> act [K, I] = silu(g) * u
    down:    a block owns one expert and RPB output rows; its table holds that expert's act row
             times its routing weight; a warp takes rows, lanes as above; each block writes its
             K partial rows to a scratch, and the last block of a row range (a ticket counter,
             reset by that block so graph replays start clean) sums them in expert order into
             out: deterministic, no float atomics on out.

Bank conflicts: at step t every lane would read column 16 j + t, two banks for 32 lanes. So the
table stores 17 floats a chunk of 16 columns (column c at c + c // 16): lane l's chunk j = l + 32 u
starts at 17 j, and at step t the warp reads banks (17 l + t) mod 32, all distinct, whatever the
nibbles are (rows are a multiple of 32 floats apart).

Status (H200 sweep, docs/PERF.md "Fifth session"): correct, but not faster than the q kernels;
with the decode removed (MODE 2) gate_up still takes ~10 us for 12.6 MB, so what bounds these
kernels is their load structure, not the decode. Selectable as "lut-g<GW>-d<DW>", not a default.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from .gpu_util import E2M1_TABLE, M32, SIM, WARP, cdiv, silu, warp_sum

_M0, _M1, _M2 = np.uint32(0xF), np.uint32(0xF0), np.uint32(0xF00)
_S12, _S24 = np.uint32(12), np.uint32(24)
_U1, _U2, _U3, _U4, _U5, _U6, _U7, _U8 = (np.uint32(i) for i in range(1, 9))
RPB = 32 if SIM else 128          # down: output rows a block (a multiple of 32: whole lines)
MAX_D = 4                         # gate_up: items a warp loads at once, at most
MAX_TABLE = 227 * 1024            # shared bytes a block may opt in to (H200)


def table_cols(n: int) -> int:
    """Table row stride (floats) for n stored columns: 17 floats a chunk of 16 columns (32
    chunks a pass of the warp), rounded up to a multiple of 256 (bank-aligned rows, and the
    strides the nibble masks multiply by are whole)."""
    return cdiv(17 * 32 * cdiv(n, 512), 256) * 256


def table_bytes(n: int) -> int:
    return 16 * table_cols(n) * 4


def _kernel(warps: int):
    """cuda.jit with registers capped so a block of `warps` warps fits on an SM."""
    return cuda.jit if SIM else cuda.jit(max_registers=min(255, 65536 // (warps * WARP)))


def _make_lut(GW: int, DW: int, NCP: int, NU: int, NCPD: int, NUD: int, D: int, MODE: int = 0):
    """(gate_up, down) for gate-up tables of NCP columns (NU chunks a lane) and down tables of
    NCPD columns (NUD chunks a lane); GW / DW warps a block; D gate-up items a warp loads at
    once (the down kernel's DD rows a warp: RPB / DW)."""
    DD = RPB // DW
    DNU, DNUD = D * NU, DD * NUD    # local array sizes must be plain closure constants
    if DD * DW != RPB:
        raise ValueError(f"lut down kernel: {DW} warps do not divide {RPB} rows")
    from .gpu_experts import _e4m3
    from .gpu_util import int_as_float
    # MODE (diagnostics for the sweep, wrong results): 1 = no shared loads (the index's bits
    # summed as floats), 2 = no decode at all (loads and table fill only)

    def make_chunk(ncp):
        # nibble p of a 32-bit word isolated by a mask where it stands (the word pre-shifted by
        # 12 * (p // 3)), times ncp / 16**(p % 3): a LOP3 and an IMAD a weight
        C0, C1, C2 = np.uint32(ncp), np.uint32(ncp >> 4), np.uint32(ncp >> 8)

        @cuda.jit(device=True, inline=True)
        def word_sum(tab, w, lb):
            w1 = w >> _S12
            w2 = w >> _S24
            s = tab[(w & _M0) * C0 + lb]
            s += tab[(w & _M1) * C1 + lb + _U1]
            s += tab[(w & _M2) * C2 + lb + _U2]
            s += tab[(w1 & _M0) * C0 + lb + _U3]
            s += tab[(w1 & _M1) * C1 + lb + _U4]
            s += tab[(w1 & _M2) * C2 + lb + _U5]
            s += tab[(w2 & _M0) * C0 + lb + _U6]
            s += tab[(w2 & _M1) * C1 + lb + _U7]
            return s

        @cuda.jit(device=True, inline=True)
        def word_sum_nolds(tab, w, lb):
            w1 = w >> _S12
            w2 = w >> _S24
            s = int_as_float((w & _M0) * C0 + lb)
            s += int_as_float((w & _M1) * C1 + lb + _U1)
            s += int_as_float((w & _M2) * C2 + lb + _U2)
            s += int_as_float((w1 & _M0) * C0 + lb + _U3)
            s += int_as_float((w1 & _M1) * C1 + lb + _U4)
            s += int_as_float((w1 & _M2) * C2 + lb + _U5)
            s += int_as_float((w2 & _M0) * C0 + lb + _U6)
            s += int_as_float((w2 & _M1) * C1 + lb + _U7)
            return s

        if MODE == 1:
            @cuda.jit(device=True, inline=True)
            def chunk(tab, w, lb):
                return word_sum_nolds(tab, uint32(w & M32), lb) + \
                    word_sum_nolds(tab, uint32(w >> 32), lb + _U8)
            return chunk
        if MODE == 2:
            @cuda.jit(device=True, inline=True)
            def chunk(tab, w, lb):
                return int_as_float(uint32(w & M32) ^ uint32(w >> 32))
            return chunk

        @cuda.jit(device=True, inline=True)
        def chunk(tab, w, lb):
            """Sum over the 16 nibbles of uint64 w of tab[n, column]; lb = the chunk's first
            column in the table."""
            return word_sum(tab, uint32(w & M32), lb) + word_sum(tab, uint32(w >> 32), lb + _U8)
        return chunk

    chunk_g = make_chunk(NCP)
    chunk_d = make_chunk(NCPD)
    e2 = E2M1_TABLE

    @cuda.jit(device=True, inline=True)
    def fill(tab, src, row, n, cols, ncp, scale):
        """tab[q * ncp + c + c // 16] = E2M1(q) * src[row, c] * scale for c < n, 0 up to cols."""
        t2 = cuda.const.array_like(e2)
        for c in range(cuda.threadIdx.x, cols, cuda.blockDim.x):
            v = src[row, c] * scale if c < n else float32(0.0)
            o = c + (c >> 4)
            for q in range(16):
                tab[q * ncp + o] = t2[q] * v

    @cuda.jit(device=True, inline=True)
    def load_gu(bank64, bank8, slots, it, I, nch, gq, gs, uq, us, wg, wu, sg, su, d):
        """Item it's chunks into slot d of the buffers (gate and up rows of one expert)."""
        k = it // I
        r = it - k * I
        slot = uint32(slots[k])
        lane = int32(cuda.threadIdx.x) & int32(WARP - 1)
        for u in range(NU):
            j = lane + int32(32 * u)
            o = r * nch + min(j, nch - int32(1))
            wg[d * NU + u] = bank64[slot, uint32(gq + o)]
            wu[d * NU + u] = bank64[slot, uint32(uq + o)]
            ok = j < nch
            sg[d * NU + u] = _e4m3(uint32(bank8[slot, uint32(gs + o)])) if ok else float32(0.0)
            su[d * NU + u] = _e4m3(uint32(bank8[slot, uint32(us + o)])) if ok else float32(0.0)

    @_kernel(GW)
    def gate_up(bank64, bank8, bankf, lay, slots, x, act):
        """x float32 [1, H] -> act float32 [K, I]; dynamic shared 16 * NCP floats. A warp
        issues the loads of its D next items at once (the latency of one batch, not of D
        dependent steps), the first batch before the block fills the table."""
        tab = cuda.shared.array(0, float32)
        red = cuda.shared.array(256 if SIM else 1, float32)
        K = int32(slots.shape[0])
        H = int32(lay[6])
        I = int32(lay[7])
        nch = int32(lay[8]) >> 4
        gq = int32(lay[0]) >> 3
        gs = int32(lay[1])
        uq = int32(lay[2]) >> 3
        us = int32(lay[3])
        items = K * I
        lane = int32(cuda.threadIdx.x) & int32(WARP - 1)
        lb = uint32(lane) * uint32(17)
        wg = cuda.local.array(DNU, np.uint64)
        wu = cuda.local.array(DNU, np.uint64)
        sg = cuda.local.array(DNU, float32)
        su = cuda.local.array(DNU, float32)
        first = int32(cuda.blockIdx.x) * int32(GW) + (int32(cuda.threadIdx.x) >> 5)
        step = int32(cuda.gridDim.x) * int32(GW)
        b0 = int32(0)
        while b0 < items:                       # uniform over the block
            for d in range(D):
                load_gu(bank64, bank8, slots, min(b0 + first + step * int32(d), items - int32(1)),
                        I, nch, gq, gs, uq, us, wg, wu, sg, su, d)
            if b0 == 0:
                fill(tab, x, 0, H, NU * 512, NCP, float32(1.0))
                cuda.syncthreads()
            for d in range(D):
                g = float32(0.0)
                v = float32(0.0)
                for u in range(NU):
                    g += sg[d * NU + u] * chunk_g(tab, wg[d * NU + u], lb + uint32(544 * u))
                    v += su[d * NU + u] * chunk_g(tab, wu[d * NU + u], lb + uint32(544 * u))
                g = warp_sum(g, red)
                v = warp_sum(v, red)
                it = b0 + first + step * int32(d)
                if lane == 0 and it < items:
                    k = it // I
                    r = it - k * I
                    slot = slots[k]
                    act[k, r] = silu(g * bankf[slot, 0]) * (v * bankf[slot, 1])
            b0 += step * int32(D)

    @cuda.jit(device=True, inline=True)
    def load_dn(bank64, bank8, slot, r, H, nch, dq, ds, wd, sd, d):
        lane = int32(cuda.threadIdx.x) & int32(WARP - 1)
        rc = min(r, H - int32(1))
        for u in range(NUD):
            j = lane + int32(32 * u)
            o = rc * nch + min(j, nch - int32(1))
            wd[d * NUD + u] = bank64[slot, uint32(dq + o)]
            sd[d * NUD + u] = _e4m3(uint32(bank8[slot, uint32(ds + o)])) if j < nch else \
                float32(0.0)

    @_kernel(DW)
    def down(bank64, bank8, bankf, lay, slots, weights, act, out, accumulate, part, ticket):
        """act float32 [K, I] -> out float32 [H] (+= when accumulate); grid K * cdiv(H, RPB),
        RPB = DW * DD rows a block, each warp's DD rows loaded at once; part float32 [K, H] and
        ticket int32 [cdiv(H, RPB)] (zeros) are scratch."""
        tab = cuda.shared.array(0, float32)
        red = cuda.shared.array(256 if SIM else 1, float32)
        last = cuda.shared.array(1, int32)
        K = int32(slots.shape[0])
        H = int32(lay[6])
        I = int32(lay[7])
        nch = int32(lay[9]) >> 4
        dq = int32(lay[4]) >> 3
        ds = int32(lay[5])
        nrb = (H + int32(RPB - 1)) // int32(RPB)
        k = int32(cuda.blockIdx.x) // nrb
        rb = int32(cuda.blockIdx.x) - k * nrb
        slot = uint32(slots[k])
        warp = int32(cuda.threadIdx.x) >> 5
        lane = int32(cuda.threadIdx.x) & int32(WARP - 1)
        lb = uint32(lane) * uint32(17)
        wd = cuda.local.array(DNUD, np.uint64)
        sd = cuda.local.array(DNUD, float32)
        r0 = rb * int32(RPB) + warp
        for d in range(DD):
            load_dn(bank64, bank8, slot, r0 + int32(DW * d), H, nch, dq, ds, wd, sd, d)
        fill(tab, act, k, I, NUD * 512, NCPD, weights[k] * bankf[slot, 2])
        cuda.syncthreads()
        for d in range(DD):
            y = float32(0.0)
            for u in range(NUD):
                y += sd[d * NUD + u] * chunk_d(tab, wd[d * NUD + u], lb + uint32(544 * u))
            y = warp_sum(y, red)
            r = r0 + int32(DW * d)
            if lane == 0 and r < H:
                part[k, r] = y
        # the last of the K blocks of this row range sums the partial rows in expert order
        cuda.threadfence()
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            last[0] = int32(1) if cuda.atomic.add(ticket, rb, 1) == K - int32(1) else int32(0)
        cuda.syncthreads()
        if last[0] == 1:
            cuda.threadfence()
            for i in range(cuda.threadIdx.x, RPB, cuda.blockDim.x):
                r = rb * int32(RPB) + int32(i)
                if r < H:
                    s = float32(0.0)
                    for kk in range(K):
                        s += part[kk, r]
                    out[r] = s + (out[r] if accumulate else float32(0.0))
            if cuda.threadIdx.x == 0:
                ticket[rb] = 0

    return gate_up, down


_LUT = {}
_SCRATCH = {}
_OPTED = set()


def lut_kernels(gw: int, dw: int, hs: int, is_: int, d: int, mode: int = 0):
    key = (gw, dw, hs, is_, d, mode)
    if key not in _LUT:
        nch, nchd = hs // 16, is_ // 16
        _LUT[key] = _make_lut(gw, dw, table_cols(hs), cdiv(nch, WARP), table_cols(is_),
                              cdiv(nchd, WARP), d, mode)
    return _LUT[key]


def _opt_in(kern, args, smem: int):
    """kern specialised for args, allowed smem bytes of dynamic shared memory (above the 48 KB
    default a block gets without asking)."""
    if SIM:
        return kern
    from .gpu_experts import _specialized
    sk = _specialized(kern, args)[0]
    key = (id(sk), smem)
    if key not in _OPTED:
        from numba.cuda.cudadrv.driver import binding, driver
        ov = next(iter(sk.overloads.values()))
        fn = ov._codelibrary.get_cufunc()
        static = fn.attrs.shared
        if smem + static > MAX_TABLE:
            raise ValueError(f"expert kernel {sk.py_func.__name__} needs {smem + static} bytes "
                             f"of shared memory, more than the {MAX_TABLE} a block can have")
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, smem, fn.handle, fn.device.id)
        _OPTED.add(key)
    return sk


def scratch(k: int, h: int):
    """(part float32 [K, H], ticket int32 [row blocks]) for the down kernel, one pair per shape
    (allocated on first use: the eager warm-up run before a graph capture)."""
    key = (k, h)
    if key not in _SCRATCH:
        _SCRATCH[key] = (cuda.device_array((k, h), np.float32),
                         cuda.to_device(np.zeros(cdiv(h, RPB), np.int32)))
    return _SCRATCH[key]


def gate_up(cfg, views, lay, lay_host, slots, x, act, stream):
    """cfg = ("lut", GW, MODE, DW, _)."""
    b64, b8, bf = views
    gw, dw = cfg[1], cfg[3]
    hs, is_ = int(lay_host[8]), int(lay_host[9])
    items = slots.shape[0] * int(lay_host[7])
    sms = 2 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT
    blocks = max(1, min(sms, cdiv(items, gw)))
    d = min(MAX_D, cdiv(items, blocks * gw))     # every item's loads in one batch if it can
    kern = lut_kernels(gw, dw, hs, is_, d, cfg[2])[0]
    args = (b64, b8, bf, lay, slots, x.reshape(1, -1), act)
    smem = table_bytes(hs)
    k = _opt_in(kern, args, smem)
    k[blocks, gw * WARP, stream, smem](*args)


def down(cfg, views, lay, lay_host, slots, weights, act, out, stream, accumulate):
    b64, b8, bf = views
    gw, dw = cfg[1], cfg[3]
    hs, is_ = int(lay_host[8]), int(lay_host[9])
    kern = lut_kernels(gw, dw, hs, is_, 1, cfg[2])[1]
    h = int(lay_host[6])
    part, ticket = scratch(slots.shape[0], h)
    args = (b64, b8, bf, lay, slots, weights, act, out, int32(1 if accumulate else 0), part,
            ticket)
    smem = table_bytes(is_)
    k = _opt_in(kern, args, smem)
    k[slots.shape[0] * cdiv(h, RPB), dw * WARP, stream, smem](*args)
