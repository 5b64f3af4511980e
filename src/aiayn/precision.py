"""Which floating-point precision a run uses, chosen by measuring the machine at hand.

``train.precision`` and the decoding commands' ``--precision`` take:

- ``fp32``: float32 everywhere (the reference);
- ``bf16``: ``torch.autocast(dtype=bfloat16)``: matrix products in bf16, float32 weights;
- ``bf16-weights`` (training only): forward and backward on a bf16 copy of the weights, Adam on
  the float32 masters (``aiayn.training.mixed``);
- ``int8`` (decoding only, on a CPU): an int8 copy of the model
  (:func:`aiayn.model.quantize.quantize_int8`: int8 weights, per-row int8 activations);
- ``fp16`` (training only): ``torch.autocast(dtype=float16)`` with a dynamic loss scale
  (``torch.amp.GradScaler``, as fairseq's ``--fp16`` and Sockeye's ``--amp``);
- ``auto``: a reduced precision only where it is faster here. On a GPU it is decided by the
  compute capability alone (:func:`gpu_precision`): bf16 from 8.0 (Ampere), where bf16 has
  tensor cores; fp16 with a loss scale below it, for training, where fp16 is fast (tensor
  cores from 7.0, Volta); else fp32. Not ``torch.cuda.is_bf16_supported()``, which since
  torch 2.4 is true on V100, T4 and P100 too, where bf16 is emulated and slow. float32
  matrix products run in TF32 from 8.0 unless ``train.tf32`` is false.
  On a CPU bf16 is decided by :func:`probe_cpu`, which times the
  model's own matrix-product shapes in
  fp32 and in bf16 for a few tens of milliseconds: CPUs with native bf16 (AVX-512 BF16, AMX)
  run those products 4-5x faster than fp32, CPUs without it (AVX2 only: Zen 3, most laptops)
  emulate them 5-45x slower (45x for a large product on a real Zen 3, 10x for ``nn.Linear`` under
  autocast there), so the choice is never close and never depends on a CPU's name. For
  decoding, :func:`probe_int8_step` times a few cached decoder steps of the model's shape in
  fp32 and on its int8 copy, and ``auto`` takes int8 where the step runs
  :data:`INT8_MIN_SPEEDUP` times as fast (int8 is batch-invariant), else bf16 where its
  products beat fp32's by :data:`BF16_MIN_SPEEDUP`, else fp32.

Mixed precision is not in the paper (§5.2 trained in float32 on P100 GPUs).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from aiayn.config import DECODE_PRECISIONS, TRAIN_PRECISIONS
from aiayn.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from aiayn.config import ModelConfig

# bf16 must beat fp32 by this factor to be chosen: its casts, and LayerNorm and softmax around
# the products, cost time the product probe does not see, and bf16 rounds more
BF16_MIN_SPEEDUP = 1.25
# an int8 decoder step must beat fp32's by this factor to be chosen: the step probe sees the
# whole step, so this is a margin for its noise (a few calls of random weights) and for the
# outputs int8 changes, not for unseen work
INT8_MIN_SPEEDUP = 1.25
# the screen settles it alone only when bf16 is this many times slower: emulated bf16 (4.6x
# slower than fp32 at the screen's shape on the simulated AVX2 class); native bf16 can lose
# at 32 rows yet win at a batch's (`tiny` on the bf16 class, one thread: 2.2x slower at 32
# rows, 3.3x faster at 512)
SCREEN_EMULATED = 3.0
PROBE_ROWS = 256  # rows of the probe's products: tokens of a batch, or beams x sentences
SCREEN_ROWS = 32  # rows of the first, smaller probe that settles it where bf16 is emulated
# the decoding probe (:func:`probe_int8_step`): 16 sentences of 16 source tokens at beam 4, 8
# steps a call, over an output layer of at most 2,048 tokens (the rate, not the layer)
STEP_PROBE_SENTENCES, STEP_PROBE_BEAM, STEP_PROBE_SOURCE, STEP_PROBE_STEPS = 16, 4, 16, 8
STEP_PROBE_VOCAB = 2048
# GPU compute capabilities (major, minor), from NVIDIA's CUDA programming guide (arithmetic
# instructions' throughput): bf16 and TF32 tensor cores from 8.0 (Ampere); below it torch runs
# bf16 by emulation. fp16 tensor cores from 7.0 (Volta); before Volta fp16 runs at twice
# fp32's rate only on 5.3, 6.0 (P100) and 6.2, at 1/64 of it on 6.1 (P40, GTX 10x0)
BF16_MIN_CAPABILITY = (8, 0)
TF32_MIN_CAPABILITY = (8, 0)
FP16_MIN_CAPABILITY = (7, 0)
FAST_FP16_BEFORE_VOLTA = ((5, 3), (6, 0), (6, 2))


@dataclass(frozen=True)
class Precision:
    """A resolved precision and why it was chosen.

    Attributes:
        requested: what the config or command asked for (one of :data:`TRAIN_PRECISIONS`).
        chosen: ``fp32``, ``bf16`` or ``bf16-weights``.
        reason: one line saying why, for logs.
        fp32_gflops, bf16_gflops: the probe's rates on the model's product shapes, GFLOP/s
            on the process's current threads (None when no probe ran).
        int8_speedup: for decoding's ``auto``, how many times as fast a cached decoder step
            runs on the model's int8 copy as in fp32 (:func:`probe_int8_step`).
        tf32: whether float32 matrix products run in TF32 (a GPU of compute capability 8.0
            or more, ``train.tf32``); set for the process by
            :func:`aiayn.devices.set_tf32`.
        capability: a GPU's compute capability, ``"8.6"`` (None on a CPU).
    """

    requested: str
    chosen: str
    reason: str
    fp32_gflops: float | None = None
    bf16_gflops: float | None = None
    int8_speedup: float | None = None
    tf32: bool = False
    capability: str | None = None

    @property
    def uses_bf16(self) -> bool:
        """Whether any product runs in bf16: under autocast (``bf16``) or on bf16 weights (a
        float32 master of a ``bf16-weights`` run, such as validation's, runs under autocast)."""
        return self.chosen in ("bf16", "bf16-weights")

    @property
    def uses_int8(self) -> bool:
        """Whether decoding runs on an int8 copy of the model
        (:func:`aiayn.model.quantize.quantize_int8`)."""
        return self.chosen == "int8"

    @property
    def bf16_weights(self) -> bool:
        """Whether training runs forward and backward on a bf16 copy of the weights."""
        return self.chosen == "bf16-weights"

    @property
    def loss_scaling(self) -> bool:
        """Whether training scales the loss (``fp16``: its gradients would underflow
        float16 without it; ``torch.amp.GradScaler``)."""
        return self.chosen == "fp16"

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values, and ``loss_scaling``, as ``metrics.jsonl`` and
        ``results.json`` hold them."""
        return {**asdict(self), "loss_scaling": self.loss_scaling}

    def describe(self) -> str:
        """``precision fp32 (auto: ...)``: the line training and decoding print at start."""
        return f"precision {self.chosen} ({self.requested}: {self.reason})"


def product_shapes(model: ModelConfig, rows: int = PROBE_ROWS) -> list[tuple[int, int, int]]:
    """The (rows, in, out) shapes of the model's linear maps that dominate its time: the
    feed-forward pair (§3.3), an attention projection (§3.2.2) and the output layer (§3.4, at
    most 2,048 of its columns: the rate, not the whole layer, is what is measured)."""
    d, f = model.d_model, model.d_ff
    return [(rows, d, f), (rows, f, d), (rows, d, d),
            (rows, d, min(model.target_vocab_size, 2048))]


def _seconds_per_call(fn: Any, budget_s: float, max_calls: int = 10,
                      min_calls: int = 3) -> float:
    """The fastest of at least ``min_calls`` timed calls (after an untimed one that builds
    the kernel: oneDNN primitive creation, ~ms): another process that wakes for a few
    milliseconds (a second training starting beside this one) slows some calls, never
    speeds one up."""
    return _fastest_interleaved([fn], budget_s, max_calls, min_calls)[0]


def _rates(shapes: list[tuple[int, int, int]], budget_s: float) -> tuple[float, float]:
    """(fp32, bf16) GFLOP/s over ``shapes``, the two dtypes' calls interleaved, each the
    fastest of its calls: a process that holds a core for a while (a test run, a second
    training starting) slows calls of both alike, so it cannot make one dtype look tens of
    times faster than the other (it once made fp32 look 1.6 GFLOP/s against bf16's 112)."""
    import torch
    import torch.nn.functional as F

    flops = sum(2.0 * m * k * n for m, k, n in shapes)
    runs = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        pairs = [(torch.randn(m, k, generator=gen).to(dtype),
                  torch.randn(n, k, generator=gen).to(dtype)) for m, k, n in shapes]

        def run(pairs: list = pairs) -> None:
            for x, w in pairs:
                F.linear(x, w)

        runs.append(run)
    seconds = _fastest_interleaved(runs, budget_s)
    return flops / seconds[0] / 1e9, flops / seconds[1] / 1e9


def _fastest_interleaved(fns: list, budget_s: float, max_rounds: int = 10,
                         min_rounds: int = 3) -> list[float]:
    """Each of ``fns``' fastest call, the calls interleaved round by round, as
    :func:`_seconds_per_call` times one (a first untimed call each builds its kernel)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    rounds, t_start = 0, time.perf_counter()
    while True:
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
        rounds += 1
        if rounds >= max_rounds or (rounds >= min_rounds
                                    and time.perf_counter() - t_start >= budget_s * len(fns)):
            return best


@functools.cache
def _probe(shapes: tuple[tuple[int, int, int], ...], threads: int) -> tuple[float, float]:
    # a screen of the first shape on a few rows: where bf16 is emulated (2-20 GFLOP/s against
    # 50-100 in fp32) the full shapes would take a second, and the screen alone decides
    screen = [(SCREEN_ROWS, k, n) for _, k, n in shapes[:1]]
    fp32, bf16 = _rates(screen, budget_s=0.002)
    if bf16 * SCREEN_EMULATED < fp32:
        return fp32, bf16
    return _rates(list(shapes), budget_s=0.005)


@functools.cache
def _probe_int8_step(model: ModelConfig, threads: int) -> float:
    import torch

    from aiayn.model import Transformer, kernels
    from aiayn.model.engine import as_engine
    from aiayn.model.quantize import quantize_int8

    cfg = dataclasses.replace(model, vocab_size=min(model.target_vocab_size, STEP_PROBE_VOCAB),
                              tgt_vocab_size=None, output_vocab="all",
                              attention_window=None)
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(0)
        fp32 = Transformer(cfg).eval()
    int8 = quantize_int8(fp32)
    kernels.warm_up()  # compiled once per machine (numba's on-disk cache), loaded after
    gen = torch.Generator().manual_seed(0)
    B, K, S, T = STEP_PROBE_SENTENCES, STEP_PROBE_BEAM, STEP_PROBE_SOURCE, STEP_PROBE_STEPS
    src = torch.randint(3, cfg.vocab_size, (B, S), generator=gen)
    tokens = torch.randint(3, cfg.vocab_size, (T, B * K, 1), generator=gen)
    runs = []
    with torch.no_grad():
        for m in (as_engine(fp32), int8):  # each as decoding runs it
            memory, mask = m.encode(src)
            memory, mask = memory.repeat_interleave(K, 0), mask.repeat_interleave(K, 0)

            def run(m=m, memory=memory, mask=mask) -> None:
                cache = m.start_cache(memory, mask, capacity=T + 1)
                for t in range(T):
                    m.decode_step(tokens[t], cache)

            runs.append(run)
        seconds = _fastest_interleaved(runs, budget_s=0.05)
    return seconds[0] / seconds[1]


def probe_int8_step(model: ModelConfig) -> float:
    """How many times as fast a cached decoder step (§3; the searches' inner call, §6.1) of
    ``model``'s shape runs on its int8 copy (:func:`~aiayn.model.quantize.quantize_int8`) as
    in fp32, on this CPU and the process's current threads: both decode
    :data:`STEP_PROBE_STEPS` steps for 64 rows (16 sentences at beam 4) of random weights,
    with ``model``'s layers and widths and an output layer of at most
    :data:`STEP_PROBE_VOCAB` tokens, and the fastest of a few calls counts. The whole step,
    not its products alone: the int8 path also runs fewer, fused calls around its products
    (:class:`~aiayn.model.fused.FusedInt8Step`), which a product probe does not see (on the
    simulated AVX2 class int8 products alone were 1.24x fp32's, whole decodes 1.6x). Kept
    for the process's life; 0.5 s (``multi30k``) to 3 s (``base``) on one thread, about half
    of it building and quantizing the random model, plus the decoding kernels' one-time
    compile on a machine that never ran them.

    Returns:
        fp32 seconds a step ÷ int8 seconds a step (> 1: int8 is faster).
    """
    import torch

    return _probe_int8_step(model, torch.get_num_threads())


def probe_cpu(model: ModelConfig, rows: int = PROBE_ROWS) -> tuple[float, float]:
    """(fp32, bf16) GFLOP/s of ``model``'s product shapes (:func:`product_shapes`) on this CPU
    and the process's current thread count. Takes 5-60 ms; the result is kept for the
    process's life (one probe per shape and thread count)."""
    import torch

    return _probe(tuple(product_shapes(model, rows)), torch.get_num_threads())


def gpu_precision(requested: str, capability: tuple[int, int], *, training: bool = True,
                  tf32: bool = True, name: str = "the GPU") -> Precision:
    """The precision on a GPU of compute ``capability`` (major, minor), a pure function of it:

    - ``auto``: ``bf16`` from :data:`BF16_MIN_CAPABILITY` (8.0, Ampere); below it, for
      training, ``fp16`` with a loss scale where fp16 is fast (:data:`FP16_MIN_CAPABILITY`,
      7.0, or one of :data:`FAST_FP16_BEFORE_VOLTA`), else ``fp32``; for decoding ``fp32``.
    - an explicit precision is kept, with a warning in ``reason`` where the GPU lacks it
      (bf16 below 8.0 is emulated; fp16 on 6.1 runs at 1/64 of fp32's rate).
    - ``tf32``: float32 matrix products in TF32 where training asks for it (``train.tf32``)
      and the GPU has it (:data:`TF32_MIN_CAPABILITY`), whatever the precision (under
      autocast few products stay in float32).

    Args:
        requested: one of :data:`~aiayn.config.TRAIN_PRECISIONS` (training) or
            :data:`~aiayn.config.DECODE_PRECISIONS`.
        capability: ``torch.cuda.get_device_capability``'s (major, minor).
        training: a training run (fp16 and TF32 are training's).
        tf32: ``train.tf32``.
        name: the GPU's name, for ``reason``.

    Raises:
        ValueError: an unknown precision, or one that is not the kind's (``fp16`` or
            ``bf16-weights`` for decoding, ``int8`` for training).
        ConfigError: ``int8`` (a CPU decoding path).
    """
    _check_requested(requested, training)
    if requested == "int8":
        raise ConfigError("precision int8 is a CPU decoding path; on CUDA use auto, bf16 "
                          "or fp32")
    cap = tuple(capability)
    where = f"{name} (compute capability {cap[0]}.{cap[1]})"
    has_bf16 = cap >= BF16_MIN_CAPABILITY
    fast_fp16 = cap >= FP16_MIN_CAPABILITY or cap in FAST_FP16_BEFORE_VOLTA
    if requested == "auto":
        if has_bf16:
            chosen, reason = "bf16", f"{where} has bf16 tensor cores"
        elif training and fast_fp16:
            chosen, reason = "fp16", (f"{where} has no bf16 tensor cores (bf16 would be "
                                      "emulated): fp16 with a dynamic loss scale")
        else:
            chosen = "fp32"
            reason = f"{where} has no bf16 tensor cores" + ("" if fast_fp16 or not training
                                                            else " and no fast fp16")
    else:
        chosen, reason = requested, "as asked"
        if requested in ("bf16", "bf16-weights") and not has_bf16:
            reason = (f"as asked, but {where} has no bf16 tensor cores: torch emulates bf16 "
                      "there, slowly (auto takes fp16 with a loss scale)")
        elif requested == "fp16" and not fast_fp16:
            reason = f"as asked, but {where} runs fp16 slower than fp32"
        elif requested != "fp32":
            reason = f"as asked on {where}"
    if chosen == "fp16":
        reason += "; the loss scaled by torch.amp.GradScaler"
    use_tf32 = training and tf32 and cap >= TF32_MIN_CAPABILITY
    if use_tf32:
        reason += "; float32 matrix products in TF32 (train.tf32)"
    elif training and cap >= TF32_MIN_CAPABILITY:
        reason += "; float32 matrix products in full float32 (train.tf32 false)"
    return Precision(requested, chosen, reason, tf32=use_tf32,
                     capability=f"{cap[0]}.{cap[1]}")


def _check_requested(requested: str, training: bool) -> None:
    allowed = TRAIN_PRECISIONS if training else DECODE_PRECISIONS
    if requested not in allowed:
        raise ValueError(f"precision {requested!r}: expected one of {', '.join(allowed)}")


def choose_precision(requested: str, device: torch.device | str, model: ModelConfig, *,
                     training: bool = True, rows: int = PROBE_ROWS,
                     tf32: bool = True) -> Precision:
    """Resolve ``requested`` (``auto`` or an explicit precision) on ``device``.

    ``auto`` gives ``bf16-weights`` for training where bf16 is faster than fp32 by at least
    :data:`BF16_MIN_SPEEDUP` on ``model``'s product shapes, else ``fp32``. For decoding on a
    CPU it also times a decoder step in int8 and in fp32 (:func:`probe_int8_step`) and takes
    int8 where the step is :data:`INT8_MIN_SPEEDUP` times as fast, else bf16 where its
    products beat fp32's by :data:`BF16_MIN_SPEEDUP`, else fp32:
    int8 is batch-invariant and bf16 is not, and bf16 products timed alone overrate bf16
    decoding (docs/hardware.md). On CUDA the device's compute capability decides
    (:func:`gpu_precision`, with ``tf32``: ``train.tf32``). An explicit precision is kept,
    with a warning in ``reason`` when the probe finds bf16 slower on this CPU.

    Raises:
        ValueError: an unknown precision, ``bf16-weights`` or ``fp16`` for decoding, or
            ``int8`` for training.
        ConfigError: ``int8`` on CUDA (int8 decoding is a CPU path).
    """
    import torch

    _check_requested(requested, training)
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_precision(requested, torch.cuda.get_device_capability(device),
                             training=training, tf32=tf32,
                             name=torch.cuda.get_device_name(device))
    if requested in ("fp32", "int8"):
        return Precision(requested, requested, "as asked")  # no probe: nothing depends on it
    if requested == "fp16":  # few CPUs have fp16 products (AVX512-FP16, AMX-FP16): no probe
        return Precision(requested, requested, "as asked, on a CPU: float16 autocast with a "
                         "loss scale, for checking that path; bf16 or fp32 are the CPU's")
    fp32, bf16 = probe_cpu(model, rows)
    rates = f"bf16 {bf16:.1f} against fp32 {fp32:.1f} GFLOP/s on the model's products"
    faster = bf16 >= BF16_MIN_SPEEDUP * fp32
    if requested == "auto" and training:
        chosen = "bf16-weights" if faster else "fp32"
        return Precision(requested, chosen, rates, round(fp32, 1), round(bf16, 1))
    if requested == "auto":
        int8 = probe_int8_step(model)
        # int8 first wherever its step beats fp32's: its products are exact and row by row,
        # so it is batch-invariant, and the decoding kernels run around it; bf16 autocast is
        # neither, and the product probe overrates it (docs/hardware.md, "Precision: chosen
        # by the machine", has the measurement)
        chosen = ("int8" if int8 >= INT8_MIN_SPEEDUP else "bf16" if faster else "fp32")
        rates = (f"an int8 decoder step {int8:.2f}x as fast as fp32's; bf16 {bf16:.1f} and "
                 f"fp32 {fp32:.1f} GFLOP/s on the model's products")
        return Precision(requested, chosen, rates, round(fp32, 1), round(bf16, 1),
                         round(int8, 2))
    note = "as asked" if bf16 >= fp32 else \
        f"as asked, but this CPU runs bf16 {fp32 / bf16:.0f}x slower than fp32 (use auto)"
    return Precision(requested, requested, f"{note}; {rates}", round(fp32, 1), round(bf16, 1))


def resumed_precision(current: Precision, recorded: str | None, recorded_device: str | None,
                      device: torch.device | str) -> Precision:
    """The precision of a training run that resumes from a checkpoint: ``current`` is what
    this process resolved, ``recorded`` and ``recorded_device`` what the checkpoint's run used
    (its training state's ``precision`` and ``precision_device``; None in checkpoints written
    before they were kept).

    An ``auto`` run keeps the recorded precision, so that one run is trained in one precision
    whatever a probe measures on a busy machine (a row of Table 3 resumed beside another
    process's start once probed bf16 at a quarter of its rate and switched to fp32 for the
    rest of its budget). It takes ``current`` instead where the machine has changed: another
    device type, a CPU where the probe measures bf16 slower than fp32 (emulated bf16, 5-45x
    slower, :func:`probe_cpu`), or a GPU without bf16 tensor cores (compute capability under
    8.0) for a run recorded in bf16. An explicit precision is kept as asked. The TF32 setting
    is always ``current``'s (``train.tf32`` on this GPU)."""
    import torch

    if (current.requested != "auto" or recorded is None or recorded == current.chosen
            or recorded_device != torch.device(device).type):
        return current
    if recorded in ("bf16", "bf16-weights") and current.bf16_gflops is not None \
            and current.fp32_gflops is not None and current.bf16_gflops < current.fp32_gflops:
        return current
    if recorded in ("bf16", "bf16-weights") and current.capability is not None \
            and _capability(current.capability) < BF16_MIN_CAPABILITY:
        return current
    return dataclasses.replace(
        current, chosen=recorded,
        reason=f"{recorded} kept from the checkpoint: a resumed run keeps its precision "
               f"(this machine's choice was {current.chosen}: {current.reason})")


def _capability(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def default_decoding_precision(recorded: str | None = None,
                               device: torch.device | str = "cpu") -> str:
    """The decoding precision a model gets when none is asked for (``aiayn translate``,
    ``evaluate``, ``serve``, ``Translator``, Table 3): the one a finished run recorded after
    its fidelity check (``generation_config.json``: int8 where it kept val BLEU within 0.2 of
    fp32, :func:`aiayn.selection.check_reduced_precision`), else ``fp32``. A model nobody
    checked (a checkpoint, an import, a run trained in fp32) decodes in fp32: a reduced
    precision changes outputs (bf16 is not even batch-invariant on a CPU), so it is chosen only
    with evidence or when asked for (``auto``, ``bf16``, ``int8``). A recorded int8 is a CPU
    choice: on another device it gives ``fp32``."""
    import torch

    if recorded is None or recorded == "auto":
        return "fp32"
    if recorded == "int8" and torch.device(device).type != "cpu":
        return "fp32"
    return recorded


def may_reduce_decoding_precision(train_precision: str) -> bool:
    """Whether the pipeline checks a reduced decoding precision for a run at all: not for a
    run trained with ``train.precision = "fp32"`` (asked for explicitly, so kept for
    decoding too)."""
    return train_precision != "fp32"
