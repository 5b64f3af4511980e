"""Whether and how the kernels compile: numba imported once (or never), the decorator every
kernel takes, the kernel families in use, and the logger that says what was chosen.

Never takes the package down (docs/kernels.md):

- ``AIAYN_NO_KERNELS=1``: numba is not imported at all; every caller runs its torch path.
- numba not installed, or failing to import: the same, with one warning.
- no writable numba cache (a read-only install and HOME, no ``NUMBA_CACHE_DIR``: numba raises
  "no locator available" where ``cache=True`` is asked): the kernels compile in memory, in
  every process, with one warning.
- a family whose kernels fail to compile at first use (:func:`usable` compiles them then):
  that family is left out of :data:`ENABLED`, with one warning, and its callers run torch.

``AIAYN_VERBOSE=kernels`` logs every choice (logger ``aiayn.kernels``, level INFO, to stderr):
numba's version and cache, the ISA variant, each int8 map's product paths.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

import torch
from torch import Tensor

#: the logger of every choice the kernels make (``AIAYN_VERBOSE=kernels`` shows its INFO)
log = logging.getLogger("aiayn.kernels")


class _Stderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is at each record (a test's capture,
    a worker's redirection), not as it was when the package was imported."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _verbose() -> None:
    """One line per record on stderr, "aiayn.kernels: ...": the warnings always (the
    fallbacks below), every choice (INFO) where ``AIAYN_VERBOSE`` names "kernels" (a
    comma-separated list, as ``ONEDNN_VERBOSE`` switches oneDNN's log). Not propagated, so a
    program's own logging setup does not print them twice."""
    if not log.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    verbose = "kernels" in os.environ.get("AIAYN_VERBOSE", "").replace(" ", "").split(",")
    log.setLevel(logging.INFO if verbose else logging.WARNING)


_verbose()

#: ``AIAYN_NO_KERNELS=1`` (any value but "" and "0"): numba is never imported
DISABLED = os.environ.get("AIAYN_NO_KERNELS", "") not in ("", "0")

numba = None
if not DISABLED:
    try:
        import numba
    except Exception as error:  # noqa: BLE001 - not installed, or broken against numpy
        numba = None
        log.warning("numba could not be imported (%s: %s); torch runs every "
                    "kernel", type(error).__name__, str(error).splitlines()[0] if str(error)
                    else "")

#: whether the kernels can run in this process at all (numba imported, not disabled)
AVAILABLE = numba is not None

#: whether compiled kernels are kept in numba's on-disk cache (False once numba found no
#: writable place for it: then they compile in memory)
CACHED = AVAILABLE


def _njit(**options):
    """numba's ``njit`` with the kernels' options (no GIL, numpy's error model), cached on disk
    where numba finds a writable place, else compiled in memory (one warning); the plain
    Python function without numba (never called then: :data:`ENABLED` is empty)."""
    if numba is None:
        return lambda f: f

    def compile_(f):
        global CACHED
        if CACHED:
            try:
                return numba.njit(cache=True, nogil=True, error_model="numpy", **options)(f)
            except RuntimeError as error:  # numba: "cannot cache function ...: no locator"
                if "cannot cache" not in str(error):
                    raise
                CACHED = False
                log.warning("no writable numba cache (%s); the kernels compile "
                            "in memory, in every process (set NUMBA_CACHE_DIR to a writable "
                            "folder to keep them)", str(error).splitlines()[0])
        return numba.njit(cache=False, nogil=True, error_model="numpy", **options)(f)

    return compile_


#: The kernel families in use: "attention" (:func:`~aiayn.model.kernels.attend`), "int8"
#: (:func:`~aiayn.model.kernels.quantize_rows`, :func:`~aiayn.model.kernels.rescale`, the
#: fused step's kernels), "search" (``row_argmax``, ``beam_top``), "softmax"
#: (``rescale_log_softmax``, ``log_softmax``), "greedy" (``rescale_greedy``, greedy search's
#: choice from the output layer's sums), "norm" (``layer_norm``, an int8 copy's LayerNorm) and
#: "embed" (``embed``, the scaled embeddings plus positions). Benchmarks remove one to
#: measure what it gains.
KINDS = frozenset({"attention", "embed", "greedy", "int8", "norm", "search", "softmax"})
ENABLED = set(KINDS) if AVAILABLE else set()

#: each family's warm-up: compiles (or loads from numba's cache) its kernels on tiny inputs.
#: Filled once by the package's ``__init__``, which sees every module.
WARM_UPS: dict[str, Callable[[], None]] = {}
_READY: set[str] = set()


def ready(kind: str) -> bool:
    """Compile the ``kind`` family's kernels now, once a process: True where they compiled;
    False, with ``kind`` left out of :data:`ENABLED` and one warning, where compiling failed
    (numba's typing or lowering errors, an LLVM error: its callers then run torch)."""
    if kind in _READY:
        return kind in ENABLED
    _READY.add(kind)
    warm = WARM_UPS.get(kind)
    if warm is None or kind not in ENABLED:
        return kind in ENABLED
    try:
        with torch.no_grad():
            warm()
    except Exception as error:  # noqa: BLE001 - any compile failure falls back to torch
        ENABLED.discard(kind)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        log.warning("the %r kernels failed to compile (%s: %s); torch runs "
                    "them", kind, type(error).__name__, first)
        return False
    return True


def usable(*tensors: Tensor, kind: str = "attention") -> bool:
    """Whether the ``kind`` kernels (see :data:`ENABLED`) can run on ``tensors``: numba
    present, the family compiled (:func:`ready`, at its first use), float32 on the CPU, no
    gradient wanted."""
    if kind not in ENABLED or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    if kind not in _READY and not ready(kind):
        return False
    for t in tensors:  # a loop, not all(generator): this runs dozens of times a step
        if not t.is_cpu or t.dtype != torch.float32:
            return False
    return True
