"""The one place where a device name becomes a ``torch.device`` (training, decoding, CLI), and
where the CPU kernels' process-wide settings are defined. They are made where a process starts
(the command line, :func:`aiayn.training.run.prepare_training_process`), never on import.
Imports torch only when called."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from aiayn.errors import UserError

if TYPE_CHECKING:
    import torch

# Primitives oneDNN keeps, one per matrix-product shape and pass (forward, the two backward
# products). Its default, 1024, is smaller than the ~1,330 that a multi30k epoch of bf16
# training uses, so every epoch re-created ~940 of them at ~7 ms each (measured with
# ONEDNN_VERBOSE=profile_create: 6.3 s of a 108 s epoch). 8192 holds them all.
ONEDNN_CACHE_CAPACITY = 8192


def widen_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Let oneDNN (CPU bf16 matrix products) keep ``capacity`` compiled primitives, unless the
    user set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` already. oneDNN reads the variable when it
    builds its first primitive, so this only takes effect before the process's first bf16
    matrix product: the command line and :func:`aiayn.train` call it first; a program that
    runs bf16 products before it keeps oneDNN's default (1,024)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def set_tf32(enabled: bool) -> None:
    """Let CUDA float32 matrix products run on TF32 tensor cores (10-bit mantissa, float32
    range; compute capability 8.0 and later) or keep them in full float32, for the whole
    process: ``torch.backends.cuda.matmul.fp32_precision`` (``"tf32"`` or ``"ieee"``) where
    torch has it (2.9 and later, which refuses a mix of it and the older flag), else
    ``torch.backends.cuda.matmul.allow_tf32``. The training run calls it with its precision's
    ``tf32`` (:func:`aiayn.precision.gpu_precision`); it changes nothing on a CPU."""
    import torch

    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:  # torch 2.6-2.8
        matmul.allow_tf32 = enabled


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20


def keep_freed_memory() -> bool:
    """Ask glibc's allocator to keep freed blocks of up to 32 MiB for reuse instead of handing
    them back to the system. Returns True when it took effect (Linux with glibc), else False.

    By default glibc serves a block of a few MiB or more with its own ``mmap`` and unmaps it
    on ``free``, so every training step's activations, gradients and logits land on fresh
    pages, each faulted in (and zeroed) by the kernel on first touch: 12,000-18,000 page
    faults a ``multi30k`` step, about 1 µs each on this machine, ~4% of the step. Raising
    the mmap threshold to its 64-bit maximum and never trimming the heap makes the second
    step reuse the first one's pages. Decoding gains more: each batch's logits,
    log-probabilities and caches of several MiB faulted in afresh (the figures are in
    ``docs/benchmarks.md``). The process keeps its peak memory until it exits, which suits a
    training run and a batch command (``aiayn translate``, ``evaluate``, ``pipeline``); a
    library or a server should not call it for its users.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    return mallopt(_M_TOP_PAD, 64 * 2**20) == 1 and ok


def cpu_times(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(steal, total) time of all CPUs since boot, in clock ticks, from Linux's ``/proc/stat``;
    None where it cannot be read (not Linux) or has no steal column (kernels before 2.6.11).

    Steal is the time a virtual machine's CPUs were ready to run but the host ran something
    else. On a shared cloud host it can take most of a CPU for minutes at a time, and a run's
    tokens per second fall with it, so training logs it beside its throughput."""
    try:
        with open(stat, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu" or not all(x.isdigit() for x in fields[1:9]):
        return None  # a diagnostic: an unexpected format must never stop a training run
    # cpu user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
    # already counted in user and nice, so the total is the first eight columns
    ticks = [int(x) for x in fields[1:9]]
    return ticks[7], sum(ticks)


def steal_percent(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen by the host between two :func:`cpu_times` readings, in
    percent (0-100); None when either reading is missing. An interval shorter than one clock
    tick (a fast step logged every update) counted no time, so nothing was stolen in it: 0.0."""
    if before is None or after is None:
        return None
    if after[1] <= before[1]:
        return 0.0
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


def choose_device(name: str | torch.device | None = None, local_rank: int = 0) -> torch.device:
    """``name`` checked against this machine; None: ``cuda`` when a GPU is present, else ``cpu``.

    Under torchrun a bare ``cuda`` means this process's GPU, ``cuda:LOCAL_RANK``.

    Raises:
        UserError: an unknown device name, or a CUDA device this machine does not have.
    """
    import torch

    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(f"--device {name!r}: not a device name (use cpu, cuda or cuda:N)") \
            from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: no CUDA GPU is available on this machine "
                            "(use --device cpu)")
        index = local_rank if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                            f"GPU(s), numbered from 0")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise UserError(f"--device {name}: only cpu and cuda devices are supported")
    return device
