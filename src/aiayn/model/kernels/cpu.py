"""What this CPU and numba's target offer, read in one place: the ISA variant of the int8
product, the int8 weight grid, the level-2 cache size, the CPU class, and the record of all
of them that a run keeps (:func:`build_record`).

``AIAYN_FORCE_ISA=avx2|vnni`` forces the u8 x s8 product's variant, as CTranslate2's
``CT2_FORCE_CPU_ISA`` does: "avx2" runs the AVX2 variant on a VNNI machine, with the AVX2
class's 7-bit weight grid (:func:`weight_levels`), so that class's int8 path can be tested
anywhere; a variant numba's target lacks is refused with a one-line
:class:`~aiayn.errors.ConfigError`, never compiled (LLVM would abort the process).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from aiayn.errors import ConfigError
from aiayn.model.kernels import jit
from aiayn.model.kernels.jit import AVAILABLE, ENABLED, log, numba

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


#: The variants of the u8 x s8 product (its tile shapes): int32 lanes a vector, vectors a
#: panel of columns, and the largest weight magnitude it sums exactly. "avx2" (CPUs without
#: VNNI): ``vpmaddubsw`` adds two products of an unsigned byte (at most 255) and a signed one
#: into an int16, so 2 * 255 * 63 = 32,130 fits and 2 * 255 * 127 does not; "vnni" (AVX-512
#: VNNI): ``vpdpbusd`` adds four such products straight into an int32. A tile is
#: :data:`U8S8_ROWS` activation rows by one panel (avx2: 16 columns, vnni: 64).
U8S8_VARIANTS = {"avx2": (8, 2, 63), "vnni": (16, 4, 127)}
U8S8_ROWS = 4  # activation rows a tile

#: the environment variable that forces the u8 x s8 variant
FORCE_ISA = "AIAYN_FORCE_ISA"


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


def _target_variants() -> tuple[str, ...]:
    """The variants numba's target CPU has the instructions of, the fastest first."""
    from llvmlite import binding

    if not binding.get_default_triple().startswith("x86_64"):
        return ()
    vnni = numba_target_has("avx512bw") and numba_target_has("avx512vnni")
    return (("vnni",) if vnni else ()) + (("avx2",) if numba_target_has("avx2") else ())


def forced_isa() -> str | None:
    """``AIAYN_FORCE_ISA``'s variant, or None where it is unset or empty.

    Raises:
        ConfigError: a value that names no variant of :data:`U8S8_VARIANTS`.
    """
    return forced_choice(FORCE_ISA, sorted(U8S8_VARIANTS), "a variant of the int8 product")


def forced_choice(variable: str, choices: Sequence[str], what: str) -> str | None:
    """The environment ``variable``'s value (stripped, lower-cased), or None where it is unset
    or empty: the one reader of the kernels' forcing variables.

    Raises:
        ConfigError: a value not in ``choices`` (naming the variable, the value and them).
    """
    value = os.environ.get(variable, "").strip().lower()
    if not value:
        return None
    if value not in choices:
        raise ConfigError(f"{variable}={value}: not {what}; use one of {', '.join(choices)}")
    return value


@functools.cache
def u8s8_variants() -> tuple[str, ...]:
    """The variants of :func:`~aiayn.model.kernels.u8s8_product` (:data:`U8S8_VARIANTS`) that
    can run here, the fastest first: "vnni" where numba's target has AVX-512 VNNI (and BW),
    "avx2" where it has AVX2 (:func:`numba_target_has`); none without the kernels or off
    x86-64. Only the forced one under ``AIAYN_FORCE_ISA``. Fixed for the process.

    Raises:
        ConfigError: ``AIAYN_FORCE_ISA`` names a variant numba's target lacks (one line; the
            variant is never compiled, so LLVM never aborts on it).
    """
    forced = forced_isa()
    if not AVAILABLE:
        return ()
    found = _target_variants()
    if forced is not None:
        if forced not in found:
            raise ConfigError(
                f"{FORCE_ISA}={forced}: numba's target CPU lacks its instructions (it runs: "
                f"{', '.join(found) or 'none'}); unset {FORCE_ISA} or choose one of those")
        found = (forced,)
    log.info("u8 x s8 variants here: %s%s", ", ".join(found) or "none",
             f" (forced by {FORCE_ISA})" if forced else "")
    return found


@functools.cache
def weight_levels() -> int:
    """127, or 63 where this CPU's int8 product is not exact at full range (and 63 under
    ``AIAYN_FORCE_ISA=avx2``: the AVX2 class's grid, which its variant sums exactly).

    Without VNNI (the AVX2 class), oneDNN multiplies int8 pairs with ``vpmaddubsw``, whose
    int16 sums of two products saturate: full-range weights then give wrong sums (seen on the
    simulated AVX2 class: errors of 10^5 on random int8 matrices). Weights of 7 bits,
    [-63, 63], keep every pair sum within int16 whatever the activations, as fbgemm's
    ``reduce_range`` does. Decided by one exactness probe, not by the CPU's name."""
    if forced_isa() == "avx2":
        return U8S8_VARIANTS["avx2"][2]
    a = torch.full((32, 64), 127, dtype=torch.int8)
    b = torch.full((64, 32), 127, dtype=torch.int8)
    exact = torch.equal(torch._int_mm(a, b), torch.full((32, 32), 64 * 127 * 127,
                                                          dtype=torch.int32))
    return 127 if exact else 63


def u8s8_variant(levels: int) -> str | None:
    """The fastest variant of :func:`u8s8_variants` that sums weights of ``levels`` (at most
    that magnitude) exactly, or None."""
    for variant in u8s8_variants():
        if levels <= U8S8_VARIANTS[variant][2]:
            return variant
    return None


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of Linux's /proc/cpuinfo ({} elsewhere)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                found[key.strip()] = value.strip()
    except OSError:
        pass
    return found


def cpu_class() -> str:
    """This process's CPU class (docs/hardware.md): "bf16" (AVX-512 with native bf16, as torch
    sees it), "avx2" (torch at AVX2: a Zen 3, or the simulation's ``ATEN_CPU_CAPABILITY``),
    else torch's capability in lower case ("default" off x86-64)."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    if capability.startswith("avx512"):
        flags = _cpuinfo().get("flags", "").split()
        return "bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else capability
    return capability


def build_record() -> dict:
    """What decides the int8 engine's numbers on this machine, for a run's generation record:
    whether the kernels run (and which families), the u8 x s8 variant and the weight grid,
    numba's and llvmlite's versions, and the CPU class and model. Two machines decode a run
    line for line where these agree (docs/hardware.md)."""
    info = _cpuinfo()
    try:
        variant = u8s8_variant(weight_levels())
    except ConfigError:  # a forced variant the CPU lacks: recorded as none
        variant = None
    record = {
        "kernels": AVAILABLE,
        "kernel_families": sorted(ENABLED),
        "kernel_cache": "disk" if jit.CACHED else "memory",
        "isa": variant,
        "weight_levels": weight_levels(),
        "numba": None,
        "llvmlite": None,
        "cpu_class": cpu_class(),
        "cpu": " ".join(filter(None, [info.get("vendor_id"),
                                      info.get("cpu family") and f"family {info['cpu family']}",
                                      info.get("model") and f"model {info['model']}"])),
    }
    if numba is not None:
        import llvmlite

        record["numba"], record["llvmlite"] = numba.__version__, llvmlite.__version__
    return record


#: the keys of :func:`build_record` whose difference can change decoded tokens: the float
#: kernels' (every precision), then the int8 product's
RECORD_KEYS = ("kernels", "numba", "cpu_class")
INT8_RECORD_KEYS = ("isa", "weight_levels")


def machine_differs(recorded: dict, int8: bool) -> str:
    """How this machine's :func:`build_record` differs from ``recorded`` (a run's) where it
    can change decoded tokens, e.g. "numba 0.68.1 here, 0.60.0 in the run"; "" where it does
    not (only the int8 product's keys where ``int8``)."""
    here = build_record()
    keys = RECORD_KEYS + (INT8_RECORD_KEYS if int8 else ())
    return "; ".join(f"{key} {here.get(key)} here, {recorded[key]} in the run" for key in keys
                     if key in recorded and recorded[key] != here.get(key))
