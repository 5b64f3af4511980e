"""Text preprocessing applied before subword segmentation (``data.preprocess``).

- ``none``: the corpus as distributed (cased, detokenized); outputs are real-cased text, scored
  with sacreBLEU.
- ``lc-norm-tok``: the Multi30k literature's text (Elliott et al. 2016 and the papers that
  report on it): lowercased, punctuation-normalized and tokenized with sacremoses'
  ``MosesPunctNormalizer`` and ``MosesTokenizer(escape=True)``. Applied to the raw
  ``test_2016_flickr`` targets it reproduces the shipped ``tok/*.lc.norm.tok.*`` references
  line for line, so outputs are scored against them directly (sacreBLEU with
  ``tokenize='none'``). Outputs stay lowercased and tokenized.

A model trained on preprocessed text records the mode in its ``config.json``;
:class:`aiayn.Translator`, through which every command reads raw text, applies it to its input
(:func:`model_text`).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Callable

from aiayn.config import PREPROCESS_MODES, PROTOCOL_TEXT, RAW_TEXT
from aiayn.data.corpus import ParallelCorpus

if TYPE_CHECKING:
    from aiayn.config import DataConfig

__all__ = ["RAW_TEXT", "PROTOCOL_TEXT", "moses", "multi30k_tokenize", "preprocess_lines",
           "tokenized_input_warning", "model_text", "is_protocol_text", "preprocess_corpus"]


@functools.lru_cache(maxsize=8)
def moses(lang: str):
    """sacremoses' ``(MosesPunctNormalizer, MosesTokenizer)`` for ``lang``, made once."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def multi30k_tokenize(line: str, lang: str) -> str:
    """One line in the Multi30k protocol's text (:data:`PROTOCOL_TEXT`): lowercase,
    ``MosesPunctNormalizer(lang).normalize``, then ``MosesTokenizer(lang).tokenize(escape=True)``
    joined by spaces. Applied to the raw ``test_2016_flickr.de`` this reproduces
    ``tok/test_2016_flickr.lc.norm.tok.de`` exactly."""
    normalizer, tokenizer = moses(lang)
    return " ".join(tokenizer.tokenize(normalizer.normalize(line.lower()), escape=True))


def preprocess_lines(lines: list[str], lang: str, mode: str) -> list[str]:
    """``lines`` of language ``lang`` (an ISO code such as ``de``) under ``mode``.

    Raises:
        ValueError: an unknown mode.
    """
    if mode == RAW_TEXT:
        return list(lines)
    if mode == PROTOCOL_TEXT:
        return [multi30k_tokenize(line, lang) for line in lines]
    raise ValueError(f"unknown data.preprocess {mode!r}; known: {', '.join(PREPROCESS_MODES)}")


# the entities that MosesTokenizer(escape=True) writes: text holding them was tokenized already
_MOSES_ESCAPES = re.compile(r"&(?:amp|apos|quot|lt|gt|#91|#93|#124);")


def tokenized_input_warning(lines: list[str], data: "DataConfig") -> str | None:
    """A warning when a model trained under ``data`` would tokenize ``lines`` twice, else None.

    Under ``lc-norm-tok`` the model tokenizes its input itself. Lines that hold Moses escapes
    (``&apos;``, ``&quot;``, ``&amp;`` ...) look tokenized already, as the shipped
    ``tok/*.lc.norm.tok.*`` files are, and tokenizing them again changes them (``&apos;``
    becomes ``&amp; apos ;``), so the model reads text it was not trained on. The warning gives
    their count and the first line number (counting from 1). Raw text with HTML entities looks
    the same, so callers warn and still translate.
    """
    if data.preprocess != PROTOCOL_TEXT:
        return None
    escaped = [i for i, line in enumerate(lines, 1) if _MOSES_ESCAPES.search(line)]
    if not escaped:
        return None
    return (f"{len(escaped)} of {len(lines)} input lines (line {escaped[0]} first) hold "
            f"Moses escapes such as &apos; or &quot;, so they look tokenized already; "
            f"the model tokenizes its input itself (data.preprocess = lc-norm-tok), and "
            f"tokenizing such lines again turns &apos; into &amp; apos ;, text it was "
            f"not trained on: pass the raw text (if these are entities of the raw text, "
            f"nothing is wrong)")


def model_text(lines: list[str], data: "DataConfig", side: str = "src",
               warn: Callable[[str], None] | None = None) -> list[str]:
    """``lines`` as a model trained under ``data`` reads them: its ``data.preprocess`` applied
    with the language of ``side`` ("src" or "tgt", e.g. a forced target). :meth:`aiayn.Translator.
    preprocess`, the one entry point that feeds raw text to a model, calls it.

    With ``warn``, :func:`tokenized_input_warning` is passed to it, once, when the lines look
    tokenized already. They are still translated.

    Raises:
        ValueError: an unknown side or mode.
    """
    if side not in ("src", "tgt"):
        raise ValueError(f"side must be 'src' or 'tgt', got {side!r}")
    if warn is not None:
        message = tokenized_input_warning(lines, data)
        if message is not None:
            warn(message)
    return preprocess_lines(lines, data.src_lang if side == "src" else data.tgt_lang,
                            data.preprocess)


def is_protocol_text(mode: str) -> bool:
    """Whether a model trained under ``data.preprocess = mode`` writes the Multi30k protocol's
    text (lowercased, tokenized): its outputs are scored as they are, never tokenized again."""
    return mode == PROTOCOL_TEXT


def preprocess_corpus(corpus: ParallelCorpus, src_lang: str, tgt_lang: str,
                      mode: str) -> ParallelCorpus:
    """Both sides of ``corpus`` under ``mode`` (the same object back for ``none``)."""
    if mode == RAW_TEXT:
        return corpus
    return ParallelCorpus(preprocess_lines(corpus.src, src_lang, mode),
                          preprocess_lines(corpus.tgt, tgt_lang, mode),
                          f"{corpus.name} ({mode})", corpus.dropped_empty)
