"""The searches' row primitives, one import point for :mod:`aiayn.decoding`: the
next-token log-probabilities, each row's best column, beam search's best extensions, and
greedy search's choice straight from an int8 output layer's sums.

Each is a compiled kernel of :mod:`aiayn.model.kernels.rows` that gives torch's numbers (the
same columns, the same float additions) and returns None (or, for :func:`log_softmax`, runs
torch) where a row holds a NaN. The code stays in the kernel package, below the searches in
the layer order (``tests/unit/test_layers.py``): the model's own output layer needs
:func:`log_softmax` and :func:`rescale_greedy` too (an int8 copy's
:meth:`~aiayn.model.quantize.Int8Linear.log_softmax`), and every compiled kernel shares the
package's compile and fallback rules (docs/kernels.md).
"""

from aiayn.model.kernels.rows import beam_top, log_softmax, rescale_greedy, row_argmax

__all__ = ["beam_top", "log_softmax", "rescale_greedy", "row_argmax"]
