"""Writing a run's checkpoints: ``RUN/checkpoints/step-N`` with the training state, and the
weights-only ``RUN/best`` and ``RUN/ema``, never with non-finite weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aiayn.checkpoint import list_checkpoints, prune_checkpoints, save_checkpoint
from aiayn.config import Config
from aiayn.data.vocab import Vocabulary
from aiayn.rundir import EMA, RunDir

if TYPE_CHECKING:
    from aiayn.training.update import Learner


def weights_finite(model: nn.Module) -> bool:
    """Whether every parameter is finite (one fused norm)."""
    norm = nn.utils.get_total_norm([p.detach() for p in model.parameters()])
    return bool(torch.isfinite(norm))


class Checkpointer:
    """Writes ``RUN/checkpoints/step-N`` (with training state), ``RUN/best`` and ``RUN/ema``
    atomically (:func:`aiayn.checkpoint.save_checkpoint`) and keeps the last ``keep_last``
    steps.

    :meth:`save` and :meth:`save_ema` write a :class:`~aiayn.training.update.Learner`;
    :meth:`save_step` and :meth:`save_named` write what they are given, so callers check
    :func:`weights_finite` first (with several processes that decision must come before the
    RNG states are gathered, and a non-finite model must not become ``best/`` either).

    Args:
        is_main: whether this process writes (every process gathers, only the main writes).
    """

    def __init__(self, run_dir: str | Path, config: Config, vocab: Vocabulary,
                 keep_last: int, is_main: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.vocab = vocab
        self.keep_last = keep_last
        self.is_main = is_main
        self.saved_at = time.monotonic()  # when save() last ran (train.checkpoint_every_s)

    def save(self, learner: Learner, reason: str = "periodic") -> Path | None:
        """Write ``checkpoints/step-N`` of ``learner`` (weights and its
        :meth:`~aiayn.training.update.Learner.state_dict`; the meta records step, epoch,
        reason, precision, processes and batches an update) and prune to ``keep_last``.
        Weights that are not all finite are never written (returns None then, and on other
        processes). Every process must call it (the RNG states are gathered).

        Raises:
            OSError: the write failed (full disk, permissions); earlier checkpoints stay.
        """
        self.saved_at = time.monotonic()
        if not weights_finite(learner.model):  # the same on every process: DDP keeps them equal
            return None
        state = learner.state_dict()
        if not self.is_main:
            return None
        s = learner.state
        # the processes and the batches of an update: what a resume on another number of
        # processes needs to keep the global batch (aiayn.training.run), read before loading
        meta = {"step": s.step, "epoch": s.epoch, "reason": reason,
                "elapsed_s": round(s.elapsed_s, 1), "precision": learner.precision.chosen,
                "world_size": learner.dist.world_size,
                "batches_per_update": learner.batches_per_update, "time": time.time()}
        return self.save_step(learner.model, meta, state)

    def save_ema(self, learner: Learner, reason: str = "final") -> Path | None:
        """Write ``RUN/ema``, a checkpoint of the moving average of ``learner``'s weights (only
        with ``train.ema_decay`` > 0, on the main process, when it has averaged at least one
        update and is finite; returns None otherwise). Its buffers, such as the
        output-vocabulary bias, are the model's.

        Raises:
            OSError: the write failed (full disk, permissions); an earlier ``ema/`` stays.
        """
        ema = learner.ema
        if ema is None or not self.is_main or int(ema.n_averaged) == 0:
            return None
        averaged = ema.module
        with torch.no_grad():
            for mine, live in zip(averaged.buffers(), learner.model.buffers()):
                mine.copy_(live)
        if not weights_finite(averaged):
            return None
        s = learner.state
        meta = {"step": s.step, "epoch": s.epoch, "reason": reason,
                "ema_decay": learner.tc.ema_decay, "ema_updates": int(ema.n_averaged),
                "time": time.time()}
        return self.save_named(EMA, averaged, meta)

    def save_step(self, model: nn.Module, meta: dict[str, Any],
                  training_state: dict[str, Any]) -> Path:
        """Write ``checkpoints/step-{meta['step']:08d}`` with ``training_state`` (optimizer, step
        and data position, every process's RNG) and prune older steps; returns its path.

        Raises:
            OSError: the write failed (full disk, permissions); earlier checkpoints stay.
        """
        path = RunDir(self.run_dir).step(meta["step"])
        save_checkpoint(path, model, self.config, self.vocab, meta, training_state)
        prune_checkpoints(self.run_dir, self.keep_last)
        return path

    def save_named(self, name: str, model: nn.Module, meta: dict[str, Any]) -> Path:
        """Replace ``RUN/<name>``, weights only (no training state): ``best`` (the best
        validation BLEU so far) or ``ema`` (the moving average of the weights); returns its
        path.

        Raises:
            OSError: the write failed (full disk, permissions); the earlier one stays.
        """
        return save_checkpoint(self.run_dir / name, model, self.config, self.vocab, meta)

    def newest(self) -> Path | None:
        """The newest complete ``checkpoints/step-N``, or None when there is none."""
        found = list_checkpoints(self.run_dir)
        return found[-1] if found else None
