"""NVFP4 expert decode (one token) on the tensor cores: mma.sync m16n8k16, f16 in, f32 accumulate.

The q / lut kernels of gpu_experts*.py multiply every weight on the CUDA cores (5-9 instructions
a weight) and hold their loads at low occupancy. Here a warp decodes E2M1 nibbles straight into
f16 pairs with bit operations (9 instructions a word of 8) and lets one mma multiply 256
weights; the f32 accumulation is the tensor core's. A warp issues its weight loads (16 bytes a
lane) before it builds its input fragments.

Exactness. A = E2M1 * 2^-14 is exact in f16. The input is split x * c = hi + lo, two f16 (22
significant bits), c = 2^(13 - floor(log2 max|x|)) per warp so hi and lo stay in f16 range.
Default ("-c"): B column 2 t + h holds the hi (h = 0) or lo (h = 1) part only on the four k of
lane t, so D[:, 2 t + h] is the sum over lane t's own 16-column scale group; the lane applies
its E4M3 scale to those columns in f32 and the quad adds its four lanes' sums. Without "-c",
A is scaled in f16 instead (E2M1 * s * 2^-7, exact too) and x goes to columns 0 / 1 on all lanes.

Tiles. A warp's mma tile is 16 rows x 16 columns. A step is 128 columns (64 bytes a row):
lane (g = lane / 4, t = lane % 4) loads 16 bytes of row g and of row g + 8 at byte 16 t of the
step. Word q (8 nibbles, columns c0 .. c0 + 7, c0 = 128 st + 32 t + 8 q) gives four f16 pairs
P_i = (nibble i, nibble i + 4): (P0, P1) feed one mma as (a0, a2) and (P2, P3) the next; the
matching B pairs (x[c0 + i], x[c0 + i + 4]) sit in shared memory, laid out so a warp's read is
one conflict-free 128-byte line. Each warp fills (and reads) only its own steps' fragments.
    gate_up: block = (expert, 8 rows); A rows 0-7 are gate rows, 8-15 the same up rows; warp w
             takes steps [w S, w S + S) of the Hs / 128; partial sums meet in shared memory
             -> act [K, I] = silu(g) * u (one block writes each row: no atomics)
    down:    block = 16 output rows; the columns are all K experts' rows side by side (an
             expert's routing weight and global scale folded into its B values); warp w
             takes steps [w S, w S + S) of the K * Is / 128 -> out [H] (+= when accumulate)
Variant "mma-g<SG>-d<SD>[-a<LA>][-p<P>][-c][-m<MODE>][-l]" (gpu_experts.parse_variant): steps a
warp, steps loaded ahead, the weight loads' cache hints, the scale placement, diagnostics, the
lean kernels (_make_lean: the same sums with about a third fewer instructions).
Needs Hs and Is multiples of 128 (supported() says; the launcher falls back to the q kernels).
Under the simulator the mma, the f16 multiply and the split run as numpy emulations.
H200 (docs/PERF.md, sixth session): 19.6 / 17.4 / 30.9 us a layer at Qwen3-30B / Next-80B /
2560x640 shapes, against 23.0 / 26.3 / 35.6 for the qtab kernels; with the decode and mma
removed (MODE 2) gate_up still takes 7.9 of its 10.3 us, so the load structure bounds them.
Nsight Compute (2026-12-02) showed why: 1467 instructions a gate_up warp for 32 mma, over half
of them 64-bit index arithmetic (a 64-bit division among them), and ptxas sinking the .nc weight
loads below the barrier and the input's loads (issued at instruction ~517). The lean kernels
(default "-p5-c-l"): 15.7 / 14.3 / 25.8 us.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from .gpu_util import (SIM, WARP, cdiv, float_as_uint, int_as_float, make_ld, pdl_kernel,
                        pdl_trigger, pdl_wait, silu, warp_max, warp_sync)

_ldx4 = make_ld(4, "")            # x / act: 16 bytes the launch before wrote (coherent)
STEP = 128                        # columns a warp's step covers (64 bytes a row, 16 a lane)
STEP_U32 = 128                    # shared uint32 of B fragments a step (4 words x 2 x 4 x 4)
MAX_WARPS = 32
SHARED_LIMIT = 48 * 1024          # dynamic shared bytes without the opt-in
RED = 1024 if SIM else 1          # the simulator's block reductions (unused on the GPU)
MXW = MAX_WARPS if SIM else 1     # the simulator's mma scratch, [warps, 32 lanes, 6 words]
_MAG, _SGN = np.uint32(0x0E000E00), np.uint32(0x80008000)
_MAG8, _SGN8 = np.uint32(0x000E000E), np.uint32(0x00800080)
_E_LO = np.uint32(0x07F00000)     # E4M3 bits 0-6 at float bits 20-26
_TWO120 = float32(2.0 ** 120)
_LO16, _HI16 = np.uint32(0xFFFF), np.uint32(0xFFFF0000)
_S1, _S2, _S3, _S4, _S5, _S7, _S8 = (np.uint32(v) for v in (1, 2, 3, 4, 5, 7, 8))
_S9, _S12, _S15, _S16 = (np.uint32(v) for v in (9, 12, 15, 16))
_S20, _S24 = np.uint32(20), np.uint32(24)
_SC_LO, _SC_LS = np.uint32(0x3F80), np.uint32(0x8000)
_SC_HI, _SC_HS = np.uint32(0x3F800000), np.uint32(0x80000000)
_TWO15 = np.uint32(0x78007800)    # f16x2 (2^15, 2^15)


if SIM:
    def _h(bits):
        return np.array([int(bits) & 0xFFFF], np.uint16).view(np.float16)[0]

    def _bits(v):
        return int(np.array([v], np.float16).view(np.uint16)[0])

    @cuda.jit(device=True)
    def _ld4(a, i, j):
        """a[i, j:j + 4] of a uint32 array (one 16-byte ld.global.nc on the GPU)."""
        return uint32(a[i, j]), uint32(a[i, j + 1]), uint32(a[i, j + 2]), uint32(a[i, j + 3])

    _LD4 = [_ld4] * 6

    @cuda.jit(device=True)
    def _ld4x(a, i, off, k):
        """a[i, off + k:off + k + 4] of a uint32 array (one 16-byte load, 32-bit offsets)."""
        j = int(off) + int(k)
        return uint32(a[i, j]), uint32(a[i, j + 1]), uint32(a[i, j + 2]), uint32(a[i, j + 3])

    _LD4X = [_ld4x] * 6

    @cuda.jit(device=True)
    def _ldu16x(a, i, off, k):
        return uint32(a[i, int(off) + int(k)])

    @cuda.jit(device=True)
    def _sts4(a, i, v0, v1, v2, v3):
        a[i] = v0
        a[i + 1] = v1
        a[i + 2] = v2
        a[i + 3] = v3

    @cuda.jit(device=True)
    def _hmul2(a, b):
        lo = _bits(np.float16(_h(a) * _h(b)))
        hi = _bits(np.float16(_h(int(a) >> 16) * _h(int(b) >> 16)))
        return uint32(lo | (hi << 16))

    @cuda.jit(device=True)
    def _split2(x0, x1):
        """(hi, lo) f16 pairs: hi = f16(x), lo = f16(x - hi), element 0 in the low halves."""
        h0, h1 = np.float16(x0), np.float16(x1)
        l0 = np.float16(np.float32(x0) - np.float32(h0))
        l1 = np.float16(np.float32(x1) - np.float32(h1))
        return uint32(_bits(h0) | (_bits(h1) << 16)), uint32(_bits(l0) | (_bits(l1) << 16))

    def _frag(mx, w, lane, reg, half):
        return float(_h(int(mx[w, lane, reg]) >> (16 * half)))

    @cuda.jit(device=True)
    def _mma(mx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C for the warp's m16n8k16 fragments (PTX ISA layout), every thread of the
        block calling: fragments through shared memory between two barriers."""
        tid = cuda.threadIdx.x
        w = tid // WARP
        lane = tid % WARP
        for r, v in enumerate((a0, a1, a2, a3, b0, b1)):
            mx[w, lane, r] = v
        cuda.syncthreads()
        g = lane >> 2
        t = lane & 3
        d = []
        for row, col in ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)):
            s = 0.0
            for k in range(16):
                kk = (k % 8) // 2
                ar = (1 if row >= 8 else 0) + (2 if k >= 8 else 0)
                s += (_frag(mx, w, 4 * (row % 8) + kk, ar, k % 2)
                      * _frag(mx, w, 4 * col + kk, 4 + (1 if k >= 8 else 0), k % 2))
            d.append(s)
        cuda.syncthreads()
        return (float32(c0 + d[0]), float32(c1 + d[1]), float32(c2 + d[2]),
                float32(c3 + d[3]))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _I32, _F32 = ir.IntType(32), ir.FloatType()

    def _u32s(context, builder, sig, args, lo, hi):
        return [context.cast(builder, v, t, types.uint32)
                for v, t in zip(args[lo:hi], sig.args[lo:hi])]

    def _make_ld4(hint):
        @intrinsic
        def ld4(typingctx, a, i, j):
            """a[i, j:j + 4] of a 2-D uint32 array, one ld.global.nc.v4 (16-byte aligned
            address). An asm with side effects, so the loads are issued where the source puts
            them."""
            if not (isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.uint32):
                return None
            sig = types.UniTuple(types.uint32, 4)(a, i, j)

            def codegen(context, builder, sig, args):
                arr = context.make_array(sig.args[0])(context, builder, value=args[0])
                idx = [context.cast(builder, v, t, types.intp)
                       for v, t in zip(args[1:], sig.args[1:])]
                ptr = cgutils.get_item_pointer(context, builder, sig.args[0], arr, idx)
                return _emit_ld4(context, builder, sig, hint, ptr)
            return sig, codegen
        return ld4

    def _emit_ld4(context, builder, sig, hint, addr):
        """ld.global<hint>.v4.u32 at addr (a pointer or an i64) -> a tuple of 4 uint32."""
        fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [addr.type])
        asm = ir.InlineAsm(fnty, f"ld.global{hint}.v4.u32 {{$0,$1,$2,$3}}, [$4];",
                           "=r,=r,=r,=r,l", side_effect=True)
        res = builder.call(asm, [addr])
        return context.make_tuple(builder, sig.return_type,
                                  [builder.extract_value(res, x) for x in range(4)])

    # cache hints of the weight loads (variant "-p<P>"): non-coherent (.nc) plain, with 128 /
    # 256-byte L2 prefetch, and with no L1 allocation too (the weights are read once); then the
    # last two coherent: ptxas moves .nc loads across barriers (below the fill), not these
    _HINTS = (".nc", ".nc.L2::128B", ".nc.L2::256B", ".nc.L1::no_allocate.L2::256B",
              ".L1::no_allocate.L2::256B", ".L2::256B")
    _LD4 = [_make_ld4(h) for h in _HINTS]

    def _row_ptr(context, builder, sig, args, esize):
        """&a[i, 0] + esize * (zext(off) + k) of a 2-D array: the row's address once (64-bit),
        then 32-bit offsets; k (a constant where the caller's is) lands in the immediate."""
        aty = sig.args[0]
        arr = context.make_array(aty)(context, builder, value=args[0])
        i0 = context.cast(builder, args[1], sig.args[1], types.intp)
        row = cgutils.get_item_pointer(context, builder, aty, arr,
                                       [i0, context.get_constant(types.intp, 0)])
        i64 = ir.IntType(64)
        off = builder.zext(context.cast(builder, args[2], sig.args[2], types.uint32), i64)
        k = builder.zext(context.cast(builder, args[3], sig.args[3], types.uint32), i64)
        byte = builder.mul(builder.add(off, k, flags=["nuw"]), ir.Constant(i64, esize),
                           flags=["nuw"])
        return builder.add(builder.ptrtoint(row, i64), byte)

    def _make_ld4x(hint):
        @intrinsic
        def ld4x(typingctx, a, i, off, k):
            """a[i, off + k:off + k + 4] of a 2-D uint32 array, one ld.global<hint>.v4."""
            if not (isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.uint32):
                return None
            sig = types.UniTuple(types.uint32, 4)(a, i, off, k)

            def codegen(context, builder, sig, args):
                return _emit_ld4(context, builder, sig, hint,
                                 _row_ptr(context, builder, sig, args, 4))
            return sig, codegen
        return ld4x

    _LD4X = [_make_ld4x(h) for h in _HINTS]

    @intrinsic
    def _ldu16x(typingctx, a, i, off, k):
        """a[i, off + k] of a 2-D uint16 array as uint32 (ld.global.nc.u16)."""
        if not (isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.uint16):
            return None
        sig = types.uint32(a, i, off, k)

        def codegen(context, builder, sig, args):
            addr = _row_ptr(context, builder, sig, args, 2)
            fnty = ir.FunctionType(_I32, [ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "ld.global.nc.u16 $0, [$1];", "=r,l", side_effect=True)
            return builder.call(asm, [addr])
        return sig, codegen

    @intrinsic
    def _sts4(typingctx, a, i, v0, v1, v2, v3):
        """a[i:i + 4] = v0 .. v3 of a 1-D uint32 shared array (one 16-byte store; i % 4 == 0)."""
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.uint32):
            return None
        sig = types.none(a, i, v0, v1, v2, v3)

        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            arr = context.make_array(aty)(context, builder, value=args[0])
            ptr = cgutils.get_item_pointer(context, builder, aty, arr,
                                           [context.cast(builder, args[1], sig.args[1],
                                                         types.intp)])
            vt = ir.VectorType(_I32, 4)
            vec = ir.Constant(vt, ir.Undefined)
            for x, (v, ty) in enumerate(zip(args[2:], sig.args[2:])):
                vec = builder.insert_element(vec, context.cast(builder, v, ty, types.uint32),
                                             ir.Constant(_I32, x))
            builder.store(vec, builder.bitcast(ptr, vt.as_pointer()), align=16)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def _hmul2(typingctx, a, b):
        sig = types.uint32(a, b)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(_I32, [_I32, _I32])
            asm = ir.InlineAsm(fnty, "mul.rn.f16x2 $0, $1, $2;", "=r,r,r")
            return builder.call(asm, _u32s(context, builder, sig, args, 0, 2))
        return sig, codegen

    @intrinsic
    def _split2(typingctx, x0, x1):
        sig = types.UniTuple(types.uint32, 2)(x0, x1)

        def codegen(context, builder, sig, args):
            fl = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 2), [_F32, _F32])
            asm = ir.InlineAsm(
                fnty, "{ .reg .b16 h0, h1; .reg .f32 f0, f1; cvt.rn.f16.f32 h0, $2; "
                "cvt.rn.f16.f32 h1, $3; cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; "
                "sub.rn.f32 f0, $2, f0; sub.rn.f32 f1, $3, f1; mov.b32 $0, {h0, h1}; "
                "cvt.rn.f16x2.f32 $1, f1, f0; }", "=r,=r,f,f")
            res = builder.call(asm, fl)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, x) for x in range(2)])
        return sig, codegen

    @intrinsic
    def _mma(typingctx, mx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(mx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            fl = [context.cast(builder, v, t, types.float32) for v, t in zip(args[7:], sig.args[7:])]
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
            asm = ir.InlineAsm(
                fnty, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, "
                "{$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, _u32s(context, builder, sig, args, 1, 7) + fl)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, x) for x in range(4)])
        return sig, codegen


@cuda.jit(device=True, inline=True)
def _scales(u):
    """uint32 holding two E4M3 bytes (groups a, b) -> f16x2 (sa, sa), (sb, sb), each s * 2^7
    (bits as f16 give s * 2^-8, exact also for subnormal E4M3; the f16 multiply by 2^15 is exact)."""
    p = ((u << _S7) & _SC_LO) | ((u << _S8) & _SC_LS) | ((u << _S15) & _SC_HI) | \
        ((u << _S16) & _SC_HS)
    p = _hmul2(p, _TWO15)
    return (p & _LO16) | (p << _S16), (p >> _S16) | (p & _HI16)


@cuda.jit(device=True, inline=True)
def _pairs(w):
    """8 E2M1 nibbles of w -> four f16x2 pairs P_i = (nibble i, nibble i + 4), each E2M1 * 2^-14
    (0.5 a subnormal): magnitude bits to f16 bits 9-11, sign to bit 15. Pairs 0 and 1 are pairs
    2 and 3's masks applied before a shift by 8 (9 instructions, not 11)."""
    y = w << _S1
    z = w << _S4
    r = w >> _S3
    p0 = ((y & _MAG8) | (z & _SGN8)) << _S8
    p1 = ((r & _MAG8) | (w & _SGN8)) << _S8
    p2 = (y & _MAG) | (z & _SGN)
    p3 = (r & _MAG) | (w & _SGN)
    return p0, p1, p2, p3


@cuda.jit(device=True, inline=True)
def _pairs_scaled(w, sc):
    p0, p1, p2, p3 = _pairs(w)
    return _hmul2(p0, sc), _hmul2(p1, sc), _hmul2(p2, sc), _hmul2(p3, sc)


@cuda.jit(device=True, inline=True)
def _fscales(u):
    """uint32 holding two E4M3 bytes (groups a, b) -> float32 (sa, sb); the bits give s * 2^-120
    (subnormal E4M3 too), the multiply by 2^120 is exact."""
    a = int_as_float(((u << _S20) & _E_LO) | ((u << _S24) & _SC_HS)) * _TWO120
    b = int_as_float(((u << _S12) & _E_LO) | ((u << _S16) & _SC_HS)) * _TWO120
    return a, b


if SIM:
    @cuda.jit(device=True)
    def _quad_sum(v, red):
        """Sum over the 4 lanes of v's quad (lane // 4), every thread of the block calling."""
        tid = cuda.threadIdx.x
        red[tid] = v
        cuda.syncthreads()
        b = tid & ~3
        t = red[b] + red[b + 1] + red[b + 2] + red[b + 3]
        cuda.syncthreads()
        return float32(t)
else:
    @cuda.jit(device=True, inline=True)
    def _quad_sum(v, red):
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        return v + cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)


@cuda.jit(device=True, inline=True)
def _absmax(v, n):
    m = float32(0.0)
    for i in range(n):
        m = max(m, abs(v[i]))
    return m


@cuda.jit(device=True, inline=True)
def _input_scale(amax):
    """c = 2^(13 - floor(log2 amax)) (|x c| < 2^14), clamped to normal floats; and 1 / c."""
    eb = int32((float_as_uint(amax) >> _S16) >> _S7) & int32(0xFF)
    f = min(max(int32(267) - eb, int32(1)), int32(254))
    c = int_as_float(uint32(f) << np.uint32(23))
    return c, float32(1.0) / c


@cuda.jit(device=True, inline=True)
def _store_unit4(bsh, base, v0, v1, v2, v3, v4, v5, v6, v7):
    """_store_unit as two 16-byte stores (base % 4 == 0)."""
    h0, l0 = _split2(v0, v4)
    h1, l1 = _split2(v1, v5)
    h2, l2 = _split2(v2, v6)
    h3, l3 = _split2(v3, v7)
    _sts4(bsh, base, h0, h1, h2, h3)
    _sts4(bsh, base + 16, l0, l1, l2, l3)


@cuda.jit(device=True, inline=True)
def _store_unit(bsh, base, v0, v1, v2, v3, v4, v5, v6, v7):
    """B fragments of one (step, word, t) unit: pairs (v0, v4) (v1, v5) | (v2, v6) (v3, v7) as
    hi at base .. base + 3 and lo at base + 16 .. base + 19."""
    h0, l0 = _split2(v0, v4)
    h1, l1 = _split2(v1, v5)
    h2, l2 = _split2(v2, v6)
    h3, l3 = _split2(v3, v7)
    bsh[base] = h0
    bsh[base + 1] = h1
    bsh[base + 2] = h2
    bsh[base + 3] = h3
    bsh[base + 16] = l0
    bsh[base + 17] = l1
    bsh[base + 18] = l2
    bsh[base + 19] = l3


@cuda.jit(device=True, inline=True)
def _meet(part, wp, g, t, a, b, inv):
    """A warp's sums of rows g and 8 + g (lane t = 0 of each quad holds them) into part[wp],
    then a block barrier."""
    if t == 0:
        part[wp, g] = a * inv
        part[wp, 8 + g] = b * inv
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _gate_up_out(part, wp, g, t, dg, du, inv, tid, r0, I, act, k, bankf, slot):
    """The warps' gate / up row sums meet in part -> act[k, r0 + tid] = silu(gate) * up for
    the block's 8 rows (bankf[slot, :2]: the expert's global scales)."""
    _meet(part, wp, g, t, dg, du, inv)
    rr = r0 + tid
    if tid < 8 and rr < I:
        sg = float32(0.0)
        su = float32(0.0)
        for w in range(int32(cuda.blockDim.x) >> 5):
            sg += part[w, tid]
            su += part[w, 8 + tid]
        act[k, rr] = silu(sg * float32(128.0) * bankf[slot, 0]) * \
            (su * float32(128.0) * bankf[slot, 1])


@cuda.jit(device=True, inline=True)
def _down_out(part, wp, g, t, d0, d1, inv, tid, r0, H, out, accumulate):
    """The warps' sums of the block's 16 output rows meet in part -> out[r0 + tid] (+=)."""
    _meet(part, wp, g, t, d0, d1, inv)
    rr = r0 + tid
    if tid < 16 and rr < H:
        o = float32(0.0)
        for w in range(int32(cuda.blockDim.x) >> 5):
            o += part[w, tid]
        out[rr] = o * float32(128.0) + (out[rr] if accumulate else float32(0.0))


def _fns(S: int, LA: int, MODE: int = 0, P: int = 0, COLS: int = 0, LEAN: int = 0):
    """(load, fill, steps): a warp's device functions for S steps (S * 128 columns) a warp, the
    loads of LA steps in flight ahead of the one multiplied (LA = S: every load issued first),
    weight loads with cache hints P (see _LD4). MODE (diagnostics for the sweep, wrong
    results): 1 = no input loads (x = 1), 2 = no decode or mma (the words XORed into the sums).
    COLS: E4M3 scales applied to each group's own D columns in f32 (no f16 multiplies; see
    steps), else to A in f16. LEAN (with COLS): the fill's stores 16 bytes wide, and the lanes
    off their scale group take zeros by a select, not from a zero chunk (no block barrier
    needed before the steps)."""
    UPT = cdiv(S, 2)              # (step, word, t) units of B a lane fills: 16 S a warp
    NV = 8 * UPT
    ld4 = _LD4[P]
    store = _store_unit4 if LEAN else _store_unit

    @cuda.jit(device=True, inline=True)
    def load(bank32, bank16, slots, slot0, wv, sv, s, wp, nst, nsi, a0, a1, s0, s1, down):
        """Step s of the warp (clamped to the last real step) into wv[8 s:8 s + 8], sv[2 s:2 s + 2]:
        16 bytes of rows g and g + 8 (uint32 offsets a0, a1 at step 0) and their two scale pairs
        (uint16 offsets s0, s1); down: steps run over the experts side by side, nsi an expert."""
        st = min(wp * int32(S) + int32(s), nst - int32(1))
        slot = slot0
        if down:
            ke = st // nsi
            st = st - ke * nsi
            slot = slots[ke]
        wv[8 * s], wv[8 * s + 1], wv[8 * s + 2], wv[8 * s + 3] = ld4(bank32, slot, a0 + st * 16)
        wv[8 * s + 4], wv[8 * s + 5], wv[8 * s + 6], wv[8 * s + 7] = ld4(bank32, slot, a1 + st * 16)
        sv[2 * s] = uint32(bank16[slot, uint32(s0 + st * 4)])     # unsigned: no wraparound
        sv[2 * s + 1] = uint32(bank16[slot, uint32(s1 + st * 4)])

    @cuda.jit(device=True, inline=True)
    def fill(bsh, v, red):
        """The lane's units' values v (input times its factor) as hi / lo f16 pairs into the
        warp's own B fragments, scaled by the warp's c; returns 1 / c. Warp-wide: no block
        barrier (a warp reads only the steps it fills)."""
        c, inv = _input_scale(warp_max(_absmax(v, NV), red))
        tid = int32(cuda.threadIdx.x)
        st0 = (tid >> 5) * int32(S)
        for i in range(UPT):
            u = (tid & 31) + int32(32 * i)
            q = (u >> 2) & 3
            if u < int32(16 * S):             # 16 S units a warp (S odd: lanes left over)
                store(bsh, (((st0 + (u >> 4)) * 4 + q) * 8 + (u & 3)) * 4,
                            v[8 * i] * c, v[8 * i + 1] * c, v[8 * i + 2] * c, v[8 * i + 3] * c,
                            v[8 * i + 4] * c, v[8 * i + 5] * c, v[8 * i + 6] * c,
                            v[8 * i + 7] * c)
        warp_sync()
        return inv

    @cuda.jit(device=True, inline=True)
    def steps(mx, bsh, red, wv, sv, bank32, bank16, slots, slot0, wp, nst, nsi, a0, a1, s0, s1,
              down):
        """The warp's S steps: rows g (words wv[8 s + q], scales sv[2 s]) and g + 8 (wv[8 s + 4 +
        q], sv[2 s + 1]) against the B fragments of steps wp S .. wp S + S - 1; steps LA .. S - 1
        are loaded here, LA steps ahead of the one multiplied."""
        lane = uint32(cuda.threadIdx.x) & uint32(31)
        sel = ((((lane >> _S2) & uint32(1)) << _S2) | (lane & uint32(3))) << _S2
        st0 = wp * int32(S)
        # COLS: B column 2 t' + h holds x (hi / lo) only on the k of lane t' (its own scale
        # group), so D separates the 4 groups of an mma; other lanes read a zero chunk
        valid = (lane & uint32(3)) == (lane >> _S3)
        zoff = uint32(cuda.blockDim.x >> 5) * uint32(S * STEP_U32)
        c0 = float32(0.0)
        c1 = float32(0.0)
        c2 = float32(0.0)
        c3 = float32(0.0)
        for s in range(S):
            if s + LA < S:
                load(bank32, bank16, slots, slot0, wv, sv, s + LA, wp, nst, nsi, a0, a1, s0, s1,
                     down)
            if MODE == 2:
                x_ = sv[2 * s] ^ sv[2 * s + 1]
                for q in range(8):
                    x_ ^= wv[8 * s + q]
                c0 += float32(x_ & uint32(255))
                continue
            if COLS:
                fa, fb = _fscales(sv[2 * s])
                ha, hb = _fscales(sv[2 * s + 1])
                for hg in range(2):             # words 2 hg, 2 hg + 1: one scale group a lane
                    d0 = float32(0.0)
                    d1 = float32(0.0)
                    d2 = float32(0.0)
                    d3 = float32(0.0)
                    for qq in range(2):
                        q = 2 * hg + qq
                        base = (uint32(st0 + s) * uint32(4) + uint32(q)) * uint32(32) + sel
                        if LEAN:
                            zb = uint32(0)
                            b0 = bsh[base] if valid else zb
                            b1 = bsh[base + 1] if valid else zb
                            b2 = bsh[base + 2] if valid else zb
                            b3 = bsh[base + 3] if valid else zb
                        else:
                            base = base if valid else zoff
                            b0 = bsh[base]
                            b1 = bsh[base + 1]
                            b2 = bsh[base + 2]
                            b3 = bsh[base + 3]
                        p0, p1, p2, p3 = _pairs(wv[8 * s + q])
                        r0, r1, r2, r3 = _pairs(wv[8 * s + 4 + q])
                        d0, d1, d2, d3 = _mma(mx, p0, r0, p1, r1, b0, b1, d0, d1, d2, d3)
                        d0, d1, d2, d3 = _mma(mx, p2, r2, p3, r3, b2, b3, d0, d1, d2, d3)
                    c0 += (fa if hg == 0 else fb) * (d0 + d1)
                    c2 += (ha if hg == 0 else hb) * (d2 + d3)
                continue
            ga, gb = _scales(sv[2 * s])
            ua, ub = _scales(sv[2 * s + 1])
            for q in range(4):
                base = (uint32(st0 + s) * uint32(4) + uint32(q)) * uint32(32) + sel
                p0, p1, p2, p3 = _pairs_scaled(wv[8 * s + q], ga if q < 2 else gb)
                r0, r1, r2, r3 = _pairs_scaled(wv[8 * s + 4 + q], ua if q < 2 else ub)
                c0, c1, c2, c3 = _mma(mx, p0, r0, p1, r1, bsh[base], bsh[base + 1],
                                      c0, c1, c2, c3)
                c0, c1, c2, c3 = _mma(mx, p2, r2, p3, r3, bsh[base + 2], bsh[base + 3],
                                      c0, c1, c2, c3)
        if COLS:      # lane t holds its own groups' sums: the quad adds them up
            return _quad_sum(c0, red) * float32(128.0), _quad_sum(c2, red) * float32(128.0)
        return c0 + c1, c2 + c3

    return load, fill, steps


def _make(S: int, LA: int, MODE: int = 0, P: int = 0, COLS: int = 0):
    """(gate_up, down) with the device functions of _fns(S, LA, MODE, P, COLS)."""
    NW8 = 8 * S                   # weight words a lane holds: 2 rows x 4 words a step
    NS2 = 2 * S
    UPT = cdiv(S, 2)
    NV = 8 * UPT
    load, fill, steps = _fns(S, LA, MODE, P, COLS)

    @cuda.jit
    def gate_up(bank32, bank16, bankf, slots, x, act, gq, gsc, uq, usc, H, I, Hs):
        """x float32 [H] -> act float32 [K, I]; grid K * cdiv(I, 8), warps * S * 128 >= Hs,
        dynamic shared warps * S * 512 bytes. The layout comes as scalars (byte offsets of the
        gate / up values and scales): no load stands between the slot and the weights."""
        bsh = cuda.shared.array(0, uint32)
        part = cuda.shared.array((MAX_WARPS, 16), float32)
        red = cuda.shared.array(RED, float32)
        mx = cuda.shared.array((MXW, WARP, 6), uint32)
        tid = int32(cuda.threadIdx.x)
        nt = int32(cuda.blockDim.x)
        wp = tid >> 5
        g = (tid & 31) >> 2
        t = tid & 3
        nst = Hs >> 7
        nrg = (I + int32(7)) >> 3
        k = int32(cuda.blockIdx.x) // nrg
        r0 = (int32(cuda.blockIdx.x) - k * nrg) << 3
        r = min(r0 + g, I - int32(1))
        pdl_wait()                            # the slots are the router's, just before
        pdl_trigger()
        slot = slots[k]
        ga = (gq + r * (Hs >> 1) + t * int32(16)) >> 2     # uint32 index, step 0
        ua = (uq + r * (Hs >> 1) + t * int32(16)) >> 2
        gs = (gsc + r * (Hs >> 4) + t * int32(2)) >> 1     # uint16 index
        us = (usc + r * (Hs >> 4) + t * int32(2)) >> 1
        wv = cuda.local.array(NW8, uint32)
        sv = cuda.local.array(NS2, uint32)
        for s in range(LA):                   # the first LA steps' weights
            load(bank32, bank16, slots, slot, wv, sv, s, wp, nst, int32(1), ga, ua, gs, us, False)
        if tid < 4:
            bsh[(nt >> 5) * int32(S * STEP_U32) + tid] = uint32(0)   # the zero chunk
        cuda.syncthreads()   # ptxas sinks the weight loads below the fill, never below a barrier
        # the lane's units of x (L2 hits), after the weights' HBM loads are on their way
        v = cuda.local.array(NV, float32)
        for i in range(UPT):
            u = (tid & 31) + int32(32 * i)
            e0 = (wp * int32(S) + (u >> 4)) * int32(STEP) + (u & 3) * int32(32) + \
                ((u >> 2) & 3) * int32(8)
            for j in range(8):
                e = e0 + int32(j)
                a = x[uint32(min(e, H - int32(1)))] if MODE != 1 else float32(1.0)
                v[8 * i + j] = a if e < H else float32(0.0)
        inv = fill(bsh, v, red)
        dg, du = steps(mx, bsh, red, wv, sv, bank32, bank16, slots, slot, wp, nst, int32(1), ga, ua,
                       gs, us, False)
        _gate_up_out(part, wp, g, t, dg, du, inv, tid, r0, I, act, k, bankf, slot)

    @cuda.jit
    def down(bank32, bank16, bankf, slots, weights, act, out, accumulate, dq, dsc, H, I, Is):
        """act float32 [K, I] -> out float32 [H] (+= when accumulate); grid cdiv(H, 16),
        warps * S * 128 >= K * Is, dynamic shared warps * S * 512 bytes."""
        bsh = cuda.shared.array(0, uint32)
        part = cuda.shared.array((MAX_WARPS, 16), float32)
        red = cuda.shared.array(RED, float32)
        mx = cuda.shared.array((MXW, WARP, 6), uint32)
        tid = int32(cuda.threadIdx.x)
        nt = int32(cuda.blockDim.x)
        wp = tid >> 5
        g = (tid & 31) >> 2
        t = tid & 3
        K = int32(slots.shape[0])
        nsi = Is >> 7                          # steps an expert
        nst = K * nsi
        r0 = int32(cuda.blockIdx.x) << 4
        ra = min(r0 + g, H - int32(1))
        rb = min(r0 + int32(8) + g, H - int32(1))
        da = (dq + ra * (Is >> 1) + t * int32(16)) >> 2
        db = (dq + rb * (Is >> 1) + t * int32(16)) >> 2
        sa = (dsc + ra * (Is >> 4) + t * int32(2)) >> 1
        sb = (dsc + rb * (Is >> 4) + t * int32(2)) >> 1
        wv = cuda.local.array(NW8, uint32)
        sv = cuda.local.array(NS2, uint32)
        # the slots come from the launch two back (the router): read, with the weights, before
        # the wait for gate_up's act
        for s in range(LA):
            load(bank32, bank16, slots, int32(0), wv, sv, s, wp, nst, nsi, da, db, sa, sb, True)
        pdl_wait()
        pdl_trigger()
        if tid < 4:
            bsh[(nt >> 5) * int32(S * STEP_U32) + tid] = uint32(0)
        cuda.syncthreads()   # as in gate_up
        v = cuda.local.array(NV, float32)
        for i in range(UPT):
            u = (tid & 31) + int32(32 * i)
            st = wp * int32(S) + (u >> 4)
            ke = min(st // nsi, K - int32(1))
            i0 = (st - ke * nsi) * int32(STEP) + (u & 3) * int32(32) + ((u >> 2) & 3) * int32(8)
            f = weights[ke] * bankf[slots[ke], 2] if MODE != 1 else float32(1.0)
            for j in range(8):
                e = i0 + int32(j)
                a = act[ke, uint32(min(e, I - int32(1)))] * f if MODE != 1 else float32(1.0)
                v[8 * i + j] = a if e < I and st < nst else float32(0.0)
        inv = fill(bsh, v, red)
        d0, d1 = steps(mx, bsh, red, wv, sv, bank32, bank16, slots, int32(0), wp, nst, nsi, da, db,
                       sa, sb, True)
        _down_out(part, wp, g, t, d0, d1, inv, tid, r0, H, out, accumulate)

    return pdl_kernel(gate_up), pdl_kernel(down)


def _units(S: int, NSI: int = 1):
    """(x_units, act_units, expert_step): device functions of the lean kernels (and the tma
    kernels of gpu_experts_tma) for S steps a warp and NSI = Is / 128 steps an expert.
        x_units(x, v, lane, wp): v[8 i:8 i + 8] = the lane's units of x, 16 bytes a load
        act_units(act, weights, bankf, slots, v, lane, ke0, sl0): the lane's units of down's
            input, act times the expert's routing weight and global scale
        expert_step(ke0, sl0, s): (expert, its step) of the warp's step sl0 + s of expert ke0
    v is zero where the lane has no unit (S odd)."""
    UPT = cdiv(S, 2)
    U = np.uint32
    _NSI = U(NSI)

    @cuda.jit(device=True, inline=True)
    def expert_step(ke0, sl0, s):
        """s < S <= NSI: one wrap at most."""
        sl = U(sl0 + s)
        w = sl >= _NSI
        return U(ke0 + U(1)) if w else ke0, U(sl - _NSI) if w else sl

    @cuda.jit(device=True, inline=True)
    def x_units(x, v, lane, wp):
        for i in range(UPT):
            u = lane + int32(32 * i)
            if u < int32(16 * S):
                e0 = (wp * int32(S) + (u >> 4)) * int32(STEP) + (u & 3) * int32(32) + \
                    ((u >> 2) & 3) * int32(8)
                v[8 * i], v[8 * i + 1], v[8 * i + 2], v[8 * i + 3] = _ldx4(x, e0)
                v[8 * i + 4], v[8 * i + 5], v[8 * i + 6], v[8 * i + 7] = _ldx4(x, e0 + int32(4))
            else:
                for j in range(8):
                    v[8 * i + j] = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def act_units(act, weights, bankf, slots, v, lane, ke0, sl0):
        lane = U(lane)
        for i in range(UPT):
            u = U(lane + U(32 * i))
            if u < U(16 * S):
                ke, sl = expert_step(ke0, sl0, u >> _S4)
                f = weights[ke] * bankf[slots[ke], 2]
                i0 = U(sl * U(STEP) + (u & U(3)) * U(32) + ((u >> _S2) & U(3)) * U(8))
                a0, a1, a2, a3 = _ldx4(act, ke, i0)
                a4, a5, a6, a7 = _ldx4(act, ke, U(i0 + U(4)))
                v[8 * i] = a0 * f
                v[8 * i + 1] = a1 * f
                v[8 * i + 2] = a2 * f
                v[8 * i + 3] = a3 * f
                v[8 * i + 4] = a4 * f
                v[8 * i + 5] = a5 * f
                v[8 * i + 6] = a6 * f
                v[8 * i + 7] = a7 * f
            else:
                for j in range(8):
                    v[8 * i + j] = float32(0.0)

    return x_units, act_units, expert_step


def _make_lean(S: int, P: int, NSI: int):
    """(gate_up, down) as _make(S, S, 0, P, 1) computes them ("-l"), for layouts where no
    step is clamped (H and I multiples of 128, Hs / 128 and K * NSI multiples of S, S <= NSI =
    Is / 128; down is compiled for its NSI), with the instruction count cut: the weights and
    scales are read at 32-bit offsets from their slot's row (the same addresses, not 64-bit
    index arithmetic for every load), gate_up's grid is (row groups, K) (no division for the
    expert), x and act come in 16-byte loads, the fill stores 16 bytes at a time, and the one
    barrier before the steps sits right after the loads (no zero chunk to publish; with
    coherent loads, -p4 / -p5, ptxas keeps them above it). Same sums in the same order: the
    same results."""
    UPT = cdiv(S, 2)
    NV = 8 * UPT
    NW8 = 8 * S
    NS2 = 2 * S
    ld4w = _LD4X[P]
    _, fill, steps = _fns(S, S, 0, P, 1, 1)
    x_units, act_units, expert_step = _units(S, NSI)

    @cuda.jit
    def gate_up(bank32, bank16, bankf, slots, x, act, gq, gsc, uq, usc, I, Hs):
        """x float32 [H = Hs] -> act float32 [K, I]; grid (cdiv(I, 8), K), Hs / 128 / S warps,
        dynamic shared warps * S * 512 bytes."""
        bsh = cuda.shared.array(0, uint32)
        part = cuda.shared.array((MAX_WARPS, 16), float32)
        red = cuda.shared.array(RED, float32)
        mx = cuda.shared.array((MXW, WARP, 6), uint32)
        tid = int32(cuda.threadIdx.x)
        wp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        k = int32(cuda.blockIdx.y)
        r0 = int32(cuda.blockIdx.x) << 3
        r = uint32(min(r0 + g, I - int32(1)))
        # uint32 / uint16 offsets of this lane's step 0 in the slot's row
        hb = uint32(Hs) >> _S1
        ga = (uint32(gq) + r * hb + uint32(t * 16 + wp * (S * 64))) >> _S2
        ua = (uint32(uq) + r * hb + uint32(t * 16 + wp * (S * 64))) >> _S2
        sb = uint32(Hs) >> _S4
        gs = (uint32(gsc) + r * sb + uint32(t * 2 + wp * (S * 8))) >> _S1
        us = (uint32(usc) + r * sb + uint32(t * 2 + wp * (S * 8))) >> _S1
        pdl_wait()                            # the slots are the router's, just before
        pdl_trigger()
        slot = slots[k]
        wv = cuda.local.array(NW8, uint32)
        sv = cuda.local.array(NS2, uint32)
        for s in range(S):
            wv[8 * s], wv[8 * s + 1], wv[8 * s + 2], wv[8 * s + 3] = ld4w(bank32, slot, ga, 16 * s)
            wv[8 * s + 4], wv[8 * s + 5], wv[8 * s + 6], wv[8 * s + 7] = ld4w(bank32, slot, ua,
                                                                              16 * s)
            sv[2 * s] = _ldu16x(bank16, slot, gs, 4 * s)
            sv[2 * s + 1] = _ldu16x(bank16, slot, us, 4 * s)
        v = cuda.local.array(NV, float32)
        x_units(x, v, lane, wp)
        # ptxas sinks loads to their first use (a step's weights after the step before: four
        # dependent trips to HBM); coherent loads (-p4 / -p5) stay above a barrier
        cuda.syncthreads()
        inv = fill(bsh, v, red)
        dg, du = steps(mx, bsh, red, wv, sv, bank32, bank16, slots, slot, wp, int32(Hs >> 7),
                       int32(1), int32(0), int32(0), int32(0), int32(0), False)
        _gate_up_out(part, wp, g, t, dg, du, inv, tid, r0, I, act, k, bankf, slot)

    U = np.uint32
    _NSI = U(NSI)
    _US = U(S)

    @cuda.jit
    def down(bank32, bank16, bankf, slots, weights, act, out, accumulate, dq, dsc, H):
        """act float32 [K, I = Is = 128 NSI] -> out float32 [H] (+= when accumulate); grid
        cdiv(H, 16), K * NSI / S warps, dynamic shared warps * S * 512 bytes."""
        bsh = cuda.shared.array(0, uint32)
        part = cuda.shared.array((MAX_WARPS, 16), float32)
        red = cuda.shared.array(RED, float32)
        mx = cuda.shared.array((MXW, WARP, 6), uint32)
        tid = int32(cuda.threadIdx.x)
        lane = U(tid & 31)
        wp = U(tid >> 5)
        g = lane >> _S2
        t = lane & U(3)
        r0 = int32(cuda.blockIdx.x) << 4
        ra = U(min(r0 + int32(g), H - int32(1)))
        rb = U(min(r0 + int32(8 + g), H - int32(1)))
        da = U(U(dq) + ra * U(NSI * 64) + t * U(16)) >> _S2
        db = U(U(dq) + rb * U(NSI * 64) + t * U(16)) >> _S2
        sa = U(U(dsc) + ra * U(NSI * 8) + t * U(2)) >> _S1
        sb = U(U(dsc) + rb * U(NSI * 8) + t * U(2)) >> _S1
        st0 = U(wp * _US)                     # the warp's first step, its expert and step there
        ke0 = U(st0 // _NSI)
        sl0 = U(st0 - ke0 * _NSI)
        wv = cuda.local.array(NW8, uint32)
        sv = cuda.local.array(NS2, uint32)
        # the slots come from the launch two back (the router): read, with the weights,
        # before the wait for gate_up's act
        for s in range(S):
            ke, sl = expert_step(ke0, sl0, U(s))
            slot = slots[ke]
            o = U(sl * U(16))
            wv[8 * s], wv[8 * s + 1], wv[8 * s + 2], wv[8 * s + 3] = ld4w(bank32, slot, da, o)
            wv[8 * s + 4], wv[8 * s + 5], wv[8 * s + 6], wv[8 * s + 7] = ld4w(bank32, slot, db, o)
            o = U(sl * U(4))
            sv[2 * s] = _ldu16x(bank16, slot, sa, o)
            sv[2 * s + 1] = _ldu16x(bank16, slot, sb, o)
        pdl_wait()
        pdl_trigger()
        v = cuda.local.array(NV, float32)
        act_units(act, weights, bankf, slots, v, lane, ke0, sl0)
        cuda.syncthreads()             # as in gate_up
        inv = fill(bsh, v, red)
        d0, d1 = steps(mx, bsh, red, wv, sv, bank32, bank16, slots, int32(0), int32(wp),
                       int32(0), int32(NSI), int32(0), int32(0), int32(0), int32(0), True)
        _down_out(part, wp, g, t, d0, d1, inv, tid, r0, H, out, accumulate)

    return pdl_kernel(gate_up), pdl_kernel(down)


_KERNELS = {}


def kernels(s: int, la: int = 0, mode: int = 0, p: int = 0, cols: int = 0, lean: int = 0):
    """(gate_up, down); lean (the "-l" flag) picks the lean kernels where the launchers can run
    them (lean_steps()) and does not change these."""
    key = (s, min(la or s, s), mode, p, cols)
    if key not in _KERNELS:
        _KERNELS[key] = _make(*key)
    return _KERNELS[key]


_LEAN = {}


def lean_kernels(s: int, p: int, nsi: int = 1):
    """(gate_up, down) of _make_lean; down is compiled for nsi = Is / 128 (gate_up for any)."""
    if (s, p, nsi) not in _LEAN:
        _LEAN[(s, p, nsi)] = _make_lean(s, p, nsi)
    return _LEAN[(s, p, nsi)]


def lean_steps(cfg, lay_host, k: int, half: str) -> int:
    """Steps a warp the lean kernels ("-l", with -c and every load first) take for `half`
    ("gate_up" / "down") of this layout, 0 where they cannot run it: no clamped step, so
    gate_up needs H = Hs and Hs / 128 a multiple of SG; down needs I = Is and takes SD, else
    the nearest count of steps (SD + 1 first) that divides K * Is / 128 and is at most Is / 128
    (2560 x 640, top-10: 50 steps, 5 a warp)."""
    la, mode, _, cols, lean = cfg[2]
    h, i, hs, is_ = (int(lay_host[j]) for j in (6, 7, 8, 9))
    if not (lean and cols and mode == 0 and la in (0, cfg[1] if half == "gate_up" else cfg[3])):
        return 0
    if half == "gate_up":
        return cfg[1] if h == hs and (hs // STEP) % cfg[1] == 0 else 0
    nsi, sd = is_ // STEP, cfg[3]
    if i != is_ or k * nsi * STEP_U32 * 4 > SHARED_LIMIT:   # a block's fragments: K * NSI steps
        return 0
    for s in [sd, sd + 1] + list(range(sd - 1, 0, -1)):
        if s <= nsi and (k * nsi) % s == 0 and k * nsi // s <= MAX_WARPS:
            return s
    return 0


def _views(b8):
    """uint32 / uint16 views of the uint8 bank [S, B] (B a multiple of 16)."""
    return b8.view(np.uint32), b8.view(np.uint16)


def _shape(lay_host, k, sg, sd):
    """(gate_up warps, down warps), or None when these kernels cannot run the layout."""
    hs, is_ = int(lay_host[8]), int(lay_host[9])
    if hs % STEP or is_ % STEP or any(int(o) % 16 for o in lay_host[:6]):
        return None
    wg = cdiv(hs // STEP, sg)
    wd = cdiv(k * is_ // STEP, sd)
    if max(wg, wd) > MAX_WARPS or max(wg * sg, wd * sd) * STEP_U32 * 4 + 16 > SHARED_LIMIT:
        return None
    return wg, wd


def supported(lay_host, k: int, cfg, row_bytes: int) -> bool:
    return row_bytes % 16 == 0 and _shape(lay_host, k, cfg[1], cfg[3]) is not None


def gate_up(cfg, views, lay, lay_host, slots, x, act, stream):
    """cfg = ("mma", SG, (LA, MODE, P, COLS), SD, 0) (LA 0: every load first)."""
    _, b8, bf = views
    b32, b16 = _views(b8)
    sg = cfg[1]
    wg, _ = _shape(lay_host, slots.shape[0], sg, cfg[3])
    L = [int32(v) for v in lay_host]
    if lean_steps(cfg, lay_host, slots.shape[0], "gate_up"):
        lean_kernels(sg, cfg[2][2])[0][(cdiv(int(lay_host[7]), 8), slots.shape[0]), wg * WARP,
                                       stream, wg * sg * STEP_U32 * 4](
            b32, b16, bf, slots, x, act, L[0], L[1], L[2], L[3], L[7], L[8])
        return
    grid = slots.shape[0] * cdiv(int(lay_host[7]), 8)
    kernels(sg, *cfg[2])[0][grid, wg * WARP, stream, wg * sg * STEP_U32 * 4 + 16](
        b32, b16, bf, slots, x, act, L[0], L[1], L[2], L[3], L[6], L[7], L[8])


def down(cfg, views, lay, lay_host, slots, weights, act, out, stream, accumulate):
    _, b8, bf = views
    b32, b16 = _views(b8)
    sd = cfg[3]
    _, wd = _shape(lay_host, slots.shape[0], cfg[1], sd)
    L = [int32(v) for v in lay_host]
    sl = lean_steps(cfg, lay_host, slots.shape[0], "down")
    if sl:
        nsi = int(lay_host[9]) // STEP
        wl = slots.shape[0] * nsi // sl
        lean_kernels(sl, cfg[2][2], nsi)[1][
            cdiv(int(lay_host[6]), 16), wl * WARP, stream, wl * sl * STEP_U32 * 4](
            b32, b16, bf, slots, weights, act, out, int32(1 if accumulate else 0), L[4], L[5],
            L[6])
        return
    kernels(sd, *cfg[2])[1][cdiv(int(lay_host[6]), 16), wd * WARP, stream, wd * sd * STEP_U32 * 4 + 16](
        b32, b16, bf, slots, weights, act, out, int32(1 if accumulate else 0), L[4], L[5], L[6],
        L[7], L[9])
