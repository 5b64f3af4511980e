"""Passes over rows of floats: order keys, argmax, the top-k of beam search, the sum of
exponentials and log-softmax, and the int8 output layer's log-probabilities and greedy choice
from its exact sums. The searches' primitives (``log_softmax``, ``row_argmax``, ``beam_top``)
are also :mod:`aiayn.decoding.primitives`' names.

Every reduction here is either an integer maximum (exact in any order: a float's *order key*,
an int32 that orders as the float does) or a float sum in a loop that stores nothing, whose
order is fixed by the row's length alone (``reassoc``: the CPU's vector width); so a row's
numbers never depend on the other rows of its batch (docs/kernels.md).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from aiayn.model.kernels.int8 import _sums
from aiayn.model.kernels.jit import _njit, usable

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


# expf on [-64, 0] in lanes: Cephes' single-precision polynomial (within 1 ulp of exp down to
# the floor, measured), 2^n made from the exponent's bits. numba's np.exp is one libm call
# per element, which does not vectorize: 5-10x slower than torch's log_softmax over a row of
# logits. The floor: every exponential below e^-64 (2^-92.3) is taken as e^-64. Such a term
# cannot move a sum that holds 1 (2^20 of them are < 2^-72 of it), and an attention weight
# there times any value above 2^-34 stays a normal float. Floored at e^-87 (2^-125.5), as
# before, peaked attention made weights and weight x value products at the edge of the
# float32 range, below 2^-126, where every x86 CPU takes a microcode assist on each vector
# instruction that meets one: the random `base` model of bench/bench_decode_peers.py, with
# 36% of its self-attention scores 87 below their row's largest, spent 40% of its
# self-attention step there (713 against 526 us a step, bf16 class). Kernels that inline
# _exp_term (attention.py, steps.py) say so, so that numba's cache, which watches only a
# kernel's own file, recompiles them when this changes.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-64.0)  # 2^-92.3 (see above)
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


@_njit(fastmath={"reassoc"})
def _sum(a):  # pragma: no cover - compiled
    # sum of a float32 row, in lanes; the loop stores nothing, so LLVM keeps one copy of it
    # and the order of the additions is fixed by the row's length alone
    s = np.float32(0.0)
    for c in range(a.shape[0]):
        s += a[c]
    return s


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
