"""Decoding from a prefix (not in the paper): each sentence's output begins with tokens the
caller gives, its *target prefix*, and the search continues from there, as CTranslate2's
``target_prefix``, fairseq's ``--prefix-size`` and Sockeye's JSON ``target_prefix`` do; and,
for autocompletion, the alternatives after the prefix (CTranslate2's ``return_alternatives``).

**Forcing.** :class:`ForcePrefix` is a :class:`~aiayn.decoding.search.ScoreProcessor`: at step
t, a row whose sentence has a prefix of P > t tokens may take only the prefix's token t; every
other column gets -inf. Rows of sentences without a prefix, and every row once t >= P, are left
as they are, so a line without a prefix decodes as it would without the feature. It runs after
the length rules and any other rule, in greedy search, sampling and beam search, over one model,
an ensemble or an int8 copy (whose columns it maps through ``SearchState.token_ids``).

**Scoring.** A forced token keeps the model's own log-probability (fairseq's and Sockeye's
choice): a translation's ``log_prob`` stays log P(prefix + continuation | source), what
:meth:`aiayn.Translator.score` gives the whole output, and ``score`` is that over lp(|Y|) as
without a prefix. CTranslate2 counts the forced tokens 0 (its score is the continuation's).
Greedy search, and beam search with alpha = 0, choose the same continuation either way (the
prefix adds one constant to every hypothesis of a sentence); with a length penalty the two may
rank finished hypotheses differently, since lp divides the prefix's part too.

**What cannot be forced is refused before decoding, in one line** (:class:`PrefixError`):
a prefix token the model never produces (an output layer limited to the target side's tokens,
``ModelConfig.output_vocab``, gives it probability 0, and an int8 copy does not score it at
all), a prefix longer than its line's maximum output length (``max_len_a`` x source tokens +
``max_len_b``, at most the model's ``max_len`` - 1, where EOS is forced), a prefix together
with a vocabulary shortlist (a token off a sentence's list has probability 0 there too), and a
count of prefixes that is not the count of lines. An empty source line gives an empty
translation whatever its prefix, as without one.

**Text.** A prefix is the model's target text: ``data.preprocess`` for the target language
(:meth:`aiayn.Translator.preprocess` with ``side="tgt"``), then the vocabulary's subwords, as
a forced target. A prefix that ends inside a word is cut into that fragment's subwords, which
may not be how the whole word is cut (as in CTranslate2): end it at a word boundary for the
natural continuation.

**Alternatives** (``alternatives=True`` with n-best k), CTranslate2's ``return_alternatives``:
the prefix is forced, the first free position is expanded to its k most likely tokens (EOS
excluded, as there; fewer where fewer are possible), and each is continued on its own by the
search asked for (beam or greedy, one output each). The k outputs come in the order of that
token's probability, not re-ranked by their scores, as CTranslate2 returns them. They differ
from CTranslate2's in two ways: their scores include the prefix (above), and there is no
``min_alternative_expansion_prob``. Without a prefix, the first position is expanded. Done in
two searches: a beam of k over prefix + one token (then EOS for free, alpha 0, so the k
hypotheses rank by that token's log-probability), then every line once per alternative, its
prefix extended by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from aiayn.data.vocab import EOS_ID
from aiayn.decoding.search import NEG_INF, SearchState, max_output_lengths
from aiayn.errors import UserError


class PrefixError(UserError):
    """A target prefix that cannot be forced (the message names the line and what is wrong)."""


class ForcePrefix:
    """The :class:`~aiayn.decoding.search.ScoreProcessor` that forces each sentence's prefix:
    at step t, a row of a sentence whose prefix is longer than t keeps only the prefix's token
    t, at the log-probability the earlier rules left it (0 where one of them banned it: the
    prefix wins over a guard); the other columns get -inf.

    Args:
        prefixes: per sentence of the search (index ``SearchState.rows``), its token ids, or
            None / [] for none.
    """

    def __init__(self, prefixes: Sequence[Sequence[int] | None]) -> None:
        P = max((len(p) for p in prefixes if p), default=0)
        self.forced = torch.full((len(prefixes), P), -1, dtype=torch.long)  # (B, P), -1: free
        for b, p in enumerate(prefixes):
            if p:
                self.forced[b, : len(p)] = torch.tensor(list(p), dtype=torch.long)

    def __call__(self, logp: Tensor, state: SearchState) -> Tensor:
        if state.t >= self.forced.shape[1]:  # past every prefix: nothing to do
            return logp
        if state.rows is None:
            raise ValueError("ForcePrefix needs each row's sentence (SearchState.rows)")
        token = self.forced.to(state.rows.device)[state.rows, state.t]  # (n,)
        rows = (token >= 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return logp
        column = token_columns(token[rows], state.token_ids)
        kept = logp[rows, column]
        # a prefix token an earlier rule banned (a guard: the prefix repeats an n-gram) is
        # still forced, at log-probability 0, as a forced EOS is with free_forced_eos: the row
        # keeps a finite score and the prefix wins over the guard (CTranslate2's order too)
        kept = torch.where(kept == NEG_INF, torch.zeros_like(kept), kept)
        logp[rows] = NEG_INF
        logp[rows, column] = kept
        return logp


def token_columns(tokens: Tensor, token_ids: Tensor | None) -> Tensor:
    """The step's column of each token (long (m,)), given its columns' tokens ``token_ids``
    (long (V',), increasing, as compact maps and shortlists are; None: column j is token j).

    Raises:
        PrefixError: a token the step does not score (:func:`check_prefixes` refuses such
            prefixes before decoding, so this is a step this module does not know).
    """
    if token_ids is None:
        return tokens
    ids = token_ids.to(tokens.device)
    column = torch.searchsorted(ids, tokens).clamp(max=ids.numel() - 1)
    missing = ids[column] != tokens
    if bool(missing.any()):
        raise PrefixError(f"target prefix token {int(tokens[missing][0])} is not among the "
                          f"{ids.numel()} tokens this search scores")
    return column


class _StopAfterFirstFree:
    """Phase one of the alternatives: at t == P (the first free position) EOS is banned, as
    CTranslate2 bans it there; past it, only EOS, for free (so the hypotheses rank by the
    token at P alone)."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = torch.tensor(list(lengths), dtype=torch.long)  # (B,) prefix lengths

    def __call__(self, logp: Tensor, state: SearchState) -> Tensor:
        P = self.lengths.to(state.rows.device)[state.rows]  # (n,)
        logp[P == state.t, EOS_ID] = NEG_INF
        past = P < state.t
        if bool(past.any()):
            logp[past] = NEG_INF
            logp[past, EOS_ID] = 0.0
        return logp


def model_prefixes(translator, prefixes: Sequence[str | None], lines: int, *,
                   preprocessed: bool = False) -> list[str | None]:
    """The prefixes as the model reads its target side (``data.preprocess`` with
    ``side="tgt"``; as they are with ``preprocessed``), None where a line has none (None, or
    a text that is empty or blank).

    Raises:
        PrefixError: not one prefix per line, or one that is not text.
    """
    prefixes = list(prefixes)
    if len(prefixes) != lines:
        raise PrefixError(f"{len(prefixes)} target prefixes for {lines} lines: give one per "
                          "line (None or an empty text for none)")
    for n, p in enumerate(prefixes, 1):
        if p is not None and not isinstance(p, str):
            raise PrefixError(f"the target prefix of line {n} is a {type(p).__name__}, "
                              "not text")
    given = [n for n, p in enumerate(prefixes) if p is not None and p.strip()]
    out: list[str | None] = [None] * lines
    texts = [prefixes[n] for n in given]
    if texts and not preprocessed:
        texts = translator.preprocess(texts, side="tgt")
    for n, text in zip(given, texts):
        out[n] = text if text.strip() else None
    return out


def first_parts(prefixes: Sequence[str | None] | None, counts: Sequence[int]
                ) -> list[str | None] | None:
    """Prefixes for lines cut into parts (``counts`` parts each): a line's prefix goes to its
    first part, the other parts have none."""
    if prefixes is None:
        return None
    return [p if k == 0 else None for p, n in zip(prefixes, counts) for k in range(n)]


def encode_prefixes(vocab, prefixes: Sequence[str | None]) -> list[list[int] | None]:
    """Each prefix's token ids (no BOS, no EOS), None where there is none."""
    texts = [p for p in prefixes if p is not None]
    ids = iter(vocab.encode_batch(texts) if texts else [])
    return [None if p is None else next(ids) or None for p in prefixes]


def check_prefixes(translator, lines: Sequence[str], prefixes: Sequence[list[int] | None],
                   decode, *, shortlist=None) -> None:
    """Refuse, before decoding, prefixes that cannot be forced (see the module's docstring).

    Args:
        lines: the model's text of each line; prefixes: each one's ids (None: none).
        decode: the :class:`~aiayn.config.DecodeConfig` (``max_len_a``, ``max_len_b``).
        shortlist: the shortlist the search would use, if any.

    Raises:
        PrefixError: naming the line (1-based) and what is wrong.
    """
    from aiayn.errors import ConfigError

    if not any(prefixes):
        return
    if shortlist is not None:
        raise ConfigError("a target prefix cannot be forced with a vocabulary shortlist (a "
                          "prefix token off a sentence's list has probability 0): decode "
                          "without the shortlist")
    vocab = translator.vocab
    max_len = translator.max_source_tokens
    sources = vocab.encode_batch(list(lines)) if lines else []
    lengths = torch.tensor([min(len(s), max_len - 1) for s in sources], dtype=torch.long)
    limits = max_output_lengths(lengths, decode.max_len_a, decode.max_len_b, max_len).tolist()
    producible = producible_tokens(translator.models)
    for n, (p, source, limit) in enumerate(zip(prefixes, sources, limits), 1):
        if not p or not source:  # an empty line is not decoded
            continue
        if len(p) > limit:
            raise PrefixError(
                f"the target prefix of line {n} has {len(p)} tokens, more than its translation "
                f"may have: {limit} (max_len_a={decode.max_len_a} x {len(source)} source "
                f"tokens + max_len_b={decode.max_len_b}, at most the model's max_len - 1 = "
                f"{max_len - 1})")
        bad = [t for t in p if t <= EOS_ID or (producible is not None and t not in producible)]
        if bad:
            raise PrefixError(
                f"the target prefix of line {n} holds {vocab.decode([bad[0]])!r} (token "
                f"{bad[0]}), which the model never produces (its output layer gives it "
                "probability 0); leave it out of the prefix")


def producible_tokens(models) -> set[int] | None:
    """The tokens some member of ``models`` (:class:`~aiayn.model.Transformer`s) can produce
    (an ensemble keeps a token that one member forbids), None when one of them produces every
    token (:meth:`~aiayn.model.Transformer.output_token_ids`)."""
    found: set[int] = set()
    for m in models:
        ids = m.output_token_ids(EOS_ID + 1)
        if ids is None:
            return None
        found.update(ids.tolist())
    return found


def decode_from_prefix(translator, lines: list[str], prefixes: Sequence[str | None] | None,
                       decode, *, nbest: int = 1, alternatives: bool = False,
                       processors: Callable[[list[int]], Sequence] | None = None,
                       **options) -> list[list]:
    """:func:`aiayn.decoding.translate_nbest` over ``translator``'s decoding models with each
    line's prefix forced (:meth:`aiayn.Translator.generate` calls it for ``target_prefix``).

    Args:
        lines: the model's text; prefixes: each line's prefix as the model's target text
            (:func:`model_prefixes`), None for none (None: no line has one).
        decode: the search; nbest: translations per line.
        alternatives: expand the first free position to the ``nbest`` best tokens and
            continue each (the module's docstring); ``nbest`` may then exceed the beam.
        processors: the caller's own per-batch rules (a ``translate_nbest`` factory), applied
            before the prefix's.
        options: passed to ``translate_nbest`` (``sampling``, ``shortlist``, ``workers``, ...).

    Returns:
        Per line, its translations (:class:`~aiayn.decoding.Translation`); each one's
        ``tokens`` begin with the prefix's ids.

    Raises:
        PrefixError, aiayn.errors.ConfigError: a prefix that cannot be forced, as
            :func:`check_prefixes` says.
    """
    from aiayn.decoding.translate import translate_nbest

    ids = encode_prefixes(translator.vocab, prefixes or [None] * len(lines))
    check_prefixes(translator, lines, ids, decode, shortlist=options.get("shortlist"))

    def run(texts, forced, search, k, extra=None, **more):
        def factory(chunk: list[int]) -> list:
            rules = list(processors(chunk)) if processors is not None else []
            if any(forced[i] for i in chunk):
                rules.append(ForcePrefix([forced[i] for i in chunk]))
            if extra is not None:
                rules.append(extra(chunk))
            return rules

        use = factory if processors is not None or extra is not None or any(forced) else None
        return translate_nbest(translator.decoding_models, translator.vocab, texts, search,
                               nbest=k, processors=use, **{**options, **more})

    if not alternatives:
        return run(lines, ids, decode, nbest)
    lengths = [len(p) if p else 0 for p in ids]
    # phase one: the nbest best tokens at each line's first free position
    first = run(lines, ids, dataclasses.replace(decode, beam_size=nbest, alpha=0.0), nbest,
                lambda chunk: _StopAfterFirstFree([lengths[i] for i in chunk]),
                sampling=None)
    texts, forced, owner = [], [], []
    for i, hyps in enumerate(first):
        P = lengths[i]
        after = [h.tokens[P] for h in hyps if len(h.tokens) == P + 2 and h.log_prob > NEG_INF]
        for token in list(dict.fromkeys(after)) or [None]:  # none: the prefix fills the line
            texts.append(lines[i])
            forced.append((ids[i] or []) + ([] if token is None else [token]))
            owner.append(i)
    # phase two: each alternative continued on its own
    out: list[list] = [[] for _ in lines]
    for i, translations in zip(owner, run(texts, forced, decode, 1)):
        out[i].extend(translations)
    return out


__all__ = ["ForcePrefix", "PrefixError", "check_prefixes", "decode_from_prefix",
           "encode_prefixes", "first_parts", "model_prefixes", "producible_tokens",
           "token_columns"]
