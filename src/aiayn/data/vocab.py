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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from aiayn.errors import ConfigError, DataError
from aiayn.rundir import TOKENIZER as VOCAB_FILE

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


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
    def learn(cls, texts: Iterable[str], size: int, kind: str = "bpe") -> Vocabulary:
        """Learn a vocabulary of ``size`` tokens (specials included) from ``texts``.

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

    def round_trip(self, texts: list[str], examples: int = 5) -> RoundTrip:
        """Check ``decode(encode(t)) == t`` for every text (stripped first, as corpora are)."""
        texts = [t.strip() for t in texts]
        decoded = self.decode_batch(self.encode_batch(texts))
        failures = [(t, d) for t, d in zip(texts, decoded, strict=True) if t != d]
        return RoundTrip(len(texts), len(texts) - len(failures), failures[:examples])

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
