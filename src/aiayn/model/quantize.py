"""int8 inference: every linear map of a Transformer with int8 weights and int8 activations.

:func:`quantize_int8` returns an inference copy of a model in which each ``nn.Linear`` of the
encoder and decoder, and the tied pre-softmax map (§3.4), is an :class:`Int8Linear`:

- weights: symmetric int8 with one scale per output row (``W ~ s_w[o] * W8[o, :]``), made once
  (7 bits, [-63, 63], on a CPU whose int8 product saturates at full range: :func:`weight_levels`);
- activations: symmetric int8 with one scale per *input row* (per token, per beam row), made
  at each call from that row alone (``x ~ s_x[r] * x8[r, :]``);
- the product ``x8 @ W8^T`` runs in ``torch._int_mm`` with int32 accumulation, which is exact,
  or, for a shape where :func:`weight_packing` finds it faster on this machine, over a weight
  packed once: in FBGEMM's or oneDNN's int8 linear (the same exact sums, as float32), or in
  aiayn's own kernel (:func:`aiayn.model.kernels.u8s8_product`, with or without VNNI); then
  ``y = s_x[r] * s_w[o] * acc + b``.

No scale and no sum mixes rows (unlike per-tensor dynamic quantization, whose one activation
scale is the batch's largest value), so each row's product is independent of its batch. The
float attention around the products runs in :func:`aiayn.model.kernels.attend` on the CPU,
over each row's own keys in an order its own lengths fix, so it does not round differently
when the batch is padded to another length: a sentence decodes to the same tokens alone or in
any batch (``tests/unit/test_batch_invariance.py``). Everything between the linear maps
(embeddings, positions, LayerNorm, softmax, attention products, residuals) stays float32; the
decoder caches' keys and values are kept in bfloat16 where the CPU kernels read them (each
rounded once, when written; ``kv_bf16``), since each step reads them all.

Around each product, the int32 sums are rescaled (and the bias added) in one pass
(:func:`aiayn.model.kernels.rescale`), and each self-attention's W^Q, W^K and W^V are one
map (the engine's ``encoder_qkv`` / ``decoder_qkv``), so their shared input is quantized
once: both give the same numbers as the separate maps and passes, bit for bit.

The copy is an :class:`aiayn.model.engine.Int8Transformer`, decoding's engine (encode /
start_cache / decode_step, as the model), not a model to train. The model itself is not
changed; the copy shares nothing with it that training could move (its float weights are
dropped, its int8 ones are buffers).
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.errors import ConfigError
from aiayn.model import kernels
from aiayn.model.engine import Int8Transformer
from aiayn.model.kernels import weight_levels
from aiayn.model.kernels.cpu import forced_choice
from aiayn.model.fused import FusedInt8Encoder, FusedInt8Step
from aiayn.model.transformer import DecoderLayer, PositionwiseFeedForward


def _quantize_rows(x: Tensor, levels: int = 127) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of ``x`` (..., k), values in [-levels, levels]:
    (int8 (..., k), float32 scales (..., 1))."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(float(levels))
    return torch.round(x / scale).to(torch.int8), scale


def _fastest(calls: list, runs: int = 5) -> list[float]:
    """Each call's fastest of ``runs`` timings, in seconds, the calls interleaved (so a
    passing slowdown of the machine falls on all of them alike)."""
    import time

    best = [float("inf")] * len(calls)
    for _ in range(runs):
        for i, call in enumerate(calls):
            t = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


@functools.cache
def weight_columns_first(in_features: int, out_features: int) -> bool:
    """Whether ``torch._int_mm`` runs faster here on the int8 weight stored column-major
    ((in, out) contiguous) than on the (out, in) rows' transposed view, for this shape.

    Measured once per shape and process (a few products of 32 rows, each layout's fastest
    of five): on the bf16 class oneDNN ran (32, 2048) x (2048, 512) 1.7x faster column-major,
    and the shapes with 512 inputs alike. The sums are exact either way, so only time changes.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, in_features), dtype=torch.int8, generator=gen)
    w = torch.randint(-63, 64, (out_features, in_features), dtype=torch.int8, generator=gen)
    layouts = [w.t(), w.t().contiguous()]
    best = _fastest([lambda b=b: torch._int_mm(a, b) for b in layouts])
    return best[1] < 0.9 * best[0]


def _packed_product(x8: Tensor, packed: Tensor, ones: Tensor, zeros: Tensor) -> Tensor:
    """``x8 @ W8^T`` as float32 (rows, out) over a weight packed by ``qlinear_prepack``: every
    scale 1 and zero point 0, so each entry is the exact int32 sum, converted to float32 as
    ``torch._int_mm``'s sums are converted by the rescaling after it."""
    return torch.ops.onednn.qlinear_pointwise(x8, 1.0, 0, packed, ones, zeros, None, 1.0, 0,
                                              torch.float32, "none", [], "")


def _pack(w8: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(packed weight, ones (out,), zeros (out,)) for :func:`_packed_product`, from an int8
    (out, in) weight (packed from its (out, in) contiguous copy: a column-major view packs
    wrongly)."""
    n = w8.shape[0]
    return (torch.ops.onednn.qlinear_prepack(w8.contiguous(), None), torch.ones(n),
            torch.zeros(n, dtype=torch.long))


def _fbgemm_product(x8: Tensor, packed) -> Tensor:
    """``x8 @ W8^T`` as float32 (rows, out) through FBGEMM's int8 linear over a weight packed
    by :func:`_pack_fbgemm`: the activations enter as unsigned bytes ``x8 + 128`` (zero point
    128, scale 1: FBGEMM quantizes the float copy of ``x8`` to exactly those), the weight with
    scale 1 and zero point 0, so each output is the exact int32 sum (FBGEMM subtracts the
    zero point's share with its column sums, kept with the packed weight) converted to
    float32, as :func:`_packed_product`'s are."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        x8.float(), 1.0, 128, packed)


def _pack_fbgemm(w8: Tensor):
    """FBGEMM's packed form of an int8 (out, in) weight (its column sums included), for
    :func:`_fbgemm_product`. torch's quantized tensors, which the packing takes, are
    deprecated; torch is pinned (pyproject.toml), and :func:`weight_packing` falls back to
    ``torch._int_mm`` where the op is missing or fails."""
    import warnings

    engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_tensor_quantized_tensor(w8.contiguous(), 1.0, 0)
            return torch.ops.quantized.linear_prepack(weight, None)
    finally:
        torch.backends.quantized.engine = engine


def _probe_operands(in_features: int, out_features: int, rows: tuple[int, ...]
                    ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The weight probes' operands, the same for every probe of a shape: an int8 (out, in)
    weight at :func:`weight_levels` with a full-range positive and negative row, its
    ``torch._int_mm`` operand in the layout :func:`weight_columns_first` picks, and int8
    inputs of each row count in ``rows``, the first with a full-range positive and negative
    row (where an int16 pair sum would saturate)."""
    levels = weight_levels()
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-levels, levels + 1, (out_features, in_features), dtype=torch.int8,
                      generator=gen)
    w[0], w[1] = levels, -levels
    wt = w.t().contiguous() if weight_columns_first(in_features, out_features) else w.t()
    xs = [torch.randint(-127, 128, (m, in_features), dtype=torch.int8, generator=gen)
          for m in rows]
    xs[0][0], xs[0][1] = 127, -127
    return w, wt, xs


def u8s8_variant() -> str | None:
    """The fastest variant of aiayn's u8 x s8 product
    (:func:`aiayn.model.kernels.u8s8_variants`) that sums this machine's int8 weights
    (:func:`weight_levels`) exactly: "vnni" (AVX-512 VNNI, any int8 weight), "avx2" (7-bit
    weights only, which is what a CPU without VNNI stores), or None."""
    return kernels.u8s8_variant(weight_levels())


def _pack_u8s8(w8: Tensor) -> tuple:
    """:func:`aiayn.model.kernels.pack_u8s8` for :func:`u8s8_variant`."""
    return kernels.pack_u8s8(w8, u8s8_variant())


def _exact_u8s8(w: Tensor, wt: Tensor, xs: list[Tensor], variant: str) -> tuple | None:
    """``w`` packed for aiayn's u8 x s8 product in ``variant``, where that product gives
    ``torch._int_mm``'s sums on every probe input of ``xs``; None, with one warning, where
    the kernel fails to compile or its sums differ (a bug: the map then takes torch's
    products)."""
    packed = kernels.pack_u8s8(w, variant)
    try:
        for x in xs:
            if not torch.equal(kernels.u8s8_product(x, *packed), torch._int_mm(x, wt)):
                kernels.log.warning("the u8s8 product (%s) is not exact for "
                                    "a %d x %d weight; torch's products run it", variant,
                                    *w.shape)
                return None
    except Exception as error:  # noqa: BLE001 - a compile failure at first use
        kernels.log.warning("the u8s8 product (%s) failed to compile (%s: %s); "
                            "torch's products run its maps", variant, type(error).__name__,
                            (str(error).strip().splitlines() or [""])[0])
        return None
    return packed


#: the row counts at which :func:`product_times` times each product path: a greedy step's 32
#: sentences, a beam-4 step's 128 rows, an encoder batch's tokens
PROBE_ROWS = (32, 128, 256)
#: a packed path takes a row count from ``torch._int_mm`` (and aiayn's u8s8 kernel from
#: torch's best path) only where it runs at most this share of that one's time: packing costs
#: a second copy of the weight, and a plan should not follow the timing's noise
PLAN_MARGIN = 0.95


def _fbgemm_exact(w: Tensor, wt: Tensor, xs: list[Tensor]):
    """``w`` packed for :func:`_fbgemm_product`, where this torch has FBGEMM's int8 linear and
    it gives ``torch._int_mm``'s sums on every probe input of ``xs``; else None."""
    if "fbgemm" not in torch.backends.quantized.supported_engines or not hasattr(
            torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32"):
        return None
    try:
        packed = _pack_fbgemm(w)
        for x in xs:
            if not torch.equal(_fbgemm_product(x, packed), torch._int_mm(x, wt).float()):
                return None
    except RuntimeError:  # pragma: no cover - a torch built without FBGEMM's kernels
        return None
    return packed


def _onednn_usable(w: Tensor, wt: Tensor, xs: list[Tensor]) -> tuple | None:
    """``w`` packed for :func:`_packed_product` (oneDNN's int8 linear over a prepacked weight),
    where that op exists, gives ``torch._int_mm``'s sums on every probe input of ``xs``, and
    is not screened out: one call of 4 rows (the full-range ones among them) taking
    :data:`PACKED_SCREEN_SLOWER` times ``torch._int_mm``'s time means oneDNN runs its
    reference code on this CPU (the family-26 EPYC: 98 ms for 32 x 256 x 768, 0.8 s for 256
    rows), and the full timing would cost seconds a shape for a clear verdict. Else None."""
    if not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return None
    try:
        packed = _pack(w)
        few = xs[0][:4]
        if not torch.equal(_packed_product(few, *packed), torch._int_mm(few, wt).float()):
            return None
        screen = _fastest([lambda: torch._int_mm(few, wt),
                           lambda: _packed_product(few, *packed)], runs=1)
        if screen[1] > PACKED_SCREEN_SLOWER * screen[0]:
            return None
        for x in xs:
            if not torch.equal(_packed_product(x, *packed), torch._int_mm(x, wt).float()):
                return None
    except RuntimeError:  # pragma: no cover - a build whose oneDNN lacks the op's kernels
        return None
    return packed


def _times(paths: dict, xs: list[Tensor], threads: int) -> dict[str, tuple[float, ...]]:
    """Each path's fastest of five at each input of ``xs`` (seconds), on ``threads`` torch
    threads, the paths interleaved at each input."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        names = list(paths)
        per_x = [_fastest([lambda f=paths[n], x=x: f(x) for n in names]) for x in xs]
    finally:
        torch.set_num_threads(before)
    return {n: tuple(t[i] for t in per_x) for i, n in enumerate(names)}


@functools.cache
def product_times(in_features: int, out_features: int) -> dict[str, dict[str, tuple]]:
    """Each product path that gives exact sums here, timed on an int8 map of this shape at
    every row count of :data:`PROBE_ROWS`: ``{"torch": {path: seconds per row count},
    "one_thread": {path: ...}}``. "torch" holds ``torch._int_mm`` (in the layout
    :func:`weight_columns_first` picks), FBGEMM's and oneDNN's int8 linear over a weight
    packed once, on the process's torch threads; "one_thread" those on one thread and aiayn's
    u8s8 kernel (:func:`u8s8_variant`; it runs on one thread, and only there: ``_product``),
    the same timings as "torch" where the process runs one thread.

    Measured once per shape and process, each path's fastest of five, the paths interleaved.
    A path is left out where its op or variant is missing, it fails, or its sums differ from
    ``torch._int_mm``'s (checked on full-range inputs, where an int16 pair sum would
    saturate: :func:`_probe_operands`); oneDNN also where a screen finds it running its
    reference code (:func:`_onednn_usable`). Not the paper's: which product runs changes time
    only, never a number."""
    w, wt, xs = _probe_operands(in_features, out_features, PROBE_ROWS)
    paths = {"int_mm": lambda x: torch._int_mm(x, wt)}
    onednn = _onednn_usable(w, wt, xs)
    if onednn is not None:
        paths["onednn"] = lambda x: _packed_product(x, *onednn)
    fbgemm = _fbgemm_exact(w, wt, xs)
    if fbgemm is not None:
        paths["fbgemm"] = lambda x: _fbgemm_product(x, fbgemm)
    threads = torch.get_num_threads()
    variant = u8s8_variant()
    u8s8 = None if variant is None else _exact_u8s8(w, wt, xs, variant)
    ours = {} if u8s8 is None else {"u8s8": lambda x: kernels.u8s8_product(x, *u8s8)}
    # each path timed once: on one thread where the process runs one (a decoding worker)
    one = _times({**paths, **ours}, xs, 1) if threads == 1 or ours else {}
    torch_times = ({n: t for n, t in one.items() if n != "u8s8"} if threads == 1
                   else _times(paths, xs, threads))
    return {"torch": torch_times, "one_thread": one}


def _winner(times: dict[str, tuple], i: int, base: str, margin: float = PLAN_MARGIN) -> str:
    """The fastest path of ``times`` at probe ``i``, unless it runs above ``margin`` of
    ``base``'s time there (then ``base``)."""
    best = min(times, key=lambda n: times[n][i])
    return best if times[best][i] < margin * times[base][i] else base


#: the product paths of an int8 map: ``torch._int_mm`` over the weight as stored, oneDNN's
#: and FBGEMM's int8 linear and aiayn's u8 x s8 kernel over a weight packed once. All give
#: the same exact sums, so which runs changes time, never a number.
PRODUCT_PATHS = ("int_mm", "onednn", "fbgemm", "u8s8")
#: the environment variable that forces one product path for every map and row count
FORCE_PRODUCT = "AIAYN_INT8_PRODUCT"
_EVERY = 1 << 62  # "at every row count" in a plan


def forced_product() -> str | None:
    """``AIAYN_INT8_PRODUCT``'s path (one of :data:`PRODUCT_PATHS`), or None where unset.

    Raises:
        ConfigError: a value that names no path.
    """
    return forced_choice(FORCE_PRODUCT, PRODUCT_PATHS, "an int8 product path")


def _forced_plan(path: str, in_features: int, out_features: int) -> tuple | None:
    """The plan of a map under ``AIAYN_INT8_PRODUCT=path``: that path at every row count,
    once its sums are checked exact on this shape's probe inputs.

    Raises:
        ConfigError: the path cannot run here (its op or variant is missing) or is not
            exact here (one line naming the variable, the path and the shape).
    """
    if path == "int_mm":
        return None
    w, wt, xs = _probe_operands(in_features, out_features, PROBE_ROWS)
    where = f"{FORCE_PRODUCT}={path} ({in_features} x {out_features} weight)"
    if path == "u8s8":
        variant = u8s8_variant()
        if variant is None:
            raise ConfigError(f"{where}: no variant of aiayn's u8s8 kernel runs here "
                              "(numba missing, off x86-64, or no AVX2)")
        if _exact_u8s8(w, wt, xs, variant) is None:
            raise ConfigError(f"{where}: the u8s8 kernel does not give exact sums here")
        return ((_EVERY, path),)
    try:
        packed = _PACK[path](w)
        product = _packed_product if path == "onednn" else _fbgemm_product
        args = packed if path == "onednn" else (packed,)
        exact = all(torch.equal(product(x, *args), torch._int_mm(x, wt).float()) for x in xs)
    except (AttributeError, RuntimeError) as error:
        raise ConfigError(f"{where}: this torch cannot run it ({error})") from None
    if not exact:
        raise ConfigError(f"{where}: its sums are not exact on this CPU")
    return ((_EVERY, path),)


def weight_packing(in_features: int, out_features: int) -> tuple | None:
    """How an int8 map of this shape runs its product here: a plan ``((rows, path), ...)``,
    row limits ascending, each product taking the first path whose limit its row count does
    not exceed (aiayn's "u8s8" kernel only on one torch thread: on more, the next entry,
    which holds torch's best path at those rows); or None (``torch._int_mm`` over the weight
    as stored, at every row count).

    By measurement (:func:`product_times`): at each row count of :data:`PROBE_ROWS`, torch's
    fastest path (a packed one only where it takes at most :data:`PLAN_MARGIN` of
    ``torch._int_mm``'s time), and aiayn's kernel where it takes at most that share of torch's
    best on one thread; a row count between two probes takes the larger one's path, one above
    them all the largest's. So every path that wins at some row count is kept, wherever it
    wins: on the simulated AVX2 class, ``base``'s 512 x 8,003 output map ran 128 rows in 6.8
    ms with aiayn's kernel against 11.7 with ``torch._int_mm``, level at 32 rows
    (docs/benchmarks.md). ``AIAYN_INT8_PRODUCT`` forces one path at every row count
    (:func:`forced_product`). All paths give the same exact sums.

    Raises:
        ConfigError: ``AIAYN_INT8_PRODUCT`` names no path, or one that cannot run here.
    """
    forced = forced_product()
    if forced is not None:
        return _forced_plan(forced, in_features, out_features)
    times = product_times(in_features, out_features)
    torch_paths = times["torch"]
    one = times["one_thread"]
    one_torch = {n: t for n, t in one.items() if n != "u8s8"}
    choices = []  # per probe: (path, torch's path on more threads where path is u8s8)
    for i in range(len(PROBE_ROWS)):
        best = _winner(torch_paths, i, "int_mm")
        rival = _winner(one_torch, i, "int_mm") if "u8s8" in one else None
        if rival is not None and one["u8s8"][i] < PLAN_MARGIN * one[rival][i]:
            choices.append(("u8s8", best))
        else:
            choices.append((best, None))
    plan: list[tuple[int, str]] = []
    for i, (path, more_threads) in enumerate(choices):
        if i + 1 < len(choices) and choices[i + 1] == (path, more_threads):
            continue  # the next probe's rows take it too
        rows = PROBE_ROWS[i] if i + 1 < len(choices) else _EVERY
        plan.append((rows, path))
        if more_threads is not None:
            plan.append((rows, more_threads))
    # a fallback entry the next entry's path repeats (or int_mm at the end) says nothing
    plan = [entry for j, entry in enumerate(plan)
            if not (j and plan[j - 1][0] == entry[0] and plan[j - 1][1] == "u8s8"
                    and (plan[j + 1][1] == entry[1] if j + 1 < len(plan)
                         else entry[1] == "int_mm"))]
    return None if plan == [(_EVERY, "int_mm")] else tuple(plan)


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) every kernel an int8 decode runs, now
    rather than at first use: the kernel families (:func:`aiayn.model.kernels.warm_up`) and
    aiayn's u8 x s8 product in this machine's variant (through one map's product plan,
    :func:`weight_packing`). For a container image built ahead of its first request, or a
    test run whose workers should load the kernels rather than each compile them. Nothing to
    do where numba is missing or ``AIAYN_NO_KERNELS=1``; a family or product that fails to
    compile is left to torch with one warning, as at first use. Not the paper's: an engine
    detail (numba compiles each kernel per argument types, about 50 CPU-s for all of them
    on the bf16 class, docs/kernels.md#compiling-ahead).

    Raises:
        ConfigError: ``AIAYN_INT8_PRODUCT`` names no path, or one that cannot run here
            (:func:`forced_product`, :func:`weight_packing`).
    """
    if not kernels.AVAILABLE:
        return
    kernels.warm_up()
    weight_packing(256, 256)


def describe_plan(plan: tuple | None) -> str:
    """A plan of :func:`weight_packing` in words, e.g. "u8s8 (vnni) up to 32 rows (fbgemm on
    more threads), int_mm up to 128 rows, u8s8 (vnni) above"."""
    if plan is None:
        return "int_mm at every row count"
    words: list[str] = []
    for j, (rows, path) in enumerate(plan):
        if j and plan[j - 1] == (rows, "u8s8"):
            words[-1] += f" ({path} on more threads)"
            continue
        name = f"u8s8 ({u8s8_variant()})" if path == "u8s8" else path
        words.append(f"{name} at every row count" if rows >= _EVERY and not words
                     else f"{name} above" if rows >= _EVERY else f"{name} up to {rows} rows")
    return ", ".join(words)


# packing -> its packer
_PACK = {"onednn": _pack, "fbgemm": _pack_fbgemm, "u8s8": _pack_u8s8}


# the packed path is dropped at once where one call of it is this many times _int_mm's
PACKED_SCREEN_SLOWER = 4.0


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 weights (per output row) and int8 activations (per input
    row, chosen at each call); x (..., in_features) float -> y (..., out_features) float32.

    Args:
        weight: float (out_features, in_features).
        bias: float (out_features,) or None.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        w8, scale = _quantize_rows(w, weight_levels())
        self.out_features, self.in_features = w.shape
        # (out, in) values; stored column-major where that runs faster (weight_columns_first)
        if weight_columns_first(self.in_features, self.out_features):
            w8 = w8.t().contiguous().t()
        self.register_buffer("weight_int8", w8)
        self.register_buffer("weight_scale", scale.squeeze(1))  # (out,)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.relu = False  # max(0, y) after the bias (the FFN's first map: quantize_int8)
        self._numpy = None  # (_arrays)
        self._set_packing(weight_packing(self.in_features, self.out_features)
                          if w8.device.type == "cpu" else None)

    def _set_packing(self, plan, rows: int | None = None) -> None:
        """Run the products by ``plan``: :func:`weight_packing`'s ``((rows, path), ...)``, None
        (``torch._int_mm`` at every row count), or one packed path's name ("onednn",
        "fbgemm", "u8s8") for products of up to ``rows`` rows (default: every row count),
        ``torch._int_mm`` above. The weight is packed now for every path of the plan."""
        if isinstance(plan, str):
            plan = ((_EVERY, plan),) if rows is None else ((rows, plan), (_EVERY, "int_mm"))
        self.plan = plan
        # under AIAYN_INT8_PRODUCT=u8s8 the kernel runs at any torch thread count
        self._u8s8_any_threads = plan is not None and forced_product() == "u8s8"
        self._packs = {path: _PACK[path](self.weight_int8) for _, path in plan or ()
                       if path != "int_mm"}
        kernels.log.info("int8 map %d -> %d: %s", self.in_features, self.out_features,
                         describe_plan(plan))

    @property
    def packing(self) -> str | None:
        """The packed paths of :attr:`plan`, joined by "+" ("u8s8+fbgemm"), or None."""
        paths = [path for _, path in self.plan or () if path != "int_mm"]
        return "+".join(paths) if paths else None

    @property
    def packed(self) -> bool:
        """Whether some products run over a weight packed once (:attr:`packing` is set)."""
        return self.packing is not None

    def __getstate__(self) -> dict:
        # a packed weight is an opaque oneDNN tensor or FBGEMM object, which neither copies
        # nor pickles: a copy packs its own at its first product (aiayn's u8s8 arrays too)
        state = self.__dict__.copy()
        state["_packs"] = {}
        state["_numpy"] = None  # views of this module's buffers, not of the copy's
        return state

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 copy of ``linear`` (weight (out, in), bias (out,) or None)."""
        return cls(linear.weight, linear.bias)

    def rows(self, index: Tensor, *, pack: bool = False) -> Int8Linear:
        """The map onto output rows ``index`` (long (k,)) only: the same int8 rows and scales,
        so each output is this map's bit for bit (a vocabulary shortlist's output layer).
        Its product runs in ``torch._int_mm`` (packing costs milliseconds: a shortlist makes a
        map per batch), unless ``pack``, where :func:`weight_packing` says so for its shape (a
        map made once)."""
        out = Int8Linear.__new__(Int8Linear)
        nn.Module.__init__(out)
        w8 = self.weight_int8[index]
        out.out_features, out.in_features = w8.shape
        if not self.weight_int8.is_contiguous():  # this map's layout (not re-measured)
            w8 = w8.t().contiguous().t()
        out.register_buffer("weight_int8", w8)
        out.register_buffer("weight_scale", self.weight_scale[index])
        out.register_buffer("bias", None if self.bias is None else self.bias[index])
        out.relu = self.relu
        out._numpy = None
        out._set_packing(weight_packing(out.in_features, out.out_features)
                         if pack and w8.device.type == "cpu" else None)
        return out

    def _product(self, x8: Tensor) -> Tensor:
        """The exact sums ``x8 @ W8^T`` (rows, out): int32, or float32 from oneDNN and FBGEMM,
        by the first path of :attr:`plan` whose row limit holds ``x8``'s rows (aiayn's u8s8
        kernel only on one torch thread, as measured: else the next path)."""
        plan = self.plan
        if plan is not None and x8.device.type == "cpu":
            m = x8.shape[0]
            for rows, kind in plan:
                if m <= rows and (kind != "u8s8" or self._u8s8_any_threads
                                  or torch.get_num_threads() == 1):
                    break
            else:  # the u8s8 kernel's rows at more than one thread
                kind = "int_mm"
            if kind != "int_mm":
                packed = self._packs.get(kind)
                if packed is None:  # a copy's (__getstate__)
                    packed = self._packs[kind] = _PACK[kind](self.weight_int8)
                if kind == "u8s8":
                    return kernels.u8s8_product(x8, *packed)  # (rows, out) int32, exact
                if kind == "fbgemm":
                    return _fbgemm_product(x8, packed)  # (rows, out) float32, exact sums
                return _packed_product(x8, *packed)  # oneDNN: (rows, out) float32, exact sums
        # (the buffer from its dict: nn.Module's __getattr__ is a Python call, every product)
        return torch._int_mm(x8, self._buffers["weight_int8"].t())  # (rows, out) int32, exact

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """The scales and bias as numpy arrays for :func:`aiayn.model.kernels.int8_linear`,
        made once and remade only when the buffers are replaced (``.to``, a copy): converting
        them at every call cost about as much as the rescaling pass at decoding's sizes."""
        buffers = self._buffers
        scale, bias = buffers["weight_scale"], buffers["bias"]
        cached = self._numpy
        if cached is None or cached[0] is not scale or cached[1] is not bias:
            b = scale if bias is None else bias
            cached = self._numpy = (scale, bias, scale.numpy(), b.numpy())
        return cached[2], cached[3], bias is not None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        if kernels.usable(rows, kind="int8"):  # 2 + 1 passes instead of 5 + 4 (+ relu)
            y = kernels.int8_linear(rows, 127, self._product, *self._arrays(), self.relu)
            return y.view(*shape[:-1], self.out_features)
        x8, x_scale = _quantize_rows(rows)  # torch ops: 5 + 4 passes (+ relu)
        y = self._product(x8).float().mul_(x_scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        if self.relu:
            y.clamp_(min=0.0)
        return y.view(*shape[:-1], self.out_features)

    def log_softmax(self, x: Tensor) -> Tensor:
        """``kernels.log_softmax(self(x))`` for x (..., in_features) float: float32 (...,
        out_features), log-probabilities. Where the int8 kernels run, in one pass from the
        product's sums (:func:`aiayn.model.kernels.rescale_log_softmax`): the logits are never
        written out, and the numbers are :func:`aiayn.model.kernels.log_softmax`'s of the
        same logits (torch's within float rounding: its exponentials are a polynomial's). The
        output layer of decoding (:class:`aiayn.model.engine.Int8OutputLayer`)."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        if kernels.usable(rows, kind="softmax") and kernels.usable(rows, kind="int8"):
            y = kernels.rescale_log_softmax(rows, 127, self._product, *self._arrays())
            if y is not None:
                return y.view(*shape[:-1], self.out_features)
        return kernels.log_softmax(self(rows)).view(*shape[:-1], self.out_features)

    def greedy(self, x: Tensor, eos: int, eos_banned: np.ndarray, eos_only: np.ndarray
               ) -> tuple[Tensor, Tensor] | None:
        """Greedy search's choice over this output layer for x (n, in_features) float: (column
        long (n,), its log-probability float32 (n,)), the numbers :meth:`log_softmax` and the
        search's length rules give, in one kernel that writes no row of log-probabilities
        (:func:`aiayn.model.kernels.rescale_greedy`, which says what ``eos``, ``eos_banned``
        and ``eos_only`` rule out). None where that kernel does not run (the caller then
        takes :meth:`log_softmax`)."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        if not (kernels.usable(rows, kind="greedy") and kernels.usable(rows, kind="softmax")
                and kernels.usable(rows, kind="int8")):
            return None
        return kernels.rescale_greedy(rows, 127, self._product, *self._arrays(), eos,
                                      eos_banned, eos_only)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 weights and activations"
                + (f", packed weight ({self.packing})" if self.packed else ""))


class KernelLayerNorm(nn.LayerNorm):
    """An int8 copy's LayerNorm (§3.1): :func:`aiayn.model.kernels.layer_norm` where the
    "norm" kernels run (float32 on the CPU, no gradient), torch's elsewhere; x (..., d) ->
    (..., d). The module path and the fused passes (:mod:`aiayn.model.fused`) both call the
    kernel, so they keep giving the same numbers."""

    @classmethod
    def from_norm(cls, norm: nn.LayerNorm) -> KernelLayerNorm:
        """A copy of ``norm`` (its weight and bias (d,), its eps), frozen: no gradient."""
        out = cls(norm.normalized_shape, eps=norm.eps, device=norm.weight.device)
        with torch.no_grad():
            out.weight.copy_(norm.weight)
            out.bias.copy_(norm.bias)
        out.requires_grad_(False)
        return out

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.float32]:
        """The weight, bias and eps as the kernels take them, made once and remade only when
        the parameters are replaced."""
        params = self._parameters  # not nn.Module's __getattr__: this runs every sub-layer
        weight, bias = params["weight"], params["bias"]
        cached = getattr(self, "_numpy", None)
        if cached is None or cached[0] is not weight or cached[1] is not bias:
            cached = self._numpy = (weight, bias, weight.detach().numpy(),
                                    bias.detach().numpy(), np.float32(self.eps))
        return cached[2], cached[3], cached[4]

    def forward(self, x: Tensor) -> Tensor:
        if kernels.usable(x, kind="norm") and len(self.normalized_shape) == 1:
            return kernels.layer_norm(x, *self.arrays())
        return super().forward(x)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_numpy"] = None  # views of this module's parameters, not of a copy's
        return state


def _replace_layer_norms(module: nn.Module) -> None:
    for name, child in module.named_children():
        if type(child) is nn.LayerNorm and child.elementwise_affine and child.bias is not None:
            setattr(module, name, KernelLayerNorm.from_norm(child))
        else:
            _replace_layer_norms(child)


def _fuse_self_attention(stack: nn.ModuleList) -> list[Int8Linear]:
    """For every self-attention of ``stack``'s layers, one int8 map for W^Q, W^K and W^V:
    their rows stacked, each keeping its own scale, so the outputs are the three maps' bit
    for bit, and the shared input is quantized once. The three maps leave the layer (the
    engine projects with the returned ones, :class:`aiayn.model.engine.Int8Transformer`)."""
    fused = []
    for layer in stack:
        attn = layer.self_attn
        maps = (attn.W_q, attn.W_k, attn.W_v)
        bias = None if any(m.bias is None for m in maps) else torch.cat([m.bias for m in maps])
        fused.append(Int8Linear(torch.cat([m.weight for m in maps]), bias))
        del attn.W_q, attn.W_k, attn.W_v
    return fused


def _replace_linears(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear.from_linear(child))
        else:
            _replace_linears(child)


def quantize_int8(model: nn.Module, *, fuse_qkv: bool = True,
                  step_fixed_ids: int | None = None, kv_bf16: bool = True) -> Int8Transformer:
    """An int8 inference copy of a :class:`~aiayn.model.Transformer` (see the module
    docstring): an :class:`~aiayn.model.engine.Int8Transformer`, in eval mode, on the model's
    device. Decode with it as with the model (the searches, ensembles, parsing, the
    Translator and the server take either).

    The embeddings stay float32; the output layer, tied to the target embedding (§3.4), gets
    an int8 copy of that matrix, with ``final_logits_bias`` (Marian) as its bias: a ``-inf``
    placeholder bias keeps its zero probability. ``model`` itself, and its training mode, are
    left as they are. With ``fuse_qkv`` (the default) each self-attention's W^Q, W^K and W^V
    become one map (same outputs, one quantization of their shared input), and the stacks run
    in fused passes (:mod:`aiayn.model.fused`) where they can. With ``step_fixed_ids`` (the
    searches' special ids: PAD, BOS and EOS are ids 0-2), a model whose output layer can
    produce only some tokens also gets decoding's own int8 map onto those (its
    ``compact_token_ids``: :meth:`~aiayn.model.Transformer.output_token_ids`): the same
    logits for them, less work. With ``kv_bf16`` (the default) its decoder caches hold the
    self-attention keys and values, and the encoder's for encoder-decoder attention, in
    bfloat16 where the CPU kernels read them: a step reads half the bytes, and every path
    (fused or the layers' own) reads the same rounded keys.
    """
    q = copy.deepcopy(model).eval()
    for p in q.parameters():
        p.requires_grad_(False)
    qkv = None
    if fuse_qkv:
        qkv = (_fuse_self_attention(q.encoder), _fuse_self_attention(q.decoder))
    for stack in (q.encoder, q.decoder):
        _replace_linears(stack)
    _replace_layer_norms(q)
    for ffn in q.modules():  # the relu moves into W_1's rescaling pass
        if isinstance(ffn, PositionwiseFeedForward) and ffn.activation is F.relu:
            ffn.W_1.relu = True
            ffn.activation = _identity
    output = Int8Linear(q.tgt_embed.weight, q.final_logits_bias)
    ids = None if step_fixed_ids is None else q.output_token_ids(step_fixed_ids)
    compact = None if ids is None else (output.rows(ids, pack=True), ids)  # one quantization
    fused_step = fused_encoder = None
    if qkv is not None and _fusable(q, q.decoder):
        fused_step = FusedInt8Step(q, qkv[1])
    if qkv is not None and _fusable(q, q.encoder):
        fused_encoder = FusedInt8Encoder(q, qkv[0])
    return Int8Transformer(q, qkv=qkv, cache_dtype=torch.bfloat16 if kv_bf16 else None,
                           output=output, compact=compact, fused_step=fused_step,
                           fused_encoder=fused_encoder).eval()


def _identity(x: Tensor) -> Tensor:
    return x


def _fusable(q: nn.Module, stack: nn.ModuleList) -> bool:
    """Whether :class:`~aiayn.model.fused.FusedInt8Step` runs ``q``'s decoder (or
    :class:`~aiayn.model.fused.FusedInt8Encoder` its encoder), ``stack``: every map int8
    (W^Q, W^K and W^V fused by the caller), the FFN's relu inside W_1, and no attention
    window."""
    if q.config.attention_window is not None:
        return False
    for layer in stack:
        maps = (layer.self_attn.W_o, layer.ffn.W_1, layer.ffn.W_2)
        if isinstance(layer, DecoderLayer):
            maps += (layer.cross_attn.W_q, layer.cross_attn.W_o)
        if (not all(isinstance(m, Int8Linear) for m in maps) or not layer.ffn.W_1.relu
                or layer.ffn.activation is not _identity):
            return False
    return True


__all__ = ["Int8Linear", "KernelLayerNorm", "product_times", "quantize_int8",
           "weight_columns_first", "weight_packing"]
