"""Guards against the known failures of translation systems: repetition loops, an end of
sentence produced too early or never, outputs far longer than their input (issue 82; not in
the paper, whose §6.1 bounds only the maximum length, input + 50).

Each guard is a decode setting (:class:`~aiayn.config.DecodeConfig`, off by default, checked
there) and, where it acts on the scores, a :class:`~aiayn.decoding.search.ScoreProcessor`
that the searches apply after the length rules. So each works alike with greedy search,
sampling, beam search (on every live hypothesis), ensembles (on the members' mean
distribution) and int8 copies. :func:`guard_processors` is the one place that builds them
from a config; :func:`~aiayn.decoding.translate_nbest` calls it for every batch. With every
guard off it returns none, and no search takes another path.

The rules read the tokens each live row has generated so far (``SearchState.tokens``, ids
of the vocabulary, oldest first; the start token is not among them, nor EOS, which ends a
row). A step may score fewer columns than the vocabulary has (``step.token_ids``, as an
int8 copy's compact output layer and a shortlist do); a guard maps ids to columns with
:func:`column_map`, and an id the step does not score has probability 0 already.

- ``no_repeat_ngram_size`` n (CTranslate2's ``no_repeat_ngram_size``, as fairseq's and
  Hugging Face's): no n consecutive generated tokens appear twice in a hypothesis. At step t
  (t tokens so far, t >= n), for every earlier position where the last n - 1 tokens occurred
  before, the token that followed them there is banned (-inf); n = 1 bans every token
  generated so far. EOS is never banned by it.
- ``repetition_penalty`` P (CTranslate2's, after Keskar et al. 2019, CTRL, arXiv:1909.05858):
  every token generated before in the row, whatever its count, has its score multiplied by P
  once; P > 1 penalizes repetition, P < 1 favours it, 1 is off. CTranslate2 applies it to the
  *logits* (a negative logit times P, a positive one divided by P) and then takes the
  log-softmax. Our processors see log-probabilities, all <= 0, so the rule multiplies the
  log-probability: the token's probability p becomes p ** P. Two differences follow: the
  effect does not depend on the logits' arbitrary offset (CTranslate2's does: a constant added
  to every logit changes which tokens it divides and which it multiplies), and the row is not
  renormalized (as the length rules' bans are not), so the other tokens keep their
  log-probabilities and a hypothesis's ``log_prob`` and ``score`` count the penalized value.
- ``min_length_ratio`` m: EOS is banned while t < m * S, S the sentence's source tokens
  without EOS (as ``max_len_a`` counts them): the output has at least ceil(m * S) tokens
  before its EOS, unless the maximum comes first (the maximum wins: EOS is never banned where
  it is forced).
- ``max_length_ratio`` R (Marian's ``--max-length-factor``): at most floor(R * S) tokens
  before EOS, which the length rules then force. It is no processor but a cap on the one
  maximum (:func:`~aiayn.decoding.search.max_output_lengths`): the maximum is
  ``min(floor(max_len_a * S + max_len_b), floor(R * S), model max_len - 1)``. Marian bounds
  every sentence of a batch by the batch's longest source (EOS included) times the factor,
  3 by default; here each sentence has its own source's bound, so an output does not depend
  on its batch, and the default is off.

Both ratios are computed in float64 with a slack of 1e-9, so a ratio written in decimal
gives the integer it means (0.3 * 10 is 3 tokens, not 4).

Shape legend: B sentences of the search, n live rows, V' the step's columns, t tokens so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from aiayn.config import DecodeConfig
from aiayn.data.vocab import EOS_ID, PAD_ID
from aiayn.decoding.search import NEG_INF, ScoreProcessor, SearchState

# the DecodeConfig fields that are guards: the faces (Translator, CLI, server) take these
GUARD_FIELDS = ("no_repeat_ngram_size", "repetition_penalty", "min_length_ratio",
                "max_length_ratio")
_SLACK = 1e-9  # float64 slack for the ratios (see the module docstring)


def column_map(token_ids: Tensor | None) -> Tensor | None:
    """Each token id's column in a step that scores the columns ``token_ids`` (long (V',)):
    long (max id + 1,), -1 for an id the step does not score; None where ``token_ids`` is
    None (column j is token j)."""
    if token_ids is None:
        return None
    cols = torch.full((int(token_ids.max()) + 1,), -1, dtype=torch.long,
                      device=token_ids.device)
    cols[token_ids] = torch.arange(token_ids.numel(), device=token_ids.device)
    return cols


def _columns(ids: Tensor, cols: Tensor | None) -> Tensor:
    """The columns of token ``ids`` (any shape) under :func:`column_map`'s ``cols``; -1 where
    the step does not score the id."""
    if cols is None:
        return ids
    inside = ids < cols.numel()
    return torch.where(inside, cols[ids.clamp(max=cols.numel() - 1)], -1)


def _tokens(state: SearchState, guard: str) -> Tensor:
    if state.tokens is None:
        raise ValueError(f"{guard} needs the tokens generated so far (SearchState.tokens)")
    return state.tokens


@dataclass(frozen=True, eq=False)
class NoRepeatNgram:
    """``no_repeat_ngram_size``: a :class:`ScoreProcessor` under which no ``size``
    consecutive generated tokens appear twice in a row's output (see the module docstring).

    Args:
        size: n >= 1.
        columns: :func:`column_map` of the step's ``token_ids`` (None: column j is token j).
    """

    size: int
    columns: Tensor | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"no_repeat_ngram_size must be >= 1 here (0 adds no guard), "
                             f"got {self.size}")

    def banned(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The tokens to ban next, from ``tokens`` long (n, t): (rows, token ids), long (m,)
        each, a row and an id repeated where several earlier n-grams agree."""
        n, t = self.size, tokens.shape[1]
        if t < n:  # no complete n-gram before the current (n - 1)-gram yet
            empty = tokens.new_empty(0)
            return empty, empty
        after = tokens[:, n - 1:]  # (n_rows, t - n + 1): the token after each earlier window
        if n == 1:
            match = torch.ones_like(after, dtype=torch.bool)
        else:
            windows = tokens.unfold(1, n - 1, 1)  # (n_rows, t - n + 2, n - 1)
            match = (windows[:, :-1] == windows[:, -1:]).all(dim=2)  # (n_rows, t - n + 1)
        rows, pos = match.nonzero(as_tuple=True)
        return rows, after[rows, pos]

    def __call__(self, logp: Tensor, state: SearchState) -> Tensor:
        rows, ids = self.banned(_tokens(state, "no_repeat_ngram_size"))
        if rows.numel():
            cols = _columns(ids, self.columns)
            scored = cols >= 0
            logp[rows[scored], cols[scored]] = NEG_INF
        return logp


@dataclass(frozen=True, eq=False)
class RepetitionPenalty:
    """``repetition_penalty``: a :class:`ScoreProcessor` that multiplies the log-probability
    of every token a row has generated before by ``penalty`` (once per distinct token; see
    the module docstring for CTranslate2's rule on logits and how this differs).

    Args:
        penalty: P > 0; > 1 penalizes repetition.
        columns: :func:`column_map` of the step's ``token_ids`` (None: column j is token j).
    """

    penalty: float
    columns: Tensor | None = None

    def __post_init__(self) -> None:
        if not self.penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.penalty}")

    def __call__(self, logp: Tensor, state: SearchState) -> Tensor:
        tokens = _tokens(state, "repetition_penalty")
        if tokens.shape[1] == 0:
            return logp
        cols = _columns(tokens, self.columns)  # (n, t)
        scored = cols >= 0
        cols = torch.where(scored, cols, PAD_ID)  # PAD (never generated) stands in for ids
        old = logp.gather(1, cols)  # (n, t), the step does not score; written back as it is
        # in float64: a penalty far from 1 (1e300, 1e-300) gives -inf or -0.0, never NaN, as
        # it would in float32 (inf * 0, 0 * -inf); each distinct token once, however often
        new = torch.where(scored, (old.double() * self.penalty).to(logp.dtype), old)
        return logp.scatter_(1, cols, new)


@dataclass(frozen=True, eq=False)
class MinLength:
    """A per-sentence minimum output length: a :class:`ScoreProcessor` that bans EOS in row
    i while ``state.t < min_lens[state.rows[i]]``, except where the row is at its maximum
    (``state.t >= state.max_lens[i]``, where the length rules force EOS).

    Args:
        min_lens: long (B,), tokens each sentence of the search must generate before EOS.
    """

    min_lens: Tensor

    @classmethod
    def from_ratio(cls, src_lengths: Tensor, ratio: float) -> MinLength:
        """``min_length_ratio``: ceil(``ratio`` * S) tokens for each sentence's S source tokens
        (``src_lengths`` long (B,), without EOS)."""
        need = torch.ceil(src_lengths.double() * ratio - _SLACK)
        return cls(need.clamp(0, 2.0**62).long())  # a huge ratio: no EOS before the maximum

    def __call__(self, logp: Tensor, state: SearchState) -> Tensor:
        if state.rows is None:
            raise ValueError("a minimum length ratio needs each row's sentence "
                             "(SearchState.rows)")
        ban = (state.t < self.min_lens[state.rows]) & (state.t < state.max_lens)  # (n,)
        logp[:, EOS_ID].masked_fill_(ban, NEG_INF)
        return logp


def max_length_cap(decode: DecodeConfig) -> float | None:
    """The ``max_ratio`` for :func:`~aiayn.decoding.search.max_output_lengths`:
    ``decode.max_length_ratio`` plus the float64 slack (so floor(R * S) is the integer R
    means), or None where the guard is off."""
    if decode.max_length_ratio is None:
        return None
    return decode.max_length_ratio + _SLACK


def guard_processors(decode: DecodeConfig, src_lengths: Tensor,
                     token_ids: Tensor | None = None) -> tuple[ScoreProcessor, ...]:
    """The score processors of the guards ``decode`` turns on, for one search over B
    sentences; empty with every guard off (the default).

    Args:
        decode: its ``no_repeat_ngram_size``, ``repetition_penalty`` and
            ``min_length_ratio`` (``max_length_ratio`` is a cap on the maximum length,
            :func:`max_length_cap`, not a processor).
        src_lengths: long (B,), each sentence's source tokens without EOS, in the search's
            input order (the order ``SearchState.rows`` indexes).
        token_ids: the step function's ``token_ids`` (its columns' ids; None: all).

    Returns:
        The processors, to apply after the length rules: the minimum length, the n-gram
        ban, the repetition penalty (they commute: each bans or lowers scores only).
    """
    out: list[ScoreProcessor] = []
    if decode.min_length_ratio > 0:
        out.append(MinLength.from_ratio(src_lengths, decode.min_length_ratio))
    cols = None
    if decode.no_repeat_ngram_size > 0 or decode.repetition_penalty != 1.0:
        cols = column_map(token_ids)
    if decode.no_repeat_ngram_size > 0:
        out.append(NoRepeatNgram(decode.no_repeat_ngram_size, cols))
    if decode.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(decode.repetition_penalty, cols))
    return tuple(out)


def guard_settings(decode: DecodeConfig) -> dict[str, Any]:
    """The guards' values in ``decode``, by field name (for records and ``/info``)."""
    return {name: getattr(decode, name) for name in GUARD_FIELDS}


def has_repeated_ngram(tokens: list[int], n: int) -> bool:
    """Whether some ``n`` consecutive ids occur twice in ``tokens`` (a trailing EOS is left
    out): what ``no_repeat_ngram_size=n`` rules out."""
    if tokens and tokens[-1] == EOS_ID:
        tokens = tokens[:-1]
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) < len(grams)


__all__ = ["GUARD_FIELDS", "MinLength", "NoRepeatNgram", "RepetitionPenalty", "column_map",
           "guard_processors", "guard_settings", "has_repeated_ngram", "max_length_cap"]
