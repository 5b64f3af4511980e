"""Shared source-target subword vocabulary, §5.1 (BPE for EN-DE, word-pieces for EN-FR).

Built on Hugging Face ``tokenizers``. The special tokens are defined here, once:

=========  ====  =============================================
token      id    use
=========  ====  =============================================
``<pad>``  0     padding (ignored by attention and the loss)
``<s>``    1     beginning of sentence (first decoder input)
``</s>``   2     end of sentence
``<unk>``  3     a character never seen when the vocabulary was learned
=========  ====  =============================================

Text is split on whitespace with a word-boundary marker (``▁``) kept on the subwords, so
``decode(encode(text)) == text`` for ordinary input: single spaces between words, no surrounding
whitespace, no ``▁`` of its own, and only characters seen when the vocabulary was learned (an
unseen character becomes ``<unk>``, which decodes to nothing). Special-token strings that occur in
the text itself (a literal ``</s>``) are encoded as ordinary text, never as the special ids.

A vocabulary is learned from at most ``data.vocab_sample_lines`` sentences (Marian's
``--sentencepiece-max-lines`` default, 2,000,000): both sides of pairs drawn once, uniformly and
with a fixed seed (:func:`sample_pair_indices`), streamed from the files (:class:`LearningSample`)
so that no corpus is held in memory to learn from it. BPE learning depends only on the words'
counts, not their order, so a corpus small enough to be used whole gives the same vocabulary
from files, from memory, in any process.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from aiayn.errors import ConfigError, DataError
from aiayn.rundir import TOKENIZER as VOCAB_FILE

if TYPE_CHECKING:
    from aiayn.config import DataConfig
    from aiayn.data.corpus import ParallelCorpus

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
# the pairs a vocabulary is learned from are drawn with this seed, whatever the run's seed: every
# process, every ensemble member and `aiayn vocab` draw the same sample from the same corpus
SAMPLE_SEED = 0
# sentences `aiayn vocab` checks decode(encode(s)) == s on: a sample, never a whole corpus
ROUND_TRIP_LINES = 100_000


class Vocabulary:
    """A trained subword vocabulary: text <-> token ids (no BOS/EOS added by ``encode``)."""

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, tokenizer: Tokenizer, kind: str = "bpe") -> None:
        for i, tok in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(tok) != i:
                raise DataError(f"vocabulary does not define {tok!r} as id {i} (found id "
                                f"{tokenizer.token_to_id(tok)}): not made by `aiayn vocab`")
        # A literal "</s>" in a sentence must not become EOS (nor "<pad>" padding); not saved
        # in tokenizer.json, so set on every construction.
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.kind = kind

    # --- learning -------------------------------------------------------------------------
    @classmethod
    def learn(cls, texts: Iterable[str] | Iterable[list[str]], size: int,
              kind: str = "bpe") -> Vocabulary:
        """Learn a vocabulary of ``size`` tokens (specials included) from ``texts``: sentences,
        or batches (lists) of them, e.g. :meth:`LearningSample.batches`; consumed once, as
        they come, so a generator keeps memory to the learner's own counts.

        The result may differ from ``size``: fewer tokens when the texts allow no more merges,
        more when their characters alone (for word-pieces, also in ``##`` form) exceed it. Use
        ``len(vocab)`` as the model's ``vocab_size``.

        Raises:
            ValueError: ``size`` not above the number of special tokens, or an unknown ``kind``.
        """
        if size <= len(SPECIAL_TOKENS):
            raise ConfigError(f"vocabulary size must exceed {len(SPECIAL_TOKENS)}, got {size}")
        metaspace = dict(replacement="▁", prepend_scheme="always", split=True)
        if kind == "bpe":
            tokenizer = Tokenizer(models.BPE(unk_token=UNK))
            trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIAL_TOKENS,
                                          show_progress=False)
            tokenizer.decoder = decoders.Metaspace(**metaspace)
        elif kind == "wordpiece":
            tokenizer = Tokenizer(models.WordPiece(unk_token=UNK, continuing_subword_prefix="##",
                                                   max_input_chars_per_word=200))
            trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=SPECIAL_TOKENS,
                                                continuing_subword_prefix="##",
                                                show_progress=False)
            # The WordPiece decoder puts a space before every piece without "##"; here such a
            # piece already starts with the "▁" the Metaspace decoder turns into a space, so
            # remove that extra space again (else "A man" would come back as "A  man").
            tokenizer.decoder = decoders.Sequence([
                decoders.WordPiece(prefix="##", cleanup=False),
                decoders.Replace(" ▁", "▁"),
                decoders.Metaspace(**metaspace)])
        else:
            raise ValueError(f"vocabulary kind must be 'bpe' or 'wordpiece', got {kind!r}")
        tokenizer.normalizer = normalizers.Strip()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace)
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer, kind)

    # --- persistence ----------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write ``DIR/tokenizer.json`` atomically; returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        from aiayn.fileio import write_atomic

        return write_atomic(directory / VOCAB_FILE, self.to_json())

    def to_json(self) -> str:
        data = json.loads(self.tokenizer.to_str())
        data["aiayn_kind"] = self.kind  # ignored by tokenizers, read back by from_json
        return json.dumps(data, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str, source: str = "vocabulary") -> Vocabulary:
        try:
            data = json.loads(text)
            if isinstance(data, dict) and data.get("aiayn_kind") == "sentencepiece":
                # separate source/target SentencePiece models (a converted Marian model)
                from aiayn.data.sentencepiece_vocab import SentencePieceVocabulary

                return SentencePieceVocabulary.from_dict(data, source)
            kind = data.pop("aiayn_kind", "bpe")
            tokenizer = Tokenizer.from_str(json.dumps(data))
        except Exception as err:  # tokenizers raises its own Exception type
            raise DataError(f"{source}: not a valid vocabulary file ({err})") from None
        try:
            return cls(tokenizer, kind)
        except DataError as err:
            raise DataError(f"{source}: {err}") from None

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        """Load from a ``tokenizer.json`` file or a directory holding one.

        Raises:
            FileNotFoundError: nothing there (the message says where it looked).
            DataError: the file is not a vocabulary of this project.
        """
        path = Path(path)
        if path.is_dir():
            path = path / VOCAB_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no vocabulary at {path} (make one with `aiayn vocab`)")
        return cls.from_json(path.read_text(encoding="utf-8"), source=str(path))

    # --- use ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def fingerprint(self) -> str:
        """sha256 of the serialized vocabulary, to tell one vocabulary from another."""
        return hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS or EOS."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; stops at the first EOS, drops PAD and BOS."""
        return self.tokenizer.decode(list(_until_eos(ids)), skip_special_tokens=True)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return self.tokenizer.decode_batch([list(_until_eos(ids)) for ids in batch],
                                           skip_special_tokens=True)

    def tokens(self, text: str) -> list[str]:
        """Subword strings of ``text`` (for display)."""
        return self.tokenizer.encode(text, add_special_tokens=False).tokens

    def round_trip(self, texts: list[str], examples: int = 5,
                   batch: int = 10_000) -> RoundTrip:
        """Check ``decode(encode(t)) == t`` for every text (stripped first, as corpora are),
        ``batch`` texts encoded at a time (memory stays that of one batch's ids)."""
        failures: list[tuple[str, str]] = []
        wrong = 0
        for start in range(0, len(texts), batch):
            chunk = [t.strip() for t in texts[start:start + batch]]
            decoded = self.decode_batch(self.encode_batch(chunk))
            bad = [(t, d) for t, d in zip(chunk, decoded, strict=True) if t != d]
            wrong += len(bad)
            failures += bad[:max(0, examples - len(failures))]
        return RoundTrip(len(texts), len(texts) - wrong, failures)

    def check_matches(self, vocab_size: int, fingerprint: str | None = None,
                      where: str = "checkpoint") -> None:
        """Raise unless this is the vocabulary a model was built with.

        Args:
            vocab_size: the model's embedding rows (``ModelConfig.vocab_size``).
            fingerprint: the :attr:`fingerprint` recorded with the model, if any.
            where: what the model came from, for the message.

        Raises:
            DataError: the sizes differ, or the fingerprints do (same size, other tokens).
        """
        if len(self) != vocab_size:
            raise DataError(f"{where}: the vocabulary has {len(self)} tokens but the model "
                            f"expects vocab_size={vocab_size}; use the vocabulary the model was "
                            f"trained with (the checkpoint's own {VOCAB_FILE})")
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise DataError(f"{where}: the vocabulary (fingerprint {self.fingerprint[:12]}) is "
                            f"not the one the model was trained with ({fingerprint[:12]}), "
                            f"although both have {vocab_size} tokens")


@dataclass(frozen=True)
class RoundTrip:
    """Result of :meth:`Vocabulary.round_trip`: ``exact`` of ``total`` texts came back intact."""

    total: int
    exact: int
    failures: list[tuple[str, str]]  # (text, decoded), the first few

    @property
    def rate(self) -> float:
        """Fraction in [0, 1]; 1.0 for no texts."""
        return self.exact / self.total if self.total else 1.0


def _until_eos(ids: Iterable[int]) -> Iterator[int]:
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            return
        yield i


# --- learning at scale -------------------------------------------------------------------------
def sample_pair_indices(pairs: int, max_lines: int, seed: int = SAMPLE_SEED) -> np.ndarray | None:
    """Which of ``pairs`` aligned pairs a vocabulary is learned from: the rule, in one place.

    Both sides of a chosen pair are used, so ``max_lines`` sentences are ``max_lines // 2``
    pairs, drawn uniformly without replacement and sorted, the same for the same arguments on
    every machine (numpy's PCG64).

    Args:
        pairs: pairs in the corpus (lines of each file).
        max_lines: at most this many sentences (``data.vocab_sample_lines``); 0: all.

    Returns:
        The chosen pair indices, ``(max_lines // 2,)`` int64 ascending; None for all pairs
        (``max_lines`` 0 or at least ``2 * pairs``).
    """
    if max_lines < 0:
        raise ConfigError(f"vocabulary sample of {max_lines} lines: must be >= 0 (0: all)")
    if max_lines == 0 or 2 * pairs <= max_lines:
        return None
    rng = np.random.Generator(np.random.PCG64(seed))
    return np.sort(rng.choice(pairs, size=max(1, max_lines // 2), replace=False))


def count_lines(path: str | Path) -> int:
    """Lines in a text file (plain, or gzip when the name ends in ``.gz``), counted in 1 MiB
    blocks; a last line without ``\\n`` counts.

    Raises:
        FileNotFoundError: no such file.
        DataError: a folder, a broken gzip stream.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a text file")
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    lines, last = 0, b"\n"
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                lines += block.count(b"\n")
                last = block[-1:]
    except (OSError, EOFError, zlib.error) as err:
        hint = "; is it a complete gzip file?" if path.suffix == ".gz" else ""
        where = f" after line {lines}" if lines else ""  # lines are counted a block at a time
        raise DataError(f"{path}: read failed{where} ({err}){hint}") from None
    return lines + (last != b"\n")


def stream_lines(path: str | Path) -> Iterator[str]:
    """The lines of a text file (plain or ``.gz``), one at a time, stripped.

    Raises:
        DataError: invalid UTF-8 (file and line named), a broken gzip stream.
    """
    from aiayn.data.corpus import decode_line

    path = Path(path)
    number = 0
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            for number, line in enumerate(f, start=1):
                yield decode_line(line, path, number).strip()
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path}: read failed after line {number} ({err})") from None


@dataclass
class LearningSample:
    """The sentences a vocabulary is learned from: both sides of the pairs
    :func:`sample_pair_indices` chooses, read once as :meth:`batches` yields them.

    Use :meth:`from_files` (streamed: memory holds one batch, whatever the corpus size) or
    :meth:`from_corpus` (pairs already in memory). While :meth:`batches` runs it counts the
    pairs used and dropped, and keeps every k-th pair used for a round-trip check, at most
    ``check_lines`` sentences in all.
    """

    read_pairs: Callable[[], Iterator[tuple[str, str]]]
    total: int  # pairs in the corpus
    max_lines: int  # data.vocab_sample_lines; 0: all
    name: str = "corpus"
    drop_empty: bool = True
    check_lines: int = ROUND_TRIP_LINES
    batch: int = 10_000  # pairs handed to the learner at a time
    used: int = 0  # pairs learned from (both sides), after :meth:`batches`
    dropped_empty: int = 0  # chosen pairs with an empty side, left out
    check: list[str] = field(default_factory=list)  # the round-trip sample

    @classmethod
    def from_files(cls, src: str | Path, tgt: str | Path, max_lines: int, *,
                   drop_empty: bool = True, check_lines: int = ROUND_TRIP_LINES
                   ) -> LearningSample:
        """Two line-aligned files (plain or ``.gz``), streamed.

        Raises:
            FileNotFoundError: a file does not exist.
            DataError: the files' line counts differ (both given), checked before any learning.
        """
        n_src, n_tgt = count_lines(src), count_lines(tgt)
        if n_src != n_tgt:
            raise DataError(f"{src} has {n_src} lines but {tgt} has {n_tgt}: source and target "
                            "files must be line-aligned")
        return cls(lambda: zip(stream_lines(src), stream_lines(tgt), strict=True), n_src,
                   max_lines, f"{src}|{tgt}", drop_empty, check_lines)

    @classmethod
    def from_corpus(cls, corpus, max_lines: int, *,
                    check_lines: int = ROUND_TRIP_LINES) -> LearningSample:
        """A :class:`~aiayn.data.corpus.ParallelCorpus` already read (its empty pairs, if
        kept, are dropped here)."""
        return cls(lambda: zip(corpus.src, corpus.tgt, strict=True), len(corpus), max_lines,
                   corpus.name, True, check_lines)

    @property
    def chosen(self) -> int:
        """Pairs drawn (before empty ones are dropped)."""
        keep = sample_pair_indices(self.total, self.max_lines)
        return self.total if keep is None else len(keep)

    def batches(self) -> Iterator[list[str]]:
        """Lists of sentences (a batch of pairs' sources, then their targets) for
        :meth:`Vocabulary.learn`; resets and fills the counts and the check sample."""
        keep = sample_pair_indices(self.total, self.max_lines)
        mask = None
        if keep is not None:
            mask = np.zeros(self.total, dtype=bool)
            mask[keep] = True
        chosen = self.total if keep is None else len(keep)
        # the round-trip sample: check_lines // 2 chosen pairs, evenly spaced over them
        to_check = np.zeros(chosen, dtype=bool)
        if chosen and self.check_lines >= 2:
            to_check[np.linspace(0, chosen - 1, min(chosen, self.check_lines // 2))
                     .round().astype(np.int64)] = True
        self.used, self.dropped_empty, self.check = 0, 0, []
        src: list[str] = []
        tgt: list[str] = []
        seen = -1  # position among the chosen pairs
        for i, (s, t) in enumerate(self.read_pairs()):
            if mask is not None and not mask[i]:
                continue
            seen += 1
            if self.drop_empty and not (s and t):
                self.dropped_empty += 1
                continue
            if to_check[seen]:
                self.check += (s, t)
            src.append(s)
            tgt.append(t)
            if len(src) == self.batch:
                self.used += len(src)
                yield src + tgt
                src, tgt = [], []
        if src:
            self.used += len(src)
            yield src + tgt

    def describe(self) -> str:
        """One line for logs: what the vocabulary was learned from."""
        part = ("all" if self.chosen == self.total else
                f"a sample of {self.chosen} (data.vocab_sample_lines = {self.max_lines})")
        empty = f", {self.dropped_empty} with an empty side left out" \
            if self.dropped_empty else ""
        return f"{self.name}: learned from {part} of {self.total} pairs{empty}"


def learn_vocabulary(corpus: ParallelCorpus, data: DataConfig, log: Callable[[str], None] | None = None,
                     who: str = "aiayn") -> Vocabulary:
    """The vocabulary a run learns from its training pairs (``aiayn train``, an ensemble's
    shared one, Table 3's): ``data.vocab_size`` tokens of ``data.vocab_kind`` from at most
    ``data.vocab_sample_lines`` sentences (:class:`LearningSample`, the same sample wherever it
    is drawn); ``log`` (if given) says what it read, as ``who``.

    Args:
        corpus: a :class:`~aiayn.data.corpus.ParallelCorpus` (the training split, as loaded).
        data: the run's :class:`~aiayn.config.DataConfig`.
    """
    sample = LearningSample.from_corpus(corpus, data.vocab_sample_lines)
    vocab = Vocabulary.learn(sample.batches(), data.vocab_size, data.vocab_kind)
    if log is not None:
        log(f"{who}: vocabulary of {len(vocab)} {data.vocab_kind} tokens, {sample.describe()}")
    return vocab
