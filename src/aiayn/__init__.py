"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017)."""

from aiayn.devices import widen_onednn_cache

__version__ = "0.1.0"

# Before any bf16 matrix product of the process: training, decoding, the CLI and the benchmarks
# all import this package first.
widen_onednn_cache()
