"""BPE-dropout: a new segmentation of the training text every epoch (Provilkov et al., 2020,
"BPE-Dropout: Simple and Effective Subword Regularization"; not in the paper).

BPE segments a word by applying its learned merges, best-ranked first, until none applies.
BPE-dropout skips each applicable merge with probability ``p`` at every step, so a word comes
out in smaller pieces now and then (``▁people`` as ``▁peop le`` or ``▁p e op le``), and the model
sees many segmentations of the same text. ``p = 0`` gives the vocabulary's own segmentation.

Hugging Face ``tokenizers`` implements the same idea, but draws from a generator that cannot be
seeded, which would break exact resume. Here every epoch's segmentation is a pure function of
``(seed, epoch)``, and it is cheap: the corpus is split into words once, each word type's
deterministic merge path is stored, and per occurrence one geometric draw says at which merge
the first skip happens; when that is past the end of the path (probability ``(1 - p)^m`` for a
word of ``m`` merges) the stored result is used, else the merging continues at random from the
stored state at that point, which samples exactly the distribution defined above.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import numpy as np

from aiayn.data.batching import EncodedCorpus
from aiayn.data.vocab import EOS_ID, Vocabulary


class BpeDropout:
    """Sample BPE-dropout segmentations of a fixed list of sentences.

    Args:
        vocab: a BPE :class:`~aiayn.data.vocab.Vocabulary` (``kind == "bpe"``).
        texts: the sentences, as given to ``vocab.encode``.
        p: the probability of skipping a merge, in [0, 1).
        allowed: token ids a segmentation may use (the output vocabulary of a decoder trained on
            these texts); an occurrence whose sampled pieces fall outside keeps the vocabulary's
            own segmentation. None: any token.

    Raises:
        ValueError: ``p`` outside [0, 1), or a vocabulary that is not BPE.
    """

    def __init__(self, vocab: Vocabulary, texts: Sequence[str], p: float,
                 allowed: np.ndarray | None = None) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"BPE-dropout probability must be in [0, 1), got {p}")
        if getattr(vocab, "kind", None) != "bpe":
            raise ValueError(f"BPE-dropout needs a BPE vocabulary, not "
                             f"{getattr(vocab, 'kind', type(vocab).__name__)!r}")
        model = json.loads(vocab.tokenizer.to_str())["model"]
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
                or model.get("ignore_merges"):
            raise ValueError("BPE-dropout supports plain BPE vocabularies (no subword prefix or "
                             "suffix, no ignore_merges), as `aiayn vocab` makes them")
        self.p = p
        self._ids: dict[str, int] = model["vocab"]
        self._ranks: dict[tuple[str, str], int] = {
            (tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))): r
            for r, m in enumerate(model["merges"])}
        self._allowed = None if allowed is None else set(int(t) for t in allowed)

        pre = vocab.tokenizer.pre_tokenizer
        norm = vocab.tokenizer.normalizer
        type_of: dict[str, int] = {}
        self._words: list[str] = []
        sentences: list[list[int]] = []
        for text in texts:
            text = norm.normalize_str(text) if norm is not None else text
            row = []
            for word, _ in pre.pre_tokenize_str(text):
                t = type_of.get(word)
                if t is None:
                    t = type_of[word] = len(self._words)
                    self._words.append(word)
                row.append(t)
            sentences.append(row)
        self._lengths = np.array([len(r) for r in sentences], dtype=np.int64)
        self._occurrences = np.fromiter((t for r in sentences for t in r), dtype=np.int64,
                                        count=int(self._lengths.sum()))
        # per word type: the states of the deterministic merge path and its final ids
        self._paths: list[list[tuple[str, ...]]] = []
        self._final: list[list[int]] = []
        merges = np.zeros(len(self._words), dtype=np.int64)
        for t, word in enumerate(self._words):
            if all(ch in self._ids for ch in word):
                path = self._merge_path(word)
                merges[t] = len(path) - 1
                self._final.append([self._ids[s] for s in path[-1]])
            else:  # a character outside the vocabulary: the tokenizer's own answer, fixed
                path = [(word,)]
                self._final.append([tok.id for tok in vocab.tokenizer.model.tokenize(word)])
            self._paths.append(path)
        self._merges = merges

    def __len__(self) -> int:
        return len(self._lengths)

    # --- merging ---------------------------------------------------------------------------
    def _candidates(self, symbols: Sequence[str]) -> list[tuple[int, int]]:
        """(rank, position) of every applicable merge, best first."""
        ranks = self._ranks
        out = []
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None:
                out.append((r, i))
        out.sort()
        return out

    def _merge_path(self, word: str) -> list[tuple[str, ...]]:
        """The deterministic BPE of ``word``: the symbols before each merge and at the end."""
        symbols = tuple(word)
        path = [symbols]
        while cands := self._candidates(symbols):
            i = cands[0][1]
            symbols = symbols[:i] + (symbols[i] + symbols[i + 1],) + symbols[i + 2:]
            path.append(symbols)
        return path

    def _continue(self, symbols: Sequence[str], draw: random.Random) -> list[str]:
        """Merge on from ``symbols`` whose best merge was just skipped: every later merge step
        skips each applicable merge with probability p and applies the first one kept."""
        symbols = list(symbols)
        first = True
        while True:
            chosen = None
            for _, i in self._candidates(symbols):
                if first:  # the skip that brought us here
                    first = False
                    continue
                if draw.random() >= self.p:
                    chosen = i
                    break
            if chosen is None:
                return symbols
            symbols[chosen:chosen + 2] = [symbols[chosen] + symbols[chosen + 1]]

    # --- sampling --------------------------------------------------------------------------
    def deterministic(self) -> list[list[int]]:
        """Every sentence under the vocabulary's own segmentation (what ``p = 0`` samples)."""
        return self._assemble(self._final_of_occurrences())

    def _final_of_occurrences(self) -> list[list[int]]:
        final = self._final
        return [final[t] for t in self._occurrences.tolist()]

    def sample(self, rng: np.random.Generator) -> list[list[int]]:
        """One segmentation of every sentence: per sentence, its token ids (no EOS).

        All randomness comes from ``rng``; the same generator state gives the same result.
        """
        pieces = self._final_of_occurrences()
        if self.p == 0.0 or len(self._occurrences) == 0:
            return self._assemble(pieces)
        first_skip = rng.geometric(self.p, size=len(self._occurrences))  # merge step, from 1
        dropped = np.flatnonzero(first_skip <= self._merges[self._occurrences])
        draw = random.Random(int(rng.integers(2**63)))
        ids, allowed = self._ids, self._allowed
        for j, t, k in zip(dropped.tolist(), self._occurrences[dropped].tolist(),
                           first_skip[dropped].tolist()):
            out = [ids[s] for s in self._continue(self._paths[t][k - 1], draw)]
            if allowed is None or all(i in allowed for i in out):
                pieces[j] = out
        return self._assemble(pieces)

    def _assemble(self, pieces: list[list[int]]) -> list[list[int]]:
        out, start = [], 0
        for n in self._lengths.tolist():
            row: list[int] = []
            for p in pieces[start:start + n]:
                row.extend(p)
            out.append(row)
            start += n
        return out


class DroppedCorpus:
    """Training pairs re-segmented with BPE-dropout every epoch.

    Wraps the deterministic :class:`~aiayn.data.batching.EncodedCorpus` of the same pairs; a
    pair whose sampled segmentation exceeds ``max_len`` on a side keeps its deterministic one
    on that side, so every epoch holds the same pairs in the same order.

    Args:
        vocab: the BPE vocabulary ``base`` was encoded with.
        src, tgt: the texts of the pairs ``base`` kept, in its order.
        base: the deterministic encoding.
        p: the probability of skipping a merge, in [0, 1).
        max_len: the length limit ``base`` was filtered with (tokens with EOS).
        seed: with the epoch, all the randomness of :meth:`epoch` (``train.seed``).
        restrict_target: only segment targets into tokens ``base``'s targets hold (for
            ``model.output_vocab = "target"``).
    """

    def __init__(self, vocab: Vocabulary, src: Sequence[str], tgt: Sequence[str],
                 base: EncodedCorpus, p: float, max_len: int, seed: int,
                 restrict_target: bool = False) -> None:
        if len(src) != len(base) or len(tgt) != len(base):
            raise ValueError(f"{len(src)} source and {len(tgt)} target texts for "
                             f"{len(base)} encoded pairs")
        self.base, self.max_len, self.seed = base, max_len, seed
        self._src = BpeDropout(vocab, src, p)
        self._tgt = BpeDropout(vocab, tgt, p,
                               allowed=base.target_token_ids() if restrict_target else None)

    def epoch(self, epoch: int) -> EncodedCorpus:
        """The pairs as segmented for ``epoch``: a pure function of ``(seed, epoch)``."""
        rng = np.random.default_rng([self.seed, epoch, 0xB9E])
        src = self._src.sample(rng)
        tgt = self._tgt.sample(rng)
        base = self.base
        out_src = [s + [EOS_ID] if len(s) + 1 <= self.max_len else b
                   for s, b in zip(src, base.src, strict=True)]
        out_tgt = [t if len(t) + 1 <= self.max_len else b
                   for t, b in zip(tgt, base.tgt, strict=True)]
        return EncodedCorpus(out_src, out_tgt, base.index, base.filtered, base.name)
