"""What a resumed run needs besides the weights, the optimizer and the RNGs: one dataclass,
saved and loaded as one (plain values, so ``torch.load(weights_only=True)`` reads it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class TrainState:
    """Where training stands.

    Attributes:
        step: updates taken.
        epoch: the epoch the next batch comes from.
        batch_in_epoch: batches of this process's shard consumed in ``epoch``.
        elapsed_s: training wall time so far, in seconds (validation excluded).
        nonfinite_total: updates skipped for a non-finite loss or gradient.
        best_metric: the best validation BLEU (or -loss when BLEU is off), None before one.
        evals_since_best: validations since ``best_metric`` last improved.
        target_tokens: target tokens trained on, all processes.
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    elapsed_s: float = 0.0
    nonfinite_total: int = 0
    best_metric: float | None = None
    evals_since_best: int = 0
    target_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (keys of the saved training state)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        """The state in a saved training state (other keys there are ignored).

        Raises:
            KeyError: a field is missing.
        """
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls)})
