"""Shared pieces of the CUDA kernels: simulator switch, warp reductions, bit casts, tables,
16-byte vector loads (inline PTX) and cp.async copies to shared memory.

The same kernel source runs on the GPU and under NUMBA_ENABLE_CUDASIM=1 (CI). The simulator has
no warp shuffles, so the warp reductions here use a shared-memory path there; callers pass a
per-block float32 scratch `red` of at least the block's thread count (`red_i` int32 likewise
for arg-reductions) and must call a reduction from every thread of the block (uniform control
flow), which the GPU path does not need but the simulator's barriers do.
Blocks are 1-D; lane = threadIdx.x % 32, warp = threadIdx.x // 32.
"""
from __future__ import annotations

import math
import time

import numpy as np
from numba import config, cuda, float32, int32, uint16, uint32, uint64

SIM = bool(config.ENABLE_CUDASIM)  # read once at import: the env var must be set before numba
WARP = 32
FULL_MASK = 0xFFFFFFFF
M32 = np.uint64(0xFFFFFFFF)
U32_15 = np.uint32(15)
NEG_INF = float32(-math.inf)


def _e4m3_table() -> np.ndarray:
    """float32 [256]: every FP8 E4M3 (FN) code decoded; 0x7f / 0xff decode to NaN."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((exp == 0xF) & (man == 0x7), np.nan, val)
    return (sign * val).astype(np.float32)


E4M3_TABLE = _e4m3_table()  # float32 [256]
E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---- bit casts -------------------------------------------------------------------------------

if SIM:
    def int_as_float(i):
        return np.array([int(i) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    def float_as_uint(f):
        return np.uint32(np.array([f], dtype=np.float32).view(np.uint32)[0])
else:
    from numba.cuda import libdevice as _ld

    @cuda.jit(device=True, inline=True)
    def int_as_float(i):
        return _ld.int_as_float(int32(i))

    @cuda.jit(device=True, inline=True)
    def float_as_uint(f):
        return uint32(_ld.float_as_int(f))


@cuda.jit(device=True, inline=True)
def bf16_lo(w):
    """The bfloat16 in the low half of a uint32 word, as float32."""
    return int_as_float((w & 0xFFFF) << 16)


@cuda.jit(device=True, inline=True)
def bf16_hi(w):
    """The bfloat16 in the high half of a uint32 word, as float32."""
    return int_as_float(w & 0xFFFF0000)


@cuda.jit(device=True, inline=True)
def bf16_at(bits):
    """One uint16 bfloat16 -> float32."""
    return int_as_float(uint32(bits) << 16)


@cuda.jit(device=True, inline=True)
def to_bf16(x):
    """float32 -> uint16 bfloat16 bits, round to nearest even, NaN kept quiet (as
    loader.quant.f32_to_bf16)."""
    u = float_as_uint(x)
    if x != x:
        return uint16((u >> uint32(16)) | uint32(0x0040))
    return uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))


@cuda.jit(device=True, inline=True)
def _put_f32(a, i, j, k, x):
    a[i, j, k] = x


@cuda.jit(device=True, inline=True)
def _put_bf16(a, i, j, k, x):
    a[i, j, k] = to_bf16(x)


def putter(bf: bool):
    """A device function put(a, i, j, k, x): a[i, j, k] = x, for a cache of float32 or (bf) of
    bf16 bits, rounded. Kernel factories pick one by the cache kind they are built for."""
    return _put_bf16 if bf else _put_f32



# ---- vector loads ----------------------------------------------------------------------------
# numba emits at most 8-byte loads; these give one ld.global.<cop>.v<width> instruction of
# `width` consecutive 4-byte elements: ld4(a, i, ..., k) -> (a[i, ..., k], ..., a[i, ..., k + 3])
# for a float32 / uint32 array of any rank, one index per axis. The address must be 4 * width
# bytes aligned (aligned() checks a launch's arrays). The simulator reads the elements one by one.

if SIM:
    def make_ld(width: int, cop: str = "nc", ordered: bool = False, volatile: bool = False):
        @cuda.jit(device=True)
        def ld(a, *idx):
            head, k = idx[:-1], idx[-1]
            return tuple(a[head + (k + c,)] for c in range(width))
        return ld

    def make_ldo(width: int, cop: str = "nc", ordered: bool = False):
        @cuda.jit(device=True)
        def ld(a, off):
            f = a.reshape(-1)
            return tuple(f[off + c] for c in range(width))
        return ld
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def make_ld(width: int, cop: str = "nc", ordered: bool = False, volatile: bool = False):
        """a[i, ..., k:k + width] of a float32 / uint32 array as one ld.global.<cop>.v<width>
        (cop "nc": read-only for the kernel's life, through the non-coherent L1 path; "cg": L2
        only; "": a plain coherent load). ordered: an asm with side effects and a memory
        clobber, so LLVM keeps it after the fence that publishes what it reads. volatile: side
        effects only, so LLVM keeps the load where it is written (a side-effect-free asm reads
        no memory as LLVM sees it and may move across a barrier)."""
        @intrinsic
        def ld(typingctx, a, *idx):
            if not (isinstance(a, types.Array) and a.ndim == len(idx)
                    and a.dtype in (types.float32, types.uint32)
                    and all(isinstance(i, types.Integer) for i in idx)):
                return None
            # the indices arrive at lowering as one tuple (the star argument)
            sig = types.UniTuple(a.dtype, width)(a, types.StarArgTuple.from_types(idx))

            def codegen(context, builder, sig, args):
                aty = sig.args[0]
                arr = context.make_array(aty)(context, builder, value=args[0])
                ix = [context.cast(builder, v, ty, types.intp)
                      for v, ty in zip(cgutils.unpack_tuple(builder, args[1]), sig.args[1])]
                ptr = cgutils.get_item_pointer(context, builder, aty, arr, ix)
                fl = aty.dtype == types.float32
                elt = context.get_value_type(aty.dtype)
                ret = ir.LiteralStructType([elt] * width) if width > 1 else elt
                fnty = ir.FunctionType(ret, [ptr.type])
                regs = ",".join(f"${x}" for x in range(width))
                vec, dst = (f".v{width}", f"{{{regs}}}") if width > 1 else ("", "$0")
                cons = ",".join(["=f" if fl else "=r"] * width) + ",l"
                op = "ld.global" + (f".{cop}" if cop else "")
                asm = ir.InlineAsm(
                    fnty, f"{op}{vec}.{'f32' if fl else 'u32'} {dst}, [${width}];",
                    cons + (",~{memory}" if ordered else ""), side_effect=ordered or volatile)
                res = builder.call(asm, [ptr])
                vals = [builder.extract_value(res, x) for x in range(width)] if width > 1 \
                    else [res]
                return context.make_tuple(builder, sig.return_type, vals)
            return sig, codegen
        return ld

    def make_ldo(width: int, cop: str = "nc", ordered: bool = False):
        """As make_ld, at a flat 32-bit offset: ld(a, off) -> a.flat[off:off + width] of a
        C-contiguous float32 / uint32 array of any rank (the data pointer plus zext(off) * 4:
        no 64-bit index arithmetic; the array must have fewer than 2**32 elements)."""
        @intrinsic
        def ld(typingctx, a, off):
            if not (isinstance(a, types.Array) and a.layout == "C"
                    and a.dtype in (types.float32, types.uint32)
                    and isinstance(off, types.Integer)):
                return None
            sig = types.UniTuple(a.dtype, width)(a, off)

            def codegen(context, builder, sig, args):
                aty = sig.args[0]
                arr = context.make_array(aty)(context, builder, value=args[0])
                i64 = ir.IntType(64)
                o = builder.zext(context.cast(builder, args[1], sig.args[1], types.uint32), i64)
                addr = builder.add(builder.ptrtoint(arr.data, i64),
                                   builder.mul(o, ir.Constant(i64, 4), flags=["nuw"]))
                fl = aty.dtype == types.float32
                elt = context.get_value_type(aty.dtype)
                ret = ir.LiteralStructType([elt] * width) if width > 1 else elt
                regs = ",".join(f"${x}" for x in range(width))
                vec, dst = (f".v{width}", f"{{{regs}}}") if width > 1 else ("", "$0")
                cons = ",".join(["=f" if fl else "=r"] * width) + ",l"
                op = "ld.global" + (f".{cop}" if cop else "")
                asm = ir.InlineAsm(
                    ir.FunctionType(ret, [i64]),
                    f"{op}{vec}.{'f32' if fl else 'u32'} {dst}, [${width}];",
                    cons + (",~{memory}" if ordered else ""), side_effect=ordered)
                res = builder.call(asm, [addr])
                vals = [builder.extract_value(res, x) for x in range(width)] if width > 1 \
                    else [res]
                return context.make_tuple(builder, sig.return_type, vals)
            return sig, codegen
        return ld

ld4 = make_ld(4, "nc")          # 16 bytes of data the kernel only reads
ld4cg = make_ld(4, "cg", True)  # 16 bytes other blocks of this launch wrote (after a fence),
ld1cg = make_ld(1, "cg", True)  # or the launch before wrote (after pdl_wait): L2, kept after it
# at a flat 32-bit offset (make_ldo), 16 and 8 bytes
ld4o, ld2o = make_ldo(4, "nc"), make_ldo(2, "nc")
ld4ocg, ld2ocg = make_ldo(4, "cg", True), make_ldo(2, "cg", True)
# ld4 kept where it is written: loads issued ahead of a barrier that must stay ahead of it
# (LLVM sees a side-effect-free asm as touching no memory and may sink it past the barrier
# to its use; ptxas keeps such loads before the bar.sync, sm_90 checked)
ld4_pinned = make_ld(4, "nc", volatile=True)


# lds4(a, i) -> a[i:i + 4] as one 16-byte load, a float32 / uint32 1-D array whose a[i] is 16-byte
# aligned (shared memory declared with alignment=16): ld.shared.v4 where indexing element by
# element costs four loads and four negative-index checks.
if SIM:
    @cuda.jit(device=True)
    def lds4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]
else:
    def _vec_ptr(context, builder, aty, arr_val, i_val, i_ty):
        arr = context.make_array(aty)(context, builder, value=arr_val)
        ptr = cgutils.get_item_pointer(context, builder, aty, arr,
                                       [context.cast(builder, i_val, i_ty, types.intp)])
        return builder.bitcast(ptr, ir.VectorType(ir.FloatType(), 4).as_pointer())

    def _f32_vector(a, i, dtypes=(types.float32,)):
        return (isinstance(a, types.Array) and a.ndim == 1 and a.dtype in dtypes
                and isinstance(i, types.Integer))

    @intrinsic
    def lds4(typingctx, a, i):
        if not _f32_vector(a, i, (types.float32, types.uint32)):
            return None
        sig = types.UniTuple(a.dtype, 4)(a, i)

        def codegen(context, builder, sig, args):
            ptr = _vec_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            elt = context.get_value_type(sig.args[0].dtype)
            v = builder.load(builder.bitcast(ptr, ir.VectorType(elt, 4).as_pointer()), align=16)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(v, ir.Constant(ir.IntType(32), k))
                                       for k in range(4)])
        return sig, codegen


# st4(a, idx, v0, v1, v2, v3): a[idx:idx + 4] = v0 .. v3 as one 16-byte store (st.v4; into
# shared memory st.shared.v4), a float32 / uint32 array of any rank, idx one integer or a tuple
# of one a axis (the last one's four elements are written); 16-byte aligned there.
if SIM:
    @cuda.jit(device=True)
    def st4(a, idx, v0, v1, v2, v3):
        if isinstance(idx, tuple):
            head, k = idx[:-1], idx[-1]
        else:
            head, k = (), idx
        for c, v in enumerate((v0, v1, v2, v3)):
            a[head + (k + c,)] = v
else:
    @intrinsic
    def st4(typingctx, a, idx, v0, v1, v2, v3):
        ix = list(idx) if isinstance(idx, types.BaseTuple) else [idx]
        if not (isinstance(a, types.Array) and a.ndim == len(ix)
                and a.dtype in (types.float32, types.uint32)
                and all(isinstance(i, types.Integer) for i in ix)):
            return None
        sig = types.none(a, idx, v0, v1, v2, v3)

        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            arr = context.make_array(aty)(context, builder, value=args[0])
            if isinstance(sig.args[1], types.BaseTuple):
                vals = zip(cgutils.unpack_tuple(builder, args[1]), sig.args[1])
            else:
                vals = [(args[1], sig.args[1])]
            ptr = cgutils.get_item_pointer(context, builder, aty, arr,
                                           [context.cast(builder, v, t, types.intp)
                                            for v, t in vals])
            elt = context.get_value_type(aty.dtype)
            vt = ir.VectorType(elt, 4)
            vec = ir.Constant(vt, ir.Undefined)
            for x, (v, ty) in enumerate(zip(args[2:], sig.args[2:])):
                vec = builder.insert_element(vec, context.cast(builder, v, ty, aty.dtype),
                                             ir.Constant(ir.IntType(32), x))
            builder.store(vec, builder.bitcast(ptr, vt.as_pointer()), align=16)
            return context.get_dummy_value()
        return sig, codegen


# cp_async4(dst, i, src, j, ..., k): dst[i:i + 4] = src[j, ..., k:k + 4] as one 16-byte
# cp.async.cg (global -> shared, through L2, no registers held while in flight); dst a float32
# 1-D shared array 16-byte aligned at i, src float32 with 16-byte aligned rows.
# cp_async_wait(): waits for this thread's copies; a barrier after it publishes them.
if SIM:
    @cuda.jit(device=True)
    def cp_async4(dst, i, src, *idx):
        head, k = idx[:-1], idx[-1]
        for c in range(4):
            dst[i + c] = src[head + (k + c,)]

    @cuda.jit(device=True)
    def cp_async_wait():
        pass
else:
    @intrinsic
    def cp_async4(typingctx, dst, i, src, *idx):
        if not (_f32_vector(dst, i) and isinstance(src, types.Array)
                and src.dtype == types.float32 and src.ndim == len(idx)
                and all(isinstance(j, types.Integer) for j in idx)):
            return None
        sig = types.none(dst, i, src, types.StarArgTuple.from_types(idx))

        def codegen(context, builder, sig, args):
            dptr = _vec_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            sty = sig.args[2]
            sarr = context.make_array(sty)(context, builder, value=args[2])
            ix = [context.cast(builder, v, ty, types.intp)
                  for v, ty in zip(cgutils.unpack_tuple(builder, args[3]), sig.args[3])]
            sptr = cgutils.get_item_pointer(context, builder, sty, sarr, ix)
            i64 = ir.IntType(64)
            fnty = ir.FunctionType(ir.VoidType(), [i64, i64])
            asm = ir.InlineAsm(
                fnty, "{ .reg .u64 s; cvta.to.shared.u64 s, $0; "
                "cp.async.cg.shared.global [s], [$1], 16; }", "l,l,~{memory}",
                side_effect=True)
            builder.call(asm, [builder.ptrtoint(dptr, i64), builder.ptrtoint(sptr, i64)])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def cp_async_wait(typingctx):
        sig = types.none()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.wait_all;",
                               "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return sig, codegen


# prefetch_l2(a, i, nbytes): asks the L2 to fetch about nbytes of the 2-D array a from the start
# of row i on (cp.async.bulk.prefetch, in 16-byte granules: one thread, nothing waits). A hint:
# before its PDL wait a kernel can pull in weights that no launch writes while the kernel before
# it still runs. No-op before sm_90 and under the simulator.
if SIM:
    @cuda.jit(device=True)
    def prefetch_l2(a, i, nbytes):
        pass
else:
    @intrinsic
    def prefetch_l2(typingctx, a, i, nbytes):
        if not (isinstance(a, types.Array) and a.ndim == 2 and isinstance(i, types.Integer)
                and isinstance(nbytes, types.Integer)):
            return None
        sig = types.none(a, i, nbytes)

        def codegen(context, builder, sig, args):
            if _pdl_target():
                aty = sig.args[0]
                arr = context.make_array(aty)(context, builder, value=args[0])
                ix = [context.cast(builder, args[1], sig.args[1], types.intp),
                      context.get_constant(types.intp, 0)]
                ptr = cgutils.get_item_pointer(context, builder, aty, arr, ix)
                i64, i32 = ir.IntType(64), ir.IntType(32)
                # 16-byte granules: the start rounded down, the size too (a hint may fall short)
                n = builder.and_(builder.trunc(context.cast(builder, args[2], sig.args[2],
                                                            types.int64), i32),
                                 ir.Constant(i32, ~15 & 0xFFFFFFFF))
                addr = builder.and_(builder.ptrtoint(ptr, i64), ir.Constant(i64, ~15))
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i64, i32]),
                                   "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r",
                                   side_effect=True)
                builder.call(asm, [addr, n])
            return context.get_dummy_value()
        return sig, codegen


# ---- programmatic dependent launch (sm_90+) --------------------------------------------------
# In a graph whose kernel -> kernel edges are programmatic (engine/graphs.py), a kernel may start
# while the one before it still runs. pdl_wait() blocks until the kernels it depends on have
# finished and their writes are visible; pdl_trigger() lets the next kernel start. A PDL kernel
# (registered with pdl_kernel) reads nothing another launch wrote before pdl_wait() and writes
# nothing before it; it calls pdl_trigger() only after pdl_wait(), so at most two kernels are in
# flight and, before its own wait, a kernel may also read what the launch two back wrote (its
# predecessor triggered only once that one had finished). Launched any other way (eagerly, in a
# graph with plain edges, before sm_90) both are no-ops.
PDL_KERNELS = []     # dispatchers whose kernels follow the rule above


def pdl_kernel(k):
    """Register a kernel dispatcher as PDL-safe (see above); returns it."""
    PDL_KERNELS.append(k)
    return k


if SIM:
    @cuda.jit(device=True)
    def _noop():
        pass

    pdl_wait = pdl_trigger = fence_system = _noop

    @cuda.jit(device=True)
    def pause():
        # a simulated spin loop (a gate waiting for the host thread) sleeps, giving up the GIL
        # for the thread it waits on: spinning bare, it starved that thread on a loaded machine
        # (a CI run timed the residency check out at 600 s; alone it takes 3 s)
        time.sleep(1e-4)

    @cuda.jit(device=True)
    def globaltimer():
        return uint64(0)
else:
    def _target_at_least(cc) -> bool:
        """Whether the kernel being compiled targets compute capability cc or later."""
        try:
            return cuda.get_current_device().compute_capability >= cc
        except Exception:
            return False

    def _pdl_target() -> bool:
        """Whether the kernel being compiled targets sm_90 or later (griddepcontrol)."""
        return _target_at_least((9, 0))

    def _asm_op(text: str, available):
        """A device function of one PTX instruction, emitted where available() says the target
        has it, else nothing."""
        @intrinsic
        def op(typingctx):
            def codegen(context, builder, sig, args):
                if available():
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                       side_effect=True)
                    builder.call(asm, [])
                return context.get_dummy_value()
            return types.none(), codegen
        return op

    @intrinsic
    def globaltimer(typingctx):
        """The GPU's nanosecond clock (%globaltimer, the same on every SM): for timeline tools."""
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []), "mov.u64 $0, %globaltimer;",
                               "=l,~{memory}", side_effect=True)
            return builder.call(asm, [])
        return types.uint64(), codegen

    pdl_wait = _asm_op("griddepcontrol.wait;", lambda: _pdl_target())
    pdl_trigger = _asm_op("griddepcontrol.launch_dependents;", lambda: _pdl_target())
    # backs a spinning thread off for about a microsecond (sm_70 and later; before, it spins)
    pause = _asm_op("nanosleep.u32 1000;", lambda: _target_at_least((7, 0)))

    @cuda.jit(device=True, inline=True)
    def fence_system():
        """Orders this thread's writes to mapped host memory for the host (membar.sys)."""
        cuda.threadfence_system()


# ---- bulk copies into shared memory (sm_90: cp.async.bulk completing on an mbarrier) --------
# The copy engine moves a contiguous run of global bytes into shared memory; no thread holds a
# register while it is in flight, so one block can have its whole share of a layer's weights on
# the way at once. bar: a uint64 1-D shared array (8-byte aligned), one barrier an entry.
#   mbar_init(bar, i, 1); mbar_fence_init()         one thread, before any copy or wait
#   mbar_expect(bar, i, nbytes)                     one thread: the arrival, and the bytes due
#   bulk_copy(dst, di, src, row, off, nbytes, bar, i)
#       dst[di:di + nbytes / 4] = src[row, off:off + nbytes / 4]: dst a uint32 1-D shared
#       array, src a 2-D uint32 global array; both ends 16-byte aligned, nbytes a multiple of 16
#   bulk_done()                                     every thread: the simulator's copies ran
#                                                   synchronously and a barrier publishes them
#   mbar_wait(bar, i, parity)                       a thread waits for phase `parity`
# The simulator keeps each barrier's bytes due in it and refuses a wait on a barrier whose
# copies do not add up to what was expected (on the GPU that wait would never end).
if SIM:
    @cuda.jit(device=True)
    def mbar_init(bar, i, count):
        bar[i] = 0

    @cuda.jit(device=True)
    def mbar_fence_init():
        pass

    @cuda.jit(device=True)
    def mbar_expect(bar, i, nbytes):
        cuda.atomic.add(bar, i, nbytes)

    @cuda.jit(device=True)
    def bulk_copy(dst, di, src, row, off, nbytes, bar, i):
        for c in range(int(nbytes) // 4):
            dst[int(di) + c] = src[int(row), int(off) + c]
        cuda.atomic.sub(bar, i, nbytes)

    @cuda.jit(device=True)
    def bulk_done():
        cuda.syncthreads()

    @cuda.jit(device=True)
    def mbar_wait(bar, i, parity):
        if bar[i] != 0:
            raise RuntimeError("mbarrier: the copies do not bring the bytes expected")
else:
    def _elem_ptr(context, builder, aty, arr_val, idx):
        """i64 address of aty-typed arr_val[idx...] (idx: (value, type) pairs)."""
        arr = context.make_array(aty)(context, builder, value=arr_val)
        ptr = cgutils.get_item_pointer(context, builder, aty, arr,
                                       [context.cast(builder, v, t, types.intp) for v, t in idx])
        return builder.ptrtoint(ptr, ir.IntType(64))

    def _u32(context, builder, v, t):
        return context.cast(builder, v, t, types.uint32)

    def _is_bar(bar, i):
        return (isinstance(bar, types.Array) and bar.ndim == 1 and bar.dtype == types.uint64
                and isinstance(i, types.Integer))

    def _bar_op(text: str):
        """An intrinsic f(bar, i, n) of one mbarrier instruction on &bar[i] (the shared-window
        address in register s of text; n in $1)."""
        def typer(typingctx, bar, i, n):
            if not (_is_bar(bar, i) and isinstance(n, types.Integer)):
                return None
            sig = types.none(bar, i, n)

            def codegen(context, builder, sig, args):
                addr = _elem_ptr(context, builder, sig.args[0], args[0], [(args[1], sig.args[1])])
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(32)]),
                                   "{ .reg .u64 s; .reg .b64 st; cvta.to.shared.u64 s, $0; "
                                   + text + " }", "l,r,~{memory}", side_effect=True)
                builder.call(asm, [addr, _u32(context, builder, args[2], sig.args[2])])
                return context.get_dummy_value()
            return sig, codegen
        return intrinsic(typer)

    mbar_init = _bar_op("mbarrier.init.shared::cta.b64 [s], $1;")
    mbar_expect = _bar_op("mbarrier.arrive.expect_tx.shared::cta.b64 st, [s], $1;")
    # the barriers' initialisation made visible to the copy engine (the async proxy)
    mbar_fence_init = _asm_op("fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta;",
                              lambda: True)

    @intrinsic
    def bulk_copy(typingctx, dst, di, src, row, off, nbytes, bar, i):
        if not (isinstance(dst, types.Array) and dst.ndim == 1 and dst.dtype == types.uint32
                and isinstance(src, types.Array) and src.ndim == 2
                and src.dtype == types.uint32 and _is_bar(bar, i)):
            return None
        sig = types.none(dst, di, src, row, off, nbytes, bar, i)

        def codegen(context, builder, sig, args):
            i64, i32 = ir.IntType(64), ir.IntType(32)
            a = sig.args
            d = _elem_ptr(context, builder, a[0], args[0], [(args[1], a[1])])
            zero = (context.get_constant(types.intp, 0), types.intp)
            g = _elem_ptr(context, builder, a[2], args[2], [(args[3], a[3]), zero])
            o = builder.zext(_u32(context, builder, args[4], a[4]), i64)
            g = builder.add(g, builder.mul(o, ir.Constant(i64, 4), flags=["nuw"]))
            m = _elem_ptr(context, builder, a[6], args[6], [(args[7], a[7])])
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [i64, i64, i32, i64]),
                "{ .reg .u64 d, m; cvta.to.shared.u64 d, $0; cvta.to.shared.u64 m, $3; "
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [d], [$1], $2, "
                "[m]; }", "l,l,r,l,~{memory}", side_effect=True)
            builder.call(asm, [d, g, _u32(context, builder, args[5], a[5]), m])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def _mbar_try(typingctx, bar, i, parity):
        if not _is_bar(bar, i):
            return None
        sig = types.uint32(bar, i, parity)

        def codegen(context, builder, sig, args):
            i64, i32 = ir.IntType(64), ir.IntType(32)
            addr = _elem_ptr(context, builder, sig.args[0], args[0], [(args[1], sig.args[1])])
            asm = ir.InlineAsm(
                ir.FunctionType(i32, [i64, i32]),
                "{ .reg .u64 s; .reg .pred p; cvta.to.shared.u64 s, $1; "
                "mbarrier.try_wait.parity.shared::cta.b64 p, [s], $2; selp.u32 $0, 1, 0, p; }",
                "=r,l,r,~{memory}", side_effect=True)
            return builder.call(asm, [addr, _u32(context, builder, args[2], sig.args[2])])
        return sig, codegen

    _trap = _asm_op("trap;", lambda: True)

    @cuda.jit(device=True, inline=True)
    def mbar_wait(bar, i, parity):
        """Spins on try_wait (each try suspends the thread a while); a wait of seconds means
        copies that will never land: a kernel error, not a hang."""
        n = uint32(0)
        while _mbar_try(bar, i, parity) == uint32(0):
            n += uint32(1)
            if n > uint32(1 << 26):
                _trap()

    @cuda.jit(device=True, inline=True)
    def bulk_done():
        pass


def aligned(nbytes: int, *arrays) -> bool:
    """Every row of the device arrays starts on nbytes and is contiguous (the vector loads of
    make_ld: 16 bytes for ld4, 8 for ld2o). Always true under the simulator."""
    if SIM:
        return True
    return all(a.__cuda_array_interface__["data"][0] % nbytes == 0
               and a.strides[-1] == a.dtype.itemsize
               and all(x % nbytes == 0 for x in a.strides[:-1]) for a in arrays)

# ---- warp reductions -------------------------------------------------------------------------

if SIM:
    @cuda.jit(device=True)
    def warp_sum(v, red):
        """Sum of v over the warp, returned to every lane."""
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        red[tid] = v
        cuda.syncthreads()
        base = tid - tid % WARP
        s = float32(0.0)
        for i in range(WARP):
            s += red[base + i]
        cuda.syncthreads()
        return s

    @cuda.jit(device=True)
    def warp_max(v, red):
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        red[tid] = v
        cuda.syncthreads()
        base = tid - tid % WARP
        m = red[base]
        for i in range(1, WARP):
            m = max(m, red[base + i])
        cuda.syncthreads()
        return m

    @cuda.jit(device=True)
    def warp_argmax(v, i, red, red_i):
        """(max value, lowest index holding it) over the warp, to every lane."""
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        red[tid] = v
        red_i[tid] = i
        cuda.syncthreads()
        base = tid - tid % WARP
        bv = red[base]
        bi = red_i[base]
        for j in range(1, WARP):
            ov = red[base + j]
            oi = red_i[base + j]
            if ov > bv or (ov == bv and oi < bi):
                bv = ov
                bi = oi
        cuda.syncthreads()
        return bv, bi
else:
    @cuda.jit(device=True, inline=True)
    def warp_sum(v, red):
        """Sum of v over the warp, returned to every lane (xor butterfly)."""
        v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
        return v

    @cuda.jit(device=True, inline=True)
    def warp_max(v, red):
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 8))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 4))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 2))
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 1))
        return v

    @cuda.jit(device=True, inline=True)
    def warp_argmax(v, i, red, red_i):
        """(max value, lowest index holding it) over the warp, to every lane."""
        off = 16
        while off > 0:
            ov = cuda.shfl_xor_sync(FULL_MASK, v, off)
            oi = cuda.shfl_xor_sync(FULL_MASK, i, off)
            if ov > v or (ov == v and oi < i):
                v = ov
                i = oi
            off //= 2
        return v, i


if SIM:
    @cuda.jit(device=True)
    def warp_sync():
        """Orders shared-memory accesses among a warp's lanes (the simulator has no syncwarp: a
        block barrier there, so every thread of the block must reach each call)."""
        cuda.syncthreads()
else:
    @cuda.jit(device=True, inline=True)
    def warp_sync():
        cuda.syncwarp()


@cuda.jit(device=True, inline=True)
def block_sum(v, red, wred):
    """Sum over the whole block, to every thread. wred: float32 shared [>= warps]."""
    s = warp_sum(v, red)
    tid = cuda.threadIdx.x
    nw = (cuda.blockDim.x + WARP - 1) // WARP
    cuda.syncthreads()
    if tid % WARP == 0:
        wred[tid // WARP] = s
    cuda.syncthreads()
    t = float32(0.0)
    for w in range(nw):
        t += wred[w]
    cuda.syncthreads()
    return t


@cuda.jit(device=True, inline=True)
def block_max(v, red, wred):
    m = warp_max(v, red)
    tid = cuda.threadIdx.x
    nw = (cuda.blockDim.x + WARP - 1) // WARP
    cuda.syncthreads()
    if tid % WARP == 0:
        wred[tid // WARP] = m
    cuda.syncthreads()
    t = wred[0]
    for w in range(1, nw):
        t = max(t, wred[w])
    cuda.syncthreads()
    return t


@cuda.jit(device=True, inline=True)
def block_argmax(v, i, red, red_i, wred, wred_i):
    bv, bi = warp_argmax(v, i, red, red_i)
    tid = cuda.threadIdx.x
    nw = (cuda.blockDim.x + WARP - 1) // WARP
    cuda.syncthreads()
    if tid % WARP == 0:
        wred[tid // WARP] = bv
        wred_i[tid // WARP] = bi
    cuda.syncthreads()
    bv = wred[0]
    bi = wred_i[0]
    for w in range(1, nw):
        ov = wred[w]
        oi = wred_i[w]
        if ov > bv or (ov == bv and oi < bi):
            bv = ov
            bi = oi
    cuda.syncthreads()
    return bv, bi


@cuda.jit(device=True, inline=True)
def silu(v):
    return v / (float32(1.0) + math.exp(-v))


def poison(arr) -> None:
    """Fill a float device array with NaN (tests: outputs poisoned before each run)."""
    host = np.full(arr.shape, np.nan, dtype=arr.dtype) if arr.dtype.kind == "f" else \
        np.full(arr.shape, -1, dtype=arr.dtype)
    arr.copy_to_device(host)


__all__ = ["SIM", "WARP", "E4M3_TABLE", "E2M1_TABLE", "cdiv", "int_as_float", "float_as_uint",
           "bf16_lo", "bf16_hi", "bf16_at", "to_bf16", "putter", "warp_sum", "warp_max", "warp_argmax", "warp_sync",
           "block_sum", "block_max", "block_argmax", "silu", "poison", "uint64", "M32", "U32_15",
           "make_ld", "ld4", "ld4cg", "ld1cg", "make_ldo", "ld4o", "ld2o", "ld4ocg", "ld2ocg",
           "ld4_pinned", "lds4", "st4",
           "cp_async4", "globaltimer",
           "cp_async_wait", "prefetch_l2", "mbar_init", "mbar_fence_init", "mbar_expect", "bulk_copy",
           "bulk_done", "mbar_wait", "aligned", "pdl_wait", "pdl_trigger", "pdl_kernel", "PDL_KERNELS"]
