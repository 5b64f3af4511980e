"""A lexical shortlist (opt-in; not in the paper): each sentence's next token is chosen only
among the target tokens its source tokens are likely to translate to, plus the most frequent
target tokens, so the output layer scores a few thousand columns, not the whole vocabulary.

It is Marian's lexical shortlist and CTranslate2's vocabulary map (``vmap``), and it changes
outputs: a token off a sentence's list cannot be produced. Two choices differ from both:

- **Per sentence, not per batch.** The output layer scores the union of the batch's lists
  (the work saved), and each row then gives ``-inf`` to the tokens off its own sentence's
  list, so a sentence translates the same alone or in any batch (the batch invariance that
  aiayn promises, ``docs/benchmarks.md``). Marian and CTranslate2 let a sentence produce any
  token of its batch's union.
- **Built from the training data by IBM Model 1** (Brown et al., 1993: a few EM iterations of
  the lexical translation probabilities p(t | s) over the training pairs, with a NULL source
  word), since no aligner is installed: a source token's list is its ``best`` most likely
  targets, plus the token itself where the target side uses it (names, numbers).

The file is CTranslate2's vmap, so one file serves both engines (``aiayn convert --to
ctranslate2 --vmap FILE``): one line per source token, ``SOURCE<TAB>TARGET TARGET ...``,
with tokens as the vocabulary spells them; the line whose source is empty lists the tokens
every sentence may produce. Source n-grams (keys with spaces), which CTranslate2 reads, are
refused here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from aiayn.decoding.search import StepFunction
from aiayn.errors import DataError

NEG_INF = float("-inf")


def _pieces(vocab, side: str) -> list[str]:
    """The token strings of ``vocab`` (side "src" or "tgt"), indexed by id."""
    if hasattr(vocab, "source_pieces"):  # SentencePiece (a converted Marian model)
        return list(vocab.source_pieces if side == "src" else vocab.output_pieces)
    tok = vocab.tokenizer
    return [tok.id_to_token(i) for i in range(len(vocab))]


@dataclass(frozen=True)
class LexicalTable:
    """IBM Model 1's lexical translation probabilities p(t | s) over subword ids (Brown et al.,
    1993), as sorted sparse pairs: what :func:`ibm_model1` learns, for the shortlist and for
    guided alignment's reference links (:mod:`aiayn.decoding.alignment`).

    Attributes:
        keys: int64 (nnz,) sorted ``s * (vocab_size + 1) + t``; ``s == vocab_size`` is NULL.
        prob: float64 (nnz,) p(t | s) of each key.
        vocab_size: ids are in [0, vocab_size) on both sides.
        target_counts: int64 (vocab_size,) how often each target id occurs in the pairs.
    """

    keys: np.ndarray
    prob: np.ndarray
    vocab_size: int
    target_counts: np.ndarray

    @property
    def source(self) -> np.ndarray:
        """(nnz,) the source id of each key (``vocab_size``: NULL)."""
        return self.keys // (self.vocab_size + 1)

    @property
    def target(self) -> np.ndarray:
        """(nnz,) the target id of each key."""
        return self.keys % (self.vocab_size + 1)


def ibm_model1(pairs: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int, *,
               iterations: int = 5,
               progress: Callable[[str], None] | None = None) -> LexicalTable:
    """Estimate p(t | s) by IBM Model 1 (EM, a NULL source word; the first iteration is a
    co-occurrence count) over ``pairs`` of (source ids, target ids) without BOS/EOS.

    Raises:
        ValueError: no iterations, or no pair with tokens on both sides.
    """
    if iterations < 1:
        raise ValueError(f"IBM Model 1 needs iterations >= 1, got {iterations}")
    NULL = vocab_size  # IBM Model 1's empty source word, one past the vocabulary
    src_cols, tgt_cols, group_cols = [], [], []
    group = 0
    tgt_count = np.zeros(vocab_size, dtype=np.int64)
    for s, t in pairs:
        if not len(s) or not len(t):
            continue
        s = np.asarray(list(s) + [NULL], dtype=np.int64)
        t = np.asarray(t, dtype=np.int64)
        np.add.at(tgt_count, t, 1)
        # one (source word, target position) link for every source word of the pair
        src_cols.append(np.tile(s, len(t)))
        tgt_cols.append(np.repeat(t, len(s)))
        group_cols.append(np.repeat(np.arange(group, group + len(t)), len(s)))
        group += len(t)
    if not src_cols:
        raise ValueError("no sentence pair with tokens on both sides to build a shortlist")
    src, tgt, grp = (np.concatenate(c) for c in (src_cols, tgt_cols, group_cols))
    del src_cols, tgt_cols, group_cols
    keys, link = np.unique(src * (vocab_size + 1) + tgt, return_inverse=True)
    del tgt
    pair_src = keys // (vocab_size + 1)
    theta = np.ones(len(keys))  # p(t | s) up to a factor per s: uniform to start
    for it in range(iterations):
        p = theta[link]
        share = p / np.bincount(grp, weights=p, minlength=group)[grp]  # E step
        counts = np.bincount(link, weights=share, minlength=len(keys))
        totals = np.bincount(pair_src, weights=counts, minlength=vocab_size + 1)
        theta = counts / totals[pair_src]  # M step
        if progress is not None:
            progress(f"shortlist: IBM Model 1 iteration {it + 1}/{iterations} over "
                     f"{group:,} target tokens, {len(keys):,} word pairs")
    return LexicalTable(keys, theta, vocab_size, tgt_count)


@dataclass(frozen=True)
class Shortlist:
    """Which target tokens each source token may bring into a sentence's output.

    Attributes:
        always: long (k,) target ids every sentence may produce (the most frequent ones).
        offsets: long (V_src + 1,) CSR row starts: source id s lists
            ``targets[offsets[s]:offsets[s + 1]]``.
        targets: long (nnz,) target ids.
        source: the vmap file it was read from (:meth:`load`), None when built in memory.
    """

    always: Tensor
    offsets: Tensor
    targets: Tensor
    source: str | None = field(default=None, compare=False)

    # --- building -------------------------------------------------------------------------
    @classmethod
    def build(cls, pairs: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int, *,
              first: int = 300, best: int = 50, iterations: int = 5,
              progress: Callable[[str], None] | None = None) -> Shortlist:
        """Estimate p(t | s) by IBM Model 1 on ``pairs`` and keep, for every source token,
        its ``best`` most likely targets (and itself where the target side uses it), and the
        ``first`` most frequent target tokens for every sentence.

        Args:
            pairs: (source ids, target ids) of training sentences, without BOS/EOS.
            vocab_size: ids are in [0, vocab_size) on both sides.
            first, best: Marian's names for the two list sizes; >= 0.
            iterations: EM iterations (>= 1; the first is a co-occurrence count).
            progress: receives one line per iteration.

        Raises:
            ValueError: a negative size, no iterations, or no pair with tokens on both sides.
        """
        if first < 0 or best < 0 or iterations < 1:
            raise ValueError(f"first and best must be >= 0 and iterations >= 1, got "
                             f"first={first}, best={best}, iterations={iterations}")
        table = ibm_model1(pairs, vocab_size, iterations=iterations, progress=progress)
        pair_src, pair_tgt, theta, tgt_count = (table.source, table.target, table.prob,
                                                table.target_counts)
        lists: list[np.ndarray] = []
        seen_tgt = tgt_count > 0
        order = np.lexsort((-theta, pair_src))  # by source, then most likely first
        starts = np.searchsorted(pair_src[order], np.arange(vocab_size + 1))
        for s_id in range(vocab_size):
            top = pair_tgt[order[starts[s_id]:starts[s_id + 1]][:best]]
            if seen_tgt[s_id]:
                top = np.append(top, s_id)  # a name or number is copied
            lists.append(np.unique(top))
        counts_per = np.array([len(x) for x in lists], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts_per)])
        targets = np.concatenate(lists) if lists else np.zeros(0, dtype=np.int64)
        by_freq = np.argsort(-tgt_count, kind="stable")[:first]
        always = np.sort(by_freq[tgt_count[by_freq] > 0])
        return cls(torch.from_numpy(always), torch.from_numpy(offsets),
                   torch.from_numpy(targets.astype(np.int64)))

    # --- the file: CTranslate2's vmap -----------------------------------------------------
    def save(self, path: str | Path, vocab) -> Path:
        """Write the vmap file (atomically); returns its path.

        Raises:
            DataError: a token string with a space or tab, which the format cannot hold.
        """
        from aiayn.fileio import write_atomic

        src, tgt = _pieces(vocab, "src"), _pieces(vocab, "tgt")
        bad = [p for p in src + tgt if p is not None and (" " in p or "\t" in p)]
        if bad:
            raise DataError(f"token {bad[0]!r} holds a space or tab: a vmap file cannot "
                            "hold this vocabulary")
        lines = ["\t" + " ".join(tgt[i] for i in self.always.tolist())]
        for s_id in range(len(self.offsets) - 1):
            row = self.targets[self.offsets[s_id]:self.offsets[s_id + 1]].tolist()
            if row:
                lines.append(src[s_id] + "\t" + " ".join(tgt[i] for i in row))
        return write_atomic(path, "\n".join(lines) + "\n")

    @classmethod
    def load(cls, path: str | Path, vocab) -> Shortlist:
        """Read a vmap file written by :meth:`save` (or for CTranslate2, without n-grams).

        Raises:
            DataError: a missing or empty file, or a line without a tab, with an n-gram key,
                or naming a token the vocabulary lacks (naming the file and line).
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"{path}: cannot read the shortlist: {err}") from None
        src_index = {p: i for i, p in enumerate(_pieces(vocab, "src"))}
        tgt_index = {p: i for i, p in enumerate(_pieces(vocab, "tgt"))}
        rows: dict[int, list[int]] = {}
        always: list[int] = []
        for n, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            key, tab, values = line.partition("\t")
            if not tab:
                raise DataError(f"{path}:{n}: no tab between the source token and its "
                                "targets (the vmap format: SOURCE<TAB>TARGET TARGET ...)")
            if " " in key:
                raise DataError(f"{path}:{n}: source n-gram {key!r}: only one-token keys "
                                "are supported")
            ids = []
            for piece in values.split():
                if piece not in tgt_index:
                    raise DataError(f"{path}:{n}: target token {piece!r} is not in the "
                                    "model's vocabulary (a shortlist of another model?)")
                ids.append(tgt_index[piece])
            if key == "":
                always.extend(ids)
            elif key not in src_index:
                raise DataError(f"{path}:{n}: source token {key!r} is not in the model's "
                                "vocabulary (a shortlist of another model?)")
            else:
                rows.setdefault(src_index[key], []).extend(ids)
        if not rows and not always:
            raise DataError(f"{path}: no entries (an empty shortlist would allow only EOS)")
        V = len(src_index)
        lists = [sorted(set(rows.get(s, []))) for s in range(V)]
        offsets = torch.tensor([0] + np.cumsum([len(x) for x in lists]).tolist(),
                               dtype=torch.long)
        targets = torch.tensor([i for x in lists for i in x], dtype=torch.long)
        return cls(torch.tensor(sorted(set(always)), dtype=torch.long), offsets, targets,
                   source=str(path))

    # --- use ------------------------------------------------------------------------------
    def candidates(self, sources: Sequence[Sequence[int]], fixed: int,
                   vocab_size: int) -> tuple[Tensor, Tensor]:
        """The columns a batch needs, and which of them each sentence may produce.

        Args:
            sources: B source id lists (padding and EOS may be in them).
            fixed: ids 0 .. fixed - 1 are always in, and first (the searches' PAD, BOS, EOS).
            vocab_size: the output layer's size (ids past it are refused).

        Returns:
            (ids, allowed): ids long (V',) increasing, the union of the batch's lists;
            allowed bool (B, V'), True where sentence b may produce column j.

        Raises:
            ValueError: a source id outside the shortlist's vocabulary.
        """
        B = len(sources)
        flat = torch.tensor([i for s in sources for i in s], dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(B),
                                      torch.tensor([len(s) for s in sources], dtype=torch.long))
        V_src = len(self.offsets) - 1
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= V_src):
            raise ValueError(f"source ids must be in [0, {V_src}) for this shortlist")
        start, stop = self.offsets[flat], self.offsets[flat + 1]
        count = stop - start
        total = int(count.sum())
        first = torch.repeat_interleave(start - (torch.cumsum(count, 0) - count), count)
        tgt = self.targets[first + torch.arange(total)]
        mat = torch.zeros(B, vocab_size, dtype=torch.bool)
        mat[torch.repeat_interleave(row, count), tgt] = True
        mat[:, self.always[self.always < vocab_size]] = True
        mat[:, :fixed] = True
        ids = mat.any(dim=0).nonzero().squeeze(1)
        return ids, mat[:, ids]

    def __repr__(self) -> str:
        V = len(self.offsets) - 1
        return (f"Shortlist(always={self.always.numel()}, sources={V}, "
                f"mean list={self.targets.numel() / max(V, 1):.1f})")


def build_shortlist(config, vocab, *, first: int = 300, best: int = 50, iterations: int = 5,
                    max_sentences: int = 200_000,
                    progress: Callable[[str], None] | None = None) -> Shortlist:
    """:meth:`Shortlist.build` on a run's training pairs (``config.data``'s train split,
    preprocessed as the model read it, encoded with ``vocab``), the first ``max_sentences``
    of them (0: all).

    Raises:
        DataError: the config names no training data.
    """
    import dataclasses

    from aiayn.data.splits import load_split

    data = config.data
    if max_sentences and not 0 < data.train_limit <= max_sentences:  # read only those
        data = dataclasses.replace(data, train_limit=max_sentences)
    train = load_split(data, "train")
    if train is None:
        raise DataError("the run's config names no training data to build a shortlist from")
    src, tgt = list(train.src), list(train.tgt)
    if progress is not None:
        progress(f"shortlist: encoding {len(src):,} training pairs")
    return Shortlist.build(zip(vocab.encode_batch(src), vocab.encode_batch(tgt)), len(vocab),
                           first=first, best=best, iterations=iterations, progress=progress)


class ShortlistStep(StepFunction):
    """A step function restricted per row to a sentence's shortlist: the inner step scores
    the batch's columns (``token_ids``), and each row's columns off its own sentence's list
    get ``-inf`` before the search's soft-max, so the row's distribution is the model's,
    renormalised over its list. Unlike the :class:`~aiayn.decoding.search.StepFunction`
    contract's compact maps, this changes results (opt-in: :mod:`aiayn.decoding.shortlist`).

    Args:
        step: a step function over the columns ``token_ids`` (long (V',)).
        banned: bool (B, V'): True where sentence b may not produce column j.
        sentence: long (n,): the sentence of each of the step's rows (default: row i is
            sentence i).
    """

    def __init__(self, step, banned: Tensor, sentence: Tensor | None = None) -> None:
        self.step = step
        self.banned = banned
        self.sentence = (torch.arange(banned.shape[0], device=banned.device)
                         if sentence is None else sentence)
        self.token_ids = step.token_ids

    @property
    def start_id(self) -> int:
        return self.step.start_id

    def __call__(self, tokens: Tensor) -> Tensor:
        logits = self.step(tokens).float()  # float32 already on the int8 path: in place
        return logits.masked_fill_(self.banned[self.sentence], NEG_INF)

    def select(self, index: Tensor) -> ShortlistStep:
        return ShortlistStep(self.step.select(index), self.banned, self.sentence[index])


__all__ = ["LexicalTable", "Shortlist", "ShortlistStep", "build_shortlist", "ibm_model1"]
