"""CPU kernels for inference: attention over cached keys, and the passes around int8 products.

Compiled by numba on first use and cached on disk (``cache=True``: in the package's
``__pycache__``, or numba's user-wide cache where that is read-only), so a second process
loads them instead of compiling. Used only on CPU, in float32, without gradients; every caller
keeps its torch path for the rest (and for a machine without numba, or with the environment
variable ``AIAYN_NO_KERNELS=1``: :data:`AVAILABLE`).

Why kernels and not torch ops (measured, ``base``, one thread): decoder attention is one query
per (row, head) against at most a few dozen keys. ``scaled_dot_product_attention`` and
``torch.bmm`` run it as one or two tiny BLAS products per (row, head), about 0.35 µs of
overhead each, thousands per step; the kernel here runs all of them in one call, 1.8-2.2x
faster. An int8 linear map took about nine passes over its activations in torch ops (absolute
value, maximum, division, rounding, cast; cast, two scalings, the bias), and the FFN's relu
one more; :func:`quantize_rows` and :func:`rescale` take three, with the same numbers.

**Batch invariance.** :func:`attend` loops, for every query, over that query's own keys
only: the real source tokens of its sentence (``key_len``), never the padding of its batch.
Every sum it makes runs in an order fixed by that query's own lengths. So a sentence's
attention is the same bit for bit alone, in a batch of 16 or in the whole set.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from torch import Tensor

try:  # numba is a dependency; a platform without it decodes through torch ops
    import numba

    AVAILABLE = os.environ.get("AIAYN_NO_KERNELS", "") in ("", "0")
except ImportError:  # pragma: no cover - numba ships wheels for every platform torch does
    numba = None
    AVAILABLE = False


def _njit(**options):
    if numba is None:  # pragma: no cover
        return lambda f: f
    return numba.njit(cache=True, nogil=True, error_model="numpy", **options)


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


def _level2_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """This CPU's level-2 cache (a core's), in bytes, as Linux's sysfs gives it; 1 MiB where
    that cannot be read (another platform, a size it does not state)."""
    try:
        for index in sorted(os.listdir(root)):
            with open(os.path.join(root, index, "level")) as f:
                if f.read().strip() != "2":
                    continue
            with open(os.path.join(root, index, "size")) as f:
                size = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return 1 << 20


#: :func:`_attend` prefetches each next head's keys and values where one call reads more than
#: this (a core's level-2 cache): there, each query's few keys came from memory one miss at a
#: time (base, beam 4: +7-10% end to end), while calls within it ran 4-7% slower with the
#: extra instructions (multi30k greedy; docs/benchmarks.md). A constant of the compiled code
#: (numba's cache is this machine's).
PREFETCH_BYTES = _level2_bytes()


@_njit(inline="always")
def _prefetch_rows(a, offsets, n, shift, d):  # pragma: no cover - compiled
    # prefetch the n rows of d elements of the flat storage a that start at offsets[:n] +
    # shift: a 64-byte line's worth of elements apart (every line of a row that starts on one)
    step = max(64 // a.itemsize, 1)
    for j in range(n):
        o = offsets[j] + shift
        for e in range(0, d, step):
            _prefetch(a, o + e)


@_njit(fastmath={"reassoc"})
def _sum(a):  # pragma: no cover - compiled
    # sum of a float32 row, in lanes; the loop stores nothing, so LLVM keeps one copy of it
    # and the order of the additions is fixed by the row's length alone
    s = np.float32(0.0)
    for c in range(a.shape[0]):
        s += a[c]
    return s


@_njit(inline="always")
def _dot4(x, a, b, c, d):  # pragma: no cover - compiled
    # (x . a, x . b, x . c, x . d) in one pass over x; inlined into _attend, under its
    # fastmath (lanes). The loop stores nothing, so LLVM keeps one copy of it: the order of
    # the additions is fixed by the length alone
    s0, s1, s2, s3 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
    for i in range(x.shape[0]):
        xi = x[i]
        s0 += xi * _f32(a[i])
        s1 += xi * _f32(b[i])
        s2 += xi * _f32(c[i])
        s3 += xi * _f32(d[i])
    return s0, s1, s2, s3


@_njit(inline="always")
def _axpy4(ov, v, w0, o0, w1, o1, w2, o2, w3, o3):  # pragma: no cover - compiled
    # ov += w0 a, then += w1 b, += w2 c, += w3 d for the rows a, b, c, d of v starting at
    # o0 .. o3: one load and store of ov for four values (ov was a chain through memory, a
    # store then a load, at every value). Inlined into _attend: each update is one fused
    # multiply-add onto the one before, in the order of the single updates, so the same
    # numbers (a test holds them to eq. 1; every path is a function of the key count alone)
    DV = ov.shape[0]
    a, b, c, d = v[o0 : o0 + DV], v[o1 : o1 + DV], v[o2 : o2 + DV], v[o3 : o3 + DV]
    for dd in range(DV):
        ov[dd] = (((ov[dd] + w0 * _f32(a[dd])) + w1 * _f32(b[dd])) + w2 * _f32(c[dd])
                  + w3 * _f32(d[dd]))


@_njit(inline="always")
def _fetches(key_sets, H, T, row_bytes):  # pragma: no cover - compiled
    # whether one attention call reads more keys and values than a core's level-2 cache
    # holds (PREFETCH_BYTES), so that prefetching the next head's rows pays: key_sets sets
    # (a sentence's, or a beam group's) of H heads x T key positions, each position's key and
    # value row_bytes together
    return key_sets * H * T * row_bytes > PREFETCH_BYTES


@_njit(inline="always")
def _head_weights(q, qo, k, ko, n, D, scale, scores):  # pragma: no cover - compiled
    # one (query, head)'s softmax numerators over its n keys (eq. 1): exp(s_j - max s) into
    # scores[:n], s_j = (q . key j) * scale with the query at q[qo:] and key j at k[ko[j]:];
    # returns 1 / their sum. Inlined into _attend and _attend_groups, whose fastmath it
    # takes: the dot products four keys a pass over the query, the exponentials in lanes
    # (_exp_term)
    zero = np.float32(0.0)
    qv = q[qo : qo + D]
    top = np.float32(-3.0e38)
    j = 0
    while j + 4 <= n:
        ka, kb = k[ko[j] : ko[j] + D], k[ko[j + 1] : ko[j + 1] + D]
        kc, kd = k[ko[j + 2] : ko[j + 2] + D], k[ko[j + 3] : ko[j + 3] + D]
        s0, s1, s2, s3 = _dot4(qv, ka, kb, kc, kd)
        s0, s1, s2, s3 = s0 * scale, s1 * scale, s2 * scale, s3 * scale
        scores[j], scores[j + 1], scores[j + 2], scores[j + 3] = s0, s1, s2, s3
        top = max(top, max(max(s0, s1), max(s2, s3)))
        j += 4
    while j < n:
        kv = k[ko[j] : ko[j] + D]
        s = zero
        for dd in range(D):
            s += qv[dd] * _f32(kv[dd])
        s *= scale
        scores[j] = s
        top = max(top, s)
        j += 1
    for j in range(n):  # exp(s - top), in lanes
        scores[j] = _exp_term(scores[j] - top)
    total = _sum(scores[:n])
    return np.float32(1.0) / total if n > 0 else zero


@_njit(fastmath=True)
def _attend_groups(q, k, v, at, N, H, D, DV, key_len, group, scale, fetch, out, scores, ko,
                   vo):  # pragma: no cover - compiled
    # _attend for one query a row (Tq = 1) where each key row serves `group` query rows (a
    # beam group over its sentence's encoder keys), d_v a multiple of _LANES: for each key
    # row and head, the key and value offsets once, each query's weights as _attend makes
    # them (_head_weights), then the group's value sums four queries a pass, each value row
    # loaded once for them (_value_sum_intrinsic). The same operations for each query as
    # _attend's, so the same bits. scores: scratch of 4 * (at least T) floats, ko and
    # vo of T int64s (T: the most keys a row has)
    q0, qr_s, qh_s = at[0], at[1], at[3]
    k0, kr_s, kh_s, kj_s = at[4], at[5], at[6], at[7]
    v0, vr_s, vh_s, vj_s = at[9], at[10], at[11], at[12]
    stride = scores.shape[0] // 4
    invs = np.empty(4, np.float32)
    for kr in range((N + group - 1) // group):
        n = key_len[kr]
        r_end = min(N, (kr + 1) * group)
        for hh in range(H):
            for j in range(n):
                ko[j] = k0 + kr * kr_s + hh * kh_s + j * kj_s
                vo[j] = v0 + kr * vr_s + hh * vh_s + j * vj_s
            if fetch and hh + 1 < H:  # the next head's keys and values, as _attend
                _prefetch_rows(k, ko, n, kh_s, D)
                _prefetch_rows(v, vo, n, vh_s, DV)
            r0 = kr * group
            while r0 < r_end:
                Q = min(4, r_end - r0)
                for t in range(Q):
                    invs[t] = _head_weights(q, q0 + (r0 + t) * qr_s + hh * qh_s, k, ko, n, D,
                                            scale, scores[t * stride : (t + 1) * stride])
                oo, ostride = (r0 * H + hh) * DV, H * DV
                if Q == 4:
                    _value_sum4(out, oo, ostride, v, vo, scores, stride, n, invs, DV)
                elif Q == 3:
                    _value_sum3(out, oo, ostride, v, vo, scores, stride, n, invs, DV)
                elif Q == 2:
                    _value_sum2(out, oo, ostride, v, vo, scores, stride, n, invs, DV)
                else:
                    _value_sum1(out, oo, ostride, v, vo, scores, stride, n, invs, DV)
                r0 += Q


@_njit(fastmath=True)
def _attend(q, k, v, at, N, Tq, H, D, DV, key_len, group, causal_from, scale,
            key_rows):  # pragma: no cover - compiled
    # q, k, v: flat storages; at: int64 offsets and strides, query (r, i, h) starting at
    # at[0] + r * at[1] + i * at[2] + h * at[3], key (r, h, j) at at[4] + r * at[5] + h * at[6]
    # + j * at[7] (T = at[8] keys at most), value (r, h, j) at at[9] + r * at[10] + h * at[11]
    # + j * at[12], each d contiguous; query row r attends to key row r // group, keys
    # 0 .. key_len[r // group] - 1 (and, if causal_from >= 0, only keys j <= causal_from + i
    # for query i). Returns out: flat (N, Tq, H, DV), allocated here.
    # With key_rows (N, Tk) non-empty, key j of query row r lies in key row key_rows[r, j].
    # Rows are taken as slices, whose indices numba knows are in range: that lets LLVM
    # vectorize the loops over d (with flat indices it did not, 8x slower). The scores go
    # four keys a pass over the query, and the exponentials in lanes (_exp_term); where d_v
    # is a multiple of _LANES the value sums run in vector registers (_value_sum_intrinsic,
    # the same chain as _axpy4's), and one query a row over keys a group of rows shares (a
    # beam group's encoder-decoder attention) goes to _attend_groups.
    # Batch invariance rests on one rule here: LLVM gives a vectorized loop that stores into
    # one array while reading others a runtime test on their addresses, with a scalar copy
    # for when it fails; a sum (or, under fastmath, a * b + c * d, which may contract two
    # ways) rounds differently in the two copies, so the output would depend on where the
    # arrays lie, the kernel's own scratch included. A first version summed the exponentials
    # in the loop that stored the weights, and its output changed with the heap
    # (docs/benchmarks.md). So every sum is in a loop that stores nothing (the dot products,
    # _sum), and the loop that stores into the output adds one product at a time
    # (ov += w * v, which contracts one way only). Every sum runs in an order fixed by the
    # query's own key count.
    q0, qr_s, qi_s, qh_s = at[0], at[1], at[2], at[3]
    k0, kr_s, kh_s, kj_s, T = at[4], at[5], at[6], at[7], at[8]
    v0, vr_s, vh_s, vj_s = at[9], at[10], at[11], at[12]
    out = np.empty(N * Tq * H * DV, np.float32)
    T1 = max(T, 1)
    scores = np.empty(4 * T1, np.float32)  # (_attend_groups: four queries')
    ko = np.empty(T1, np.int64)  # where each key and value row starts
    vo = np.empty(T1, np.int64)
    by_row = key_rows.shape[0] > 0
    zero = np.float32(0.0)
    # the bytes of keys and values the call reads (each key row's once)
    fetch = _fetches(N // group, H, T, D * k.itemsize + DV * v.itemsize)
    if group > 1 and Tq == 1 and not by_row and DV % _LANES == 0:
        _attend_groups(q, k, v, at, N, H, D, DV, key_len, group, scale, fetch, out, scores,
                       ko, vo)
        return out
    invs = np.empty(1, np.float32)
    for r in range(N):
        kr = r // group
        n_all = key_len[kr]
        for i in range(Tq):
            n = n_all if causal_from < 0 else min(n_all, causal_from + i + 1)
            for hh in range(H):
                for j in range(n):
                    row = key_rows[r, j] if by_row else kr
                    ko[j] = k0 + row * kr_s + hh * kh_s + j * kj_s
                    vo[j] = v0 + row * vr_s + hh * vh_s + j * vj_s
                if fetch and hh + 1 < H:  # the next head's keys and values, fetched while
                    _prefetch_rows(k, ko, n, kh_s, D)  # this one computes
                    _prefetch_rows(v, vo, n, vh_s, DV)
                qo = q0 + r * qr_s + i * qi_s + hh * qh_s
                inv = _head_weights(q, qo, k, ko, n, D, scale, scores)
                oo = ((r * Tq + i) * H + hh) * DV
                if DV % _LANES == 0:  # the output held in registers (_value_sum_intrinsic)
                    invs[0] = inv
                    _value_sum1(out, oo, 0, v, vo, scores, 0, n, invs, DV)
                    continue
                ov = out[oo : oo + DV]
                ov[:] = zero
                j = 0
                while j + 4 <= n:  # four values a pass over ov (a load and a store each)
                    _axpy4(ov, v, scores[j] * inv, vo[j], scores[j + 1] * inv, vo[j + 1],
                           scores[j + 2] * inv, vo[j + 2], scores[j + 3] * inv, vo[j + 3])
                    j += 4
                while j < n:
                    w = scores[j] * inv
                    vv = v[vo[j] : vo[j] + DV]
                    for dd in range(DV):
                        ov[dd] += w * _f32(vv[dd])
                    j += 1
    return out


@_njit()
def _amax_bits(xr):  # pragma: no cover - compiled
    # max |x| over a float32 row, as the int32 bits of the float: with the sign bit cleared,
    # the bits of non-negative floats order as the floats do, so an integer maximum (which
    # vectorizes; the float one did not: 7x slower) gives the exact maximum.
    top = np.int32(0)
    for c in range(xr.shape[0]):
        top = max(top, xr[c] & np.int32(0x7FFFFFFF))
    return top


@_njit()
def _quantize_rows(x, levels):  # pragma: no cover - compiled
    # x (M, K) float32 -> x8 (M, K) int8 and scale (M, 1) float32, torch's arithmetic exactly:
    # scale = max(amax|x|, 1e-12) / levels, x8 = round_half_even(x / scale). |x / scale| <=
    # levels < 2^22, where adding and subtracting 1.5 * 2^23 rounds half to even, as torch.round
    # does, and vectorizes (a call to rint per element does not). The outputs are allocated
    # here: a torch.empty and a .numpy() per output cost more than the pass at decoding's sizes.
    M, K = x.shape
    x8 = np.empty((M, K), np.int8)
    scale = np.empty((M, 1), np.float32)
    bits = x.view(np.int32)
    top = np.empty(1, np.int32)
    for r in range(M):
        scale[r, 0] = _quantize_row(x[r], bits[r], x8[r], top, levels)
    return x8, scale


@_njit(inline="always")
def _quantize_row(xr, bits, qr, top, levels):  # pragma: no cover - compiled
    # one row of _quantize_rows: qr = round(xr / s), returning s; bits is xr's int32 view,
    # top an int32 (1,) scratch (the maximum's bits, read back as a float)
    magic = np.float32(12582912.0)
    top[0] = _amax_bits(bits)
    s = max(top.view(np.float32)[0], np.float32(1e-12)) / np.float32(levels)
    for c in range(xr.shape[0]):
        qr[c] = np.int32((xr[c] / s + magic) - magic)
    return s


@_njit(inline="always")
def _rescale_row(ar, sx, w_scale, bias, has_bias, yr):  # pragma: no cover - compiled
    # yr = float(ar) * sx * w_scale (+ bias), rounded in that order: one row of _rescale.
    # Inlined in numba's IR: called, it ran _rescale 20-35% slower (the caller's fresh output
    # no longer told LLVM that yr and ar cannot overlap)
    if has_bias:
        for o in range(yr.shape[0]):
            yr[o] = (np.float32(ar[o]) * sx) * w_scale[o] + bias[o]
    else:
        for o in range(yr.shape[0]):
            yr[o] = (np.float32(ar[o]) * sx) * w_scale[o]


@_njit(inline="always")
def _rescale_row_range(ar, sx, w_scale, bias, has_bias, yr):  # pragma: no cover - compiled
    # _rescale_row, returning the largest and the smallest order key of yr (_key_range's) from
    # the same pass: integer maxima, exact in any order
    top = _KEY_MIN
    low = np.int32(0x7FFFFFFF)
    if has_bias:
        for o in range(yr.shape[0]):
            y = (np.float32(ar[o]) * sx) * w_scale[o] + bias[o]
            yr[o] = y
            top, low = _widen(np.float32(y).view(np.int32), top, low)
    else:
        for o in range(yr.shape[0]):
            y = (np.float32(ar[o]) * sx) * w_scale[o]
            yr[o] = y
            top, low = _widen(np.float32(y).view(np.int32), top, low)
    return top, low


@_njit()
def _rescale(acc, x_scale, w_scale, bias, has_bias, relu):  # pragma: no cover - compiled
    # out = float(acc) * x_scale[r] * w_scale[o] (+ bias[o]), rounded in that order (then
    # max(0, .) with relu); out allocated here, as _quantize_rows allocates its outputs
    M, n_out = acc.shape
    out = np.empty((M, n_out), np.float32)
    zero = np.float32(0.0)
    for r in range(M):
        yr = out[r]
        _rescale_row(acc[r], x_scale[r, 0], w_scale, bias, has_bias, yr)
        if relu:
            for o in range(n_out):
                yr[o] = max(yr[o], zero)
    return out


@_njit()
def _rescale_add(acc, x_scale, w_scale, bias, has_bias, resid):  # pragma: no cover - compiled
    # resid + _rescale(acc, ...): a sub-layer's output map and its residual connection (§5.4,
    # dropout off) in one pass; the float addition is torch's ``x + out`` bit for bit
    out = _rescale(acc, x_scale, w_scale, bias, has_bias, False)
    M, n_out = out.shape
    for r in range(M):
        yr, xr = out[r], resid[r]
        for o in range(n_out):
            yr[o] = xr[o] + yr[o]
    return out


@_njit(fastmath={"reassoc"})
def _sum_sq_dev(a, m):  # pragma: no cover - compiled
    # sum of (a[c] - m)^2 over a float32 row, in lanes (as _sum)
    s = np.float32(0.0)
    for c in range(a.shape[0]):
        d = a[c] - m
        s += d * d
    return s


@_njit()
def _layer_norm_row(x, w, b, eps, y):  # pragma: no cover - compiled
    # y = (x - mean) / sqrt(var + eps) * w + b over one float32 row (§3.1's LayerNorm, biased
    # variance as torch's); the sums in lanes, the output without fastmath, so each element
    # rounds the same way whichever copy of the loop runs
    n = np.float32(x.shape[0])
    mean = _sum(x) / n
    rstd = np.float32(1.0) / np.sqrt(_sum_sq_dev(x, mean) / n + eps)
    for c in range(x.shape[0]):
        y[c] = ((x[c] - mean) * rstd) * w[c] + b[c]


@_njit()
def _layer_norm(x, w, b, eps):  # pragma: no cover - compiled
    # LayerNorm over each row of a float32 (M, d) x: a new (M, d)
    M, d = x.shape
    out = np.empty((M, d), np.float32)
    for r in range(M):
        _layer_norm_row(x[r], w, b, eps, out[r])
    return out


@_njit()
def _rescale_add_norm(acc, x_scale, w_scale, bias, has_bias, resid, w, b,
                      eps):  # pragma: no cover - compiled
    # LayerNorm(resid + _rescale(acc, ...)): a post-norm sub-layer's output map, residual and
    # LayerNorm (§3.1, §5.4 with dropout off); each row's sum is _rescale_add's, normalized in
    # place by _layer_norm's arithmetic, so the numbers are those two kernels' bit for bit
    # (each row made in a scratch row: normalized in place, input and output would overlap,
    # and LLVM would run that loop's scalar copy, 2x slower)
    M, n_out = acc.shape
    out = np.empty((M, n_out), np.float32)
    y = np.empty(n_out, np.float32)
    for r in range(M):
        _rescale_row(acc[r], x_scale[r, 0], w_scale, bias, has_bias, y)
        xr = resid[r]
        for o in range(n_out):
            y[o] = xr[o] + y[o]
        _layer_norm_row(y, w, b, eps, out[r])
    return out


@_njit()
def _rescale_quantize(acc, x_scale, w_scale, bias, has_bias, relu,
                      levels):  # pragma: no cover - compiled
    # _rescale then _quantize_rows: the FFN's inner layer, straight into W_2's int8 input.
    # Row by row through one scratch row that stays in cache, rather than the whole float
    # block written out and read back (at base's 128 x 2,048: 48 -> 40 us); each row's
    # arithmetic is those two kernels', so the same numbers
    M, n_out = acc.shape
    x8 = np.empty((M, n_out), np.int8)
    scale = np.empty((M, 1), np.float32)
    y = np.empty(n_out, np.float32)
    bits = y.view(np.int32)
    top = np.empty(1, np.int32)
    zero = np.float32(0.0)
    for r in range(M):
        _rescale_row(acc[r], x_scale[r, 0], w_scale, bias, has_bias, y)
        if relu:
            for o in range(n_out):
                y[o] = max(y[o], zero)
        scale[r, 0] = _quantize_row(y, bits, x8[r], top, levels)
    return x8, scale


@_njit()
def _self_attention_step(acc, x_scale, w_scale, bias, has_bias, H, Dk, Dv, kbuf, vbuf, pos,
                         key_rows, scale, levels):  # pragma: no cover - compiled
    # One decoding step of cached self-attention after the W^QKV product: rescale the sums
    # (n, H * (2 Dk + Dv)), write each row's new key and value into buffer row r at position
    # pos of kbuf (R, H, C, Dk) and vbuf (R, H, C, Dv) (float32, or a bf16 cache's bits as
    # uint16: _put), attend from each row's query over its keys 0 .. pos (key j of row r in
    # buffer row key_rows[r, j]), and quantize the attention output (n, H * Dv) for W^O. The
    # same calls, and so the same numbers, as the module path.
    n = acc.shape[0]
    qkv = _rescale(acc, x_scale, w_scale, bias, has_bias, False)
    width = qkv.shape[1]
    k0, v0 = H * Dk, 2 * H * Dk
    C = kbuf.shape[2]
    if Dk % _LANES == 0 and Dv % _LANES == 0:
        kf, vf, src = kbuf.reshape(kbuf.size), vbuf.reshape(vbuf.size), qkv.reshape(qkv.size)
        for r in range(n):
            for hh in range(H):
                at = (r * H + hh) * C + pos
                _store_rows(kf, at * Dk, src, r * width + k0 + hh * Dk, Dk)
                _store_rows(vf, at * Dv, src, r * width + v0 + hh * Dv, Dv)
    else:
        for r in range(n):
            for hh in range(H):
                _put(kbuf[r, hh, pos, :], qkv[r, k0 + hh * Dk : k0 + (hh + 1) * Dk])
                _put(vbuf[r, hh, pos, :], qkv[r, v0 + hh * Dv : v0 + (hh + 1) * Dv])
    T = pos + 1
    at = np.empty(13, np.int64)
    at[0], at[1], at[2], at[3] = 0, width, width, Dk
    at[4], at[5], at[6], at[7], at[8] = 0, H * C * Dk, C * Dk, Dk, T
    at[9], at[10], at[11], at[12] = 0, H * C * Dv, C * Dv, Dv
    key_len = np.full(n, T, np.int64)
    out = _attend(qkv.reshape(n * width), kbuf.reshape(kbuf.size), vbuf.reshape(vbuf.size),
                  at, n, 1, H, Dk, Dv, key_len, 1, -1, scale, key_rows)
    return _quantize_rows(out.reshape(n, H * Dv), levels)


@_njit()
def _cross_attention_step(acc, x_scale, w_scale, bias, has_bias, H, Dk, Dv, k, v, kv_at,
                          key_len, group, scale, no_rows, levels):  # pragma: no cover - compiled
    # Encoder-decoder attention after the W^Q product: rescale the queries (n, H * Dk), attend
    # over the flat storages k and v (kv_at: at[4:] of _attend), and quantize the output
    # (n, H * Dv) for W^O
    n = acc.shape[0]
    q = _rescale(acc, x_scale, w_scale, bias, has_bias, False)
    at = np.empty(13, np.int64)
    at[0], at[1], at[2], at[3] = 0, H * Dk, H * Dk, Dk
    at[4:] = kv_at
    out = _attend(q.reshape(n * H * Dk), k, v, at, n, 1, H, Dk, Dv, key_len, group, -1, scale,
                  no_rows)
    return _quantize_rows(out.reshape(n, H * Dv), levels)


@_njit()
def _encoder_attention(acc, x_scale, w_scale, bias, has_bias, H, Dk, Dv, key_rows, key_len,
                       scale, levels):  # pragma: no cover - compiled
    # Encoder self-attention over the real tokens of a batch packed into n rows (no padding),
    # after the W^QKV product: rescale the sums (n, H * (2 Dk + Dv)), attend from each token
    # over its own sentence's tokens (key j of row r is row key_rows[r, j], key_len[r] of
    # them), and quantize the output (n, H * Dv) for W^O. The same calls as the module path
    # over the padded batch, so the same numbers.
    n = acc.shape[0]
    qkv = _rescale(acc, x_scale, w_scale, bias, has_bias, False)
    width = qkv.shape[1]
    at = np.empty(13, np.int64)
    flat = qkv.reshape(n * width)
    if Dv % _LANES == 0:
        # sentence by sentence: its tokens' queries share its keys and values, so they go
        # four a pass through _attend_groups (one key row, the tokens j * width apart: the
        # same addresses, so the same numbers, as key_rows gives them), each straight into
        # its rows of out
        out = np.empty(n * H * Dv, np.float32)
        S = max(key_rows.shape[1], 1)
        scores, ko, vo = np.empty(4 * S, np.float32), np.empty(S, np.int64), np.empty(S, np.int64)
        length = np.empty(1, np.int64)
        r = 0
        while r < n:  # row r starts a sentence of key_len[r] tokens (key_rows[r, 0] == r)
            L = key_len[r]
            at[0], at[1], at[2], at[3] = r * width, width, width, Dk
            at[4], at[5], at[6], at[7], at[8] = H * Dk + r * width, 0, Dk, width, L
            at[9], at[10], at[11], at[12] = 2 * H * Dk + r * width, 0, Dv, width
            length[0] = L
            fetch = _fetches(1, H, L, (Dk + Dv) * 4)
            _attend_groups(flat, flat, flat, at, L, H, Dk, Dv, length, L, scale, fetch,
                           out[r * H * Dv:], scores, ko, vo)
            r += max(L, 1)
        return _quantize_rows(out.reshape(n, H * Dv), levels)
    at[0], at[1], at[2], at[3] = 0, width, width, Dk
    at[4], at[5], at[6], at[7], at[8] = H * Dk, width, Dk, 0, key_rows.shape[1]
    at[9], at[10], at[11], at[12] = 2 * H * Dk, width, Dv, 0
    out = _attend(flat, flat, flat, at, n, 1, H, Dk, Dv, key_len, 1, -1, scale, key_rows)
    return _quantize_rows(out.reshape(n, H * Dv), levels)


_KEY_MIN = np.int32(-2147483648)
_KEY_INF = np.int32(0x7F800000)  # the order key of +inf; -inf's is -_KEY_INF - 1
_SCAN = 128  # columns a chunk in _first_at_least


@_njit()
def _order_key(b):  # pragma: no cover - compiled
    # A float's order key, from its int32 bits: an int32 that orders as the float does (every
    # float but NaN): the bits, with the magnitude flipped where the sign is set. The map is
    # its own inverse, so it also turns a key back into the float's bits.
    return np.int32(b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@_njit()
def _key_range(br, c0, c1):  # pragma: no cover - compiled
    # The largest and the smallest order key of the float32 bits br[c0:c1]. Integer maxima
    # vectorize (float ones, which must mind NaN, do not: 7x slower). A NaN's key lies above
    # +inf's or below -inf's. The loop runs over a slice from 0: over range(c0, c1), numba's
    # wraparound of a negative index made LLVM load the row by gathers (8x slower).
    top = _KEY_MIN
    low = np.int32(0x7FFFFFFF)
    b = br[c0:c1]
    for c in range(b.shape[0]):
        top, low = _widen(b[c], top, low)
    return top, low


@_njit(inline="always")
def _widen(b, top, low):  # pragma: no cover - compiled
    # (top, low) widened to the order key of the float32 bits b: the step of _key_range and
    # of _rescale_row_range's key range
    k = _order_key(b)
    return np.int32(k if k > top else top), np.int32(k if k < low else low)


@_njit()
def _has_nan(top, low):  # pragma: no cover - compiled
    return top > _KEY_INF or low < -_KEY_INF - np.int32(1)


@_njit()
def _row_argmax(x, out):  # pragma: no cover - compiled
    # out[r] = the first column of row r's maximum, as torch.argmax gives it; -1 for a row
    # holding a NaN (the caller then asks torch). One pass finds the largest order key, the
    # next the first column holding it.
    M, V = x.shape
    bits = x.view(np.int32)
    for r in range(M):
        br = bits[r]
        top, low = _key_range(br, 0, V)
        if _has_nan(top, low):
            out[r] = -1
            continue
        for c in range(V):
            if _order_key(br[c]) == top:
                out[r] = c
                break


_CHUNK = 128


@_njit()
def _insert(vals, idx, filled, k, s, i):  # pragma: no cover - compiled
    # s (flat index i) into the descending list vals[:filled] of at most k entries, after
    # every entry >= s (earlier indices win ties); returns the new count
    if filled == k and not s > vals[k - 1]:
        return filled
    j = filled if filled < k else k - 1
    while j > 0 and vals[j - 1] < s:
        if j < k:
            vals[j] = vals[j - 1]
            idx[j] = idx[j - 1]
        j -= 1
    vals[j] = s
    idx[j] = i
    return filled + 1 if filled < k else k


@_njit()
def _beam_top(logp, live, k, G, values, index):  # pragma: no cover - compiled
    # For each sentence b: the k largest of live[b, g] + logp[b * G + g, v] over (g, v),
    # descending, ties to the lower flat index g * V + v. Pass 1 finds each chunk's largest
    # candidate: live + its largest x, since fl(live + x) is monotone in x. The k-th largest of
    # those bounds the answer from below (k chunks hold a candidate at least that large), so
    # pass 2 scans only the chunks reaching it, in index order. Returns False on a NaN (the
    # caller then asks torch).
    n = live.shape[0]
    V = logp.shape[1]
    per_row = (V + _CHUNK - 1) // _CHUNK
    bits = logp.view(np.int32)
    chunk_top = np.empty(G * per_row, np.float32)
    key = np.empty(1, np.int32)
    key_f = key.view(np.float32)
    bound_v = np.empty(k, np.float32)
    bound_i = np.empty(k, np.int64)
    for b in range(n):
        # pass 1: each chunk's largest candidate, and the k-th largest of those
        nb = 0
        for g in range(G):
            lg = live[b, g]
            if np.isnan(lg):
                return False
            br = bits[b * G + g]
            for ci in range(per_row):
                top, low = _key_range(br, ci * _CHUNK, min(ci * _CHUNK + _CHUNK, V))
                if _has_nan(top, low):
                    return False
                key[0] = _order_key(top)  # the chunk's largest x, as float bits
                c = lg + key_f[0]
                chunk_top[g * per_row + ci] = c
                nb = _insert(bound_v, bound_i, nb, k, c, g * per_row + ci)
        bound = bound_v[k - 1] if nb == k else np.float32(-np.inf)
        # pass 2: the chunks that can hold one of the k largest
        vals, idx = values[b], index[b]
        filled = 0
        for g in range(G):
            lg = live[b, g]
            row = logp[b * G + g]
            for ci in range(per_row):
                if not chunk_top[g * per_row + ci] >= bound:
                    continue
                for c in range(ci * _CHUNK, min(ci * _CHUNK + _CHUNK, V)):
                    filled = _insert(vals, idx, filled, k, lg + row[c], g * V + c)
        for j in range(filled, k):  # pragma: no cover - fewer candidates than k: not called
            vals[j] = np.float32(-np.inf)
            idx[j] = -1
    return True


# expf on [-87, 0] in lanes: Cephes' single-precision polynomial (within 1 ulp of exp down to
# e^-80, measured; nearer the underflow, terms too small to move a sum that holds 1), 2^n
# made from the exponent's bits. numba's np.exp is one libm call per element, which
# does not vectorize: 5-10x slower than torch's log_softmax over a row of logits.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-87.0)  # 2^-125.5: a sum over < 2^20 such terms is < 2^-105 of 1
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(
    8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(
    5.0000001201e-1)


@_njit(fastmath={"contract"})
def _exp_term(d):  # pragma: no cover - compiled
    # exp(d) for one float32 d <= 0 (floored at _EXP_FLOOR): mant * 2^n. 'contract' only
    # (fused multiply-adds): reassociation would fold the rounding trick's (y + magic) - magic
    # into y. A function of its own, so that its instructions keep these flags where LLVM
    # inlines it into a loop compiled with others (a sum's 'reassoc').
    magic = np.float32(12582912.0)
    d = d if d > _EXP_FLOOR else _EXP_FLOOR
    n = (d * _LOG2E + magic) - magic  # round to nearest: d = n ln2 + r, |r| <= ln2 / 2
    r = (d - n * _LN2_HI) - n * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    mant = (p * r) * r + r + np.float32(1.0)
    two_n = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)  # n>=-126
    return mant * two_n


@_njit(fastmath={"reassoc"})
def _sum_exp(x, m):  # pragma: no cover - compiled
    # sum of exp(x[c] - m) over a float32 row whose largest entry is m (finite), in lanes
    # ('reassoc': the order of the additions is the vector width's, as in torch's own
    # log_softmax), each term made in the same pass (_exp_term) and never stored
    s = np.float32(0.0)
    for c in range(x.shape[0]):
        s += _exp_term(x[c] - m)
    return s


@_njit()
def _log_softmax_row(y, out, key, top, low):  # pragma: no cover - compiled
    # out = y - max(y) - log(sum exp(y - max(y))) for one float32 row, whose largest and
    # smallest order keys are top and low (_key_range's); False on a NaN or an infinite
    # maximum (the caller then asks torch). key: int32 (1,) scratch (the maximum's bits), made
    # once per call of the caller
    V = y.shape[0]
    if _has_nan(top, low) or top >= _KEY_INF or top <= -_KEY_INF - np.int32(1):
        return False  # a NaN, or an infinite maximum
    key[0] = _order_key(top)
    m = key.view(np.float32)[0]
    lse = np.float32(np.log(_sum_exp(y, m)))
    for c in range(V):
        out[c] = (y[c] - m) - lse
    return True


@_njit()
def _rescale_log_softmax(acc, x_scale, w_scale, bias, has_bias):  # pragma: no cover
    # log_softmax over each row of an int8 map's output, from its exact sums: the rescaling
    # of _rescale (the same logits), with their largest key, into a scratch row that stays in
    # cache, then the sum of exponentials, then the output; the logits are never written out.
    # Returns (out (M, O) float32, ok): ok False where a row held a NaN or an infinity.
    M, n_out = acc.shape
    out = np.empty((M, n_out), np.float32)
    y = np.empty(n_out, np.float32)
    key = np.empty(1, np.int32)
    for r in range(M):
        top, low = _rescale_row_range(acc[r], x_scale[r, 0], w_scale, bias, has_bias, y)
        if not _log_softmax_row(y, out[r], key, top, low):
            return out, False
    return out, True


@_njit()
def _embed(weight, tokens, scale, table):  # pragma: no cover - compiled
    # out[b, t] = weight[tokens[b, t]] * scale + table[t], rounded in that order (torch's
    # ``rows * scale + positions`` over float32); (out, False) at a token outside weight's rows
    B, T = tokens.shape
    V, d = weight.shape
    out = np.empty((B, T, d), np.float32)
    for b in range(B):
        for t in range(T):
            tok = tokens[b, t]
            if tok < 0 or tok >= V:
                return out, False
            w = weight[tok]
            p = table[t]
            o = out[b, t]
            for c in range(d):
                o[c] = w[c] * scale + p[c]
    return out, True


@_njit()
def _float_of_key(k, key):  # pragma: no cover - compiled
    # the float32 whose order key is k (not a NaN's); key: int32 (1,) scratch
    key[0] = _order_key(np.int32(k))
    return key.view(np.float32)[0]


@_njit()
def _first_at_least(br, c0, c1, k):  # pragma: no cover - compiled
    # The first c in [c0, c1) whose float32 bits br[c] have an order key >= k (c1 if none).
    # A chunk's largest key first, in lanes (a loop that breaks early does not vectorize:
    # a scan of a whole row cost more than the rest of the greedy kernel), then the first
    # chunk that reaches k column by column.
    for c in range(c0, c1, _SCAN):
        e = min(c + _SCAN, c1)
        if _key_range(br, c, e)[0] >= k:
            for j in range(c, e):
                if _order_key(br[j]) >= k:
                    return j
    return c1


@_njit()
def _rescale_greedy(acc, x_scale, w_scale, bias, has_bias, eos, eos_banned, eos_only,
                    column, value):  # pragma: no cover - compiled
    # Greedy search's choice in each row of an int8 output map, from its exact sums: the first
    # column of the largest log-probability among those the row may take (as torch.argmax
    # picks it), and that log-probability, each the very number _rescale_log_softmax writes,
    # without writing the row out. The columns before `eos` (PAD, BOS) are never taken;
    # `eos` not where eos_banned[r]; only `eos` where eos_only[r] (where eos is banned too,
    # column 0 at -inf, torch's argmax of a row of -inf). A log-probability (y - m) - lse is
    # a non-decreasing function of its logit y, so the largest among the ordinary columns is
    # their largest logit's; the first column holding it is the first whose logit's order key
    # reaches the smallest key mapped to it (found by bisection). Returns False where a row
    # held a NaN or an infinite maximum (the caller then asks torch).
    M, V = acc.shape
    y = np.empty(V, np.float32)
    key = np.empty(1, np.int32)
    yb = y.view(np.int32)
    neg_inf = np.float32(-np.inf)
    for r in range(M):
        top, low = _rescale_row_range(acc[r], x_scale[r, 0], w_scale, bias, has_bias, y)
        if _has_nan(top, low) or top >= _KEY_INF or top <= -_KEY_INF - np.int32(1):
            return False
        m = _float_of_key(top, key)
        yb_top = _order_key(top)  # the maximum's bits
        lse = np.float32(np.log(_sum_exp(y, m)))
        e = (y[eos] - m) - lse if not eos_banned[r] else neg_inf
        if eos_only[r]:
            column[r] = eos if not eos_banned[r] else 0
            value[r] = e
            continue
        best = neg_inf
        hi = np.int64(top)  # the ordinary columns' largest key: the row's, unless a special
        if eos + 1 < V:     # column holds that (another pass, 2x the first's cost, only then)
            for c in range(eos + 1):
                if yb[c] == yb_top:
                    hi = np.int64(_key_range(yb, eos + 1, V)[0])
                    break
            best = (_float_of_key(hi, key) - m) - lse
        if not best > neg_inf and not e > neg_inf:
            column[r] = 0  # every column the row may take is at -inf
            value[r] = neg_inf
        elif e >= best:
            column[r] = eos  # the lower column wins a tie
            value[r] = e
        else:
            lo = np.int64(-_KEY_INF - np.int32(1))  # -inf's key: its log-probability < best
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                if (_float_of_key(mid, key) - m) - lse >= best:
                    hi = mid
                else:
                    lo = mid
            column[r] = _first_at_least(yb, eos + 1, V, np.int32(hi))
            value[r] = best
    return True


@_njit()
def _log_softmax(x):  # pragma: no cover - compiled
    # log_softmax over each row of a float32 (M, V) x; (out, ok) as _rescale_log_softmax
    M, V = x.shape
    out = np.empty((M, V), np.float32)
    key = np.empty(1, np.int32)
    for r in range(M):
        top, low = _key_range(x[r].view(np.int32), 0, V)
        if not _log_softmax_row(x[r], out[r], key, top, low):
            return out, False
    return out, True


# ---- the int8 product over a weight packed once (aiayn's u8 x s8 kernels) --------------------

#: the variants of the u8 x s8 product: int32 lanes a vector, vectors a panel of columns, and
#: the largest weight magnitude it sums exactly. "avx2" (CPUs without VNNI): ``vpmaddubsw``
#: adds two products of an unsigned byte (at most 255) and a signed one into an int16, so
#: 2 * 255 * 63 = 32,130 fits and 2 * 255 * 127 does not (quantize.weight_levels); "vnni"
#: (AVX-512 VNNI): ``vpdpbusd`` adds four such products straight into an int32
U8S8_VARIANTS = {"avx2": (8, 2, 63), "vnni": (16, 4, 127)}
_U8S8_ROWS = 4  # activation rows a tile


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


@_njit()
def _u8s8_bytes(x8, Kp):  # pragma: no cover - compiled
    # x8 (M, K) int8 -> the unsigned bytes x8 + 128, rows of Kp (zero padded), flat
    M, K = x8.shape
    xu = np.zeros(M * Kp, np.uint8)
    for r in range(M):
        for k in range(K):
            xu[r * Kp + k] = np.uint8(x8[r, k]) ^ np.uint8(0x80)
    return xu


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


@_njit()
def _u8s8_product(x8, packed, comp, N, cols, marker):  # pragma: no cover - compiled
    # x8 (M, K) int8 -> (M, N) int32: tiles of _U8S8_ROWS = 4 rows (then 3, 2 or 1, the
    # intrinsics _u8s8_tile picks) against each panel of
    # ``cols`` columns of ``marker``'s variant; comp (N rounded up to a panel,) = -128 * each
    # column's weight sum takes the activations' 128 off
    M, P = x8.shape[0], comp.shape[0] // cols
    KB = packed.shape[0] // (P * 4 * cols)
    xu, out = _u8s8_bytes(x8, 4 * KB), np.empty((M, N), np.int32)
    tail = np.empty(_U8S8_ROWS * cols, np.int32)  # a last panel's partial columns
    flat = out.reshape(-1)
    for p in range(P):
        c0, wo, whole, r = p * cols, p * KB * 4 * cols, (p + 1) * cols <= N, 0
        while r < M:
            n = min(M - r, _U8S8_ROWS)
            dst, at, stride = (flat, r * N + c0, N) if whole else (tail, 0, cols)
            _u8s8_tile(marker, n, xu, r * 4 * KB, 4 * KB, packed, wo, KB, dst, at, stride,
                       comp, c0)
            if not whole:
                for i in range(n):
                    for c in range(N - c0):
                        out[r + i, c0 + c] = tail[i * cols + c]
            r += n
    return out


def numba_target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature`` (LLVM's name: "avx2", "avx512f",
    "avx512vnni", ...). numba hands LLVM ``NUMBA_CPU_FEATURES`` where set, else the host's
    features, whatever ``NUMBA_CPU_NAME`` says: the name alone does not hold the kernels to
    AVX2 (docs/hardware.md). False without numba."""
    if numba is None:
        return False
    from llvmlite import binding
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return f"+{feature}" in config.CPU_FEATURES.split(",")
    return bool(binding.get_host_cpu_features().get(feature))


@functools.cache
def u8s8_variants() -> tuple[str, ...]:
    """The variants of :func:`u8s8_product` (:data:`U8S8_VARIANTS`) that can run here, the
    fastest first: "vnni" where numba's target has AVX-512 VNNI (and BW), "avx2" where it has
    AVX2 (:func:`numba_target_has`); none without the kernels or off x86-64. Fixed for the
    process."""
    if not AVAILABLE:
        return ()
    from llvmlite import binding

    if not binding.get_default_triple().startswith("x86_64"):
        return ()
    vnni = numba_target_has("avx512bw") and numba_target_has("avx512vnni")
    return (("vnni",) if vnni else ()) + (("avx2",) if numba_target_has("avx2") else ())


def pack_u8s8(w8: Tensor, variant: str) -> tuple[np.ndarray, np.ndarray, int, str]:
    """An int8 (out, in) weight packed once for :func:`u8s8_product`'s ``variant``: (the
    packed bytes, int8; the compensation ``-128 * sum(w)`` per column, int32 (out rounded up
    to a panel,); out; the variant).

    Raises:
        ValueError: a weight beyond the variant's magnitude (:data:`U8S8_VARIANTS`: its sums
            would saturate).
    """
    lanes, vectors, levels = U8S8_VARIANTS[variant]
    w = w8.contiguous().numpy()
    if w.size and int(np.abs(w.astype(np.int16)).max()) > levels:
        raise ValueError(f"pack_u8s8: weights beyond +-{levels} would saturate the {variant} "
                         "u8 x s8 product's sums")
    cols = lanes * vectors
    N, K = w.shape
    Kp, Np = -(-K // 4) * 4, -(-N // cols) * cols
    padded = np.zeros((Np, Kp), np.int8)
    padded[:N, :K] = w
    P, KB = Np // cols, Kp // 4
    # panel p, block kb: columns p*cols .. p*cols+cols-1, each its 4 inputs kb*4 .. kb*4+3
    packed = np.ascontiguousarray(padded.reshape(P, cols, KB, 4).transpose(0, 2, 1, 3))
    comp = (-128 * padded.astype(np.int32).sum(axis=1)).astype(np.int32)
    return packed.reshape(-1), comp, N, variant


def u8s8_product(x8: Tensor, packed: np.ndarray, comp: np.ndarray, N: int,
                 variant: str) -> Tensor:
    """The exact sums ``x8 @ W8^T``, int32 (rows, out), for x8 int8 (rows, in) and a weight
    packed by :func:`pack_u8s8`, on one thread. The activations enter as unsigned bytes
    ``x8 + 128``, and the packed compensation takes ``128 * sum(w)`` off each column, so the
    sums are ``torch._int_mm``'s exactly. Where oneDNN (``torch._int_mm``) packs the weight
    again at every call, this pays at decoding's few rows (docs/benchmarks.md)."""
    lanes, vectors, _ = U8S8_VARIANTS[variant]
    return torch.from_numpy(_u8s8_product(x8.contiguous().numpy(), packed, comp, N,
                                          lanes * vectors, _U8S8_MARKER[variant]))


#: The kernel families in use: "attention" (:func:`attend`), "int8" (:func:`quantize_rows`,
#: :func:`rescale`), "search" (:func:`row_argmax`, :func:`beam_top`), "softmax"
#: (:func:`rescale_log_softmax`, the output layer's), "greedy" (:func:`rescale_greedy`, greedy
#: search's choice from the output layer's sums), "norm" (:func:`layer_norm`, an int8
#: copy's LayerNorm) and "embed" (:func:`embed`, the scaled embeddings plus positions).
#: Benchmarks remove one to measure what it gains.
KINDS = frozenset({"attention", "embed", "greedy", "int8", "norm", "search", "softmax"})
ENABLED = set(KINDS) if AVAILABLE else set()


def usable(*tensors: Tensor, kind: str = "attention") -> bool:
    """Whether the ``kind`` kernels (see :data:`ENABLED`) can run on ``tensors``: numba
    present, float32 on the CPU, no gradient wanted."""
    if kind not in ENABLED or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    for t in tensors:  # a loop, not all(generator): this runs dozens of times a step
        if not t.is_cpu or t.dtype != torch.float32:
            return False
    return True


_NO_ROWS = np.zeros((0, 0), dtype=np.int64)


def attend(q: Tensor, k: Tensor, v: Tensor, key_len: Tensor, *, group: int = 1,
           causal_from: int = -1, scale: float | None = None,
           key_rows: Tensor | None = None) -> Tensor:
    """softmax(q k^T * scale) v (eq. 1), per query over its own keys only.

    Args:
        q: float32 (N, Tq, h, d_k), the projected queries (the linear map's own layout).
        k: float32 or bfloat16 (R, h, Tk, d_k) keys, any strides (a cache buffer, or a split
            projection).
        v: (R, h, Tk, d_v) values, k's dtype.
        key_len: long (R,), the keys each key row holds (its real tokens, a prefix of Tk).
        group: query rows per key row: row r attends to key row r // group (the beams of a
            sentence over its one copy of the encoder output). N = R * group.
        causal_from: -1, or the position of query 0 among the keys: query i then sees keys
            0 .. causal_from + i only (decoder self-attention, §3.2.3).
        scale: default d_k ** -0.5.
        key_rows: optional long (N, Tk): key j of query row r lies in row ``key_rows[r, j]``
            of ``k`` and ``v`` (a gathering :class:`~aiayn.model.DecoderCache`'s
            ``key_rows``); ``group`` is then 1.

    Returns:
        float32 (N, Tq, h, d_v): contiguous, so ``.view(N, Tq, h * d_v)`` is the input of W^O.
    """
    N, Tq, H, D = q.shape
    DV = v.shape[3]
    if q.stride(3) != 1:
        q = q.contiguous()
    if k.stride(3) != 1 or v.stride(3) != 1:
        k, v = k.contiguous(), v.contiguous()
    # read in place through offsets and strides: no copy of q (a slice of W_qkv's output)
    at = np.array([q.storage_offset(), *q.stride()[:3], k.storage_offset(), *k.stride()[:3],
                   k.shape[2], v.storage_offset(), *v.stride()[:3]], dtype=np.int64)
    out = _attend(_storage(q), _storage(k), _storage(v), at, N, Tq, H, D, DV, key_len.numpy(),
                  group, causal_from, np.float32(D**-0.5 if scale is None else scale),
                  _NO_ROWS if key_rows is None else key_rows.contiguous().numpy())
    return torch.from_numpy(out).view(N, Tq, H, DV)


def _storage(t: Tensor) -> np.ndarray:
    """The whole storage under ``t``, flat: float32, or a bfloat16 tensor's as uint16."""
    if t.dtype == torch.bfloat16:
        flat = t.as_strided((t.untyped_storage().nbytes() // 2,), (1,), 0)
        return flat.view(torch.int16).numpy().view(np.uint16)
    return t.as_strided((t.untyped_storage().nbytes() // 4,), (1,), 0).numpy()


def as_array(t: Tensor) -> np.ndarray:
    """``t.numpy()``, and for a bfloat16 tensor its bits as uint16 (what the kernels read)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def kv_usable(k: Tensor, v: Tensor) -> bool:
    """Whether :func:`attend` reads these keys and values: on the CPU, float32 or bfloat16
    (a bf16 self-attention cache: :class:`aiayn.model.DecoderCache`'s ``kv_dtype``)."""
    return (k.is_cpu and v.is_cpu and k.dtype == v.dtype
            and k.dtype in (torch.float32, torch.bfloat16))


def quantize_rows(x: Tensor, levels: int = 127) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of a float32 (M, K) ``x``: (int8 (M, K), float32 scales (M, 1)),
    bit for bit what ``round(x / (max(amax|x|, 1e-12) / levels))`` gives in torch, in two
    passes instead of five."""
    x8, scale = _quantize_rows(x.contiguous().numpy(), levels)
    return torch.from_numpy(x8), torch.from_numpy(scale)


def rescale(acc: Tensor, x_scale: Tensor, w_scale: Tensor, bias: Tensor | None,
            relu: bool = False) -> Tensor:
    """float32 (M, O) ``acc * x_scale * w_scale + bias`` from int32 ``acc`` (M, O) (or float32
    holding the same exact sums: a packed weight's product), in one pass
    (``x_scale`` (M, 1), ``w_scale`` (O,), ``bias`` (O,) or None), rounded as torch's
    ``acc.float().mul_(x_scale).mul_(w_scale).add_(bias)`` rounds; then max(0, ·) with
    ``relu`` (the FFN's, §3.3)."""
    b = bias if bias is not None else w_scale
    return torch.from_numpy(_rescale(acc.numpy(), x_scale.numpy(), w_scale.numpy(), b.numpy(),
                                     bias is not None, relu))


def int8_linear(rows: Tensor, levels: int, product, w_scale: np.ndarray, bias: np.ndarray,
                has_bias: bool, relu: bool) -> Tensor:
    """One int8 linear map's passes around its product, with the fewest conversions: the
    float32 (M, K) ``rows`` quantized per row (:func:`quantize_rows`), ``product(x8)`` (a
    callable: int8 (M, K) -> the exact sums (M, O), int32 or float32), then rescaled with the
    bias and relu (:func:`rescale`): float32 (M, O), the same numbers as those two functions.
    ``w_scale`` (O,) and ``bias`` (O,) are float32 numpy arrays (``bias`` any (O,) float32
    array when ``has_bias`` is False): the caller keeps them, so they are not converted at each
    call (:class:`aiayn.model.quantize.Int8Linear`)."""
    acc, x_scale = _sums(rows, levels, product)
    return torch.from_numpy(_rescale(acc, x_scale, w_scale, bias, has_bias, relu))


def _sums(rows: Tensor, levels: int, product) -> tuple[np.ndarray, np.ndarray]:
    """The exact sums (M, O) of an int8 map over float32 (M, K) ``rows`` quantized per row,
    and the rows' scales (M, 1): the part before the rescaling that :func:`int8_linear` and
    :func:`rescale_log_softmax` share."""
    x8, x_scale = _quantize_rows(rows.contiguous().numpy(), levels)
    return product(torch.from_numpy(x8)).numpy(), x_scale


def rescale_log_softmax(rows: Tensor, levels: int, product, w_scale: np.ndarray,
                        bias: np.ndarray, has_bias: bool) -> Tensor | None:
    """``log_softmax(int8_linear(rows, ...), dim=-1)`` (:func:`int8_linear`'s arguments, no
    relu): float32 (M, O) log-probabilities of the output layer (§3.4's softmax), the rescaled
    logits kept one row at a time in cache and never written out. Each row is
    ``(y - max y) - log(sum exp(y - max y))``, as torch computes it, with the exponentials from
    a polynomial that runs in lanes (within 1 ulp of exp down to e^-80; torch's own differ
    between CPU classes likewise): within float rounding of ``F.log_softmax``, row by row,
    whatever the batch, and :func:`log_softmax`'s numbers for the same logits bit for bit.
    None where a row's logits hold a NaN or an infinite maximum (the caller then asks
    torch)."""
    acc, x_scale = _sums(rows, levels, product)
    out, ok = _rescale_log_softmax(acc, x_scale, w_scale, bias, has_bias)
    return torch.from_numpy(out) if ok else None


def embed(weight: Tensor, tokens: Tensor, scale: float, positions: Tensor) -> Tensor | None:
    """§3.4-3.5's input of a stack in one kernel: ``weight[tokens] * scale + positions``,
    float32 (B, T, d_model), the numbers torch's lookup, product and sum give (each rounded to
    float32 in that order). ``weight`` float32 (V, d_model), ``tokens`` long (B, T),
    ``positions`` float32 (T, d_model). None where a token lies outside weight's rows (the
    caller then asks torch, which says so)."""
    out, ok = _embed(weight.detach().numpy(), tokens.contiguous().numpy(), np.float32(scale),
                     positions.detach().contiguous().numpy())
    return torch.from_numpy(out) if ok else None


def rescale_greedy(rows: Tensor, levels: int, product, w_scale: np.ndarray, bias: np.ndarray,
                   has_bias: bool, eos: int, eos_banned: np.ndarray, eos_only: np.ndarray
                   ) -> tuple[Tensor, Tensor] | None:
    """Greedy search's choice from an int8 output layer (:func:`int8_linear`'s arguments, no
    relu), without writing the log-probabilities out: for each of the M rows, the column of
    its largest log-probability among the columns it may take, and that log-probability.

    Exactly what :func:`rescale_log_softmax` followed by greedy search's length rules
    (:func:`aiayn.decoding.search._log_probs`) and ``argmax`` gives: the same column (the first
    of a tie) and the same float32 number. Columns below ``eos`` (PAD and BOS) are never
    taken; column ``eos`` not where ``eos_banned[r]``; only it where ``eos_only[r]`` (where it
    is banned too: column 0 at -inf, as ``argmax`` over a row of -inf gives).

    Args:
        eos: the end-of-sentence column; the columns before it are PAD and BOS.
        eos_banned, eos_only: bool numpy (M,).

    Returns:
        (column long (M,), log-probability float32 (M,)), or None where a row's logits hold a
        NaN or an infinite maximum (the caller then asks torch).
    """
    acc, x_scale = _sums(rows, levels, product)
    column = torch.empty(acc.shape[0], dtype=torch.long)
    value = torch.empty(acc.shape[0], dtype=torch.float32)
    ok = _rescale_greedy(acc, x_scale, w_scale, bias, has_bias, eos, eos_banned, eos_only,
                         column.numpy(), value.numpy())
    return (column, value) if ok else None


def log_softmax(x: Tensor) -> Tensor:
    """``F.log_softmax(x.float(), dim=-1)`` for logits x (..., V): float32 (..., V), the
    next-token log-probabilities (§3.4's softmax, in logs). Raises nothing of its own. In one
    kernel where the "softmax" kernels run on it (float32 on the CPU, no gradient; the same
    numbers as :func:`rescale_log_softmax` gives from the sums of the same logits), else, and
    for a row holding a NaN or an infinite maximum, torch's. The one log-softmax of decoding:
    every search and step function reaches it, so a path through an int8 output layer's kernel
    and one through its logits give the same numbers."""
    x = x.float()
    if x.dim() >= 1 and x.numel() and usable(x, kind="softmax"):
        out, ok = _log_softmax(x.reshape(-1, x.shape[-1]).contiguous().numpy())
        if ok:
            return torch.from_numpy(out).view(x.shape)
    return torch.log_softmax(x, dim=-1)


def layer_norm(x: Tensor, weight: np.ndarray, bias: np.ndarray, eps: float) -> Tensor:
    """LayerNorm (§3.1) over the last dimension of a float32 x (..., d) in one kernel: float32
    (..., d), ``(x - mean) / sqrt(var + eps) * weight + bias`` per row (biased variance),
    within float rounding of ``F.layer_norm`` (its sums run in another order), and the same
    numbers for a row whatever else is in the batch. ``weight`` and ``bias`` are float32 (d,)
    numpy arrays the caller keeps (:class:`aiayn.model.quantize.KernelLayerNorm`)."""
    d = x.shape[-1]
    out = _layer_norm(x.reshape(-1, d).contiguous().numpy(), weight, bias, np.float32(eps))
    return torch.from_numpy(out).view(x.shape)


def row_argmax(x: Tensor) -> Tensor | None:
    """``x.argmax(dim=1)`` of a float32 (M, V) ``x``: long (M,), each row's first column of its
    maximum, as torch gives it, in two vectorized integer passes instead of torch's scalar
    one (on one thread: 325 against 17 us for a pass over (32, 8000) on the Intel Xeon with
    AMX). None where a row holds a NaN: the caller then asks torch."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    _row_argmax(x.numpy(), out.numpy())
    return None if x.shape[0] and bool((out < 0).any()) else out


def beam_top(logp: Tensor, live: Tensor, k: int) -> tuple[Tensor, Tensor] | None:
    """The ``k`` best extensions of each sentence's beams, as beam search ranks them:
    ``(live[:, :, None] + logp.view(n, G, V)).view(n, G * V).topk(k, dim=1)`` without making
    the (n, G * V) sums.

    Args:
        logp: float32 (n * G, V), the log-probabilities of G rows per sentence.
        live: float32 (n, G), each row's score so far.
        k: how many to keep, at most G * V.

    Returns:
        (values float32 (n, k), indices long (n, k) into G * V), values descending, each
        the same float addition the sum above makes; exact ties go to the lower index
        (``topk`` leaves their order open). None where an input holds a NaN: the caller then
        asks torch.
    """
    n, G = live.shape
    values = torch.empty(n, k, dtype=torch.float32)
    index = torch.empty(n, k, dtype=torch.long)
    ok = _beam_top(logp.contiguous().numpy(), live.contiguous().numpy(), k, G,
                   values.numpy(), index.numpy())
    return (values, index) if ok else None


def prefix_lengths(mask: Tensor) -> Tensor | None:
    """The lengths (B,) of a bool (B, S) mask whose True entries are a prefix of each row
    (right padding, as :func:`aiayn.data.batching.pad_sources` makes); None otherwise."""
    lengths = mask.sum(dim=1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    return lengths if torch.equal(prefix, mask) else None


def warm_up() -> None:
    """Compile (or load from the on-disk cache) every kernel now, on tiny inputs."""
    if not AVAILABLE:
        return
    with torch.no_grad():
        q = torch.zeros(2, 1, 1, 4)
        attend(q, q.transpose(1, 2), q.transpose(1, 2), torch.ones(2, dtype=torch.long))
        kv = q.transpose(1, 2).to(torch.bfloat16)
        attend(q, kv, kv, torch.ones(2, dtype=torch.long))
        _, s = quantize_rows(torch.ones(2, 4))
        for bias in (torch.ones(3), None):
            for relu in (False, True):
                for acc in (torch.int32, torch.float32):
                    rescale(torch.ones(2, 3, dtype=acc), s, torch.ones(3), bias, relu)
        row_argmax(torch.zeros(2, 3))
        embed(torch.zeros(3, 4), torch.zeros(2, 1, dtype=torch.long), 2.0, torch.zeros(1, 4))
        _layer_norm(np.ones((2, 3), np.float32), np.ones(3, np.float32),
                    np.zeros(3, np.float32), np.float32(1e-6))
        _log_softmax(np.zeros((2, 3), np.float32))
        for acc in (np.ones((2, 3), np.int32), np.ones((2, 3), np.float32)):
            for has_bias in (True, False):
                _rescale_log_softmax(acc, np.ones((2, 1), np.float32), np.ones(3, np.float32),
                                     np.ones(3, np.float32), has_bias)
                flags = np.zeros(2, np.bool_)
                _rescale_greedy(acc, np.ones((2, 1), np.float32), np.ones(3, np.float32),
                                np.ones(3, np.float32), has_bias, 2, flags, flags,
                                np.zeros(2, np.int64), np.zeros(2, np.float32))
        beam_top(torch.zeros(4, 3), torch.zeros(2, 2), 2)
        # the fused int8 step's kernels (aiayn.model.fused), over int32 and float32 sums
        x8, xs = _quantize_rows(np.ones((2, 4), np.float32), 127)
        ws, f4 = np.ones(4, np.float32), np.ones((2, 4), np.float32)
        for acc in (np.ones((2, 4), np.int32), f4):
            _rescale_add(acc, xs, ws, ws, True, f4)
            _rescale_add_norm(acc, xs, ws, ws, True, f4, ws, ws, np.float32(1e-6))
            _rescale_quantize(acc, xs, ws, ws, True, True, 127)
            _cross_attention_step(acc, xs, ws, ws, True, 1, 4, 4, ws, ws,
                                  np.array([0, 4, 4, 4, 1, 0, 4, 4, 4], np.int64),
                                  np.ones(1, np.int64), 2, np.float32(0.5), _NO_ROWS, 127)
            acc3 = np.ones((2, 12), acc.dtype)
            w3 = np.ones(12, np.float32)
            buf = np.zeros((2, 1, 3, 4), np.float32)
            _self_attention_step(acc3, xs, w3, w3, True, 1, 4, 4, buf, buf.copy(), 0,
                                 np.zeros((2, 3), np.int64), np.float32(0.5), 127)
            b16 = np.zeros((2, 1, 3, 4), np.uint16)  # a bf16 cache's buffers
            _self_attention_step(acc3, xs, w3, w3, True, 1, 4, 4, b16, b16.copy(), 0,
                                 np.zeros((2, 3), np.int64), np.float32(0.5), 127)
            _encoder_attention(acc3, xs, w3, w3, True, 1, 4, 4, np.zeros((2, 2), np.int64),
                               np.ones(2, np.int64), np.float32(0.5), 127)


__all__ = ["AVAILABLE", "ENABLED", "KINDS", "as_array", "attend", "beam_top", "embed",
           "int8_linear", "kv_usable", "layer_norm", "log_softmax", "numba_target_has",
           "pack_u8s8", "prefix_lengths", "quantize_rows", "rescale", "rescale_greedy",
           "rescale_log_softmax", "row_argmax", "u8s8_product", "u8s8_variants", "usable",
           "warm_up"]
