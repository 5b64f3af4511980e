"""The training loop: §5 recipe, checkpoints that resume exactly, validation, several processes.

One :class:`Trainer` runs on one process; under ``torchrun`` each process holds one shard of
every epoch's batches and DistributedDataParallel averages the gradients. The loss of an update
is normalised by the target tokens of the whole global batch (all accumulation steps, all
processes), so N processes with one batch each make the same update as one process that
accumulates the same N batches.

Run directory::

    RUN/config.json        every value that shaped the run (``aiayn train --config RUN/config.json``)
    RUN/tokenizer.json     the shared vocabulary
    RUN/metrics.jsonl      one JSON object per log line (train and valid)
    RUN/tb/                TensorBoard event files
    RUN/checkpoints/step-N the last ``keep_last`` checkpoints (with training state)
    RUN/best/              the checkpoint with the best validation BLEU (or loss)
    RUN/ema/               the exponential moving average of the weights when training ends
                           (only with ``train.ema_decay`` > 0)
"""

from __future__ import annotations

import contextlib
import gc
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from aiayn.checkpoint import load_training_state, load_weights
from aiayn.config import Config
from aiayn.data.batching import Batch, EncodedCorpus
from aiayn.data.corpus import ParallelCorpus
from aiayn.data.vocab import Vocabulary
from aiayn.devices import cpu_times, steal_percent
from aiayn.errors import UserError
from aiayn.fileio import write_json_atomic
from aiayn.model import Transformer, count_parameters
from aiayn.precision import Precision, choose_precision, resumed_precision
from aiayn.rundir import BEST, EMA, RunDir
from aiayn.training import step as update
from aiayn.training.distributed import (
    DistInfo,
    agree_precision,
    init_distributed,
    main_decides,
    restore_rng_state,
    rng_states,
)
from aiayn.training.mixed import MixedPrecision
from aiayn.training.parts import (
    Checkpointer,
    MetricsSink,
    Progress,
    Window,
    validation_figures,
    weights_finite,
)
from aiayn.training.schedule import budget_progress
from aiayn.training.state import TrainState
from aiayn.training.stream import EpochStream

__all__ = ["DistInfo", "StopTraining", "TrainState", "Trainer", "build_model", "build_optimizer",
           "init_distributed"]


class StopTraining(UserError):
    """Raised inside the loop to end it early with a message (non-finite losses)."""


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


class Trainer:
    """Trains a model on ``train`` (encoded pairs) as ``config.train`` says (§5).

    Args:
        config: the whole run config (model, data, train, decode).
        run_dir: where checkpoints, metrics and events go (see module docstring).
        vocab: the shared vocabulary (saved into every checkpoint).
        train: encoded training pairs.
        valid: raw validation pairs (BLEU) and ``valid_encoded`` their encoding (loss).
        device: ``cpu`` or ``cuda:N`` (choose it with :func:`aiayn.devices.choose_device`).
        progress: show a tqdm progress bar (main process only).
        model: the model to train, already on ``device``; default :func:`build_model`.
        optimizer: its optimizer; default :func:`build_optimizer` (Adam, §5.3). Its learning
            rate is overwritten at every step by the §5.3 schedule.
        metrics: where log records go; default :class:`MetricsSink` on ``run_dir``.
        checkpointer: writes checkpoints; default :class:`Checkpointer` on ``run_dir``.
        train_text: the pairs ``train`` was encoded from (``train.index`` points into them);
            needed only with ``data.bpe_dropout``, which segments them anew every epoch.

    Raises:
        ValueError: no training pairs, or ``data.bpe_dropout`` without ``train_text``.
        RuntimeError: several processes but no process group (call :func:`init_distributed`).
    """

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        vocab: Vocabulary,
        train: EncodedCorpus,
        valid: ParallelCorpus | None = None,
        valid_encoded: EncodedCorpus | None = None,
        device: str | torch.device = "cpu",
        progress: bool = True,
        math_attention: bool | None = None,
        *,
        model: Transformer | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        metrics: MetricsSink | None = None,
        checkpointer: Checkpointer | None = None,
        train_text: ParallelCorpus | None = None,
    ) -> None:
        self.config, self.tc, self.vocab = config, config.train, vocab
        self.run_dir = Path(run_dir)
        self.valid, self.valid_encoded = valid, valid_encoded
        self.device = torch.device(device)
        self.dist = DistInfo.from_env()
        if self.dist.world_size > 1 and not torch.distributed.is_initialized():
            raise RuntimeError("several processes: call init_distributed(device) before "
                               "building a Trainer")
        if config.model.pad_id != vocab.pad_id:  # the vocabulary is the one source of truth
            raise ValueError(f"model.pad_id={config.model.pad_id} but the vocabulary pads "
                             f"with id {vocab.pad_id}")
        self.stream = EpochStream(config, vocab, train, train_text, self.dist)
        self.progress = progress and self.dist.is_main
        # CPU training no longer calls SDPA (MultiHeadAttention writes eq. 1 out); on other
        # devices the math kernel can still be asked for (measured in bench/bench_train.py)
        self.math_attention = self.device.type == "cpu" if math_attention is None \
            else math_attention
        self.state = TrainState()
        self._stop_signal: int | None = None
        self._last_ckpt_time = time.monotonic()
        self.model = model if model is not None else build_model(config, self.device,
                                                                 self.tc.seed)
        if model is None and config.model.output_vocab == "target":
            # the tokens the decoder is ever asked to produce: those of the training targets
            # and EOS (resuming loads the same bias back from the checkpoint)
            self.model.limit_output_vocab(torch.from_numpy(train.target_token_ids()))
        if self.dist.world_size > 1:  # same initial weights, different dropout masks
            torch.manual_seed(self.tc.seed + 1000 * self.dist.rank)
        # train.precision, "auto" measured on this machine and agreed by every process
        self.precision = agree_precision(
            choose_precision(self.tc.precision, self.device, config.model), self.dist,
            self.device)
        self._dropout_active: bool | None = None  # set by _schedule_dropout (late dropout)
        self.metrics_dropped = 0  # metrics.jsonl lines of steps after the resumed checkpoint
        self._set_precision(self.precision)
        self.optimizer = optimizer if optimizer is not None else build_optimizer(self.model,
                                                                                 self.tc)
        # train.ema_decay: a float32 moving average of the master weights, one lerp per update
        self.ema: AveragedModel | None = None
        if self.tc.ema_decay > 0:
            self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(
                self.tc.ema_decay), use_buffers=False)
        self.metrics = metrics if metrics is not None else \
            MetricsSink(self.run_dir, enabled=self.dist.is_main)
        self.checkpointer = checkpointer if checkpointer is not None else \
            Checkpointer(self.run_dir, config, vocab, self.tc.keep_last)

    def _set_precision(self, precision: Precision) -> None:
        """Build the compute model for ``precision`` (a bf16 copy for bf16-weights) and wrap it
        in DistributedDataParallel when there are several processes."""
        self.precision = precision
        self.mixed = MixedPrecision(self.model, precision, self.device)
        self.ddp_model: nn.Module = self.compute_model
        if self.dist.world_size > 1:
            self.ddp_model = nn.parallel.DistributedDataParallel(
                self.compute_model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None)

    @property
    def compute_model(self) -> nn.Module:
        """The model the passes run on: the master itself, or its bf16 copy (bf16-weights)."""
        return self.mixed.compute_model

    # --- data -----------------------------------------------------------------------------
    def data_of_epoch(self, epoch: int) -> EncodedCorpus:
        """See :meth:`EpochStream.data_of_epoch`."""
        return self.stream.data_of_epoch(epoch)

    def batches_of_epoch(self, epoch: int) -> list[list[int]]:
        """See :meth:`EpochStream.batches_of_epoch`."""
        return self.stream.batches_of_epoch(epoch)

    def next_batch(self) -> Batch:
        """The next batch of the data order, on the device (the state's position moves on)."""
        return self.stream.next_batch(self.state, self.device)

    # --- checkpoints ----------------------------------------------------------------------
    def _training_state(self) -> dict[str, Any]:
        """Everything a resume restores besides the weights (a collective: the RNG states of
        every process are gathered)."""
        return {**self.state.to_dict(), "optimizer": self.optimizer.state_dict(),
                **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
                "rng": rng_states(self.dist, self.device),
                "rank": self.dist.rank, "world_size": self.dist.world_size,
                "precision": self.precision.chosen, "precision_device": self.device.type}

    def resume(self, checkpoint: Path) -> None:
        """Restore weights (checked to fit the model, as loading does), optimizer, schedule
        position, RNGs and data position.

        Raises:
            UserError: weights that do not fit; a checkpoint of another number of processes
                or of another optimizer layout.
        """
        load_weights(self.model, checkpoint, self.device)
        st = load_training_state(checkpoint)
        if st.get("world_size", 1) != self.dist.world_size:
            raise UserError(f"{checkpoint} was written by a run of {st.get('world_size')} "
                            f"processes; resume it with the same number (now "
                            f"{self.dist.world_size})")
        saved, ours = len(st["optimizer"]["param_groups"]), len(self.optimizer.param_groups)
        if saved != ours:
            raise UserError(f"{checkpoint}: its optimizer state has {saved} parameter group(s), "
                            f"this run's optimizer {ours}; resume with "
                            "train.decoupled_weight_decay as it was when it was written")
        # torch restores the saved hyperparameters with the moments; this run's config (its
        # --set overrides on resume included) decides them instead. lr is set at every step.
        hyper = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                 for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(st["optimizer"])
        for group, settings in zip(self.optimizer.param_groups, hyper):
            group.update(settings)
        # agreed again: resumed_precision reads each process's own probe rates
        kept = agree_precision(resumed_precision(self.precision, st.get("precision"),
                                                 st.get("precision_device"), self.device),
                               self.dist, self.device)
        if kept != self.precision:
            self._set_precision(kept)
        self.mixed.weights_to_compute()
        if self.ema is not None:  # a run that turns the EMA on when resumed starts it here
            if "ema" in st:
                self.ema.load_state_dict(st["ema"])
            else:
                self.ema.n_averaged.zero_()
        self.state = TrainState.from_dict(st)
        restore_rng_state(st, self.dist, self.device)
        self.stream.seek()
        # the steps after the checkpoint are trained again: their old records go
        self.metrics_dropped = self.metrics.rewind(self.state.step)

    # --- one update -----------------------------------------------------------------------
    def _attention_backend(self) -> contextlib.AbstractContextManager:
        if self.math_attention:
            return sdpa_kernel(SDPBackend.MATH)
        return contextlib.nullcontext()

    def batch_loss(self, model: nn.Module, batch: Batch,
                   grad_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """:func:`aiayn.training.step.batch_loss` with this run's settings: label smoothing,
        precision, and R-Drop from its start on while dropout masks are drawn (not in eval
        mode, not before late dropout's start, not with every rate 0: else its two passes
        would be one)."""
        core = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        rdrop = self.tc.rdrop_alpha if (self.tc.rdrop_alpha > 0 and core.draws_dropout and
                                        self._budget_spent() >= self.tc.rdrop_start) else 0.0
        return update.batch_loss(model, batch, epsilon_ls=self.tc.epsilon_ls,
                                 pad_id=self.vocab.pad_id, autocast=self.mixed.autocast(model),
                                 rdrop_alpha=rdrop, grad_scale=grad_scale)

    def _budget_spent(self) -> float:
        """The fraction of the budget spent before this update, as the lr schedule measures
        it: a function of the saved step and training seconds, so late dropout and late R-Drop
        (``train.rdrop_start``) switch in a resumed run where the uninterrupted one would."""
        return budget_progress(self.state.step, self.state.elapsed_s, self.tc.max_steps,
                               self.tc.time_budget_s)

    def _schedule_dropout(self) -> None:
        """Late dropout (``train.late_dropout_start``): the model's dropout is off until that
        fraction of the budget is spent (:meth:`_budget_spent`), then on."""
        if self.tc.late_dropout_start <= 0:
            return
        active = self._budget_spent() >= self.tc.late_dropout_start
        if active != self._dropout_active:
            self.compute_model.set_dropout_active(active)
            self._dropout_active = active

    def train_step(self) -> dict[str, float]:
        """One update from ``accum_steps`` batches (per process); see
        :func:`aiayn.training.step.train_step`. Returns loss figures."""
        self.ddp_model.train()
        self._schedule_dropout()
        batches = [self.next_batch() for _ in range(self.tc.accum_steps)]
        return update.train_step(
            self.ddp_model, batches, self.batch_loss, self.optimizer, self.mixed, self.state,
            tc=self.tc, d_model=self.config.model.d_model, info=self.dist, device=self.device,
            ema=self.ema, attention=self._attention_backend)

    def release_process_group(self) -> None:
        """Drop the DDP wrapper, whose reducer holds the process group; call it before
        ``dist.destroy_process_group()``. The Trainer sits in a reference cycle (frames of
        torch's lazy imports in Adam's constructor), so without this the reducer and gloo's
        threads outlive the group into the interpreter's teardown, where a rank once aborted
        ("terminate called without an active exception") on a heavily loaded host. The
        Trainer can still save and validate afterwards, but no longer train on several
        processes."""
        self.ddp_model = self.compute_model
        gc.collect()

    def save(self, reason: str = "periodic") -> Path | None:
        """Write ``checkpoints/step-N`` (main process) and prune to ``keep_last``. Weights that
        are not all finite are never written (returns None then, and on other processes).
        Every process must call it (the RNG states are gathered)."""
        self._last_ckpt_time = time.monotonic()
        if not weights_finite(self.model):  # the same on every process: DDP keeps them equal
            return None
        state = self._training_state()
        if not self.dist.is_main:
            return None
        meta = {"step": self.state.step, "epoch": self.state.epoch, "reason": reason,
                "elapsed_s": round(self.state.elapsed_s, 1), "time": time.time()}
        return self.checkpointer.save_step(self.model, meta, state)

    def save_ema(self, reason: str = "final") -> Path | None:
        """Write ``RUN/ema``, a checkpoint of the moving average of the weights (only with
        ``train.ema_decay`` > 0, on the main process, when it has averaged at least one update
        and is finite; returns None otherwise). Its buffers, such as the output-vocabulary bias,
        are the model's.

        Raises:
            OSError: the write failed (full disk, permissions); an earlier ``ema/`` stays.
        """
        if self.ema is None or not self.dist.is_main or int(self.ema.n_averaged) == 0:
            return None
        averaged = self.ema.module
        with torch.no_grad():
            for mine, live in zip(averaged.buffers(), self.model.buffers()):
                mine.copy_(live)
        if not weights_finite(averaged):
            return None
        meta = {"step": self.state.step, "epoch": self.state.epoch, "reason": reason,
                "ema_decay": self.tc.ema_decay, "ema_updates": int(self.ema.n_averaged),
                "time": time.time()}
        return self.checkpointer.save_named(EMA, averaged, meta)

    def validate(self) -> dict[str, float]:
        """Validation figures of the current weights (see :func:`validation_figures`)."""
        return validation_figures(self.model, self.batch_loss, self.config, self.vocab,
                                  self.valid, self.valid_encoded, self.device,
                                  bf16=self.precision.uses_bf16)

    # --- the loop -------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps``, ``time_budget_s``, early stopping or a signal: §5 as a
        loop of updates (batches of §5.1, Adam and the schedule of §5.3, dropout and label
        smoothing of §5.4), with logging, validation and checkpoints between them.

        SIGINT / SIGTERM finish the current update, write a checkpoint and return.

        Returns:
            A summary: steps, elapsed_s, why it stopped, best metric, last validation figures.

        Raises:
            StopTraining: more than ``max_nonfinite`` non-finite losses in a row (a checkpoint
                of the last good state is written first, if its weights are finite).
        """
        tc, s = self.tc, self.state
        self.metrics.open()
        # what ran, and the probe that chose it: a run's figures depend on it
        self.metrics.log({"kind": "precision", "step": s.step, **self.precision.to_dict()})
        bar = Progress(self.progress, tc.max_steps, tc.time_budget_s, s.step, s.elapsed_s)
        self._window, last_valid, bad_in_a_row = Window(), {}, 0
        stop_reason = "max_steps"
        self._clock = time.monotonic()
        cpu_start = cpu_times()
        try:
            with self._signals_caught():
                while s.step < tc.max_steps:
                    stop_reason = self._between_steps()
                    if stop_reason:
                        break
                    fig = self.train_step()  # §5: one update
                    self._tick()
                    if fig["skipped"]:  # a non-finite loss or gradient: no update was made
                        bad_in_a_row += 1
                        s.nonfinite_total += 1
                        if bad_in_a_row > tc.max_nonfinite:
                            self._stop_nonfinite(bad_in_a_row)
                        continue
                    bad_in_a_row = 0
                    self._log(fig, bar)
                    if s.step % tc.eval_every_steps == 0:
                        last_valid = self._evaluate_and_track()
                    if tc.checkpoint_every_steps and s.step % tc.checkpoint_every_steps == 0:
                        self.save()
                        self._clock = time.monotonic()
                stop_reason = stop_reason or "max_steps"
                if s.step % tc.eval_every_steps != 0 or not last_valid:
                    last_valid = self._evaluate_and_track()
                self.save(stop_reason)
                self.save_ema(stop_reason)
        finally:
            bar.close()
            self.metrics.close()
        return self._summary(stop_reason, last_valid, cpu_start)

    def _log(self, fig: dict[str, float], bar: Progress) -> None:
        """Add an update's figures to the window; every ``log_every_steps`` (and at step 1),
        log the window's record and show it on the progress bar."""
        s = self.state
        self._window.add(fig)
        bar.update(s.step, s.elapsed_s)
        if s.step % self.tc.log_every_steps != 0 and s.step != 1:
            return
        record = self._window.record(s.step, s.epoch, fig["lr"], s.elapsed_s, s.nonfinite_total)
        self.metrics.log(record)
        shown = dict(step=s.step, loss=f"{record['loss']:.3f}", lr=f"{fig['lr']:.2e}",
                     tok_s=f"{record['tokens_per_s']:.0f}")
        if record.get("cpu_steal_pct", 0.0) >= 5.0:  # a shared host is slow
            shown["steal"] = f"{record['cpu_steal_pct']:.0f}%"
        bar.update(s.step, s.elapsed_s, **shown)
        self._window = Window()

    def _summary(self, stop_reason: str, last_valid: dict[str, float],
                 cpu_start: tuple[int, int] | None) -> dict[str, Any]:
        """The run's summary, written to ``RUN/train_summary.json`` by the main process."""
        s = self.state
        summary = {
            "steps": s.step, "epochs": s.epoch, "elapsed_s": round(s.elapsed_s, 1),
            "stop_reason": stop_reason, "target_tokens": s.target_tokens,
            "nonfinite_total": s.nonfinite_total,
            "parameters": count_parameters(self.model), **last_valid,
            "precision": self.precision.to_dict(),
        }
        steal = steal_percent(cpu_start, cpu_times())
        if steal is not None:  # over the fit's wall time (validation included)
            summary["cpu_steal_pct"] = round(steal, 1)
        if self.dist.is_main:
            write_json_atomic(RunDir(self.run_dir).train_summary, summary)
        return summary

    def _tick(self) -> None:
        """Add the wall time since the last tick to ``elapsed_s`` (validation excluded)."""
        now = time.monotonic()
        self.state.elapsed_s += now - self._clock
        self._clock = now

    def _between_steps(self) -> str:
        """Why to stop now ("" to go on), and a time-based checkpoint when one is due: the
        main process decides (clocks and signals differ by rank), in one broadcast."""
        tc, s = self.tc, self.state
        # the main process's clock, so that a time-aware schedule gives every process one lr
        s.elapsed_s, (stop, budget, early, due) = main_decides(
            self.dist, self.device, s.elapsed_s,
            self._stop_signal is not None,
            bool(tc.time_budget_s) and s.elapsed_s >= tc.time_budget_s,
            bool(tc.early_stopping_patience) and s.evals_since_best >= tc.early_stopping_patience,
            bool(tc.checkpoint_every_s)
            and time.monotonic() - self._last_ckpt_time >= tc.checkpoint_every_s)
        if stop:
            name = signal.Signals(self._stop_signal).name if self._stop_signal \
                else "on the main process"
            return f"signal {name}"
        if budget or early:
            return "time_budget" if budget else "early_stopping"
        if due:
            self.save()
            self._clock = time.monotonic()
        return ""

    def _stop_nonfinite(self, in_a_row: int) -> None:
        path = self.save("nonfinite")
        if path is not None:
            where = f"the last good state is in {path}"
        else:
            newest = self.checkpointer.newest()
            where = ("the weights are not finite, so no checkpoint was written; "
                     + (f"the newest saved one is {newest}" if newest else
                        "none was saved before"))
        raise StopTraining(f"{in_a_row} non-finite losses in a row at step {self.state.step}; "
                           f"{where}. Lower the learning rate (train.lr_scale) or enable "
                           "train.clip_norm.")

    @contextlib.contextmanager
    def _signals_caught(self):
        """SIGINT and SIGTERM set a flag that the loop reads between updates."""
        def handler(signum: int, frame: Any) -> None:
            self._stop_signal = signum

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        try:
            yield
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    def _evaluate_and_track(self) -> dict[str, float]:
        """Validate (main process), keep ``best/``, count evaluations without improvement."""
        figures: dict[str, float] = {}
        if self.dist.is_main:
            t0 = time.monotonic()
            figures = self.validate()
            figures["valid_seconds"] = time.monotonic() - t0
            metric = figures.get("valid_bleu", -figures.get("valid_loss", float("inf")))
            s = self.state
            better = math.isfinite(metric) and (s.best_metric is None or metric > s.best_metric)
            if better and weights_finite(self.model):
                s.best_metric = metric
                s.evals_since_best = 0
                meta = {"step": s.step, **{k: round(v, 4) for k, v in figures.items()}}
                self.checkpointer.save_named(BEST, self.model, meta)
            else:
                s.evals_since_best += 1
            self.metrics.log({"kind": "valid", "step": s.step,
                              "elapsed_s": round(s.elapsed_s, 2), **figures})
        # evals_since_best lives on the main process; the next step's flags carry its verdict
        self._clock = time.monotonic()
        return figures
