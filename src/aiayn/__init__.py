"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

The package's API:

- :class:`Translator` (``aiayn.translator``): load a checkpoint, a run directory, an ensemble
  or a Hugging Face Marian model; translate raw text, score pairs, look at attention.
- :func:`train` (``aiayn.training.run``): train or fine-tune a model, as ``aiayn train``.
- :func:`load_config` (``aiayn.config``): a preset or config file, with ``--set`` overrides.

Importing ``aiayn`` changes nothing in the process (no environment variables, no allocator
settings) and loads torch only when one of these is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Translator", "__version__", "load_config", "train"]

if TYPE_CHECKING:
    from aiayn.config import load_config
    from aiayn.training.run import train
    from aiayn.translator import Translator

_LAZY = {"Translator": "aiayn.translator", "train": "aiayn.training.run",
         "load_config": "aiayn.config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'aiayn' has no attribute {name!r}")
