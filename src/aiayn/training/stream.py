"""The order in which training sees its pairs (§5.1): epochs of batches of about
``data.max_tokens`` tokens a side, shuffled by ``(train.seed, epoch)``, each process taking its
shard, and with ``data.bpe_dropout`` the pairs segmented anew every epoch. A pure function of
the seed and the position, so a resumed run continues exactly where it stopped.

An epoch's batches are the same list for every split of one update's batches (processes x
``train.accum_steps``) and are dealt to the processes round-robin, so process ``r``'s ``k``-th
batch is the list's ``k x processes + r``-th: the position a checkpoint keeps is that global
index (:func:`global_batch_index`), and a run resumed on another number of processes, with the
accumulation steps that keep the update's batches, trains on the same global batches.

The batches are padded by a :class:`torch.utils.data.DataLoader` over this process's batch list
(its ``batch_sampler``): with a prepared (memory-mapped) corpus beside an accelerator, in a worker
process that keeps the next batches ready (:func:`loader_workers`), in pinned memory on CUDA.
Each batch comes tagged with its position, so the position a checkpoint saves is the batch
trained on, never one the worker read ahead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from aiayn.config import Config
from aiayn.data.batching import Batch, EncodedCorpus, collate, make_batch_arrays
from aiayn.data.bpe_dropout import DroppedCorpus
from aiayn.data.corpus import ParallelCorpus
from aiayn.data.vocab import Vocabulary
from aiayn.training.distributed import DistInfo
from aiayn.training.state import TrainState


def global_batch_index(batch_in_epoch: int, info: DistInfo) -> int:
    """The batches of an epoch all processes have consumed when each has consumed
    ``batch_in_epoch`` of its own (every process takes the same number: one update's)."""
    return batch_in_epoch * info.world_size


def local_batch_index(global_index: int, info: DistInfo) -> int:
    """This process's position in its share of an epoch, from the global one
    (:func:`global_batch_index`).

    Raises:
        ValueError: ``global_index`` is not whole rounds of the processes (a position saved
            mid-update; checkpoints are written between updates).
    """
    if global_index % info.world_size:
        raise ValueError(f"global batch position {global_index} is not a whole round of "
                         f"{info.world_size} processes")
    return global_index // info.world_size


def loader_workers(device: torch.device) -> int:
    """Worker processes that pad a memory-mapped corpus's batches ahead of the step (a forked
    worker shares the map's pages): one beside an accelerator, whose step leaves the host's
    cores free; none on the CPU, whose step takes the cores a worker would use and lasts
    seconds against a collate of about a millisecond (bench/bench_data.py measures both)."""
    return 0 if device.type == "cpu" else 1


class EpochStream:
    """Batches of the training pairs, epoch after epoch, at the position a
    :class:`~aiayn.training.state.TrainState` holds (``epoch``, ``batch_in_epoch``).

    Args:
        config: the run's config (``data.max_tokens``, ``data.bpe_dropout``, ``train.seed``,
            and the model's ``decoder_start_id``, the decoder inputs' first token).
        train: the encoded training pairs.
        train_text: the pairs ``train`` was encoded from; needed only with ``data.bpe_dropout``.
        info: this process among the others (its shard).

    Raises:
        ValueError: no training pairs, or ``data.bpe_dropout`` without ``train_text``.
    """

    def __init__(self, config: Config, vocab: Vocabulary, train: EncodedCorpus,
                 train_text: ParallelCorpus | None, info: DistInfo) -> None:
        if len(train) == 0:
            raise ValueError("no training pairs: every epoch would be empty")
        self.config, self.train, self.info = config, train, info
        self.start_id = config.model.decoder_start_id
        self._dropped: DroppedCorpus | None = None
        if config.data.bpe_dropout > 0:
            if train_text is None:
                raise ValueError("data.bpe_dropout needs the training pairs' text (train_text)")
            self._dropped = DroppedCorpus(
                vocab, [train_text.src[i] for i in train.index],
                [train_text.tgt[i] for i in train.index], train, config.data.bpe_dropout,
                config.data.max_len, config.train.seed,
                restrict_target=config.model.output_vocab == "target")
        self._epoch_data: tuple[int, EncodedCorpus] | None = None
        self._epoch_batches: tuple[int, list[np.ndarray]] | None = None
        self._iter: Iterator[tuple[int, int, Batch]] | None = None
        self._pin = False

    def data_of_epoch(self, epoch: int) -> EncodedCorpus:
        """The training pairs as ``epoch`` sees them: the encoded corpus, or with
        ``data.bpe_dropout`` its segmentation for ``(train.seed, epoch)`` (the last one kept)."""
        if self._dropped is None:
            return self.train
        if self._epoch_data is None or self._epoch_data[0] != epoch:
            self._epoch_data = (epoch, self._dropped.epoch(epoch))
        return self._epoch_data[1]

    def batches_of_epoch(self, epoch: int) -> list[list[int]]:
        """The batches of ``epoch`` this process trains on, in order: lists of indices into
        :meth:`data_of_epoch`, each batch at most ``data.max_tokens`` tokens a side (padding
        included), shuffled by ``(train.seed, epoch)``, their count made a multiple of one
        update's batches (processes x ``train.accum_steps``) and dealt by rank. Deterministic:
        resuming, and benchmarks that time the same batches, call it again."""
        return [b.tolist() for b in self.batch_arrays(epoch)]

    def batch_arrays(self, epoch: int) -> list[np.ndarray]:
        """:meth:`batches_of_epoch` as int64 arrays (the last epoch's kept)."""
        if self._epoch_batches is None or self._epoch_batches[0] != epoch:
            data = self.data_of_epoch(epoch)
            batches = make_batch_arrays(
                data.src_lengths(), data.tgt_lengths(), self.config.data.max_tokens,
                seed=self.config.train.seed, epoch=epoch, shuffle=True,
                num_shards=self.info.world_size, shard_index=self.info.rank,
                multiple_of=self.info.world_size * self.config.train.accum_steps)
            if not batches:
                raise ValueError(f"epoch {epoch} has no batch")  # guarded in __init__
            self._epoch_batches = (epoch, batches)
        return self._epoch_batches[1]

    def next_batch(self, state: TrainState, device: torch.device) -> Batch:
        """The batch at ``state``'s position, on ``device``; the position moves on by one
        batch, to the next epoch when this one is used up."""
        if self._iter is None:
            self._iter = self._loader(state.epoch, state.batch_in_epoch, device)
        epoch, pos, batch = next(self._iter)
        expected = (state.epoch, state.batch_in_epoch)
        if (epoch, pos) != expected and not (epoch > state.epoch and pos == 0):
            # the position was moved from outside (a restored state): start again from it
            self._iter = None
            return self.next_batch(state, device)
        state.epoch, state.batch_in_epoch = epoch, pos + 1
        return batch.to(device, non_blocking=self._pin)

    def _loader(self, epoch: int, position: int,
                device: torch.device) -> Iterator[tuple[int, int, Batch]]:
        """(epoch, position, batch) from ``(epoch, position)`` on, through a DataLoader."""
        prepared = hasattr(self.train, "collate_rows") and self._dropped is None
        self._pin = device.type == "cuda"
        workers = loader_workers(device) if prepared else 0
        loader = torch.utils.data.DataLoader(
            _Padder(self), batch_sampler=_Positions(self, epoch, position),
            collate_fn=_first, num_workers=workers, pin_memory=self._pin,
            prefetch_factor=2 if workers else None, persistent_workers=False,
            # its own generator: starting a loader must not draw from the global RNG, whose
            # state (dropout masks) a checkpoint restores
            generator=torch.Generator())
        return iter(loader)

    def seek(self) -> None:
        """Forget the batches read ahead: the next batch is found from the state's position
        again (after a resume)."""
        self._iter = None


class _Positions:
    """The DataLoader's batch sampler: (epoch, position, indices) of every batch from a
    position on, epoch after epoch (read in the training process)."""

    def __init__(self, stream: EpochStream, epoch: int, position: int) -> None:
        self.stream, self.epoch, self.position = stream, epoch, position

    def __iter__(self) -> Iterator[tuple[int, int, np.ndarray]]:
        epoch, position = self.epoch, self.position
        while True:
            batches = self.stream.batch_arrays(epoch)
            for k in range(position, len(batches)):
                yield epoch, k, batches[k]
            epoch, position = epoch + 1, 0


class _Padder(torch.utils.data.Dataset):
    """Pads one tagged batch of the stream's corpus (in the DataLoader's worker)."""

    def __init__(self, stream: EpochStream) -> None:
        self.stream = stream

    def __len__(self) -> int:
        return len(self.stream.train)

    def __getitem__(self, item: Any) -> Any:
        raise TypeError("pairs are read a batch at a time (__getitems__)")

    def __getitems__(self, item: tuple[int, int, np.ndarray]) -> tuple[int, int, Batch]:
        epoch, position, indices = item
        data = self.stream.data_of_epoch(epoch)
        return epoch, position, collate(data, indices, start_id=self.stream.start_id)


def _first(batch: Any) -> Any:
    return batch
