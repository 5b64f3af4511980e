"""The LLVM code behind plain-Python names: each name here is a Python function that raises
when called from Python, and that numba replaces, inside compiled code, by an ``@overload`` or
an ``@intrinsic`` written with llvmlite's IR builder. The rest of the package calls them as
ordinary functions.

Why LLVM code at all: numba offers no other way to keep a block of outputs in vector registers
across a loop, nor to name an instruction such as ``vpdpbusd`` (docs/kernels.md).

**Register budget.** x86-64 has 32 vector registers with AVX-512 (zmm, 16 float32 or int32
lanes) and 16 with AVX2 (ymm, 8 lanes). The code is written for 16 lanes; on the AVX2 class
LLVM splits each 16-lane vector into two ymm registers.

- value sums (:func:`_value_sum_intrinsic`): up to 4 queries x 4 vectors of 16 float32 =
  16 accumulators, plus the 4 value vectors loaded once for all queries and 1 broadcast
  weight: 21 of AVX-512's 32 zmm. On the AVX2 class the widest block needs 32 ymm
  accumulators, more than the 16 it has: LLVM keeps some on the stack (not re-tuned).
- u8 x s8 tiles (:func:`_u8s8_tile_intrinsic`, :data:`~aiayn.model.kernels.cpu.U8S8_VARIANTS`):
  "vnni" 4 rows x 4 vectors = 16 int32 accumulators + 4 weight vectors + 1 broadcast = 21 of
  32 zmm; "avx2" 4 rows x 2 vectors = 8 accumulators + 2 weight vectors + 1 broadcast + the
  ones of ``vpmaddwd`` + 1-2 temporaries = 13-14 of 16 ymm.

**Preconditions** (the callers hold them; nothing is checked in compiled code):

- ``_value_sum*`` and ``_store_rows``: the row length (d_v, d) is a multiple of 16 (one
  vector); :func:`~aiayn.model.kernels.attention._attend` takes its other path otherwise.
- the u8s8 tiles: the packed weight's blocks of 4 inputs cover the activations' K (``KB ==
  ceil(K / 4)``), and every weight's magnitude is at most the variant's level (63 for
  "avx2": ``vpmaddubsw`` adds two products of an unsigned byte and a signed one into an
  int16, and 2 * 255 * 63 = 32,130 fits in 32,767 where 2 * 255 * 127 does not):
  :func:`~aiayn.model.kernels.int8.pack_u8s8` and
  :func:`~aiayn.model.kernels.int8.u8s8_product` check both.
- a variant's instructions exist only where numba's target CPU has them; LLVM aborts the
  process (no exception) on a VNNI instruction for a target without it, so a variant is
  compiled only where :func:`~aiayn.model.kernels.cpu.u8s8_variants` lists it.
"""

from __future__ import annotations

import numpy as np

from aiayn.model.kernels.cpu import U8S8_VARIANTS
from aiayn.model.kernels.jit import numba

def _f32(x):  # pragma: no cover - replaced by its overload inside compiled code
    """One stored element as float32: itself, or the float32 whose upper half are a bfloat16's
    16 bits (a key or value of a bf16 cache, held as uint16)."""
    raise NotImplementedError


def _put(dst, src):  # pragma: no cover - replaced by its overload inside compiled code
    """``dst[:] = src`` for a float32 row ``src``: copied, or rounded to bfloat16 (to nearest,
    ties to even, as torch's ``.to(torch.bfloat16)`` rounds; a NaN stays a NaN) into the
    uint16 row of a bf16 cache's bits."""
    raise NotImplementedError


if numba is not None:
    from numba import types
    from numba.extending import overload

    @overload(_f32, inline="always")
    def _f32_overload(x):  # pragma: no cover - compile time
        if isinstance(x, types.Integer):
            return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
        return lambda x: x

    @overload(_put, inline="always")
    def _put_overload(dst, src):  # pragma: no cover - compile time
        if isinstance(dst.dtype, types.Integer):
            def put_bf16(dst, src):
                bits = src.view(np.uint32)
                for c in range(dst.shape[0]):
                    b = bits[c]
                    if b & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):  # NaN
                        dst[c] = np.uint16(0x7FC0)
                    else:
                        dst[c] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16))
                                                                    & np.uint32(1)))
                                           >> np.uint32(16))
            return put_bf16

        def put_f32(dst, src):
            dst[:] = src
        return put_f32


def _prefetch(a, i):  # pragma: no cover - replaced by its intrinsic inside compiled code
    """Ask the CPU to bring element ``i`` of array ``a``'s storage into its caches (LLVM's
    ``llvm.prefetch``: a hint, no fault, no effect on any value)."""
    raise NotImplementedError


if numba is not None:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _prefetch_intrinsic(typingctx, a, i):  # pragma: no cover - compile time
        if not isinstance(a, types.Array) or not isinstance(i, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            at = context.cast(builder, args[1], signature.args[1], types.intp)
            byte = _ir.IntType(8).as_pointer()
            i32 = _ir.IntType(32)
            fn = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(_ir.VoidType(), [byte, i32, i32, i32]),
                "llvm.prefetch.p0")
            # a read (0), kept in every cache level (3), of data (1)
            builder.call(fn, [builder.bitcast(builder.gep(arr.data, [at]), byte), i32(0),
                              i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(a, i), codegen

    @overload(_prefetch, inline="always")
    def _prefetch_overload(a, i):  # pragma: no cover - compile time
        return lambda a, i: _prefetch_intrinsic(a, i)


def _as_int64(context, builder, value, ty):  # pragma: no cover - compile time
    """An intrinsic's integer argument ``value`` (of numba type ``ty``) as an LLVM i64."""
    return context.cast(builder, value, ty, types.int64)


#: float32 lanes of one vector register in the value sums' code (AVX-512; LLVM splits each
#: into two on the AVX2 class)
_LANES = 16


def _value_sum_intrinsic(queries: int):
    """A numba intrinsic ``(out, oo, ostride, v, vo, weights, wstride, n, inv, DV) -> None``:
    the DV outputs (a multiple of 16) of each of ``queries`` attention rows that read the
    same n value rows (a beam group's queries over their sentence's encoder values; or one
    query): for query t, ``out[oo + t * ostride + e] = sum_j (weights[t * wstride + j] *
    inv[t]) * v[vo[j] + e]``, the weighted sum of its values (eq. 1), each value row starting
    at element ``vo[j]`` of the flat storage ``v`` (float32, or a bf16 cache's uint16 bits).
    Each output is a chain of fused multiply-adds over j = 0 .. n-1 from 0, held in vector
    registers across all the keys (blocks of four vectors, then of one) and stored once: the
    same chain, so the same bits, as :func:`_axpy4`'s, without its load and store of the
    output at every pass and without the test on addresses (and the scalar copy) that LLVM
    gives such a loop of its own; with several queries, each value row is loaded once for all
    of them, and their chains run side by side. Written as LLVM code because numba offers no
    other way to keep a row in registers (docs/benchmarks.md)."""

    def codegen(context, builder, signature, args):  # pragma: no cover - compile time
        out_t, oo_t, os_t, v_t, vo_t, w_t, ws_t, n_t, inv_t, dv_t = signature.args
        out_v, oo_v, os_v, v_v, vo_v, w_v, ws_v, n_v, inv_v, dv_v = args
        out_a = context.make_array(out_t)(context, builder, out_v)
        v_a = context.make_array(v_t)(context, builder, v_v)
        vo_a = context.make_array(vo_t)(context, builder, vo_v)
        w_a = context.make_array(w_t)(context, builder, w_v)
        inv_a = context.make_array(inv_t)(context, builder, inv_v)
        i32, i64, f32 = _ir.IntType(32), _ir.IntType(64), _ir.FloatType()
        lanes_f32, lanes_i32 = _ir.VectorType(f32, _LANES), _ir.VectorType(i32, _LANES)
        bf16 = v_t.dtype == types.uint16
        lanes_in = _ir.VectorType(_ir.IntType(16) if bf16 else f32, _LANES)
        fma = _cgutils.get_or_insert_function(
            builder.module, _ir.FunctionType(lanes_f32, [lanes_f32] * 3), "llvm.fma.v16f32")

        def int64(value, ty):
            return _as_int64(context, builder, value, ty)

        oo, ostride = int64(oo_v, oo_t), int64(os_v, os_t)
        wstride, n, DV = int64(ws_v, ws_t), int64(n_v, n_t), int64(dv_v, dv_t)
        zero = _ir.Constant(lanes_f32, [0.0] * _LANES)
        invs = [builder.load(builder.gep(inv_a.data, [i64(t)])) for t in range(queries)]
        undef = _ir.Constant(lanes_f32, _ir.Undefined)

        def block(c, vectors):  # the outputs c .. c + 16 * vectors - 1 of every query
            sums = [[_cgutils.alloca_once_value(builder, zero) for _ in range(vectors)]
                    for _ in range(queries)]
            for s in (s for row in sums for s in row):  # (alloca_once_value stores in the
                builder.store(zero, s)                  # entry block: zero them here)
            with _cgutils.for_range(builder, n) as loop:
                j = loop.index
                row = builder.add(builder.load(builder.gep(vo_a.data, [j])), c)
                xs = []
                for m in range(vectors):
                    at = builder.gep(v_a.data, [builder.add(row, i64(_LANES * m))])
                    x = builder.load(builder.bitcast(at, lanes_in.as_pointer()),
                                     align=2 if bf16 else 4)
                    if bf16:  # a bfloat16's bits are a float32's upper half (_f32)
                        x = builder.bitcast(builder.shl(builder.zext(x, lanes_i32),
                                                        _ir.Constant(lanes_i32, [16] * _LANES)),
                                            lanes_f32)
                    xs.append(x)
                for t in range(queries):
                    at = builder.add(builder.mul(i64(t), wstride), j)
                    w = builder.fmul(builder.load(builder.gep(w_a.data, [at])), invs[t])
                    w = builder.shuffle_vector(builder.insert_element(undef, w, i32(0)), undef,
                                               _ir.Constant(lanes_i32, [0] * _LANES))
                    for x, s in zip(xs, sums[t]):
                        builder.store(builder.call(fma, [w, x, builder.load(s)]), s)
            for t in range(queries):
                start = builder.add(builder.add(oo, builder.mul(i64(t), ostride)), c)
                for m, s in enumerate(sums[t]):
                    at = builder.gep(out_a.data, [builder.add(start, i64(_LANES * m))])
                    builder.store(builder.load(s), builder.bitcast(
                        at, lanes_f32.as_pointer()), align=4)

        wide = builder.udiv(DV, i64(4 * _LANES))
        with _cgutils.for_range(builder, wide) as loop:
            block(builder.mul(loop.index, i64(4 * _LANES)), 4)
        done = builder.mul(wide, i64(4 * _LANES))
        with _cgutils.for_range(builder, builder.udiv(builder.sub(DV, done), i64(_LANES))) as loop:
            block(builder.add(done, builder.mul(loop.index, i64(_LANES))), 1)
        return context.get_dummy_value()

    @intrinsic
    def value_sum(typingctx, out, oo, ostride, v, vo, weights, wstride, n, inv,
                  DV):  # pragma: no cover - compile time
        arrays = (out, v, vo, weights, inv)
        if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
                    for a in arrays)
                and out.dtype == weights.dtype == inv.dtype == types.float32
                and v.dtype in (types.float32, types.uint16) and vo.dtype == types.int64
                and all(isinstance(t, types.Integer) for t in (oo, ostride, wstride, n, DV))):
            return None
        return types.void(out, oo, ostride, v, vo, weights, wstride, n, inv, DV), codegen

    return value_sum


if numba is not None:
    # one query's value sums, and a group's of 2, 3 or 4 queries
    _value_sum1, _value_sum2, _value_sum3, _value_sum4 = (_value_sum_intrinsic(t)
                                                          for t in (1, 2, 3, 4))
else:  # without numba nothing is compiled, and these names are never called
    _value_sum1 = _value_sum2 = _value_sum3 = _value_sum4 = None


def _store_rows_codegen(context, builder, signature, args):  # pragma: no cover - compile time
    dst_t, do_t, src_t, so_t, d_t = signature.args
    dst_v, do_v, src_v, so_v, d_v = args
    dst_a = context.make_array(dst_t)(context, builder, dst_v)
    src_a = context.make_array(src_t)(context, builder, src_v)
    i16, i32, i64, f32 = _ir.IntType(16), _ir.IntType(32), _ir.IntType(64), _ir.FloatType()
    L = _LANES
    lf, li, lh = _ir.VectorType(f32, L), _ir.VectorType(i32, L), _ir.VectorType(i16, L)
    bf16 = dst_t.dtype == types.uint16
    do, so = _as_int64(context, builder, do_v, do_t), _as_int64(context, builder, so_v, so_t)
    d = _as_int64(context, builder, d_v, d_t)

    def splat(ty, value):
        return _ir.Constant(ty, [value] * L)

    with _cgutils.for_range(builder, builder.udiv(d, i64(L))) as loop:
        c = builder.mul(loop.index, i64(L))
        at = builder.gep(src_a.data, [builder.add(so, c)])
        x = builder.load(builder.bitcast(at, lf.as_pointer()), align=4)
        to = builder.gep(dst_a.data, [builder.add(do, c)])
        if bf16:  # _put's rounding: to nearest, ties to even; a NaN stays a NaN
            b = builder.bitcast(x, li)
            odd = builder.and_(builder.lshr(b, splat(li, 16)), splat(li, 1))
            rounded = builder.trunc(builder.lshr(builder.add(builder.add(b, splat(li, 0x7FFF)),
                                                             odd), splat(li, 16)), lh)
            nan = builder.icmp_unsigned(">", builder.and_(b, splat(li, 0x7FFFFFFF)),
                                        splat(li, 0x7F800000))
            x = builder.select(nan, splat(lh, 0x7FC0), rounded)
            builder.store(x, builder.bitcast(to, lh.as_pointer()), align=2)
        else:
            builder.store(x, builder.bitcast(to, lf.as_pointer()), align=4)
    return context.get_dummy_value()


def _store_rows(dst, do, src, so, d):  # pragma: no cover - replaced inside compiled code
    """``dst[do : do + d] = src[so : so + d]`` between flat storages, d a multiple of 16: the
    float32 elements copied, or rounded into a bf16 cache's uint16 bits as :func:`_put`
    rounds them, 16 lanes at a time. :func:`_put` over a 64-element row spent more on its
    loop's setup (the test on addresses, the scalar copy's entry) than on its four vectors of
    work: at ``base``'s beam-4 shapes (128 rows, 8 heads), the self-attention step kernel took
    42 µs less a call this way (97 -> 55 µs at one key), the same bits."""
    raise NotImplementedError


if numba is not None:

    @intrinsic
    def _store_rows_intrinsic(typingctx, dst, do, src, so, d):  # pragma: no cover
        if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
                and dst.ndim == src.ndim == 1 and dst.layout == src.layout == "C"
                and src.dtype == types.float32
                and dst.dtype in (types.float32, types.uint16)
                and all(isinstance(t, types.Integer) for t in (do, so, d))):
            return None
        return types.void(dst, do, src, so, d), _store_rows_codegen

    @overload(_store_rows, inline="always")
    def _store_rows_overload(dst, do, src, so, d):  # pragma: no cover - compile time
        return lambda dst, do, src, so, d: _store_rows_intrinsic(dst, do, src, so, d)


def _u8s8_tile_intrinsic(variant: str, rows: int):
    """A numba intrinsic ``(xu, xo, xs, w, wo, KB, out, oo, ostride, comp, co) -> None``: the
    int32 sums of ``rows`` activation rows (unsigned bytes ``xu``, row r from element
    ``xo + r * xs``, KB blocks of 4) against one panel of packed weight columns (``w`` from
    ``wo``: for each block of 4 inputs, each column's 4 signed bytes, the panel's columns in
    order), plus ``comp[co:]``, stored at ``out[oo + r * ostride:]``. "avx2": each block is
    ``vpmaddubsw`` (unsigned activation bytes times signed weight bytes, adjacent products
    summed into int16: exact for 7-bit weights) then ``vpmaddwd`` by ones (int16 pairs into
    int32); "vnni": one ``vpdpbusd`` (four products into int32). Either is added to sums held
    in registers (:data:`U8S8_VARIANTS`). Only where numba's target has the instructions
    (:func:`u8s8_variants`)."""
    lanes, vectors, _ = U8S8_VARIANTS[variant]

    def codegen(context, builder, signature, args):  # pragma: no cover - compile time
        xu_t, xo_t, xs_t, w_t, wo_t, kb_t, out_t, oo_t, os_t, c_t, co_t = signature.args
        xu_v, xo_v, xs_v, w_v, wo_v, kb_v, out_v, oo_v, os_v, c_v, co_v = args
        xu = context.make_array(xu_t)(context, builder, xu_v)
        w = context.make_array(w_t)(context, builder, w_v)
        out = context.make_array(out_t)(context, builder, out_v)
        comp = context.make_array(c_t)(context, builder, c_v)
        i8, i16, i32, i64 = (_ir.IntType(n) for n in (8, 16, 32, 64))
        vi32 = _ir.VectorType(i32, lanes)
        if variant == "vnni":  # LLVM's vpdpbusd takes its bytes as int32 vectors
            vbytes = vi32
            dpbusd = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(vi32, [vi32] * 3),
                "llvm.x86.avx512.vpdpbusd.512")
        else:
            vbytes, vi16 = _ir.VectorType(i8, 4 * lanes), _ir.VectorType(i16, 2 * lanes)
            maddubs = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(vi16, [vbytes, vbytes]),
                "llvm.x86.avx2.pmadd.ub.sw")
            maddwd = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(vi32, [vi16, vi16]), "llvm.x86.avx2.pmadd.wd")
            ones = _ir.Constant(vi16, [1] * (2 * lanes))

        def int64(value, ty):
            return _as_int64(context, builder, value, ty)

        xo, xs, wo = int64(xo_v, xo_t), int64(xs_v, xs_t), int64(wo_v, wo_t)
        KB, oo, ostride = int64(kb_v, kb_t), int64(oo_v, oo_t), int64(os_v, os_t)
        co = int64(co_v, co_t)
        zero, undef = _ir.Constant(vi32, [0] * lanes), _ir.Constant(vi32, _ir.Undefined)
        sums = [[_cgutils.alloca_once_value(builder, zero) for _ in range(vectors)]
                for _ in range(rows)]
        for s in (s for row in sums for s in row):  # (zeroed here, not in the entry block)
            builder.store(zero, s)
        with _cgutils.for_range(builder, KB) as loop:
            kb = loop.index
            at = builder.add(wo, builder.mul(kb, i64(4 * lanes * vectors)))
            ws = [builder.load(builder.bitcast(
                builder.gep(w.data, [builder.add(at, i64(4 * lanes * h))]),
                vbytes.as_pointer()), align=1) for h in range(vectors)]
            for r in range(rows):
                xat = builder.add(builder.add(xo, builder.mul(i64(r), xs)),
                                  builder.mul(kb, i64(4)))
                x = builder.load(builder.bitcast(builder.gep(xu.data, [xat]), i32.as_pointer()),
                                 align=1)  # the row's 4 bytes of this block, to every lane
                x = builder.shuffle_vector(builder.insert_element(undef, x, i32(0)), undef,
                                           _ir.Constant(vi32, [0] * lanes))
                x = builder.bitcast(x, vbytes)
                for h in range(vectors):
                    acc = builder.load(sums[r][h])
                    if variant == "vnni":
                        acc = builder.call(dpbusd, [acc, x, ws[h]])
                    else:
                        acc = builder.add(acc, builder.call(
                            maddwd, [builder.call(maddubs, [x, ws[h]]), ones]))
                    builder.store(acc, sums[r][h])
        for h in range(vectors):
            c = builder.load(builder.bitcast(
                builder.gep(comp.data, [builder.add(co, i64(lanes * h))]), vi32.as_pointer()),
                align=4)
            for r in range(rows):
                at = builder.add(builder.add(oo, builder.mul(i64(r), ostride)), i64(lanes * h))
                builder.store(builder.add(builder.load(sums[r][h]), c),
                              builder.bitcast(builder.gep(out.data, [at]), vi32.as_pointer()),
                              align=4)
        return context.get_dummy_value()

    @intrinsic
    def tile(typingctx, xu, xo, xs, w, wo, KB, out, oo, ostride, comp,
             co):  # pragma: no cover - compile time
        arrays = (xu, w, out, comp)
        if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
                    for a in arrays)
                and xu.dtype == types.uint8 and w.dtype == types.int8
                and out.dtype == comp.dtype == types.int32
                and all(isinstance(t, types.Integer) for t in (xo, xs, wo, KB, oo, ostride, co))):
            return None
        return types.void(xu, xo, xs, w, wo, KB, out, oo, ostride, comp, co), codegen

    return tile


if numba is not None:
    _avx2_tile1, _avx2_tile2, _avx2_tile3, _avx2_tile4 = (_u8s8_tile_intrinsic("avx2", r)
                                                          for r in (1, 2, 3, 4))
    _vnni_tile1, _vnni_tile2, _vnni_tile3, _vnni_tile4 = (_u8s8_tile_intrinsic("vnni", r)
                                                          for r in (1, 2, 3, 4))


def _u8s8_tile(marker, n, xu, xo, xs, w, wo, KB, out, oo, ostride, comp,
               co):  # pragma: no cover - replaced inside compiled code
    """The tile of ``n`` rows (1-4) of the variant that ``marker``'s dtype names (int16:
    "avx2", int32: "vnni"), called with the tile intrinsic's arguments. Resolved when the
    caller is compiled, so a function compiled for one variant holds only that variant's
    instructions: LLVM cannot compile a VNNI instruction for a target without it (a fatal
    error, not an exception)."""
    raise NotImplementedError


#: the ``marker`` argument of :func:`_u8s8_product` for each variant (see :func:`_u8s8_tile`)
_U8S8_MARKER = {"avx2": np.empty(0, np.int16), "vnni": np.empty(0, np.int32)}

if numba is not None:

    @overload(_u8s8_tile, inline="always")
    def _u8s8_tile_overload(marker, n, xu, xo, xs, w, wo, KB, out, oo, ostride, comp,
                            co):  # pragma: no cover - compile time
        t1, t2, t3, t4 = ((_vnni_tile1, _vnni_tile2, _vnni_tile3, _vnni_tile4)
                          if marker.dtype == types.int32 else
                          (_avx2_tile1, _avx2_tile2, _avx2_tile3, _avx2_tile4))

        def tile(marker, n, xu, xo, xs, w, wo, KB, out, oo, ostride, comp, co):
            if n == 4:
                t4(xu, xo, xs, w, wo, KB, out, oo, ostride, comp, co)
            elif n == 3:
                t3(xu, xo, xs, w, wo, KB, out, oo, ostride, comp, co)
            elif n == 2:
                t2(xu, xo, xs, w, wo, KB, out, oo, ostride, comp, co)
            else:
                t1(xu, xo, xs, w, wo, KB, out, oo, ostride, comp, co)
        return tile
