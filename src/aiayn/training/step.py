"""One update of §5: the loss of a global batch, its gradient, clipping, the learning rate of
§5.3 (eq. 3), Adam. Plain functions: the :class:`~aiayn.training.loop.Trainer` calls them with
its parts."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aiayn.data.batching import Batch
from aiayn.training.distributed import DistInfo, sum_over_processes
from aiayn.training.fused_loss import projected_label_smoothed_loss, rdrop_loss
from aiayn.training.mixed import MixedPrecision
from aiayn.training.schedule import scheduled_lr
from aiayn.training.state import TrainState

# (model, batch, grad_scale = 1.0) -> (loss_sum, nll_sum, tokens scored); validation calls it
# without grad_scale
BatchLoss = Callable[..., "tuple[torch.Tensor, torch.Tensor, int]"]


def batch_loss(model: nn.Module, batch: Batch, *, epsilon_ls: float, pad_id: int,
               autocast: contextlib.AbstractContextManager, rdrop_alpha: float = 0.0,
               grad_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Label-smoothed loss of one batch (§5.4), summed over its non-pad target tokens; only
    those positions reach the output layer, fused with the loss (no (n, V) logits in memory).
    With ``rdrop_alpha`` > 0, R-Drop (not in the paper): the batch stacked on itself, so that
    one forward runs both passes with independent dropout masks.

    Returns:
        (loss_sum, nll_sum, n_tokens); the backward of loss_sum gives the gradient of
        ``grad_scale * loss_sum``.
    """
    keep = batch.tgt_out != pad_id  # (B, T)
    core = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    with autocast:
        if rdrop_alpha > 0:
            hidden = model(torch.cat([batch.src, batch.src]),
                           torch.cat([batch.tgt_in, batch.tgt_in]),
                           output_mask=torch.cat([keep, keep]), project=False)  # (2n, d)
            return rdrop_loss(hidden, core.tgt_embed.weight, core.final_logits_bias,
                              batch.tgt_out[keep], epsilon_ls, rdrop_alpha, pad_id,
                              grad_scale)
        hidden = model(batch.src, batch.tgt_in, output_mask=keep, project=False)  # (n, d)
        return projected_label_smoothed_loss(hidden, core.tgt_embed.weight,
                                             core.final_logits_bias, batch.tgt_out[keep],
                                             epsilon_ls, pad_id, grad_scale)


def train_step(model: nn.Module, batches: list[Batch], loss: BatchLoss,
               optimizer: torch.optim.Optimizer, mixed: MixedPrecision, state: TrainState, *,
               tc: Any, d_model: int, info: DistInfo, device: torch.device,
               ema: Any = None,
               attention: Callable[[], contextlib.AbstractContextManager] =
               contextlib.nullcontext) -> dict[str, float]:
    """One update from ``batches`` (this process's accumulation steps) of every process.

    The loss is normalised by the target tokens of the whole global batch (all accumulation
    steps, all processes), so N processes with one batch each make the same update as one
    process that accumulates the N batches. A non-finite loss or gradient norm skips the
    update (``skipped`` 1.0); else the gradient is clipped to ``tc.clip_norm``, the learning
    rate set by the schedule, Adam steps, the EMA follows, and ``state`` advances.

    Args:
        model: what the passes run on (the DDP wrapper under torchrun, else the compute model).
        loss: :func:`batch_loss` with the run's settings bound.
        mixed: the master and compute models.

    Returns:
        loss and nll per target token, tokens, and (when not skipped) lr and grad_norm.

    Raises:
        ValueError: a batch has target tokens the model's output vocabulary cannot produce.
    """
    global_tokens = sum_over_processes([float(sum(b.tgt_tokens for b in batches))], info,
                                       device)[0]
    scale = info.world_size / global_tokens  # DDP averages over processes: a global sum
    loss_sum = nll_sum = 0.0
    optimizer.zero_grad(set_to_none=True)
    mixed.zero_grad()
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        sync = model.no_sync() if (info.world_size > 1 and not last) \
            else contextlib.nullcontext()
        with sync, attention():
            value, nll, scored = loss(model, batch, scale)
            value.backward()  # the gradient of scale * loss (folded into the loss)
        if scored != batch.tgt_tokens:  # a gold token with a -inf output bias
            raise ValueError(f"{batch.tgt_tokens - scored} target tokens of a training "
                             "batch are outside the model's output vocabulary "
                             "(model.output_vocab); they cannot be learned")
        loss_sum += float(value.detach())
        nll_sum += float(nll)
    loss_tok, nll_tok = (v / global_tokens for v in
                         sum_over_processes([loss_sum, nll_sum], info, device))
    mixed.gradients_to_master()
    # One fused norm over all gradients (already averaged across processes by DDP, so every
    # process sees the same value) both detects non-finite gradients and clips.
    grads = [p.grad for p in mixed.model.parameters() if p.grad is not None]
    total_norm = nn.utils.get_total_norm(grads)
    grad_norm = float(total_norm)
    if not (math.isfinite(loss_tok) and math.isfinite(grad_norm)):
        return {"loss": loss_tok, "nll": nll_tok, "tokens": global_tokens, "skipped": 1.0}
    if tc.clip_norm > 0:
        nn.utils.clip_grads_with_norm_(grads, tc.clip_norm, total_norm)
    lr = scheduled_lr(tc, d_model, state.step + 1, state.elapsed_s)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    mixed.weights_to_compute()
    if ema is not None:
        ema.update_parameters(mixed.model)
    state.step += 1
    state.target_tokens += int(global_tokens)
    return {"loss": loss_tok, "nll": nll_tok, "tokens": global_tokens, "lr": lr,
            "grad_norm": grad_norm, "skipped": 0.0}


__all__ = ["BatchLoss", "batch_loss", "train_step"]
