"""Separate source and target SentencePiece vocabularies, as Marian / OPUS-MT models have them.

A :class:`SentencePieceVocabulary` turns text into ids and ids into text exactly as
``transformers.MarianTokenizer`` does (same pieces in, same text out), but with the ids of this
project: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, 3 ``<unk>``, then the Marian vocabulary's other
pieces in their Marian order (``aiayn convert`` permutes the embedding rows to match). Marian has
no ``<s>``; id 1 is a placeholder row that the model never predicts (its logit bias is -inf).

It is stored in a checkpoint's ``tokenizer.json`` (``"aiayn_kind": "sentencepiece"``), the two
SentencePiece models inlined as base64, so a converted checkpoint is one self-contained
directory; :meth:`aiayn.data.vocab.Vocabulary.load` returns this class for such a file.
The ``sentencepiece`` package is needed to use it (``pip install 'aiayn[interop]'``).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiayn.errors import DataError
from aiayn.rundir import TOKENIZER

KIND = "sentencepiece"
SPIECE_UNDERLINE = "▁"


def _load_spm(model: bytes, source: str):
    try:
        import sentencepiece
    except ImportError:
        raise DataError(f"{source}: this vocabulary needs the sentencepiece package "
                        "(pip install 'aiayn[interop]')") from None
    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromSerializedProto(model)
    return sp


class SentencePieceVocabulary:
    """Source and target SentencePiece models with their piece lists (ids of this project).

    Args:
        source_spm, target_spm: serialized SentencePiece models (the bytes of ``*.spm``).
        source_pieces: piece of each source id (index = id), specials first as above.
        target_pieces: same for the target; None when the vocabulary is shared.
        decode_with: "source" or "target": the SentencePiece model that detokenizes outputs
            (``MarianTokenizer`` uses the source one unless the vocabularies are separate).
        special_pieces: Marian's pad, EOS and unk pieces (dropped from decoded text).
        marian_ids: the Marian ids of pad, EOS and unk (``pad``, ``eos``, ``unk_src``,
            ``unk_tgt``), so that export can put every piece back at its Marian id.
    """

    kind = KIND
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, source_spm: bytes, target_spm: bytes, source_pieces: list[str],
                 target_pieces: list[str] | None = None, decode_with: str = "source",
                 special_pieces: Iterable[str] = ("<pad>", "</s>", "<unk>"),
                 marian_ids: dict[str, int] | None = None, source: str = "vocabulary") -> None:
        if decode_with not in ("source", "target"):
            raise ValueError(f"decode_with must be 'source' or 'target', got {decode_with!r}")
        self.source_spm_bytes, self.target_spm_bytes = source_spm, target_spm
        self.source_pieces = list(source_pieces)
        self.target_pieces = None if target_pieces is None else list(target_pieces)
        self.decode_with = decode_with
        self.special_pieces = list(special_pieces)
        self.marian_ids = dict(marian_ids or {})
        self._sp_source = _load_spm(source_spm, source)
        self._sp_target = _load_spm(target_spm, source)
        self._source_index = {p: i for i, p in enumerate(self.source_pieces)}
        self._special_ids = {i for i, p in enumerate(self.output_pieces)
                             if p in set(self.special_pieces)} | {0, 1, 2, 3}

    @property
    def output_pieces(self) -> list[str]:
        return self.source_pieces if self.target_pieces is None else self.target_pieces

    # --- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"aiayn_kind": KIND,
                "source_spm": base64.b64encode(self.source_spm_bytes).decode("ascii"),
                "target_spm": base64.b64encode(self.target_spm_bytes).decode("ascii"),
                "source_pieces": self.source_pieces, "target_pieces": self.target_pieces,
                "decode_with": self.decode_with, "special_pieces": self.special_pieces,
                "marian_ids": self.marian_ids}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "vocabulary") -> SentencePieceVocabulary:
        try:
            return cls(base64.b64decode(data["source_spm"]), base64.b64decode(data["target_spm"]),
                       data["source_pieces"], data.get("target_pieces"),
                       data.get("decode_with", "source"),
                       data.get("special_pieces", ("<pad>", "</s>", "<unk>")),
                       data.get("marian_ids"), source)
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{source}: not a valid SentencePiece vocabulary ({err})") from None

    def save(self, directory: str | Path) -> Path:
        """Write ``DIR/tokenizer.json`` atomically; returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        tmp.replace(path)
        return path

    # --- use ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Source vocabulary size (the model's ``vocab_size``)."""
        return len(self.source_pieces)

    @property
    def target_size(self) -> int:
        return len(self.output_pieces)

    @property
    def fingerprint(self) -> str:
        """sha256 of the serialized vocabulary."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def tokens(self, text: str) -> list[str]:
        """Source pieces of ``text``; a leading ``>>xx<<`` language code stays one piece."""
        code: list[str] = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2 :]
        return code + self._sp_source.encode(text, out_type=str)

    def encode(self, text: str) -> list[int]:
        """Source ids of ``text``, without EOS (pieces not in the vocabulary become ``<unk>``)."""
        return [self._source_index.get(p, self.unk_id) for p in self.tokens(text)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Target text of ``ids``: stops at the first EOS, drops special pieces, detokenizes."""
        pieces = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i not in self._special_ids:
                pieces.append(self.output_pieces[i])
        sp = self._sp_source if self.decode_with == "source" else self._sp_target
        return sp.decode_pieces(pieces).replace(SPIECE_UNDERLINE, " ").strip()

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def check_matches(self, vocab_size: int, fingerprint: str | None = None,
                      where: str = "checkpoint") -> None:
        """Raise :class:`DataError` unless this is the vocabulary of a model with
        ``vocab_size`` source rows (and, when given, the recorded ``fingerprint``)."""
        if len(self) != vocab_size:
            raise DataError(f"{where}: the vocabulary has {len(self)} source pieces but the "
                            f"model expects vocab_size={vocab_size}")
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise DataError(f"{where}: the vocabulary (fingerprint {self.fingerprint[:12]}) is "
                            f"not the one the model was converted with ({fingerprint[:12]})")
