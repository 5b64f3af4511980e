"""A confidence for every translation, and flags for its likely failures (not in the paper;
issue 82, item 4). The one owner of their definitions: the search, the faces (``aiayn
translate --json``, :class:`aiayn.Translator`, ``aiayn serve``) and the benchmark all call it.

Every :class:`~aiayn.decoding.Translation` carries, besides its text:

- ``confidence``: the length-normalized log-probability, ``log_prob / |Y|``, where
  ``log_prob`` is the search's sum of token log-probabilities (natural log, after the score
  rules the search applied) and ``|Y|`` the output's tokens, its EOS included (a 5-token
  sentence counts 6). It is <= 0; ``exp(confidence)`` is the geometric mean of the tokens'
  probabilities. An empty input (no search) has confidence 0.0 and no flags.
- ``flags``: the names of the failures it shows, in :data:`FLAGS` order, each defined below;
  empty when none.
- ``unchecked``: the names of the flags that could not be evaluated for it: ``length_ratio``
  when no validation range is known (a bare checkpoint, not a pipeline's run directory).

The flags, each a property of one output (the search's tokens ``Y`` without EOS, its text,
and the source as the model read it, ``X`` its tokens without EOS):

- ``repeat``: ``Y`` holds an n-gram of 2 to :data:`REPEAT_MAX_N` tokens repeated
  :data:`REPEAT_MIN_TIMES` or more times back to back (``a b a b a b``), or one token
  :data:`REPEAT_MIN_TIMES_ONE` or more times (``x x x x``): the repetition loop of neural MT.
  (A single token three times is common in good text: an ellipsis ``. . .``, the zeros of
  ``1000`` in a small vocabulary.)
- ``length_ratio``: ``|Y| / |X|`` (subword tokens, without EOS) outside the range recorded
  for the model on its validation set (:class:`LengthRange`: the 1st-99th percentile of the
  validation *references'* target/source token counts).
- ``copy``: the output copies its input: at least :data:`COPY_MIN_WORDS` words in the output,
  and a share of at least :data:`COPY_MIN_SHARE` of them found among the source's words.
  Words are ``\\w+`` runs, case-folded, that are not all digits (numbers carry over in a
  good translation too); counted with repeats.
- ``no_eos``: the search never chose end of sentence: the output reached its maximum length
  (``max_lens``, §6.1: input + 50) and the EOS that ends it was forced by the length rules.

The cost: one pass of at most :data:`REPEAT_MAX_N` comparisons per output token, and a regex
over the output and its source, in Python, after the search; the searched tokens and text are
not changed.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aiayn.data.vocab import EOS_ID
from aiayn.errors import UserError

REPEAT = "repeat"
LENGTH_RATIO = "length_ratio"
COPY = "copy"
NO_EOS = "no_eos"
FLAGS = (REPEAT, LENGTH_RATIO, COPY, NO_EOS)
"""Every flag's name, in the order outputs list them."""

REPEAT_MAX_N = 4
"""The longest repeated unit ``repeat`` looks for, in tokens."""
REPEAT_MIN_TIMES = 3
"""Back-to-back occurrences of a unit of 2 or more tokens that make a loop."""
REPEAT_MIN_TIMES_ONE = 4
"""Back-to-back occurrences of a single token that make a loop."""
COPY_MIN_WORDS = 3
"""``copy`` is not judged on outputs of fewer words (a name, a number)."""
COPY_MIN_SHARE = 0.7
"""The share of the output's words found in the source from which it is a copy."""
RANGE_PERCENTILES = (1.0, 99.0)
"""The percentiles of the validation ratios that bound ``length_ratio``'s range."""

_WORD = re.compile(r"\w+")


def confidence(log_prob: float, tokens: int) -> float:
    """``log_prob / tokens``: the length-normalized log-probability of an output of ``tokens``
    tokens, EOS included (0.0 for no tokens: an empty input, nothing searched)."""
    return log_prob / tokens if tokens else 0.0


def repeated_ngram(tokens: Sequence[int], max_n: int = REPEAT_MAX_N,
                   min_times: int = REPEAT_MIN_TIMES,
                   min_times_one: int = REPEAT_MIN_TIMES_ONE) -> tuple[int, int, int] | None:
    """The first loop in ``tokens``: an n-gram (2 <= n <= ``max_n``) that occurs ``min_times``
    or more times back to back, or one token that occurs ``min_times_one`` or more times.

    Returns:
        (start index, n, times it occurs in a row), or None. The shortest unit wins at a
        position (``x x x x`` is a 1-gram four times, not a 2-gram twice).
    """
    for i in range(len(tokens)):
        for n in range(1, max_n + 1):
            need = min_times_one if n == 1 else min_times
            if i + n * need > len(tokens):  # longer units need more room still
                break
            unit = tokens[i:i + n]
            times = 1
            while tokens[i + times * n:i + (times + 1) * n] == unit:
                times += 1
            if times >= need:
                return i, n, times
    return None


def _words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.casefold()) if not w.isdigit()]


def copy_share(output: str, source: str) -> float | None:
    """The share of ``output``'s words (``\\w+``, case-folded, not all digits, counted with
    repeats) that are among ``source``'s words; None when the output has fewer than
    :data:`COPY_MIN_WORDS` of them."""
    words = _words(output)
    if len(words) < COPY_MIN_WORDS:
        return None
    seen = set(_words(source))
    return sum(w in seen for w in words) / len(words)


def length_ratio(output_tokens: int, source_tokens: int) -> float:
    """``output_tokens / source_tokens``, both without EOS (a source has at least one)."""
    return output_tokens / max(1, source_tokens)


@dataclass(frozen=True)
class LengthRange:
    """The output/input length ratios a model's translations are expected within: the
    :data:`RANGE_PERCENTILES` (1st and 99th) of the ratio ``|Y| / |X|`` (subword tokens,
    without EOS) over the validation references, made by :func:`length_ratio_range` when a
    pipeline finishes and kept in the run's generation record
    (:data:`aiayn.rundir.GENERATION_CONFIG`, key ``length_ratio``).

    The references, not the model's own val output: they say what a right translation's
    length is, whatever the model does (a model that loops on val would widen a range made
    of its own output), they need no decoding, and one range serves every member, averaging
    and precision of the run.

    Attributes:
        low, high: the bounds (inclusive), ratios.
        sentences: the validation pairs they were measured on.
    """

    low: float
    high: float
    sentences: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high)
                and 0.0 <= self.low <= self.high):
            raise ValueError(f"a length ratio range needs 0 <= low <= high, got "
                             f"low={self.low}, high={self.high}")

    def contains(self, ratio: float) -> bool:
        return self.low <= ratio <= self.high

    def to_record(self) -> dict[str, Any]:
        """The generation record's ``length_ratio`` object."""
        return {"low": round(self.low, 4), "high": round(self.high, 4),
                "percentiles": list(RANGE_PERCENTILES), "sentences": self.sentences,
                "of": "validation references: target / source subword tokens, without EOS"}

    @classmethod
    def from_record(cls, data: Any, where: str = "generation record") -> LengthRange | None:
        """The range a generation record holds (None when it holds none).

        Raises:
            UserError: a ``length_ratio`` that is not such an object, naming ``where``.
        """
        if data is None:
            return None
        try:
            return cls(float(data["low"]), float(data["high"]), int(data.get("sentences", 0)))
        except (TypeError, KeyError, ValueError) as err:
            raise UserError(f"{where}: 'length_ratio' must be an object with numbers low <= "
                            f"high ({err})") from None


def length_ratio_range(vocab, sources: Sequence[str], targets: Sequence[str]) -> LengthRange:
    """:class:`LengthRange` of validation pairs: the 1st and 99th percentile (linear
    interpolation, numpy's default) of ``len(target) / len(source)`` in ``vocab``'s subword
    tokens; pairs with an empty side are left out.

    Args:
        sources, targets: the validation pairs in the model's text (``data.preprocess``).

    Raises:
        ValueError: different counts, or no pair with both sides non-empty.
    """
    import numpy as np

    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
    src = vocab.encode_batch(list(sources)) if sources else []
    tgt = vocab.encode_batch(list(targets)) if targets else []
    ratios = [len(t) / len(s) for s, t in zip(src, tgt) if s and t]
    if not ratios:
        raise ValueError("no validation pair with both sides non-empty to measure a length "
                         "ratio range on")
    low, high = np.percentile(ratios, RANGE_PERCENTILES)
    return LengthRange(float(low), float(high), len(ratios))


def assess(tokens: Sequence[int], log_prob: float, text: str, source: str,
           source_tokens: int, max_len: int,
           length_range: LengthRange | None) -> dict[str, Any]:
    """The quality fields of one searched output, as :class:`~aiayn.decoding.Translation`
    takes them: ``{"confidence", "flags", "unchecked"}``.

    Args:
        tokens: the output's ids, ending in EOS (the search's hypothesis).
        log_prob: their summed log-probability (natural log).
        text: the output's text; source: its input line, both the model's text.
        source_tokens: the input's subword tokens as the model read them, without EOS.
        max_len: the most tokens the search let it generate before the forced EOS.
        length_range: the validation range, or None (``length_ratio`` is then unchecked).
    """
    body = list(tokens[:-1]) if tokens and tokens[-1] == EOS_ID else list(tokens)
    raised = set()
    if repeated_ngram(body) is not None:
        raised.add(REPEAT)
    if length_range is not None and \
            not length_range.contains(length_ratio(len(body), source_tokens)):
        raised.add(LENGTH_RATIO)
    share = copy_share(text, source)
    if share is not None and share >= COPY_MIN_SHARE:
        raised.add(COPY)
    if len(body) >= max_len:
        raised.add(NO_EOS)
    return {"confidence": confidence(log_prob, len(tokens)),
            "flags": _ordered(raised),
            "unchecked": () if length_range is not None else (LENGTH_RATIO,)}


def joined(parts: Sequence[Any]) -> dict[str, Any]:
    """The quality fields of a line translated in parts (:func:`aiayn.translator.join_parts`),
    from its parts' :class:`~aiayn.decoding.Translation`s: the confidence of all their tokens
    together (their log-probabilities summed over their tokens counted, each part's EOS
    included: the parts' confidences weighted by length), and every flag (and unchecked
    flag) any part has."""
    n = sum(len(p.tokens) for p in parts)
    return {"confidence": confidence(sum(p.log_prob for p in parts), n),
            "flags": _ordered(f for p in parts for f in p.flags),
            "unchecked": _ordered(f for p in parts for f in p.unchecked)}


def to_json(t: Any) -> dict[str, Any]:
    """A translation's quality fields as the JSON outputs carry them (``aiayn translate
    --json``, ``POST /translate`` and ``/document``)."""
    return {"confidence": t.confidence, "flags": list(t.flags), "unchecked": list(t.unchecked)}


def _ordered(names: Iterable[str]) -> tuple[str, ...]:
    got = set(names)
    return tuple(f for f in FLAGS if f in got)


def flag_counts(translations: Iterable[Any]) -> Counter:
    """How many of ``translations`` raise each flag, and ``"any"``: how many raise one."""
    counts: Counter = Counter({f: 0 for f in (*FLAGS, "any")})
    for t in translations:
        counts.update(t.flags)
        counts["any"] += bool(t.flags)
    return counts


__all__ = ["COPY", "COPY_MIN_SHARE", "COPY_MIN_WORDS", "FLAGS", "LENGTH_RATIO", "LengthRange",
           "NO_EOS", "RANGE_PERCENTILES", "REPEAT", "REPEAT_MAX_N", "REPEAT_MIN_TIMES",
           "REPEAT_MIN_TIMES_ONE",
           "assess", "confidence", "copy_share", "flag_counts", "joined", "length_ratio",
           "length_ratio_range", "repeated_ngram", "to_json"]
