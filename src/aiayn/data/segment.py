"""Plain text with paragraphs in, sentences out, and translations back into the same layout.

The model translates one sentence at a time (§6.1: the test sets are one sentence a line).
Real text comes as paragraphs, and some lines are longer than the model's positional table
(``model.max_len``). This module is the one owner of how such text is cut and put back:

- :func:`segment`: a document (paragraphs separated by blank lines) into its sentences, with
  `sentencex <https://pypi.org/project/sentencex/>`_, a rule-based splitter that knows each
  language's abbreviations ("Dr.", "z.B.", "U.S.") and keeps every character of the input;
- :meth:`Document.rejoin`: one translation per sentence back into the document, every byte
  between sentences (spaces, line breaks, blank lines, leading and trailing whitespace) kept;
- :func:`split_long`: one over-long line into parts that each fit, at the best boundary there
  is (a sentence end, then ``;`` or ``:``, then a comma, then a window of words).

Conventions: a paragraph is a run of lines that are not blank; a single line break inside a
paragraph is a soft wrap, so a sentence may run over it (as Moses' ``split-sentences.perl``
reads text). A line break between two sentences is kept as it is, so a file of one sentence a
line comes back one translation a line. Whitespace inside a sentence (a wrapped line's break,
double spaces) reaches the model as one space.

Example::

    from aiayn.data.segment import segment

    doc = segment("Dr. Smith arrived. He sat down.\\n\\nThe end.\\n", "en")
    doc.sentences                   # ['Dr. Smith arrived.', 'He sat down.', 'The end.']
    doc.rejoin(["A.", "B.", "C."])  # 'A. B.\\n\\nC.\\n'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Document", "segment", "split_long", "split_sentences"]

# clause ends, then commas (with their full-width forms), the boundaries split_long tries after
# the sentence ends, in this order
_CLAUSE = re.compile(r"(?<=[;:；：])\s+|(?<=[；：])")
_COMMA = re.compile(r"(?<=[,，、])\s+|(?<=[，、])")
_BLANK = re.compile(r"^[ \t\f\v\r]*(?:\n|$)", re.MULTILINE)  # a line of whitespace only


@dataclass(frozen=True)
class Document:
    """A text cut into sentences, and what lies between them.

    Attributes:
        text: the text as given.
        spans: (start, end) character offsets of each sentence in ``text``, in order; the
            sentence has no leading or trailing whitespace.
        paragraphs: the 0-based paragraph of each sentence.
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    paragraphs: tuple[int, ...]

    @property
    def sentences(self) -> list[str]:
        """Each sentence as the model should read it: inner whitespace runs made one space."""
        return [" ".join(self.text[a:b].split()) for a, b in self.spans]

    @property
    def gaps(self) -> list[str]:
        """The ``len(spans) + 1`` stretches of text around the sentences: before the first,
        between each two, after the last (all whitespace)."""
        ends = [0] + [b for _, b in self.spans]
        starts = [a for a, _ in self.spans] + [len(self.text)]
        return [self.text[e:s] for e, s in zip(ends, starts)]

    def rejoin(self, translations: Sequence[str]) -> str:
        """The document with each sentence replaced by its translation, every gap kept.

        A line break inside a translation becomes a space, so a translation cannot add a
        paragraph. ``rejoin(sentences)`` gives ``text`` back up to whitespace inside
        sentences.

        Args:
            translations: one text per sentence, in order.

        Raises:
            ValueError: not one translation per sentence (naming both counts).
        """
        if len(translations) != len(self.spans):
            raise ValueError(f"rejoin: {len(translations)} translations for "
                             f"{len(self.spans)} sentences")
        gaps = self.gaps
        out = [gaps[0]]
        for t, gap in zip(translations, gaps[1:]):
            out += [" ".join(t.split("\n")).replace("\r", " "), gap]
        return "".join(out)


def split_sentences(text: str, lang: str) -> list[tuple[int, int]]:
    """(start, end) offsets of the sentences of one paragraph, stripped of whitespace.

    Args:
        text: a paragraph (or any text; blank lines are not treated specially here).
        lang: the text's language, an ISO 639 code ("en", "de"); one sentencex does not know
            falls back to its language family or to English rules.
    """
    from sentencex import segment as sentencex_segment

    spans = []
    start = 0
    for piece in sentencex_segment(lang, text):  # the pieces concatenate to text
        end = start + len(piece)
        core = piece.strip()
        if core:
            a = start + (len(piece) - len(piece.lstrip()))
            spans.append((a, a + len(core)))
        start = end
    if start != len(text):  # never seen; the rest of this module relies on it
        raise AssertionError(f"sentencex lost text: {start} of {len(text)} characters")
    return spans


def segment(text: str, lang: str) -> Document:
    """Cut ``text`` into paragraphs (runs of non-blank lines) and each into its sentences.

    Args:
        text: plain text; paragraphs separated by one or more blank lines.
        lang: the source language, an ISO 639 code (the model's ``data.src_lang``).

    Returns:
        A :class:`Document`; an empty or all-whitespace text has no sentences.
    """
    spans: list[tuple[int, int]] = []
    paragraphs: list[int] = []
    for n, (a, b) in enumerate(_paragraph_spans(text)):
        for s, e in split_sentences(text[a:b], lang):
            spans.append((a + s, a + e))
            paragraphs.append(n)
    return Document(text, tuple(spans), tuple(paragraphs))


def _paragraph_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each run of non-blank lines."""
    spans, start = [], 0
    for m in _BLANK.finditer(text):
        if m.start() > start:
            spans.append((start, m.start()))
        start = max(start, m.end())
        if m.end() == len(text):
            break
    if start < len(text) and text[start:].strip():
        spans.append((start, len(text)))
    return spans


def split_long(text: str, lang: str, fits: Callable[[str], bool]) -> list[str]:
    """Cut one line into as few parts as fit, each at the best boundary available.

    Boundaries are tried in order: the sentence ends the splitter finds, then clause
    punctuation (``;`` ``:``), then commas, then spaces between words, and last (a "word"
    that alone does not fit) characters. At each level consecutive pieces are packed greedily
    into parts while ``fits`` holds; a piece too long alone goes down to the next level.
    Nothing is dropped: the parts joined with single spaces give the line back up to
    whitespace.

    Args:
        text: the line.
        lang: its language (for the sentence splitter).
        fits: whether a part is short enough (e.g. its subword tokens with EOS <=
            ``model.max_len``); must hold for any single character.

    Returns:
        The parts, in order; ``[text]`` when it fits (or is blank).

    Raises:
        ValueError: ``fits`` refuses a single character.
    """
    text = " ".join(text.split())
    if not text or fits(text):
        return [text]
    return _split(text, lang, fits, 0)


def _pieces(text: str, lang: str, level: int) -> list[str]:
    if level == 0:
        return [text[a:b] for a, b in split_sentences(text, lang)]
    if level == 1:
        return [p for p in _CLAUSE.split(text) if p.strip()]
    if level == 2:
        return [p for p in _COMMA.split(text) if p.strip()]
    if level == 3:
        return text.split()
    return list(text)


def _split(text: str, lang: str, fits: Callable[[str], bool], level: int) -> list[str]:
    if level > 4:
        raise ValueError(f"split_long: a single character does not fit: {text!r}")
    pieces = _pieces(text, lang, level)
    if len(pieces) < 2:
        return _split(text, lang, fits, level + 1)
    glue = "" if level == 4 else " "
    parts: list[str] = []
    current = ""
    for piece in pieces:
        joined = current + glue + piece if current else piece
        if fits(joined):
            current = joined
            continue
        if current:
            parts.append(current)
        if fits(piece):
            current = piece
        else:
            parts += _split(piece, lang, fits, level + 1)
            current = ""
    if current:
        parts.append(current)
    return parts
