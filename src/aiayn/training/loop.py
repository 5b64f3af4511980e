"""The training loop, §5: :func:`fit` runs updates (:class:`~aiayn.training.update.Learner`)
on batches of the stream (§5.1), and between them logs, validates and writes checkpoints at
the run's :class:`Cadence`. :class:`Trainer` assembles those parts for one run on one
process; under ``torchrun`` each process holds one shard of every epoch's batches and
DistributedDataParallel averages the gradients.

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
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiayn.checkpoint import load_training_state, load_weights
from aiayn.config import Config
from aiayn.data.batching import Batch, EncodedCorpus
from aiayn.data.corpus import ParallelCorpus
from aiayn.data.vocab import Vocabulary
from aiayn.devices import cpu_times, steal_percent
from aiayn.errors import UserError
from aiayn.fileio import write_json_atomic
from aiayn.model import Transformer, count_parameters
from aiayn.precision import Precision
from aiayn.rundir import RunDir
from aiayn.training.checkpointer import Checkpointer
from aiayn.training.distributed import DistInfo, init_distributed, main_decides
from aiayn.training.evaluate import Evaluator
from aiayn.training.metrics import MetricsSink, Progress, Window
from aiayn.training.state import TrainState
from aiayn.training.stream import EpochStream
from aiayn.training.update import Learner, build_model, build_optimizer, training_precision

__all__ = ["Cadence", "Clock", "DistInfo", "StopTraining", "TrainState", "Trainer", "fit",
           "init_distributed"]


class StopTraining(UserError):
    """Raised inside the loop to end it early with a message (non-finite losses)."""


@dataclass(frozen=True)
class Cadence:
    """When the loop does what (the ``train`` settings of the same names): it stops at
    ``max_steps`` updates or ``time_budget_s`` training seconds (0: none), takes
    ``batches_per_update`` batches an update (``accum_steps``), logs every
    ``log_every_steps``, validates every ``eval_every_steps``, checkpoints every
    ``checkpoint_every_steps`` updates (after the update whose step is a multiple) and every
    ``checkpoint_every_s`` seconds of wall clock since the last checkpoint (before the next
    update), each 0 for never; with both, whichever is due writes one and a checkpoint of
    either kind restarts the clock. It gives up after ``max_nonfinite`` skipped updates in a
    row (fp16's overflows, which halve its loss scale, are not counted while the scale stays
    at least :data:`~aiayn.training.update.MIN_LOSS_SCALE`)."""

    max_steps: int
    time_budget_s: float
    batches_per_update: int
    log_every_steps: int
    eval_every_steps: int
    checkpoint_every_steps: int
    checkpoint_every_s: float
    max_nonfinite: int

    @classmethod
    def of(cls, tc: Any) -> Cadence:
        """The cadence a :class:`~aiayn.config.TrainConfig` sets."""
        return cls(tc.max_steps, tc.time_budget_s, tc.accum_steps, tc.log_every_steps,
                   tc.eval_every_steps, tc.checkpoint_every_steps, tc.checkpoint_every_s,
                   tc.max_nonfinite)


class Clock:
    """Training seconds: the wall time of updates, not of what is done with the clock
    :meth:`paused` (validation, checkpoints). The time budget and a time-shaped learning-rate
    schedule read it (``TrainState.elapsed_s``)."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._mark = now()

    def tick(self) -> float:
        """Seconds since the last tick (or the end of the last pause)."""
        now = self._now()
        seconds, self._mark = now - self._mark, now
        return seconds

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside does not count as training time."""
        try:
            yield
        finally:
            self._mark = self._now()


def fit(learner: Learner, stream: EpochStream, cadence: Cadence, evaluator: Evaluator,
        checkpointer: Checkpointer, metrics: MetricsSink, clock: Clock, *,
        progress: bool = False) -> dict[str, Any]:
    """Train until ``max_steps``, ``time_budget_s``, early stopping or a signal: §5 as a loop
    of updates (batches of §5.1, Adam and the schedule of §5.3, dropout and label smoothing of
    §5.4), with logging, validation and checkpoints between them.

    SIGINT / SIGTERM finish the current update, write a checkpoint and return.

    Returns:
        A summary: steps, elapsed_s, why it stopped, the last validation figures, precision.

    Raises:
        StopTraining: more than ``max_nonfinite`` non-finite losses in a row (a checkpoint
            of the last good state is written first, if its weights are finite).
    """
    s, dist = learner.state, learner.dist
    metrics.open()
    # what ran, and the probe that chose it: a run's figures depend on it
    metrics.log({"kind": "precision", "step": s.step, **learner.precision.to_dict()})
    bar = Progress(progress and dist.is_main, cadence.max_steps, cadence.time_budget_s,
                   s.step, s.elapsed_s)
    window, last_valid, bad_in_a_row = Window(), {}, 0
    stop_reason, signalled = "", _Signals()
    cpu_start = cpu_times()
    clock.tick()
    try:
        with signalled.caught():
            while s.step < cadence.max_steps:
                # the main process decides (clocks and signals differ by rank), in one
                # broadcast; its clock, so that a time-aware schedule gives all one lr
                s.elapsed_s, (stop, budget, early, due) = main_decides(
                    dist, learner.device, s.elapsed_s, signalled.number is not None,
                    bool(cadence.time_budget_s) and s.elapsed_s >= cadence.time_budget_s,
                    evaluator.stop_early(s),
                    bool(cadence.checkpoint_every_s)
                    and time.monotonic() - checkpointer.saved_at >= cadence.checkpoint_every_s)
                if stop or budget or early:
                    stop_reason = signalled.reason() if stop else \
                        "time_budget" if budget else "early_stopping"
                    break
                if due:
                    with clock.paused():
                        checkpointer.save(learner)

                batches = [stream.next_batch(s, learner.device)
                           for _ in range(cadence.batches_per_update)]
                fig = learner.update(batches)  # §5: one update
                s.elapsed_s += clock.tick()

                if fig["skipped"]:  # a non-finite loss or gradient: no update was made
                    # fp16's loss scale halved after an overflow is the scaler's own search,
                    # not a diverging run: counted in the total, not in the run of failures
                    bad_in_a_row += 0 if fig.get("overflow") else 1
                    s.nonfinite_total += 1
                    if bad_in_a_row > cadence.max_nonfinite:
                        _stop_nonfinite(learner, checkpointer, bad_in_a_row)
                    continue
                bad_in_a_row = 0
                window = _log(fig, window, s, cadence, metrics, bar)
                if s.step % cadence.eval_every_steps == 0:
                    with clock.paused():
                        last_valid = evaluator.evaluate(learner)
                if cadence.checkpoint_every_steps and \
                        s.step % cadence.checkpoint_every_steps == 0:
                    with clock.paused():
                        checkpointer.save(learner)
            stop_reason = stop_reason or "max_steps"
            if s.step % cadence.eval_every_steps != 0 or not last_valid:
                last_valid = evaluator.evaluate(learner)
            checkpointer.save(learner, stop_reason)
            checkpointer.save_ema(learner, stop_reason)
    finally:
        bar.close()
        metrics.close()
    summary = {"steps": s.step, "epochs": s.epoch, "elapsed_s": round(s.elapsed_s, 1),
               "stop_reason": stop_reason, "target_tokens": s.target_tokens,
               "nonfinite_total": s.nonfinite_total,
               "parameters": count_parameters(learner.model), **last_valid,
               "precision": learner.precision.to_dict()}
    steal = steal_percent(cpu_start, cpu_times())
    if steal is not None:  # over the fit's wall time (validation included)
        summary["cpu_steal_pct"] = round(steal, 1)
    return summary


def _log(fig: dict[str, float], window: Window, s: TrainState, cadence: Cadence,
         metrics: MetricsSink, bar: Progress) -> Window:
    """Add an update's figures to ``window``; every ``log_every_steps`` (and at step 1), log
    the window's record, show it on the progress bar and start a new window (returned)."""
    window.add(fig)
    bar.update(s.step, s.elapsed_s)
    if s.step % cadence.log_every_steps != 0 and s.step != 1:
        return window
    record = window.record(s.step, s.epoch, fig["lr"], s.elapsed_s, s.nonfinite_total)
    if "loss_scale" in fig:  # fp16: the scale of the logged update
        record["loss_scale"] = fig["loss_scale"]
    metrics.log(record)
    shown = dict(step=s.step, loss=f"{record['loss']:.3f}", lr=f"{fig['lr']:.2e}",
                 tok_s=f"{record['tokens_per_s']:.0f}")
    if record.get("cpu_steal_pct", 0.0) >= 5.0:  # a shared host is slow
        shown["steal"] = f"{record['cpu_steal_pct']:.0f}%"
    bar.update(s.step, s.elapsed_s, **shown)
    return Window()


def _stop_nonfinite(learner: Learner, checkpointer: Checkpointer, in_a_row: int) -> None:
    path = checkpointer.save(learner, "nonfinite")
    if path is not None:
        where = f"the last good state is in {path}"
    else:
        newest = checkpointer.newest()
        where = ("the weights are not finite, so no checkpoint was written; "
                 + (f"the newest saved one is {newest}" if newest else "none was saved before"))
    raise StopTraining(f"{in_a_row} non-finite losses in a row at step {learner.state.step}; "
                       f"{where}. Lower the learning rate (train.lr_scale) or enable "
                       "train.clip_norm.")


class _Signals:
    """SIGINT and SIGTERM, while :meth:`caught`, set :attr:`number`, which the loop reads
    between updates."""

    def __init__(self) -> None:
        self.number: int | None = None

    def reason(self) -> str:
        name = signal.Signals(self.number).name if self.number else "on the main process"
        return f"signal {name}"

    @contextlib.contextmanager
    def caught(self) -> Iterator[None]:
        def handler(signum: int, frame: Any) -> None:
            self.number = signum

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


class Trainer:
    """One run's parts, assembled: the stream of batches, the :class:`Learner` (restored from
    ``resume_from`` when given), the evaluator, the checkpointer and the metrics; :meth:`fit`
    runs :func:`fit` over them and writes ``RUN/train_summary.json``.

    Args:
        config: the whole run config (model, data, train, decode).
        run_dir: where checkpoints, metrics and events go (see module docstring).
        vocab: the shared vocabulary (saved into every checkpoint).
        train: encoded training pairs.
        valid: raw validation pairs (BLEU) and ``valid_encoded`` their encoding (loss).
        device: ``cpu`` or ``cuda:N`` (choose it with :func:`aiayn.devices.choose_device`).
        progress: show a tqdm progress bar (main process only).
        model: the model to train, already on ``device``; default :func:`build_model`.
        optimizer: its optimizer; default :func:`build_optimizer` (Adam, §5.3).
        metrics: where log records go; default :class:`MetricsSink` on ``run_dir``.
        checkpointer: writes checkpoints; default :class:`Checkpointer` on ``run_dir``.
        train_text: the pairs ``train`` was encoded from (``train.index`` points into them);
            needed only with ``data.bpe_dropout``, which segments them anew every epoch.
        resume_from: a checkpoint of this run to continue from: its weights, its training
            state (:meth:`Learner.load_state_dict`) and its precision
            (:func:`training_precision`).

    Raises:
        ValueError: no training pairs, or ``data.bpe_dropout`` without ``train_text``.
        RuntimeError: several processes but no process group (call :func:`init_distributed`).
        UserError: ``resume_from`` does not fit (see :meth:`Learner.load_state_dict`).
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
        *,
        model: Transformer | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        metrics: MetricsSink | None = None,
        checkpointer: Checkpointer | None = None,
        train_text: ParallelCorpus | None = None,
        resume_from: Path | None = None,
    ) -> None:
        tc = config.train
        self.run_dir, self.progress = Path(run_dir), progress
        device = torch.device(device)
        dist = DistInfo.from_env()
        if dist.world_size > 1 and not torch.distributed.is_initialized():
            raise RuntimeError("several processes: call init_distributed(device) before "
                               "building a Trainer")
        if config.model.pad_id != vocab.pad_id:  # the vocabulary is the one source of truth
            raise ValueError(f"model.pad_id={config.model.pad_id} but the vocabulary pads "
                             f"with id {vocab.pad_id}")
        self.stream = EpochStream(config, vocab, train, train_text, dist)
        if model is None:
            model = build_model(config, device, tc.seed)
            if config.model.output_vocab == "target":
                # the tokens the decoder is ever asked to produce: those of the training
                # targets and EOS (resuming loads the same bias back from the checkpoint)
                model.limit_output_vocab(torch.from_numpy(train.target_token_ids()))
        if dist.world_size > 1:  # same initial weights, different dropout masks
            torch.manual_seed(tc.seed + 1000 * dist.rank)
        saved = None
        if resume_from is not None:
            load_weights(model, resume_from, device)
            saved = load_training_state(resume_from)
        precision = training_precision(tc.precision, device, config.model, dist, saved,
                                       tf32=tc.tf32)
        optimizer = optimizer if optimizer is not None else build_optimizer(model, tc)
        self.learner = Learner(config, model, optimizer, precision, device, dist, vocab.pad_id)
        if tc.guided_alignment_weight > 0:  # its reference links: IBM Model 1 on these pairs
            from aiayn.decoding.alignment import GuidedAlignment

            self.learner.guided = GuidedAlignment.from_corpus(config, train)
        self.metrics = metrics if metrics is not None else \
            MetricsSink(self.run_dir, enabled=dist.is_main)
        self.checkpointer = checkpointer if checkpointer is not None else \
            Checkpointer(self.run_dir, config, vocab, tc.keep_last, dist.is_main)
        self.evaluator = Evaluator(config, vocab, valid, valid_encoded, self.checkpointer,
                                   self.metrics, dist.is_main)
        self.cadence = Cadence.of(tc)
        self.metrics_dropped = 0  # metrics.jsonl lines of steps after the resumed checkpoint
        if saved is not None:
            self.learner.load_state_dict(saved, str(resume_from))
            self.stream.seek()
            # the steps after the checkpoint are trained again: their old records go
            self.metrics_dropped = self.metrics.rewind(self.learner.state.step)

    @property
    def model(self) -> Transformer:
        """The float32 master model."""
        return self.learner.model

    @property
    def state(self) -> TrainState:
        return self.learner.state

    @property
    def precision(self) -> Precision:
        return self.learner.precision

    def next_batches(self) -> list[Batch]:
        """The batches of the next update, on the device (the state's position moves on)."""
        return [self.stream.next_batch(self.state, self.learner.device)
                for _ in range(self.cadence.batches_per_update)]

    def fit(self) -> dict[str, Any]:
        """:func:`fit` over this run's parts; the main process writes the summary to
        ``RUN/train_summary.json``.

        Raises:
            StopTraining: see :func:`fit`.
        """
        summary = fit(self.learner, self.stream, self.cadence, self.evaluator,
                      self.checkpointer, self.metrics, Clock(), progress=self.progress)
        if self.learner.dist.is_main:
            write_json_atomic(RunDir(self.run_dir).train_summary, summary)
        return summary
