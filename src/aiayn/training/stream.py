"""The order in which training sees its pairs (§5.1): epochs of batches of about
``data.max_tokens`` tokens a side, shuffled by ``(train.seed, epoch)``, each process taking its
shard, and with ``data.bpe_dropout`` the pairs segmented anew every epoch. A pure function of
the seed and the position, so a resumed run continues exactly where it stopped."""

from __future__ import annotations

import torch

from aiayn.config import Config
from aiayn.data.batching import Batch, EncodedCorpus, collate, make_batches
from aiayn.data.bpe_dropout import DroppedCorpus
from aiayn.data.corpus import ParallelCorpus
from aiayn.data.vocab import Vocabulary
from aiayn.training.distributed import DistInfo
from aiayn.training.state import TrainState


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
        self._batches: list[list[int]] | None = None

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
        included), shuffled by ``(train.seed, epoch)`` and sharded by rank. Deterministic:
        resuming, and benchmarks that time the same batches, call it again."""
        data = self.data_of_epoch(epoch)
        return make_batches(data.src_lengths(), data.tgt_lengths(),
                            self.config.data.max_tokens, seed=self.config.train.seed,
                            epoch=epoch, shuffle=True, num_shards=self.info.world_size,
                            shard_index=self.info.rank)

    def next_batch(self, state: TrainState, device: torch.device) -> Batch:
        """The batch at ``state``'s position, on ``device``; the position moves on by one
        batch, to the next epoch when this one is used up."""
        if self._batches is None:
            self._batches = self.batches_of_epoch(state.epoch)
        while state.batch_in_epoch >= len(self._batches):
            if not self._batches and state.batch_in_epoch == 0:
                raise ValueError(f"epoch {state.epoch} has no batch")  # guarded in __init__
            state.epoch += 1
            state.batch_in_epoch = 0
            self._batches = self.batches_of_epoch(state.epoch)
        indices = self._batches[state.batch_in_epoch]
        state.batch_in_epoch += 1
        return collate(self.data_of_epoch(state.epoch), indices,
                       start_id=self.start_id).to(device)

    def seek(self) -> None:
        """Forget the current epoch's batches: the next batch is found from the state's
        position again (after a resume)."""
        self._batches = None
