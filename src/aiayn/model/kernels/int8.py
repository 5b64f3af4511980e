"""The passes around an int8 linear map, and aiayn's own int8 product.

- :func:`quantize_rows`: float32 rows -> int8 and one scale per row, torch's arithmetic bit
  for bit, in two passes instead of five;
- :func:`rescale`: the exact int32 sums back to float32, times both scales, plus the bias
  (and relu), rounded as torch's ``acc.float().mul_(x_scale).mul_(w_scale).add_(bias)``;
- :func:`pack_u8s8` and :func:`u8s8_product`: ``x8 @ W8^T`` over a weight packed once, in
  tiles of 4 activation rows by one panel of columns held in registers (the variant's
  instructions: :data:`~aiayn.model.kernels.cpu.U8S8_VARIANTS`,
  :mod:`~aiayn.model.kernels.intrinsics`).

An int8 linear map took about nine passes over its activations in torch ops (absolute
value, maximum, division, rounding, cast; cast, two scalings, the bias), and the FFN's relu
one more; :func:`quantize_rows` and :func:`rescale` take three, with the same numbers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from aiayn.model.kernels.cpu import U8S8_ROWS as _U8S8_ROWS
from aiayn.model.kernels.cpu import U8S8_VARIANTS
from aiayn.model.kernels.intrinsics import _U8S8_MARKER, _u8s8_tile
from aiayn.model.kernels.jit import _njit

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
def _u8s8_bytes(x8, Kp):  # pragma: no cover - compiled
    # x8 (M, K) int8 -> the unsigned bytes x8 + 128, rows of Kp (zero padded), flat
    M, K = x8.shape
    xu = np.zeros(M * Kp, np.uint8)
    for r in range(M):
        for k in range(K):
            xu[r * Kp + k] = np.uint8(x8[r, k]) ^ np.uint8(0x80)
    return xu


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


def pack_u8s8(w8: Tensor, variant: str) -> tuple[np.ndarray, np.ndarray, int, str]:
    """An int8 (out, in) weight packed once for :func:`u8s8_product`'s ``variant``: (the
    packed bytes, int8; the compensation ``-128 * sum(w)`` per column, int32 (out rounded up
    to a panel,); out; the variant).

    Raises:
        ValueError: not an int8 (out, in) weight, or a weight beyond the variant's magnitude
            (:data:`U8S8_VARIANTS`: 2 * 255 * 63 = 32,130 fits the "avx2" variant's int16
            pair sums, 2 * 255 * 127 would saturate them).
    """
    if w8.dtype != torch.int8 or w8.dim() != 2 or variant not in U8S8_VARIANTS:
        raise ValueError(f"pack_u8s8: an int8 (out, in) weight and a variant of "
                         f"{sorted(U8S8_VARIANTS)}, not {w8.dtype} {tuple(w8.shape)} and "
                         f"{variant!r}")
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
    again at every call, this pays at decoding's few rows (docs/benchmarks.md).

    Raises:
        ValueError: ``x8`` not int8 (rows, in) on the CPU, a variant :data:`U8S8_VARIANTS`
            lacks, or a packed weight that does not fit ``x8`` (K agreement: its blocks of 4
            inputs must be ``ceil(in / 4)``) or ``N`` (not one of its panels' column counts):
            compiled code checks nothing, and would read and write out of bounds.
    """
    shape = _U8S8_SHAPES.get(variant)
    # one expression, a few hundred ns: this runs at every product of a decoding step, and a
    # slower check shifted quantize.product_times' timing (the full message only on failure)
    if (shape is None or x8.dtype != torch.int8 or x8.dim() != 2
            or packed.size != ((x8.shape[1] + 3) // 4) * 4 * comp.size
            or not comp.size - shape[1] < N <= comp.size or packed.dtype != np.int8
            or comp.dtype != np.int32):
        _u8s8_check(x8, packed, comp, N, variant)
    return torch.from_numpy(_u8s8_product(x8.contiguous().numpy(), packed, comp, N, shape[1],
                                          shape[0]))


#: variant -> (its marker, its panel's columns), for :func:`u8s8_product`
_U8S8_SHAPES = {v: (_U8S8_MARKER[v], lanes * vectors)
                for v, (lanes, vectors, _) in U8S8_VARIANTS.items()}


def _u8s8_check(x8: Tensor, packed: np.ndarray, comp: np.ndarray, N: int, variant: str) -> None:
    """Raise the ValueError that names which of :func:`u8s8_product`'s preconditions fails."""
    if variant not in U8S8_VARIANTS:
        raise ValueError(f"u8s8_product: no variant {variant!r}; one of "
                         f"{sorted(U8S8_VARIANTS)}")
    lanes, vectors, _ = U8S8_VARIANTS[variant]
    cols = lanes * vectors
    if x8.dtype != torch.int8 or x8.dim() != 2 or not x8.is_cpu:
        raise ValueError(f"u8s8_product: x8 must be int8 (rows, in) on the CPU, not "
                         f"{x8.dtype} {tuple(x8.shape)} on {x8.device}")
    if (packed.dtype != np.int8 or comp.dtype != np.int32 or packed.ndim != 1
            or comp.ndim != 1 or comp.size % cols or packed.size % (4 * cols)):
        raise ValueError(f"u8s8_product: not a {variant} packed weight (pack_u8s8): packed "
                         f"{packed.dtype} {packed.shape}, compensation {comp.dtype} "
                         f"{comp.shape}, panels of {cols} columns")
    panels = comp.size // cols
    blocks = packed.size // (4 * cols * panels) if panels else 0
    K = x8.shape[1]
    if (blocks != -(-K // 4) or packed.size != blocks * 4 * cols * panels
            or not (panels - 1) * cols < N <= panels * cols):
        raise ValueError(f"u8s8_product: the packed weight holds {blocks} blocks of 4 inputs "
                         f"and {panels} panels of {cols} columns; x8 has {K} inputs "
                         f"(needs {-(-K // 4)} blocks) and N is {N}")
    raise AssertionError("u8s8_product: the quick check and _u8s8_check disagree")


def quantize_rows(x: Tensor, levels: int = 127) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of a float32 (M, K) ``x``: (int8 (M, K), float32 scales (M, 1)),
    bit for bit what ``round(x / (max(amax|x|, 1e-12) / levels))`` gives in torch, in two
    passes instead of five.

    Raises:
        ValueError: ``x`` not float32 (M, K) on the CPU, or ``levels`` outside 1..127.
    """
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu:
        raise ValueError(f"quantize_rows: x must be float32 (M, K) on the CPU, not {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if not 1 <= levels <= 127:
        raise ValueError(f"quantize_rows: levels must be in 1..127, not {levels}")
    x8, scale = _quantize_rows(x.contiguous().numpy(), levels)
    return torch.from_numpy(x8), torch.from_numpy(scale)


def rescale(acc: Tensor, x_scale: Tensor, w_scale: Tensor, bias: Tensor | None,
            relu: bool = False) -> Tensor:
    """float32 (M, O) ``acc * x_scale * w_scale + bias`` from int32 ``acc`` (M, O) (or float32
    holding the same exact sums: a packed weight's product), in one pass
    (``x_scale`` (M, 1), ``w_scale`` (O,), ``bias`` (O,) or None), rounded as torch's
    ``acc.float().mul_(x_scale).mul_(w_scale).add_(bias)`` rounds; then max(0, ·) with
    ``relu`` (the FFN's, §3.3).

    Raises:
        ValueError: shapes that do not agree, or dtypes other than those above.
    """
    M, n_out = acc.shape if acc.dim() == 2 else (-1, -1)
    if (acc.dtype not in (torch.int32, torch.float32) or M < 0
            or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (M, 1)
            or w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (n_out,)
            or (bias is not None and (bias.dtype != torch.float32
                                      or tuple(bias.shape) != (n_out,)))):
        raise ValueError(f"rescale: acc int32 or float32 (M, O), x_scale float32 (M, 1), "
                         f"w_scale and bias float32 (O,); got acc {acc.dtype} "
                         f"{tuple(acc.shape)}, x_scale {x_scale.dtype} {tuple(x_scale.shape)}, "
                         f"w_scale {w_scale.dtype} {tuple(w_scale.shape)}, bias "
                         f"{None if bias is None else (bias.dtype, tuple(bias.shape))}")
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
