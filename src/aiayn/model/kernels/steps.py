"""The fused int8 step's kernels (:mod:`aiayn.model.fused`), LayerNorm, and the embeddings.

Each kernel here is a chain of the other modules' passes run row by row without leaving
compiled code: a sub-layer's output map with its residual and LayerNorm
(:func:`_rescale_add_norm`), the FFN's inner map straight into W_2's int8 input
(:func:`_rescale_quantize`), and one decoding step of self-attention, encoder-decoder
attention or encoder attention after its product (:func:`_self_attention_step`,
:func:`_cross_attention_step`, :func:`_encoder_attention`). Each row's arithmetic is those
passes', so the numbers are the module path's bit for bit
(``tests/unit/test_int8_decoding.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from aiayn.model.kernels.attention import _attend, _attend_groups, _fetches
from aiayn.model.kernels.int8 import _quantize_row, _quantize_rows, _rescale, _rescale_row
from aiayn.model.kernels.intrinsics import _LANES, _put, _store_rows
from aiayn.model.kernels.jit import _njit
from aiayn.model.kernels.rows import _sum

# _attend (and through it rows._exp_term) is inlined here: a change to either must touch this
# file too, or numba's on-disk cache keeps the old code. Exponentials floored at e^-64.

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


def embed(weight: Tensor, tokens: Tensor, scale: float, positions: Tensor) -> Tensor | None:
    """§3.4-3.5's input of a stack in one kernel: ``weight[tokens] * scale + positions``,
    float32 (B, T, d_model), the numbers torch's lookup, product and sum give (each rounded to
    float32 in that order). ``weight`` float32 (V, d_model), ``tokens`` long (B, T),
    ``positions`` float32 (T, d_model). None where a token lies outside weight's rows (the
    caller then asks torch, which says so)."""
    out, ok = _embed(weight.detach().numpy(), tokens.contiguous().numpy(), np.float32(scale),
                     positions.detach().contiguous().numpy())
    return torch.from_numpy(out) if ok else None


def layer_norm(x: Tensor, weight: np.ndarray, bias: np.ndarray, eps: float) -> Tensor:
    """LayerNorm (§3.1) over the last dimension of a float32 x (..., d) in one kernel: float32
    (..., d), ``(x - mean) / sqrt(var + eps) * weight + bias`` per row (biased variance),
    within float rounding of ``F.layer_norm`` (its sums run in another order), and the same
    numbers for a row whatever else is in the batch. ``weight`` and ``bias`` are float32 (d,)
    numpy arrays the caller keeps (:class:`aiayn.model.quantize.KernelLayerNorm`)."""
    d = x.shape[-1]
    out = _layer_norm(x.reshape(-1, d).contiguous().numpy(), weight, bias, np.float32(eps))
    return torch.from_numpy(out).view(x.shape)
