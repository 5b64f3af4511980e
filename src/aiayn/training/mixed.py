"""Mixed precision for training (not in the paper; the machine chooses, :mod:`aiayn.precision`).

- ``fp32``: one model, float32 throughout.
- ``bf16``: the same model under ``torch.autocast`` (products in bf16, weights float32).
- ``bf16-weights``: forward and backward on a bf16 copy of the weights (the compute model);
  Adam updates the float32 master weights, whose gradients are the copy's, widened; the copy
  is refreshed from the master after every update.
- ``fp16``: the model under ``torch.autocast`` in float16; the loss scale that keeps its
  gradients from underflowing is the update's (:class:`aiayn.training.update.Learner`).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from aiayn.precision import Precision


class MixedPrecision:
    """The master model, the model the passes run on, and the casts between them.

    Args:
        model: the float32 master model (what the optimizer updates and checkpoints hold).
        precision: the run's resolved precision.
        device: the training device (the autocast device type).
    """

    def __init__(self, model: nn.Module, precision: Precision, device: torch.device) -> None:
        self.model = model
        self.precision = precision
        self.device = device
        self.compute_model: nn.Module = model
        if precision.bf16_weights:
            self.compute_model = copy.deepcopy(model).to(torch.bfloat16)

    def autocast(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """bf16 autocast where the run uses bf16 on float32 weights (bf16 weights need none: it
        would run LayerNorm in float32 and cast around it), float16 autocast for ``fp16``."""
        if self.precision.loss_scaling:
            return torch.autocast(self.device.type, dtype=torch.float16)
        if self.precision.uses_bf16 and next(model.parameters()).dtype == torch.float32:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        """Drop the compute model's gradients (the master's are set by
        :meth:`gradients_to_master`, or are the same tensors in fp32 and bf16 autocast)."""
        self.compute_model.zero_grad(set_to_none=True)

    def gradients_to_master(self) -> None:
        """The compute model's bf16 gradients, widened, as the master's (bf16-weights)."""
        if self.compute_model is self.model:
            return
        for master, work in zip(self.model.parameters(), self.compute_model.parameters()):
            master.grad = None if work.grad is None else work.grad.float()

    @torch.no_grad()
    def weights_to_compute(self) -> None:
        """Copy the float32 master weights into the bf16 compute copy (bf16-weights)."""
        if self.compute_model is self.model:
            return
        for master, work in zip(self.model.parameters(), self.compute_model.parameters()):
            work.copy_(master)
            work.grad = None
