"""Token-based batching, §5.1: "Sentence pairs were batched together by approximate sequence
length. Each training batch contained a set of sentence pairs containing approximately 25000
source tokens and 25000 target tokens."

A batch here holds at most ``max_tokens`` source tokens and at most ``max_tokens`` target tokens,
counted with padding (rows × longest row), so the bound also holds for real tokens. Batches are a
pure function of (lengths, max_tokens, seed, epoch): resuming a run recomputes them and skips the
ones already seen.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from aiayn.data.corpus import ParallelCorpus
from aiayn.data.vocab import EOS_ID, PAD_ID, Vocabulary


@dataclass
class EncodedCorpus:
    """Token ids of a corpus; sources end in EOS, targets hold the bare tokens.

    Attributes:
        src, tgt: per kept pair, token ids.
        index: per kept pair, its line index in the original corpus.
        filtered: pairs dropped for exceeding ``max_len``.
        name: the corpus's name, for messages.
    """

    src: list[list[int]]
    tgt: list[list[int]]
    index: list[int]
    filtered: int = 0
    name: str = "corpus"

    def __len__(self) -> int:
        return len(self.src)

    def src_lengths(self) -> np.ndarray:
        """(n,) int64 encoder lengths: source tokens + EOS."""
        return np.fromiter((len(s) for s in self.src), dtype=np.int64, count=len(self.src))

    def tgt_lengths(self) -> np.ndarray:
        """(n,) int64 decoder lengths: target tokens + 1 (the start token in the input, EOS in
        the output)."""
        return np.fromiter((len(t) + 1 for t in self.tgt), dtype=np.int64, count=len(self.tgt))

    def target_token_ids(self) -> np.ndarray:
        """(k,) int64 sorted ids of the tokens the targets hold, EOS included (every target
        ends in it): the tokens a decoder trained on this corpus is asked to produce."""
        ids = np.fromiter(itertools.chain.from_iterable(self.tgt), dtype=np.int64)
        return np.union1d(ids, np.array([EOS_ID], dtype=np.int64))

    def describe(self) -> str:
        """One line for logs: pairs kept and pairs filtered for length."""
        total = len(self) + self.filtered
        return (f"{self.name}: {len(self)} of {total} pairs kept, {self.filtered} over the "
                "maximum length filtered")


def encode_corpus(vocab: Vocabulary, corpus: ParallelCorpus, max_len: int) -> EncodedCorpus:
    """Encode both sides; drop pairs whose source + EOS or target + EOS exceed ``max_len``
    tokens, and count them in ``filtered`` (see :meth:`EncodedCorpus.describe`).

    Raises:
        ValueError: ``max_len`` < 2 (no pair could be kept).
    """
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (a token and EOS), got {max_len}")
    src_ids = vocab.encode_batch(corpus.src)
    tgt_ids = vocab.encode_batch(corpus.tgt)
    out = EncodedCorpus([], [], [], name=corpus.name)
    for i, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)):
        if len(s) + 1 > max_len or len(t) + 1 > max_len:
            out.filtered += 1
            continue
        out.src.append(s + [EOS_ID])
        out.tgt.append(t)
        out.index.append(i)
    return out


def make_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int,
                 **kwargs: Any) -> list[list[int]]:
    """:func:`make_batch_arrays` as lists of ints (same arguments, same batches)."""
    return [b.tolist() for b in make_batch_arrays(src_lengths, tgt_lengths, max_tokens,
                                                  **kwargs)]


def make_batch_arrays(
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    max_tokens: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    num_shards: int = 1,
    shard_index: int = 0,
    multiple_of: int = 0,
) -> list[np.ndarray]:
    """Group pair indices into batches of similar length, §5.1.

    Pairs are sorted by (target length, source length) with ties broken at random, cut greedily
    into batches whose padded size stays within ``max_tokens`` on each side, and the batch order
    is shuffled. All randomness comes from ``(seed, epoch)``: the same arguments give the same
    batches. With ``num_shards`` > 1 the batches are dealt round-robin, so the shards partition
    the epoch (no pair lost or repeated); the largest batches are first split in two as often as
    needed for the count to be a multiple of ``multiple_of`` (default ``num_shards``), so that
    every shard gets the same number of batches (data-parallel processes must take the same
    number of steps). Training passes the batches of one update (processes x accumulation
    steps): every epoch is then whole updates, and the epoch's batches in dealing order are
    the same for any split of that number into processes and accumulation steps, so a position
    counted in them (a global batch index) holds when the number of processes changes.

    Args:
        src_lengths, tgt_lengths: (n,) int token counts per pair, as fed to the model (see
            :meth:`EncodedCorpus.src_lengths`, :meth:`EncodedCorpus.tgt_lengths`).
        max_tokens: bound on rows × longest row, each side, in tokens.
        seed, epoch: the random state of the tie-breaking and the batch order.
        shuffle: False gives batches in length order with no randomness.
        num_shards, shard_index: this process's share of the batches.
        multiple_of: the batch count is made a multiple of this (a multiple of
            ``num_shards``; 0: ``num_shards``).

    Returns:
        This shard's batches, each an int64 array of indices into the corpus.

    Raises:
        ValueError: a pair longer than ``max_tokens`` (it could never fit), lengths of different
            shapes, a bad shard, fewer pairs than shards, ``multiple_of`` not a multiple of
            ``num_shards``, or batches that cannot be made a multiple (all of one pair each).
    """
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index={shard_index} is not in [0, num_shards={num_shards})")
    multiple_of = multiple_of or num_shards
    if multiple_of % num_shards:
        raise ValueError(f"multiple_of={multiple_of} is not a multiple of "
                         f"num_shards={num_shards}")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    src_lengths, tgt_lengths = np.asarray(src_lengths), np.asarray(tgt_lengths)
    if src_lengths.shape != tgt_lengths.shape or src_lengths.ndim != 1:
        raise ValueError(f"src_lengths {src_lengths.shape} and tgt_lengths {tgt_lengths.shape} "
                         "must be 1-D and of one length")
    n = len(src_lengths)
    if n == 0:
        return []
    longest = int(max(src_lengths.max(), tgt_lengths.max()))
    if longest > max_tokens:
        raise ValueError(f"a pair of {longest} tokens cannot fit max_tokens={max_tokens}; "
                         "raise max_tokens or lower the maximum length")
    if n < num_shards:
        raise ValueError(f"{n} pairs cannot give each of num_shards={num_shards} shards a batch")
    rng = np.random.default_rng([seed, epoch])
    tiebreak = rng.random(n) if shuffle else np.arange(n)
    order = np.lexsort((tiebreak, src_lengths, tgt_lengths))
    batches = [order[a:b] for a, b in _cuts(src_lengths[order], tgt_lengths[order], max_tokens)]
    if multiple_of > 1:
        batches = _split_to_multiple(batches, multiple_of)
    if shuffle:
        perm = rng.permutation(len(batches))
        batches = [batches[j] for j in perm]
    return batches[shard_index::num_shards]


def _cuts(src: np.ndarray, tgt: np.ndarray, max_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of the greedy batches of pairs in the given order (targets ascending):
    each batch is the longest run from its start whose rows x longest row stays within
    ``max_tokens`` on each side. Both products only grow along a run, so the end is the
    first position where one exceeds, found in numpy over a window of the rows the batch's
    first target allows (one window per batch, no loop over pairs)."""
    n = len(src)
    src = src.astype(np.int64, copy=False)
    tgt = tgt.astype(np.int64, copy=False)
    out: list[tuple[int, int]] = []
    start = 0
    while start < n:
        # targets ascend, so no batch from here holds more than max_tokens // tgt[start] rows
        end = min(n, start + max_tokens // int(tgt[start]) + 1)
        rows = np.arange(1, end - start + 1)
        over = ((np.maximum.accumulate(src[start:end]) * rows > max_tokens)
                | (np.maximum.accumulate(tgt[start:end]) * rows > max_tokens))
        hit = int(over.argmax()) if over[-1] else end - start  # over is monotone
        stop = start + max(1, hit)
        out.append((start, stop))
        start = stop
    return out


def _split_to_multiple(batches: list[np.ndarray], k: int) -> list[np.ndarray]:
    """Split the largest batch in halves, fewer than ``k`` times, until the number of batches is
    a multiple of ``k``. Halves of a batch fit whatever the batch fit."""
    batches = list(batches)
    for _ in range(-len(batches) % k):
        sizes = np.fromiter(map(len, batches), np.int64, len(batches))
        j = int(sizes.argmax())  # the first of the largest, as max() took it
        b = batches[j]
        if len(b) < 2:  # found by the property tests: every batch is a single pair
            raise ValueError(f"{len(batches)} batches of one pair each cannot be dealt "
                             f"equally to {k} (shards, or the batches of one update); raise "
                             "max_tokens (each pair takes more than half of it)")
        batches[j : j + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return batches


@dataclass
class Batch:
    """Padded tensors for one batch (B rows).

    Attributes:
        src: (B, S) source ids ending in EOS, right-padded with PAD.
        tgt_in: (B, T) the start token + target, the decoder input shifted right (§3.1).
        tgt_out: (B, T) target + EOS, what the decoder must predict; PAD where ignored.
        indices: the corpus indices of the rows.
    """

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    indices: list[int]

    @property
    def tgt_tokens(self) -> int:
        return int((self.tgt_out != PAD_ID).sum())

    @property
    def src_tokens(self) -> int:
        return int((self.src != PAD_ID).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(self.src.to(device, non_blocking=non_blocking),
                     self.tgt_in.to(device, non_blocking=non_blocking),
                     self.tgt_out.to(device, non_blocking=non_blocking), self.indices)

    def pin_memory(self) -> Batch:
        """The batch in page-locked memory (``torch.utils.data.DataLoader(pin_memory=True)``
        calls it), for asynchronous copies to a GPU."""
        return Batch(self.src.pin_memory(), self.tgt_in.pin_memory(),
                     self.tgt_out.pin_memory(), self.indices)


def collate(corpus: Any, indices: Any, *, start_id: int) -> Batch:
    """Pad the pairs ``indices`` of ``corpus`` (an :class:`EncodedCorpus`, or a
    :class:`~aiayn.data.prepared.PreparedCorpus`, whose slices are read from its memory map)
    into a :class:`Batch` (int64 tensors on CPU).

    The decoder's inputs are the targets shifted right behind ``start_id``, the model's
    ``config.decoder_start_id`` (BOS; pad in Marian models), the token every search starts
    from (§3: "offset by one position")."""
    if hasattr(corpus, "collate_rows"):
        src, tgt_in, tgt_out, index = corpus.collate_rows(indices, start_id)
        return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                     index)
    srcs = [corpus.src[i] for i in indices]
    tgts = [corpus.tgt[i] for i in indices]
    B = len(indices)
    S = max(len(s) for s in srcs)
    T = max(len(t) for t in tgts) + 1
    src = np.full((B, S), PAD_ID, dtype=np.int64)
    tgt_in = np.full((B, T), PAD_ID, dtype=np.int64)
    tgt_out = np.full((B, T), PAD_ID, dtype=np.int64)
    tgt_in[:, 0] = start_id
    for r, (s, t) in enumerate(zip(srcs, tgts, strict=True)):
        src[r, : len(s)] = s
        tgt_in[r, 1 : len(t) + 1] = t
        tgt_out[r, : len(t)] = t
        tgt_out[r, len(t)] = EOS_ID
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                 [corpus.index[i] for i in indices])


def pad_sources(seqs: list[list[int]]) -> Tensor:
    """Right-pad source id lists (already ending in EOS) into (B, S) with PAD."""
    S = max(len(s) for s in seqs)
    out = torch.full((len(seqs), S), PAD_ID, dtype=torch.long)
    for r, s in enumerate(seqs):
        out[r, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out
