"""CPU kernels for inference, compiled by numba: attention over cached keys, and the passes
around int8 products (docs/kernels.md).

The package's layers, lowest first; each module imports only those above it in this list:

- :mod:`~aiayn.model.kernels.jit`: whether numba is imported (``AIAYN_NO_KERNELS=1``: never),
  the decorator of every kernel (cached on disk, or compiled in memory where no cache can be
  written), the kernel families in use (:data:`ENABLED`, :func:`usable`, each compiled at its
  first use, torch where that fails), and the ``aiayn.kernels`` logger;
- :mod:`~aiayn.model.kernels.cpu`: the CPU and numba's target, in one place: the u8 x s8
  variant (``AIAYN_FORCE_ISA``), the int8 weight grid, the level-2 cache, the CPU class, and
  :func:`build_record` for a run's generation record;
- :mod:`~aiayn.model.kernels.intrinsics`: the LLVM code (value sums in registers, the u8 x s8
  tiles, prefetch, bf16 stores) behind plain-Python names, with the register budget;
- :mod:`~aiayn.model.kernels.int8`: row quantization, rescaling, and the u8 x s8 product over
  a weight packed once;
- :mod:`~aiayn.model.kernels.rows`: order keys, argmax, beam search's top-k, log-softmax, the
  int8 output layer's log-probabilities and greedy choice;
- :mod:`~aiayn.model.kernels.attention`: eq. 1 per query over its own keys;
- :mod:`~aiayn.model.kernels.steps`: the fused int8 step's kernels, LayerNorm, embeddings.

Used only on CPU, in float32, without gradients; every caller keeps its torch path for the
rest. Every name the rest of aiayn uses is importable from here (``kernels.attend``, ...).
"""

from __future__ import annotations

import numpy as np
import torch

from aiayn.model.kernels.attention import _NO_ROWS as _NO_ROWS
from aiayn.model.kernels.attention import _attend as _attend
from aiayn.model.kernels.attention import _attend_groups as _attend_groups
from aiayn.model.kernels.attention import _axpy4 as _axpy4
from aiayn.model.kernels.attention import _storage as _storage
from aiayn.model.kernels.attention import as_array, attend, kv_usable, prefix_lengths
from aiayn.model.kernels.cpu import (
    PREFETCH_BYTES,
    U8S8_VARIANTS,
    build_record,
    cpu_class,
    forced_isa,
    machine_differs,
    numba_target_has,
    u8s8_variant,
    u8s8_variants,
    weight_levels,
)
from aiayn.model.kernels.cpu import _level2_bytes as _level2_bytes
from aiayn.model.kernels.int8 import _quantize_rows as _quantize_rows
from aiayn.model.kernels.int8 import _rescale as _rescale
from aiayn.model.kernels.int8 import int8_linear, pack_u8s8, quantize_rows, rescale, u8s8_product
from aiayn.model.kernels.intrinsics import _f32 as _f32
from aiayn.model.kernels.intrinsics import _value_sum1 as _value_sum1
from aiayn.model.kernels.intrinsics import _value_sum2 as _value_sum2
from aiayn.model.kernels.intrinsics import _value_sum3 as _value_sum3
from aiayn.model.kernels.intrinsics import _value_sum4 as _value_sum4
from aiayn.model.kernels.intrinsics import _value_sum_intrinsic as _value_sum_intrinsic
from aiayn.model.kernels.jit import AVAILABLE, ENABLED, KINDS, WARM_UPS, log, ready, usable
from aiayn.model.kernels.rows import _beam_top as _beam_top
from aiayn.model.kernels.rows import _first_at_least as _first_at_least
from aiayn.model.kernels.rows import _key_range as _key_range
from aiayn.model.kernels.rows import _log_softmax as _log_softmax
from aiayn.model.kernels.rows import _order_key as _order_key
from aiayn.model.kernels.rows import _rescale_greedy as _rescale_greedy
from aiayn.model.kernels.rows import _rescale_log_softmax as _rescale_log_softmax
from aiayn.model.kernels.rows import _rescale_row_range as _rescale_row_range
from aiayn.model.kernels.rows import _row_argmax as _row_argmax
from aiayn.model.kernels.rows import (
    beam_top,
    log_softmax,
    rescale_greedy,
    rescale_log_softmax,
    row_argmax,
)
from aiayn.model.kernels.steps import _cross_attention_step as _cross_attention_step
from aiayn.model.kernels.steps import _embed as _embed
from aiayn.model.kernels.steps import _encoder_attention as _encoder_attention
from aiayn.model.kernels.steps import _layer_norm as _layer_norm
from aiayn.model.kernels.steps import _rescale_add as _rescale_add
from aiayn.model.kernels.steps import _rescale_add_norm as _rescale_add_norm
from aiayn.model.kernels.steps import _rescale_quantize as _rescale_quantize
from aiayn.model.kernels.steps import _self_attention_step as _self_attention_step
from aiayn.model.kernels.steps import embed, layer_norm


def _warm_attention() -> None:
    q = torch.zeros(2, 1, 1, 4)
    attend(q, q.transpose(1, 2), q.transpose(1, 2), torch.ones(2, dtype=torch.long))
    kv = q.transpose(1, 2).to(torch.bfloat16)
    attend(q, kv, kv, torch.ones(2, dtype=torch.long))


def _warm_int8() -> None:
    _, s = quantize_rows(torch.ones(2, 4))
    for bias in (torch.ones(3), None):
        for relu in (False, True):
            for acc in (torch.int32, torch.float32):
                rescale(torch.ones(2, 3, dtype=acc), s, torch.ones(3), bias, relu)
    # the fused int8 step's kernels (aiayn.model.fused), over int32 and float32 sums
    x8, xs = _quantize_rows(np.ones((2, 4), np.float32), 127)
    ws, f4 = np.ones(4, np.float32), np.ones((2, 4), np.float32)
    for acc in (np.ones((2, 4), np.int32), f4):
        _rescale_add(acc, xs, ws, ws, True, f4)
        _rescale_add_norm(acc, xs, ws, ws, True, f4, ws, ws, np.float32(1e-6))
        _rescale_quantize(acc, xs, ws, ws, True, True, 127)
        # the encoder's keys and values in float32 and, as an int8 copy keeps them, bfloat16
        for kv in (ws, np.zeros(4, np.uint16)):
            _cross_attention_step(acc, xs, ws, ws, True, 1, 4, 4, kv, kv,
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


def _warm_search() -> None:
    _row_argmax(np.zeros((2, 3), np.float32), np.zeros(2, np.int64))
    _beam_top(np.zeros((4, 3), np.float32), np.zeros((2, 2), np.float32), 2, 2,
              np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int64))


def _warm_softmax() -> None:
    _log_softmax(np.zeros((2, 3), np.float32))
    for acc in (np.ones((2, 3), np.int32), np.ones((2, 3), np.float32)):
        for has_bias in (True, False):
            _rescale_log_softmax(acc, np.ones((2, 1), np.float32), np.ones(3, np.float32),
                                 np.ones(3, np.float32), has_bias)


def _warm_greedy() -> None:
    flags = np.zeros(2, np.bool_)
    for acc in (np.ones((2, 3), np.int32), np.ones((2, 3), np.float32)):
        for has_bias in (True, False):
            _rescale_greedy(acc, np.ones((2, 1), np.float32), np.ones(3, np.float32),
                            np.ones(3, np.float32), has_bias, 2, flags, flags,
                            np.zeros(2, np.int64), np.zeros(2, np.float32))


def _warm_norm() -> None:
    _layer_norm(np.ones((2, 3), np.float32), np.ones(3, np.float32), np.zeros(3, np.float32),
                np.float32(1e-6))


def _warm_embed() -> None:
    _embed(np.zeros((3, 4), np.float32), np.zeros((2, 1), np.int64), np.float32(2.0),
           np.zeros((1, 4), np.float32))


WARM_UPS.update(attention=_warm_attention, int8=_warm_int8, search=_warm_search,
                softmax=_warm_softmax, greedy=_warm_greedy, norm=_warm_norm, embed=_warm_embed)


def _say_how() -> None:
    """The kernels' state at import, for ``AIAYN_VERBOSE=kernels``."""
    from aiayn.model.kernels import jit

    if not AVAILABLE:
        log.info("kernels off (%s): torch runs every one",
                 "AIAYN_NO_KERNELS" if jit.DISABLED else "numba not importable")
        return
    from numba.core import config

    log.info("numba %s, target CPU %s%s, kernels %s", jit.numba.__version__,
             config.CPU_NAME or "host", f" ({config.CPU_FEATURES})" if config.CPU_FEATURES
             else "", "cached on disk" if jit.CACHED else "compiled in memory")


_say_how()


def warm_up() -> None:
    """Compile (or load from numba's cache) every enabled family's kernels now, on tiny
    inputs; a family that fails to compile is left out, with one warning (:func:`ready`)."""
    for kind in sorted(KINDS):
        ready(kind)


__all__ = ["AVAILABLE", "ENABLED", "KINDS", "as_array", "attend", "beam_top", "build_record",
           "cpu_class", "embed", "forced_isa", "int8_linear", "kv_usable", "layer_norm", "log",
           "log_softmax", "machine_differs", "numba_target_has", "pack_u8s8", "prefix_lengths", "quantize_rows",
           "rescale", "rescale_greedy", "rescale_log_softmax", "row_argmax", "u8s8_product",
           "u8s8_variant", "u8s8_variants", "usable", "warm_up", "weight_levels",
           "PREFETCH_BYTES", "U8S8_VARIANTS"]
