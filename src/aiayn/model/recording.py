"""Recording the attention weights of every layer of a :class:`~aiayn.model.Transformer`
while it runs (eq. 1's softmax(QK^T / sqrt(d_k)) per head): what the attention pictures
(:mod:`aiayn.viz.attention`) and the word alignments (:mod:`aiayn.decoding.alignment`) read."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

KINDS = ("encoder", "decoder", "cross")


class AttentionRecord:
    """What :func:`record_attention` yields: after the forward pass, ``weights(kind)`` gives
    one float32 tensor (B, h, Tq, Tk) per layer, bottom layer first."""

    def __init__(self, modules: dict[str, list]) -> None:
        self._modules = modules
        self._kept: dict[str, list[Tensor]] | None = None

    def weights(self, kind: str) -> list[Tensor]:
        """Per-layer weights of ``kind`` (one of :data:`KINDS`) from the latest forward pass.

        Raises:
            ValueError: unknown kind, or no forward pass ran inside the ``with`` block.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if self._kept is not None:
            found = self._kept[kind]
        else:
            found = [m.weights for m in self._modules[kind]]
        if any(w is None for w in found):
            raise ValueError(f"no {kind} attention was recorded: run the model inside the "
                             "record_attention block")
        return found

    def _keep(self) -> None:
        self._kept = {k: [m.weights for m in ms] for k, ms in self._modules.items()}


@contextlib.contextmanager
def record_attention(model) -> Iterator[AttentionRecord]:
    """Record the attention weights of every layer while the block runs.

    Usage::

        with record_attention(model) as rec:
            model(src, tgt_in)
        cross = rec.weights("cross")  # N tensors (B, h, T, S)

    The model computes attention with the explicit eq. 1 inside the block (same result as the
    fused kernel, up to float rounding) and goes back to ``scaled_dot_product_attention`` after.
    An incremental ``decode_step`` inside the block keeps only the last step's weights.
    """
    modules = {
        "encoder": [layer.self_attn for layer in model.encoder],
        "decoder": [layer.self_attn for layer in model.decoder],
        "cross": [layer.cross_attn for layer in model.decoder],
    }
    all_modules = [m for ms in modules.values() for m in ms]
    for m in all_modules:
        m.record_weights, m.weights = True, None
    record = AttentionRecord(modules)
    try:
        yield record
    finally:
        record._keep()
        for m in all_modules:
            m.record_weights, m.weights = False, None


__all__ = ["KINDS", "AttentionRecord", "record_attention"]
