"""Inline markup and placeholders carried through translation (issue 83, item 3).

A line such as ``Click <b>Save</b> to keep %d files.<br/>`` is cut (:func:`parse`) into the
plain text the model reads, ``Click Save to keep files.``, and its *items*: each paired tag
with the source words it spans, each self-closing tag (and comment) and each placeholder with
the word boundary it stands at. The model translates the plain text; :func:`restore` puts the
items back into the translation at the target words the word alignments give
(:attr:`aiayn.decoding.Translation.alignment`: Pharaoh ``i-j`` pairs of source and target
words, whitespace-separated, as in fairseq's ``--print-alignment``).

Words are whitespace-separated, on both sides. A tag that starts or ends inside a word spans
that whole word. Entities (``&amp;``) are text and stay as they are.

Putting back, always well-formed and nested as in the source:

- **A paired tag** goes around the target words aligned to its source words (from the first to
  the last of them), inside its parent's span and clear of the spans of the tags placed before
  it in the source (the largest free stretch is kept).
  Fallbacks: a tag whose words have no aligned target word goes around the one target word at
  the aligned position of its first source word; without any alignment (none given, or an
  empty translation), each tag goes around the same share of the output as of the source
  (restored by position). A tag left no free word becomes an empty pair at that position.
- **A self-closing tag, a comment or a placeholder** stands at the aligned position of its
  boundary: before the first target word aligned to the source word after it, else after the
  last aligned to the word before it (the word it is glued to first), else the nearest aligned
  word's, else by position; inside its parent, never inside a sibling pair.
- **Unbalanced tags** (an opening tag never closed, a closing tag never opened, crossing pairs
  such as ``<b><i>x</b></i>``) are carried as written like a self-closing tag, so the output is
  as balanced as the input, with one warning naming the lines (:attr:`MarkupConfig.malformed`
  ``"warn"``), or refused with a :class:`MarkupError` naming the line (``"error"``). A ``<``
  that opens no tag (``a < b``) is text.

Placeholders are found in the text between tags by regular expressions
(:data:`DEFAULT_PLACEHOLDERS`: URLs, e-mail addresses, ``{name}``, ``%s``/``%d``, numbers), and
put back exactly as written. Those marked ``copy`` (all but printf's) that the model can write
exactly (:func:`copyable`: its subwords spell them and it can produce each) stay in the model's
text and become the line's terminology constraints (:mod:`aiayn.decoding.constraints`), so the
search copies them; :func:`restore` then puts one back only where the output lacks it. The
others are taken out and put back at their aligned position. HTML's void elements written
without a slash (``<br>``, ``<img ...>``) are self-closing tags.

Example::

    from aiayn import Translator

    translator = Translator.from_pretrained("runs/multi30k-en-de")
    translator.translate(["A <b>dog</b> runs."], markup=True)   # ['Ein <b>Hund</b> rennt.']
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiayn.errors import ConfigError, UserError

__all__ = ["DEFAULT_PLACEHOLDERS", "Item", "Markup", "MarkupConfig", "MarkupError",
           "Placeholder", "Restored", "copyable", "generate_marked", "parse", "parse_lines", "restore", "restore_translations",
           "tags_of", "well_formed"]


class MarkupError(UserError, ValueError):
    """A line whose tags do not pair up (with :attr:`MarkupConfig.malformed` ``"error"``)."""


@dataclass(frozen=True)
class Placeholder:
    """A pattern of text the model must not translate, put back exactly as written.

    Attributes:
        pattern: a Python regular expression; it may not match the empty string.
        name: what it finds, for messages.
        copy: the text must appear exactly in the output (URLs, e-mails, numbers, ``{name}``):
            it may be left in the model's text as a constraint (``parse(keep_copies=True)``).

    Raises:
        ConfigError: a pattern that does not compile or matches the empty string.
    """

    pattern: str
    name: str = "custom"
    copy: bool = False

    def __post_init__(self) -> None:
        try:
            regex = _compile(self.pattern)
        except re.error as err:
            raise ConfigError(f"placeholder pattern {self.pattern!r}: not a regular "
                              f"expression ({err})") from None
        if regex.match("") is not None:
            raise ConfigError(f"placeholder pattern {self.pattern!r} matches the empty string")


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern)


_URL = r"(?:\b(?:https?|ftp)://|\bwww\.)[^\s<>\"']*[^\s<>\"'.,;:!?)\]}]"
_EMAIL = r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}\b"
_PRINTF = r"%(?:\d+\$)?[-+0#]*\d*(?:\.\d+)?[sdifuxXeEgGc](?![A-Za-z0-9])"
_NUMBER = r"(?<![\w.,])[-+]?\d+(?:[.,]\d+)*(?![\w])"

#: The patterns used by default, in priority order (an earlier one wins at the same start).
DEFAULT_PLACEHOLDERS: tuple[Placeholder, ...] = (
    Placeholder(_URL, "url", copy=True),
    Placeholder(_EMAIL, "email", copy=True),
    Placeholder(r"\{[^{}\s]*\}", "braces", copy=True),
    Placeholder(_PRINTF, "printf"),
    Placeholder(_NUMBER, "number", copy=True),
)

_MALFORMED = ("warn", "error")


@dataclass(frozen=True)
class MarkupConfig:
    """How :func:`parse` reads a line.

    Attributes:
        placeholders: the patterns taken out besides tags (default
            :data:`DEFAULT_PLACEHOLDERS`; ``()``: tags only).
        malformed: ``"warn"``: unbalanced tags are carried as written at their aligned
            position (like a self-closing tag) and one warning names the lines; ``"error"``:
            :class:`MarkupError` naming the first such line.

    Raises:
        ConfigError: an unknown ``malformed``.
    """

    placeholders: tuple[Placeholder, ...] = DEFAULT_PLACEHOLDERS
    malformed: str = "warn"

    def __post_init__(self) -> None:
        if self.malformed not in _MALFORMED:
            raise ConfigError(f"markup malformed={self.malformed!r}; expected one of "
                              f"{', '.join(_MALFORMED)}")
        object.__setattr__(self, "placeholders", tuple(
            p if isinstance(p, Placeholder) else Placeholder(p) for p in self.placeholders))


@dataclass(frozen=True)
class Item:
    """One thing taken out of a line.

    Attributes:
        kind: ``"pair"`` (an opening and its closing tag), ``"point"`` (a self-closing tag, a
            comment, or an unbalanced tag) or ``"placeholder"``.
        text: as written: the opening tag, the tag, or the placeholder's text.
        close: a pair's closing tag as written ("" otherwise).
        start, end: source words (0-based): a pair spans ``[start, end)``; a point or
            placeholder stands before word ``start`` (``end == start``; ``start`` = the number
            of words: at the end). A kept placeholder is word ``start`` itself.
        parent: the index in :attr:`Markup.items` of the pair it is inside; -1: none.
        space_before: whitespace (or the line's start) before it (a pair: before its opening).
        space_after: whitespace (or the line's end) after it (a pair: after its closing).
        kept: a placeholder left in the model's text (a constraint), not taken out.
        name: a tag's name, or a placeholder's pattern name.
        punct_after: a pair closed before punctuation glued to its last word
            (``<b>Save</b>,``): the target's closing tag goes before that word's trailing
            punctuation too.
        word_before, word_after: a point glued to text (not whitespace, not a tag) before it
            or after it in the source (``%sfoo``): it stays glued to the target word there.
    """

    kind: str
    text: str
    close: str = ""
    start: int = 0
    end: int = 0
    parent: int = -1
    space_before: bool = True
    space_after: bool = True
    kept: bool = False
    name: str = ""
    punct_after: bool = False
    word_before: bool = False
    word_after: bool = False


@dataclass(frozen=True)
class Markup:
    """A line cut into the text the model reads and the items taken out of it.

    Attributes:
        line: the line as given.
        plain: the text for the model: the line less its tags and placeholders (kept ones
            excepted), with no double space where one was taken out. A line with no items is
            given as it is.
        items: in the order they open in the line.
        problems: what was wrong with its tags (unbalanced ones), one phrase each.
    """

    line: str
    plain: str
    items: tuple[Item, ...]
    problems: tuple[str, ...] = ()

    @property
    def words(self) -> list[str]:
        """The plain text's whitespace-separated words (the alignment's source words)."""
        return self.plain.split()

    @property
    def constraints(self) -> list[str]:
        """The kept placeholders' texts: what the output must contain exactly."""
        return [it.text for it in self.items if it.kept]


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` gives.

    Attributes:
        text: the translation with the items put back.
        aligned: items placed where the alignment put them.
        fallback: items placed by a fallback (no aligned word, no alignment, no room).
    """

    text: str
    aligned: int
    fallback: int


_TAG = re.compile(
    r"<!--.*?-->"
    r"|<(/?)([A-Za-z_:][-\w:.]*)"  # 1: "/" of a closing tag, 2: the name
    r"((?:\s+[^\s/>\"'=]+(?:\s*=\s*(?:\"[^\"]*\"|'[^']*'|[^\s\"'=<>`]+))?)*)"  # 3: attributes
    r"\s*(/?)>",  # 4: "/" of a self-closing tag
    re.S)
_WORD = re.compile(r"\S+")
# HTML's void elements: never closed, so <br> is a self-closing tag as <br/> is
_VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
_CLOSING_PUNCT = ",.;:!?)]}"
_PUNCT = re.compile(r"[^\w\s]+")
_TRAILING_PUNCT = re.compile(r"(.*?\w)([^\w\s]+)")


def tags_of(text: str) -> list[str]:
    """Every tag and comment in ``text`` as written, in order (for checks)."""
    return [m.group(0) for m in _TAG.finditer(text)]


_XML_ENTITY = re.compile(r"&(?!(?:amp|lt|gt|quot|apos|#\d+|#x[0-9a-fA-F]+);)")


def well_formed(text: str) -> bool:
    """Whether ``text``'s tags nest properly: it parses as XML content with the standard
    library (wrapped in a root element; an ``&`` that starts no XML entity, such as HTML's
    ``&nbsp;``, counts as text, and HTML's void elements such as ``<br>`` as closed)."""
    import xml.etree.ElementTree as ET

    def xml(m: re.Match) -> str:  # HTML's <br> as XML's <br/>
        void = m.group(2) and not m.group(1) and not m.group(4) and m.group(2).lower() in _VOID
        return m.group(0)[:-1] + "/>" if void else m.group(0)

    try:
        ET.fromstring("<root>" + _XML_ENTITY.sub("&amp;", _TAG.sub(xml, text)) + "</root>")
    except ET.ParseError:
        return False
    return True


# --- parsing ------------------------------------------------------------------------------

@dataclass
class _Token:
    """A tag or placeholder found in the line, before pairing."""

    kind: str  # "open", "close", "point", "placeholder"
    text: str
    name: str
    begin: int  # in the line, characters
    finish: int
    at: int = 0  # in the plain text, characters
    kept: bool = False
    copy: bool = False


def _placeholders_in(text: str, offset: int, placeholders: Sequence[Placeholder],
                     keep_copies: bool | Callable[[str], bool]) -> list[_Token]:
    """Non-overlapping placeholder matches in ``text`` (leftmost first; at one start, the
    earlier pattern wins)."""
    found = []
    for rank, p in enumerate(placeholders):
        for m in _compile(p.pattern).finditer(text):
            if m.end() > m.start():
                found.append((m.start(), rank, m, p))
    found.sort(key=lambda f: (f[0], f[1]))
    out, end = [], 0
    for start, _, m, p in found:
        if start >= end:
            kept = p.copy and (keep_copies(m.group(0)) if callable(keep_copies)
                               else keep_copies)
            out.append(_Token("placeholder", m.group(0), p.name, offset + start, offset + m.end(),
                              kept=kept, copy=p.copy))
            end = m.end()
    return out


def parse(line: str, config: MarkupConfig | None = None, *, number: int | None = None,
          keep_copies: bool | Callable[[str], bool] = False) -> Markup:
    """Cut ``line`` into the model's text and its items (see the module's docstring).

    Args:
        config: the placeholders and what unbalanced tags do (default :class:`MarkupConfig`).
        number: the line's number (from 1), for the error message.
        keep_copies: leave placeholders marked ``copy`` in the text (as constraints); a
            callable: those whose text it accepts (:func:`copyable`).

    Raises:
        MarkupError: unbalanced tags with ``config.malformed == "error"``, naming the line.
    """
    config = config or MarkupConfig()
    tokens: list[_Token] = []
    pos = 0
    for m in _TAG.finditer(line):
        tokens += _placeholders_in(line[pos:m.start()], pos, config.placeholders, keep_copies)
        text = m.group(0)
        if text.startswith("<!--") or m.group(4) or (
                not m.group(1) and m.group(2).lower() in _VOID):
            kind, name = "point", m.group(2) or "!--"
        else:
            kind, name = ("close" if m.group(1) else "open"), m.group(2)
        tokens.append(_Token(kind, text, name, m.start(), m.end()))
        pos = m.end()
    tokens += _placeholders_in(line[pos:], pos, config.placeholders, keep_copies)
    if not tokens:
        return Markup(line, line, ())

    problems = _pair_up(tokens)
    if problems and config.malformed == "error":
        where = f"line {number}: " if number is not None else ""
        raise MarkupError(f"{where}{problems[0]}; fix the tags, or let them be carried as "
                          "written (malformed='warn')")

    # the plain text, and where in it each token stands
    plain, pos = "", 0
    for t in tokens + [None]:
        chunk = line[pos:] if t is None else line[pos:t.begin]
        if pos > 0 and (not plain or plain[-1].isspace()):  # no double space where one was
            chunk = chunk.lstrip()                           # taken out
        if plain[-1:].isspace() and chunk[:1] and chunk[0] in _CLOSING_PUNCT:
            plain = plain.rstrip()  # "Hello %s, you" -> "Hello, you", not "Hello , you"
        plain += chunk
        if t is None:
            break
        t.at = len(plain)
        if t.kept:
            plain += t.text
        pos = t.finish
    if not line[pos:].strip():  # the line ends with something taken out
        plain = plain.rstrip()
    words = [(m.start(), m.end()) for m in _WORD.finditer(plain)]

    def boundary(at: int) -> int:  # the words that start before character `at`
        return sum(1 for s, _ in words if s < at)

    def covered(a: int, b: int) -> tuple[int, int] | None:  # words meeting characters [a, b)
        inside = [k for k, (s, e) in enumerate(words) if s < b and e > a]
        return (inside[0], inside[-1] + 1) if inside else None

    def space(i: int) -> bool:
        return i < 0 or i >= len(line) or line[i].isspace()

    def text_at(i: int, tag_end: str) -> bool:  # text there, not whitespace, not a tag's end
        return not space(i) and line[i] != tag_end

    items: list[Item] = []
    stack: list[tuple[int, _Token]] = []  # the open pairs: (item, opening token)
    for t in tokens:
        parent = stack[-1][0] if stack else -1
        if t.kind == "open":
            stack.append((len(items), t))
            items.append(Item("pair", t.text, start=boundary(t.at), end=boundary(t.at),
                              parent=parent, space_before=space(t.begin - 1), name=t.name))
        elif t.kind == "close":
            i, opened = stack.pop()
            start, end = covered(opened.at, t.at) or (items[i].start, items[i].start)
            rest = _WORD.match(line, t.finish)  # what follows, up to the next whitespace
            items[i] = dataclasses.replace(
                items[i], close=t.text, start=start, end=end, space_after=space(t.finish),
                punct_after=bool(rest and _PUNCT.fullmatch(_TAG.sub("", rest.group(0)))))
        else:
            k = covered(t.at, t.at + len(t.text))[0] if t.kept else boundary(t.at)
            items.append(Item("placeholder" if t.kind == "placeholder" else "point", t.text,
                              start=k, end=k, parent=parent, space_before=space(t.begin - 1),
                              space_after=space(t.finish), kept=t.kept, name=t.name,
                              word_before=text_at(t.begin - 1, ">"),
                              word_after=text_at(t.finish, "<")))
    return Markup(line, plain, tuple(items), tuple(problems))


def _pair_up(tokens: list[_Token]) -> list[str]:
    """Match opening and closing tags; the ones that do not match become points. Returns what
    was wrong, one phrase per unmatched tag."""
    problems: list[str] = []
    stack: list[int] = []
    for n, t in enumerate(tokens):
        if t.kind == "open":
            stack.append(n)
        elif t.kind == "close":
            names = [tokens[k].name for k in stack]
            if t.name not in names:
                problems.append(f"closing tag {t.text} at character {t.begin + 1} has no "
                                f"opening <{t.name}>")
                t.kind = "point"
                continue
            while tokens[stack[-1]].name != t.name:  # opened inside, never closed: crossing
                k = stack.pop()
                problems.append(f"tag {tokens[k].text} at character {tokens[k].begin + 1} is "
                                f"not closed before {t.text}")
                tokens[k].kind = "point"
            stack.pop()
    for k in stack:
        problems.append(f"tag {tokens[k].text} at character {tokens[k].begin + 1} is never "
                        "closed")
        tokens[k].kind = "point"
    return problems


def parse_lines(lines: Sequence[str], config: MarkupConfig | None = None, *,
                warn: Callable[[str], None] | None = None,
                keep_copies: bool | Callable[[str], bool] = False) -> list[Markup]:
    """:func:`parse` each line; one warning (to ``warn``) names the lines with unbalanced tags.

    Raises:
        MarkupError: with ``config.malformed == "error"``, naming the first bad line (from 1).
    """
    out = [parse(line, config, number=n, keep_copies=keep_copies)
           for n, line in enumerate(lines, 1)]
    bad = [n for n, m in enumerate(out, 1) if m.problems]
    if bad and warn is not None:
        first = out[bad[0] - 1].problems[0]
        warn(f"{len(bad)} line(s) with unbalanced tags, carried as written without pairing "
             f"(first: line {bad[0]}: {first})")
    return out


# --- putting back -------------------------------------------------------------------------

def _pairs(alignment) -> list[tuple[int, int]] | None:
    """Alignment pairs from an :class:`~aiayn.decoding.alignment.Alignment` (its ``pairs``),
    a Pharaoh string ``"0-0 1-2"`` or a sequence of ``(i, j)``."""
    if alignment is None:
        return None
    alignment = getattr(alignment, "pairs", alignment)
    if isinstance(alignment, str):
        return [(int(a), int(b)) for a, b in (p.split("-")[:2] for p in alignment.split())]
    return [(int(a), int(b)) for a, b in alignment]


def restore(markup: Markup, text: str, alignment=None) -> Restored:
    """Put ``markup``'s items back into ``text``, the translation of ``markup.plain``.

    Args:
        markup: from :func:`parse`.
        text: the translation of ``markup.plain``; its words are whitespace-separated.
        alignment: Pharaoh pairs ``(i, j)`` (or the string ``"i-j ..."``): source word ``i``
            of ``markup.plain`` is aligned to target word ``j`` of ``text``, both from 0;
            pairs out of range are ignored. None: no alignment (items placed by position).

    Returns:
        A :class:`Restored`: the text (each item once, pairs nested as in the source, so a
        well-formed input gives a well-formed output), and how many items were placed by the
        alignment and how many by a fallback (see the module's docstring).
    """
    items = markup.items
    if not items:
        return Restored(text, 0, 0)
    words = text.split()
    n, m = len(markup.words), len(words)
    pairs = _pairs(alignment)
    aligned: list[list[int]] = [[] for _ in range(n)]
    for i, j in pairs or ():
        if 0 <= i < n and 0 <= j < m:
            aligned[i].append(j)
    by_position = pairs is None or not any(aligned)
    # a kept placeholder is placed only where the output lacks it
    present = {t: text.count(t) for t in {it.text for it in items if it.kept}}
    children: dict[int, list[int]] = {}
    for k, it in enumerate(items):
        if it.kept and present[it.text] > 0:
            present[it.text] -= 1
            continue
        children.setdefault(it.parent, []).append(k)
    spans: dict[int, tuple[int, int]] = {}
    counts = [0, 0]  # aligned, fallback

    def prop(k: int) -> int:  # source boundary k by position
        return round(k * m / n) if n else 0

    def point(k: int, left_first: bool) -> tuple[int, bool]:
        """The target boundary for source boundary k (before source word k): before the
        first target word aligned to word k, or after the last aligned to word k - 1
        (``left_first``: that one first), else the nearest aligned word's; whether it is the
        alignment's own (a word next to it is aligned)."""
        if not by_position:
            for d in range(max(k, n - k) + 1):
                r, left = k + d, k - 1 - d
                after = min(aligned[r]) if r < n and aligned[r] else None
                before = max(aligned[left]) + 1 if left >= 0 and aligned[left] else None
                for p in ((before, after) if left_first else (after, before)):
                    if p is not None:
                        return p, d == 0
        return prop(k), False

    def outside(p: int, placed: list[tuple[int, int]]) -> int:
        """Boundary p moved out of any placed sibling pair's interior (to its nearer end)."""
        for s, e in placed:
            if s < p < e:
                return s if p - s < e - p else e
        return p

    def layout(parent: int, s: int, e: int) -> None:
        """Place ``parent``'s children inside target words [s, e), then theirs."""
        kids = children.get(parent, [])
        placed: list[tuple[int, int]] = []
        for k in (k for k in kids if items[k].kind == "pair"):
            a, b = items[k].start, items[k].end
            js = [] if by_position else [j for i in range(a, b) for j in aligned[i]]
            if b == a:  # an empty pair in the source: at a boundary
                p, via = point(a, False)
                span = (p, p)
            elif js:
                span, via = (min(js), max(js) + 1), True
            elif by_position:
                span, via = (prop(a), max(prop(b), prop(a) + 1)), False
            else:  # no word of it aligned: the target word at its first word's position
                p = point(a, False)[0]
                span, via = (p, p + 1), False
            free = _free(span, s, e, placed)
            if free is None:
                p = min(max(span[0], s), e)
                free, via = (p, p), via and b == a and p == span[0]
            spans[k] = free
            placed.append(free)
            counts[0 if via else 1] += 1
        for k in (k for k in kids if items[k].kind == "pair"):  # an empty pair that a later
            if spans[k][0] == spans[k][1]:                       # one covers moves out of it
                q = outside(spans[k][0], placed)
                spans[k] = (q, q)
        for k in (k for k in kids if items[k].kind != "pair"):
            it = items[k]
            p, via = point(it.start, not it.space_before and it.space_after)
            if it.kept and not by_position and aligned[it.start]:  # its own word's place
                p, via = min(aligned[it.start]), True
            q = outside(min(max(p, s), e), placed)
            spans[k] = (q, q)
            counts[0 if via and q == p else 1] += 1
        for k in kids:
            if items[k].kind == "pair":
                layout(k, *spans[k])

    layout(-1, 0, m)
    pieces: list[tuple[str, int | str]] = []

    def render(parent: int, s: int, e: int) -> None:
        cur = s
        for k in sorted(children.get(parent, []), key=lambda k: (*spans[k], k)):
            ts, te = spans[k]
            assert cur <= ts <= te <= e, (cur, ts, te, e)
            pieces.extend(("w", w) for w in words[cur:ts])
            if items[k].kind == "pair":
                pieces.append(("open", k))
                tail = _TRAILING_PUNCT.fullmatch(words[te - 1]) if te > ts and \
                    items[k].punct_after else None
                if tail:  # "<b>Speichern</b>," as the source's "<b>Save</b>,"
                    words[te - 1] = tail.group(1)
                render(k, ts, te)
                pieces.append(("close", k))
                if tail:
                    pieces.append(("g", tail.group(2)))
            else:
                pieces.append(("point", k))
            cur = te
        pieces.extend(("w", w) for w in words[cur:e])

    render(-1, 0, m)
    return Restored(_join(pieces, items), counts[0], counts[1])


def _free(span: tuple[int, int], s: int, e: int,
          placed: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The largest stretch of ``span`` inside ``[s, e)`` that no placed span covers."""
    a, b = max(span[0], s), min(span[1], e)
    if a >= b:  # empty, or outside [s, e)
        return None
    cuts = sorted(x for x in placed if x[1] > x[0])
    best, cur = None, a
    for ps, pe in cuts + [(b, b)]:
        lo, hi = cur, min(ps, b)
        if hi > lo and (best is None or hi - lo > best[1] - best[0]):
            best = (lo, hi)
        cur = max(cur, pe)
        if cur >= b:
            break
    return best


def _join(pieces: list[tuple[str, int | str]], items: tuple[Item, ...]) -> str:
    """Words ("w"), punctuation glued to the piece before ("g") and tags into text: one space
    between words; between a word and the next one across tags, the space where the source
    had it beside those tags (else before the first opening tag, else after the tags)."""
    out: list[str] = []
    i, prev_word = 0, False
    while i < len(pieces):
        run = []
        while i < len(pieces) and pieces[i][0] not in ("w", "g"):
            run.append(pieces[i])
            i += 1
        next_word = i < len(pieces) and pieces[i][0] == "w"
        spaced: set[int] = set()  # boundaries in the run (k: before run[k]) with a space
        for k, (kind, x) in enumerate(run):  # a point keeps the spaces it had, and is
            it = items[x]                    # apart from a word unless glued to one
            if kind == "point":
                if (not it.word_before) if k == 0 and prev_word else it.space_before:
                    spaced.add(k)
                if (not it.word_after) if k == len(run) - 1 and next_word else it.space_after:
                    spaced.add(k + 1)
        if not prev_word:  # no space at the start, before only opening tags
            spaced -= {k for k in range(len(run) + 1)
                       if all(kind == "open" for kind, _ in run[:k])}
        if not next_word:  # nor at the end or before glued punctuation, after only closing
            spaced -= {k for k in range(len(run) + 1)
                       if all(kind == "close" for kind, _ in run[k:])}
        if prev_word and next_word:  # a space where the first tag that had one has it,
            asked = [k if kind == "open" else k + 1 for k, (kind, x) in enumerate(run)
                     if (kind == "open" and items[x].space_before)
                     or (kind == "close" and items[x].space_after)]
            opens = [k for k, (kind, _) in enumerate(run) if kind == "open"]
            if asked:
                spaced.add(asked[0])
            elif not spaced:  # else before the first opening tag, else after the tags
                spaced.add(opens[0] if opens else len(run))
        for k, (kind, x) in enumerate(run):
            out.append(" " if k in spaced else "")
            out.append(items[x].close if kind == "close" else items[x].text)
        if i < len(pieces):
            out.append(" " if len(run) in spaced else "")
            out.append(pieces[i][1])
            i += 1
            prev_word = True
    return "".join(out)


def restore_translations(marked: Sequence[Markup], results: Sequence[Sequence]) -> list[list]:
    """Each line's translations (:class:`~aiayn.decoding.Translation`, with ``alignment``
    where the search gave it) with their text put back by :func:`restore`; ``tokens``,
    ``score`` and ``alignment`` stay those of the plain text."""
    return [[dataclasses.replace(t, text=restore(mk, t.text, getattr(t, "alignment", None)
                                                 ).text) for t in ts]
            for mk, ts in zip(marked, results)]


def copyable(translator) -> Callable[[str], bool]:
    """Whether a placeholder's text can be a terminology constraint for ``translator``: the
    model's target text is the text itself (no preprocessing changes it), its subwords decode
    back to it exactly, and the models can produce each of them. Others are taken out and put
    back by position."""
    from aiayn.decoding.constraints import producible_tokens
    from aiayn.model.engine import as_engine

    ids = producible_tokens([as_engine(m) for m in translator.decoding_models])
    allowed = None if ids is None else set(ids.tolist())
    vocab = translator.vocab

    def keep(text: str) -> bool:
        read = translator.preprocess([text], "tgt", warn=lambda msg: None)[0]
        tokens = vocab.encode(read)
        return (read == text and bool(tokens) and vocab.decode(tokens) == text
                and (allowed is None or allowed.issuperset(tokens)))

    return keep


def generate_marked(translator, generate: Callable, lines: Sequence[str], markup, *,
                    warn: Callable[[str], None] | None = None, **options):
    """Translate ``lines`` with their markup: each is :func:`parse`d, ``generate`` (the
    ``translator``'s ``generate`` or ``generate_text``) translates the plain texts with word
    alignments, and :func:`restore_translations` puts the items back. What
    ``Translator.generate(..., markup=...)`` runs.

    Placeholders marked ``copy`` that the model can write exactly (:func:`copyable`) stay in
    the text and become the line's terminology constraints (:mod:`aiayn.decoding.constraints`,
    with any given in ``options``), so the search must copy them; not when sampling, which
    takes no constraints.

    Args:
        markup: True (:class:`MarkupConfig`'s defaults) or a :class:`MarkupConfig`.
        options: for ``generate``.

    Returns:
        What ``generate`` returns, with each translation's text put back.

    Raises:
        MarkupError: unbalanced tags with ``malformed="error"``, naming the line.
    """
    from aiayn.decoding.constraints import merge_constraints

    config = markup if isinstance(markup, MarkupConfig) else MarkupConfig()
    keep = options.get("sampling") is None and any(p.copy for p in config.placeholders)
    marked = parse_lines(lines, config, warn=warn,
                         keep_copies=copyable(translator) if keep else False)
    ours = [m.constraints or None for m in marked]
    if any(ours):
        options["constraints"] = merge_constraints(options.get("constraints"), ours)
    options["alignments"] = True  # where the items go
    result = generate([m.plain for m in marked], warn=warn, **options)
    if isinstance(result, list):
        return restore_translations(marked, result)
    return dataclasses.replace(result, translations=restore_translations(
        marked, result.translations))
