"""One update of §5, and the object that makes it: :class:`Learner` holds the model, Adam
(§5.3), mixed precision (with fp16's loss scale), the moving average of the weights and the
:class:`TrainState`; :meth:`Learner.update` takes a global batch's loss (§5.4), its gradient,
clipping, the learning rate of eq. 3, and one Adam step. :meth:`Learner.state_dict` and
:meth:`Learner.load_state_dict` are what a checkpoint keeps besides the weights, so that a
resumed run continues exactly.

The precision is decided before a Learner exists (:func:`training_precision`), once for a
fresh run and once more, from the checkpoint's record, for a resumed one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from aiayn.config import Config, ModelConfig
from aiayn.data.batching import Batch
from aiayn.devices import set_tf32
from aiayn.errors import UserError
from aiayn.model import Transformer
from aiayn.precision import Precision, choose_precision, resumed_precision
from aiayn.training.distributed import (
    DistInfo,
    agree_precision,
    data_parallel,
    restore_rng_state,
    rng_states,
    sum_over_processes,
)
from aiayn.training.loss import projected_label_smoothed_loss, rdrop_loss
from aiayn.training.mixed import MixedPrecision
from aiayn.training.schedule import budget_progress, scheduled_lr
from aiayn.training.state import TrainState
from aiayn.training.stream import global_batch_index, local_batch_index

# (model, batch, grad_scale = 1.0) -> (loss_sum, nll_sum, tokens scored); validation calls it
# without grad_scale
BatchLoss = Callable[..., "tuple[torch.Tensor, torch.Tensor, int]"]
# fp16: an overflow that takes the loss scale below this is no longer the scaler's search but a
# diverging run, and counts towards train.max_nonfinite (fairseq's --min-loss-scale default)
MIN_LOSS_SCALE = 1e-4


def build_model(config: Config, device: torch.device, seed: int) -> Transformer:
    """The §3 model of ``config.model`` on ``device``, initialised from ``seed`` (the same
    weights on every process)."""
    torch.manual_seed(seed)
    return Transformer(config.model).to(device)


def build_optimizer(model: nn.Module, tc: Any) -> torch.optim.Optimizer:
    """Adam with beta1, beta2, epsilon of §5.3 (the learning rate is set at every step).

    Fused (one kernel over all parameters) on CPU and CUDA: the same update as the
    per-parameter loop up to rounding, 4-5x faster on CPU (about 4 against 15-21 ms a step for
    the ``multi30k`` preset's 127 tensors on 2 threads), and the same ``state_dict``.

    ``tc.weight_decay`` > 0 is an L2 term added to the gradient of every parameter (Adam's own
    ``weight_decay``), or, with ``tc.decoupled_weight_decay``, AdamW's decay (Loshchilov &
    Hutter 2019; not in the paper): each step shrinks the weights by lr x weight_decay apart
    from the gradient, and only the matrices and embeddings (parameters of 2 or more
    dimensions), not biases or LayerNorm gains. That optimizer has two parameter groups.

    Args:
        model: the model whose parameters are optimized (all of them, in ``parameters()``
            order, so that a saved ``state_dict`` loads into a rebuilt optimizer).
        tc: the run's :class:`~aiayn.config.TrainConfig` (``adam_beta1``, ``adam_beta2``,
            ``adam_eps``, ``weight_decay``, ``decoupled_weight_decay``).

    Returns:
        a ``torch.optim.Adam`` with lr 0 (the schedule sets it before the first step). It
        raises nothing of its own: ``TrainConfig`` checked these values when it was built.
    """
    params = list(model.parameters())
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    groups: list[Any] = params
    decoupled = tc.decoupled_weight_decay  # TrainConfig refuses it with weight_decay 0
    if decoupled:
        groups = [{"params": [p for p in params if p.ndim >= 2]},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.Adam(groups, lr=0.0, betas=(tc.adam_beta1, tc.adam_beta2),
                            eps=tc.adam_eps, weight_decay=tc.weight_decay,
                            decoupled_weight_decay=decoupled, fused=fused or None)


def training_precision(requested: str, device: torch.device, model: ModelConfig,
                       dist: DistInfo, saved: dict[str, Any] | None = None, *,
                       tf32: bool = True) -> Precision:
    """The one decision of a run's training precision, made before its :class:`Learner`:
    ``requested`` (``train.precision``; ``auto`` measured on this machine, or on a GPU read
    from its compute capability, :func:`~aiayn.precision.choose_precision`; ``tf32``:
    ``train.tf32``), agreed by every process, and for a resumed
    run (``saved``: the checkpoint's training state, whose ``precision`` and
    ``precision_device`` record what the run used) decided again by
    :func:`~aiayn.precision.resumed_precision`, which keeps the recorded one unless the
    machine changed. A collective under torchrun: every process calls it."""
    mine = agree_precision(choose_precision(requested, device, model, tf32=tf32), dist, device)
    if saved is None:
        return mine
    # agreed again: resumed_precision reads each process's own probe rates
    return agree_precision(resumed_precision(mine, saved.get("precision"),
                                             saved.get("precision_device"), device),
                           dist, device)


def batch_loss(model: nn.Module, batch: Batch, *, epsilon_ls: float, pad_id: int,
               autocast: contextlib.AbstractContextManager, rdrop_alpha: float = 0.0,
               grad_scale: float = 1.0, guided=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Label-smoothed loss of one batch (§5.4), summed over its non-pad target tokens; only
    those positions reach the output layer, fused with the loss (no (n, V) logits in memory).
    With ``rdrop_alpha`` > 0, R-Drop (not in the paper): the batch stacked on itself, so that
    one forward runs both passes with independent dropout masks. With ``guided`` (a
    :class:`~aiayn.decoding.alignment.GuidedAlignment`; not in the paper), its weighted
    alignment cross-entropy is added to loss_sum (not to nll_sum).

    Returns:
        (loss_sum, nll_sum, n_tokens); the backward of loss_sum gives the gradient of
        ``grad_scale * loss_sum``.
    """
    if guided is not None:
        core = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        with guided.capture(core) as found:
            value, nll, scored = batch_loss(model, batch, epsilon_ls=epsilon_ls, pad_id=pad_id,
                                            autocast=autocast, rdrop_alpha=rdrop_alpha,
                                            grad_scale=grad_scale)
        extra = guided.loss(found["log_attention"], batch.src, batch.tgt_out)
        # the value of extra, the gradient of grad_scale * extra (as the fused loss's)
        return value + (extra * grad_scale + (extra * (1.0 - grad_scale)).detach()), nll, scored
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


def check_same_update(saved: dict[str, Any], world_size: int, accum_steps: int,
                      source: str = "the checkpoint") -> None:
    """Refuse to resume ``saved`` (a checkpoint's training state) at ``world_size`` processes
    x ``accum_steps`` unless its position can carry over: the same batches an update (the
    epoch's batch list and the global batch depend on it), and, for checkpoints written
    before positions were global, the same number of processes.

    Raises:
        UserError: naming ``source``, what it was written with and what to resume with.
    """
    old_world = saved.get("world_size", 1)
    if "batches_per_update" not in saved:
        if old_world != world_size:
            raise UserError(f"{source} was written by a run of {old_world} processes (before "
                            "positions were kept as global batch indices); resume it with the "
                            f"same number (now {world_size})")
        return
    per_update = saved["batches_per_update"]
    if world_size * accum_steps != per_update:
        fits = [w for w in range(1, per_update + 1) if per_update % w == 0]
        raise UserError(f"{source}: its updates hold {per_update} batches ({old_world} "
                        f"process(es) x {per_update // old_world} accumulation step(s)); "
                        f"{world_size} process(es) x train.accum_steps={accum_steps} would "
                        f"change the global batch: resume with {', '.join(map(str, fits))} "
                        f"process(es) and processes x train.accum_steps = {per_update}")


class Learner:
    """The model, its optimizer, mixed precision, the moving average and where training
    stands: everything one update changes.

    With ``fp16`` (:attr:`Precision.loss_scaling`) a ``torch.amp.GradScaler`` keeps float16's
    gradients from underflowing: the loss is scaled before the backward, the gradients are
    unscaled before the norm and clipping, an update with an overflow is skipped and the scale
    halved, and the scale grows again after 2,000 updates without one (torch's defaults). On
    a GPU of compute capability 8.0 or more the precision's TF32 setting is made for the
    process (:func:`aiayn.devices.set_tf32`).

    Args:
        config: the run's config (``train`` settings; ``model.d_model`` for the schedule).
        model: the float32 master model, on ``device`` (weights already loaded on resume).
        optimizer: its optimizer (:func:`build_optimizer`: Adam, §5.3); its learning rate is
            overwritten at every step by the schedule.
        precision: the run's precision (:func:`training_precision`).
        device: the training device.
        dist: this process among the others; several processes wrap the compute model in
            DistributedDataParallel (the process group must be joined).
        pad_id: the vocabulary's padding id.
    """

    def __init__(self, config: Config, model: Transformer, optimizer: torch.optim.Optimizer,
                 precision: Precision, device: torch.device, dist: DistInfo,
                 pad_id: int) -> None:
        self.tc, self.d_model, self.pad_id = config.train, config.model.d_model, pad_id
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.device, self.dist = device, dist
        self.state = TrainState()
        self.mixed = MixedPrecision(model, precision, device)
        # disabled (every call a pass-through to the optimizer) unless fp16
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.loss_scaling)
        if device.type == "cuda":
            set_tf32(precision.tf32)
        self.ddp_model: nn.Module = self.compute_model
        if dist.world_size > 1:
            self.ddp_model = data_parallel(self.compute_model, device, self.tc)
        # train.ema_decay: a float32 moving average of the master weights, one lerp per update
        self.ema: AveragedModel | None = None
        if self.tc.ema_decay > 0:
            self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(
                self.tc.ema_decay), use_buffers=False)
        self._dropout_active: bool | None = None  # set by _schedule_dropout (late dropout)
        # train.guided_alignment_weight > 0: a GuidedAlignment the Trainer sets (its IBM Model 1
        # is learned on the training pairs); None: the loss of §5.4 alone
        self.guided = None

    @property
    def compute_model(self) -> nn.Module:
        """The model the passes run on: the master itself, or its bf16 copy (bf16-weights)."""
        return self.mixed.compute_model

    # --- §5.4 and §5.3: one update ----------------------------------------------------------
    def batch_loss(self, model: nn.Module, batch: Batch,
                   grad_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """:func:`batch_loss` with this run's settings: label smoothing, precision, and
        R-Drop from its start on while dropout masks are drawn (not in eval mode, not before
        late dropout's start, not with every rate 0: else its two passes would be one)."""
        core = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        rdrop = self.tc.rdrop_alpha if (self.tc.rdrop_alpha > 0 and core.draws_dropout and
                                        self.budget_spent() >= self.tc.rdrop_start) else 0.0
        guided = self.guided if self.guided is not None and model.training else None
        return batch_loss(model, batch, epsilon_ls=self.tc.epsilon_ls, pad_id=self.pad_id,
                          autocast=self.mixed.autocast(model), rdrop_alpha=rdrop,
                          grad_scale=grad_scale, guided=guided)

    def update(self, batches: list[Batch]) -> dict[str, float]:
        """One update from ``batches`` (this process's accumulation steps) of every process.

        The loss is normalised by the target tokens of the whole global batch (all
        accumulation steps, all processes), so N processes with one batch each make the same
        update as one process that accumulates the N batches. A non-finite loss or gradient
        norm skips the update (``skipped`` 1.0); else the gradient is clipped to
        ``train.clip_norm``, the learning rate set by the schedule (§5.3), Adam steps, the
        EMA follows, and the state advances. Under fp16 the gradient is that of the loss
        times the scaler's scale (folded into the loss's own gradient, which is stored in
        float16 in the forward: scaling after it would be too late), unscaled before its norm;
        an overflow halves the scale (``overflow`` 1.0 while the scale stays at least
        :data:`MIN_LOSS_SCALE`).

        Returns:
            loss and nll per target token, tokens, ``skipped``, and (when not skipped) lr and
            grad_norm; under fp16 also ``loss_scale`` (the scale this update used) and
            ``overflow``.

        Raises:
            ValueError: a batch has target tokens the model's output vocabulary cannot
                produce.
        """
        model, mixed, info = self.ddp_model, self.mixed, self.dist
        model.train()
        self._schedule_dropout()
        global_tokens = sum_over_processes([float(sum(b.tgt_tokens for b in batches))], info,
                                           self.device)[0]
        scale = info.world_size / global_tokens  # DDP averages over processes: a global sum
        scaler = self.scaler
        # the scaler's scale (its first call makes its state); the loss itself stays unscaled
        loss_scale = float(scaler.scale(torch.ones((), device=self.device))) \
            if scaler.is_enabled() else 1.0
        loss_sum = nll_sum = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        mixed.zero_grad()
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            sync = model.no_sync() if (info.world_size > 1 and not last) \
                else contextlib.nullcontext()
            with sync:
                value, nll, scored = self.batch_loss(model, batch, scale * loss_scale)
                value.backward()  # the gradient of scale * loss_scale * loss (folded in)
            if scored != batch.tgt_tokens:  # a gold token with a -inf output bias
                raise ValueError(f"{batch.tgt_tokens - scored} target tokens of a training "
                                 "batch are outside the model's output vocabulary "
                                 "(model.output_vocab); they cannot be learned")
            loss_sum += float(value.detach())
            nll_sum += float(nll)
        loss_tok, nll_tok = (v / global_tokens for v in
                             sum_over_processes([loss_sum, nll_sum], info, self.device))
        mixed.gradients_to_master()
        scaler.unscale_(self.optimizer)  # fp16: the gradients divided by loss_scale
        # One fused norm over all gradients (already averaged across processes by DDP, so
        # every process sees the same value) both detects non-finite gradients and clips.
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total_norm = nn.utils.get_total_norm(grads)
        grad_norm = float(total_norm)
        scaled = {"loss_scale": loss_scale} if scaler.is_enabled() else {}
        if not (math.isfinite(loss_tok) and math.isfinite(grad_norm)):
            if scaler.is_enabled():  # fp16: an overflow halves the scale
                scaler.update()
                scaled["overflow"] = float(math.isfinite(loss_tok)
                                           and scaler.get_scale() >= MIN_LOSS_SCALE)
            return {"loss": loss_tok, "nll": nll_tok, "tokens": global_tokens, "skipped": 1.0,
                    **scaled}
        if self.tc.clip_norm > 0:
            nn.utils.clip_grads_with_norm_(grads, self.tc.clip_norm, total_norm)
        s = self.state
        lr = scheduled_lr(self.tc, self.d_model, s.step + 1, s.elapsed_s)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        scaler.step(self.optimizer)  # optimizer.step() (fp16: told there was no overflow)
        scaler.update()  # fp16: the scale grows after 2,000 updates without an overflow
        mixed.weights_to_compute()
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        s.step += 1
        s.target_tokens += int(global_tokens)
        return {"loss": loss_tok, "nll": nll_tok, "tokens": global_tokens, "lr": lr,
                "grad_norm": grad_norm, "skipped": 0.0, **scaled}

    def budget_spent(self) -> float:
        """The fraction of the budget spent before this update, as the lr schedule measures
        it: a function of the saved step and training seconds, so late dropout and late
        R-Drop (``train.rdrop_start``) switch in a resumed run where the uninterrupted one
        would."""
        return budget_progress(self.state.step, self.state.elapsed_s, self.tc.max_steps,
                               self.tc.time_budget_s)

    def _schedule_dropout(self) -> None:
        """Late dropout (``train.late_dropout_start``): the model's dropout is off until that
        fraction of the budget is spent (:meth:`budget_spent`), then on."""
        if self.tc.late_dropout_start <= 0:
            return
        active = self.budget_spent() >= self.tc.late_dropout_start
        if active != self._dropout_active:
            self.compute_model.set_dropout_active(active)
            self._dropout_active = active

    # --- what a checkpoint keeps besides the weights -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume restores besides the weights: the :class:`TrainState`, the
        optimizer, the EMA, fp16's loss scale, every process's RNG state (a collective: they
        are gathered), the precision the run used, and the position in the epoch as a global
        batch index with the batches of one update (processes x accumulation steps), which a
        resume on another number of processes keeps."""
        return {**self.state.to_dict(), "optimizer": self.optimizer.state_dict(),
                **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
                **({"scaler": self.scaler.state_dict()} if self.scaler.is_enabled() else {}),
                "rng": rng_states(self.dist, self.device),
                "rank": self.dist.rank, "world_size": self.dist.world_size,
                "global_batch_in_epoch": global_batch_index(self.state.batch_in_epoch,
                                                            self.dist),
                "batches_per_update": self.batches_per_update,
                "precision": self.precision.chosen, "precision_device": self.device.type}

    def load_state_dict(self, saved: dict[str, Any], source: str = "the checkpoint") -> None:
        """Restore what :meth:`state_dict` saved (the weights are already in the model; the
        precision was decided from ``saved`` before this Learner was built).

        The optimizer's moments are the checkpoint's; its hyperparameters are this run's
        config (its ``--set`` overrides on resume included).

        The position in the epoch is the saved global batch index, shared out anew when the
        number of processes changed (:func:`~aiayn.training.stream.local_batch_index`).

        Raises:
            UserError: ``saved`` holds updates of another number of batches (processes x
                accumulation steps; the run resumes with the same), or was written by another
                number of processes before positions were saved as global ones, or with
                another optimizer layout (naming ``source``).
        """
        check_same_update(saved, self.dist.world_size, self.tc.accum_steps, source)
        groups, ours = len(saved["optimizer"]["param_groups"]), len(self.optimizer.param_groups)
        if groups != ours:
            raise UserError(f"{source}: its optimizer state has {groups} parameter group(s), "
                            f"this run's optimizer {ours}; resume with "
                            "train.decoupled_weight_decay as it was when it was written")
        # torch restores the saved hyperparameters with the moments; lr is set at every step
        hyper = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                 for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(saved["optimizer"])
        for group, settings in zip(self.optimizer.param_groups, hyper):
            group.update(settings)
        self.mixed.weights_to_compute()
        if self.ema is not None:  # a run that turns the EMA on when resumed starts it here
            if "ema" in saved:
                self.ema.load_state_dict(saved["ema"])
            else:
                self.ema.n_averaged.zero_()
        if self.scaler.is_enabled() and "scaler" in saved:  # else the scale starts afresh
            self.scaler.load_state_dict(saved["scaler"])
        self.state = TrainState.from_dict(saved)
        if "global_batch_in_epoch" in saved:
            self.state.batch_in_epoch = local_batch_index(saved["global_batch_in_epoch"],
                                                          self.dist)
        restore_rng_state(saved, self.dist, self.device)

    @property
    def batches_per_update(self) -> int:
        """The batches of one update, over all processes (processes x accumulation steps)."""
        return self.dist.world_size * self.tc.accum_steps

    def release_process_group(self) -> None:
        """Drop the DDP wrapper, whose reducer holds the process group; call it before
        ``dist.destroy_process_group()``. Without it the reducer and gloo's threads can
        outlive the group into the interpreter's teardown (the Learner sits in a reference
        cycle through frames of torch's lazy imports in Adam's constructor), where a rank once
        aborted on a heavily loaded host. The Learner can still be saved afterwards, but no
        longer trains on several processes."""
        import gc

        self.ddp_model = self.compute_model
        gc.collect()


__all__ = ["BatchLoss", "Learner", "batch_loss", "build_model", "build_optimizer",
           "check_same_update", "training_precision"]
