"""Attention over cached keys (eq. 1), one query per (row, head) against its own keys.

Why a kernel and not torch ops (measured, ``base``, one thread): decoder attention is one
query per (row, head) against at most a few dozen keys. ``scaled_dot_product_attention`` and
``torch.bmm`` run it as one or two tiny BLAS products per (row, head), about 0.35 µs of
overhead each, thousands per step; the kernel here runs all of them in one call, 1.8-2.2x
faster.

**Batch invariance.** :func:`attend` loops, for every query, over that query's own keys
only: the real source tokens of its sentence (``key_len``), never the padding of its batch.
Every sum it makes runs in an order fixed by that query's own lengths. So a sentence's
attention is the same bit for bit alone, in a batch of 16 or in the whole set.

**Shapes.** Queries, keys and values are read in place through offsets and strides (``at``
below). Where d_v is a multiple of 16 (:data:`_LANES`) the value sums run in vector
registers (:func:`~aiayn.model.kernels.intrinsics._value_sum_intrinsic`), four queries of a
beam group a pass; otherwise through :func:`_axpy4`, the same numbers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from aiayn.model.kernels.cpu import PREFETCH_BYTES
from aiayn.model.kernels.intrinsics import (
    _LANES,
    _f32,
    _prefetch,
    _value_sum1,
    _value_sum2,
    _value_sum3,
    _value_sum4,
)
from aiayn.model.kernels.jit import _njit
from aiayn.model.kernels.rows import _exp_term, _sum

# _exp_term is inlined here: a change to it (its floor, rows.py) must touch this file too, or
# numba's on-disk cache keeps the old code (it watches only a kernel's own file). Floor: e^-64.

@_njit(inline="always")
def _prefetch_rows(a, offsets, n, shift, d):  # pragma: no cover - compiled
    # prefetch the n rows of d elements of the flat storage a that start at offsets[:n] +
    # shift: a 64-byte line's worth of elements apart (every line of a row that starts on one)
    step = max(64 // a.itemsize, 1)
    for j in range(n):
        o = offsets[j] + shift
        for e in range(0, d, step):
            _prefetch(a, o + e)


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
        key_len: long (R,), the keys each key row holds (its real tokens, a prefix of Tk);
            (N,), one per query row, with ``key_rows``.
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

    Raises:
        ValueError: shapes or dtypes other than the above (compiled code checks nothing).
        The caller keeps ``key_len`` within Tk and ``key_rows`` within R (not checked: a
        pass over them would cost more than the kernel at decoding's sizes).
    """
    if (q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.dtype != torch.float32
            or k.dtype != v.dtype or k.dtype not in (torch.float32, torch.bfloat16)
            or k.shape[:3] != v.shape[:3] or k.shape[1] != q.shape[2]
            or k.shape[3] != q.shape[3]
            or key_len.shape != (q.shape[0] if key_rows is not None else k.shape[0],)
            or (key_rows is None and q.shape[0] != k.shape[0] * group)):
        raise ValueError(f"attend: q float32 (N, Tq, h, d_k), k and v float32 or bfloat16 "
                         f"(R, h, Tk, d), key_len (R,) ((N,) with key_rows), N = R * group; got q {q.dtype} "
                         f"{tuple(q.shape)}, k {k.dtype} {tuple(k.shape)}, v {v.dtype} "
                         f"{tuple(v.shape)}, key_len {tuple(key_len.shape)}, group {group}")
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


def prefix_lengths(mask: Tensor) -> Tensor | None:
    """The lengths (B,) of a bool (B, S) mask whose True entries are a prefix of each row
    (right padding, as :func:`aiayn.data.batching.pad_sources` makes); None otherwise."""
    lengths = mask.sum(dim=1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    return lengths if torch.equal(prefix, mask) else None
