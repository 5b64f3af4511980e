"""Translate text with a trained model: encode, search (§6.1), detokenize.

Sentences are sorted by length and decoded in batches of ``batch_size``, so padding stays
small; results come back in input order. An empty (or whitespace-only) line gives an empty
translation without running the model.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aiayn.data.batching import pad_sources
from aiayn.data.vocab import EOS_ID, Vocabulary
from aiayn.decoding.search import (
    CachedStep,
    DecodeStats,
    EnsembleStep,
    Hypothesis,
    SamplingConfig,
    ScoreProcessor,
    UncachedStep,
    beam_search,
    greedy_search,
    max_output_lengths,
    same_columns,
)
from aiayn.decoding.alignment import Alignment
from aiayn.decoding.shortlist import ShortlistStep
from aiayn.config import DecodeConfig
from aiayn.errors import ConfigError, UserError
from aiayn.model.engine import as_engine


@dataclass(frozen=True)
class Translation:
    """One output for one input line.

    Attributes:
        text: detokenized translation.
        score: search score (``log_prob / lp(|Y|)`` for beam search, ``log_prob`` otherwise).
        log_prob: sum of token log-probabilities, EOS included (natural log).
        tokens: generated ids, EOS included.
        alignment: its word alignment to the source
            (:class:`~aiayn.decoding.alignment.Alignment`: Pharaoh links, soft matrix, words),
            when asked for (:meth:`aiayn.Translator.generate` ``alignments=True``), else None.
    """

    text: str
    score: float
    log_prob: float
    tokens: list[int]
    alignment: Alignment | None = None


class InputTooLongError(UserError):
    """A source line has more subword tokens than the model's positional table holds."""


def encode_sources(
    vocab: Vocabulary, lines: list[str], max_len: int, *, long_inputs: str = "truncate",
    warn: Callable[[str], None] | None = None,
) -> list[list[int]]:
    """Token ids of each line plus EOS, as the encoder was trained on (no BOS).

    Args:
        max_len: the model's ``max_len``; longer sources are truncated to ``max_len - 1``
            tokens + EOS (``long_inputs="truncate"``, with a warning naming the lines) or
            rejected (``long_inputs="error"``).
        warn: receives the warning text; default ``warnings.warn``.

    Raises:
        InputTooLongError: with ``long_inputs="error"``, naming the first long line (1-based).
        ValueError: unknown ``long_inputs``.
    """
    if long_inputs not in ("truncate", "error"):
        raise ValueError(f"long_inputs must be 'truncate' or 'error', got {long_inputs!r}")
    ids = vocab.encode_batch(lines) if lines else []
    long_lines = [i + 1 for i, s in enumerate(ids) if len(s) + 1 > max_len]
    if long_lines:
        first = long_lines[0]
        msg = (f"{len(long_lines)} input line(s) longer than the model's max_len={max_len} "
               f"tokens (first: line {first}, {len(ids[first - 1]) + 1} tokens with EOS)")
        if long_inputs == "error":
            raise InputTooLongError(msg + "; shorten or split them, or allow truncation")
        (warn or (lambda m: warnings.warn(m, stacklevel=3)))(msg + f"; truncated to {max_len}")
    return [s[: max_len - 1] + [EOS_ID] for s in ids]


def translate_nbest(
    model,
    vocab: Vocabulary,
    lines: list[str],
    decode: DecodeConfig,
    *,
    nbest: int = 1,
    sampling: SamplingConfig | None = None,
    bf16: bool = False,
    use_cache: bool = True,
    min_len: int = 0,
    long_inputs: str = "truncate",
    warn: Callable[[str], None] | None = None,
    progress: bool = False,
    stats: DecodeStats | None = None,
    workers: int | str = 1,
    shortlist=None,
    processors: Callable[[list[int]], Sequence[ScoreProcessor]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]] | None] | None = None,
) -> list[list[Translation]]:
    """Translate ``lines`` of the model's own text; for each, up to ``nbest`` translations,
    best first. The engine under :class:`aiayn.Translator`, which owns the raw-text contract
    (preprocessing, the decode defaults, precision): call that unless the text is already
    the model's.

    Args:
        model: a :class:`~aiayn.model.Transformer` (unwrapped, not DDP), or a sequence of them
            sharing ``vocab``: an ensemble, whose members' next-token probabilities are
            averaged at every step (:class:`~aiayn.decoding.search.EnsembleStep`). Decoded in
            eval mode, and left in the training/eval mode each came in.
        lines: text as the model reads it (``data.preprocess`` applied).
        decode: the search (§6.1): ``beam_size`` K (1 = greedy; ignored when ``sampling`` is
            given), ``alpha`` (lp(Y) = ((5 + |Y|) / 6) ** alpha), at most ``max_len_a *
            source_tokens + max_len_b`` output tokens, ``batch_size`` sentences decoded
            together, ``beam_rules`` (see :func:`~aiayn.decoding.search.beam_search`).
        nbest: translations per line (<= beam_size; greedy and sampling give 1).
        sampling: sample instead of searching (see :class:`SamplingConfig`).
        bf16: run the model under ``torch.autocast(dtype=torch.bfloat16)``.
        use_cache: False reruns the decoder over the whole prefix each step (benchmarks).
        min_len: ban EOS before this many tokens (benchmarks fix output lengths with it).
        long_inputs: "truncate" (warn) or "error"; see :func:`encode_sources`.
        progress: show a tqdm bar (sentences) on stderr.
        stats: a :class:`~aiayn.decoding.search.DecodeStats` that counts the searches'
            decoder calls and row-steps (benchmarks).
        workers: processes that decode the batches: 1 (this one), a count, or "auto" (one
            one-thread process per torch thread on CPU; see
            :func:`~aiayn.decoding.workers.choose_workers`). The output is the same whatever
            the count.
        shortlist: a :class:`~aiayn.decoding.shortlist.Shortlist`: each sentence produces
            only its own list's tokens (opt-in; changes outputs; needs the cache).
        processors: per batch, the score rules its search applies after the length rules:
            called with the batch's line numbers (0-based indices into ``lines``, in the
            batch's order) and returning :class:`~aiayn.decoding.search.ScoreProcessor`s,
            which find a row's line as ``chunk[state.rows[i]]``. Called in the process that
            decodes the batch (a forked worker sees the closure, unpickled).
        constraints: per line, target phrases (token id lists) its translation must hold, or
            None: such lines are decoded in their own batches by
            :func:`~aiayn.decoding.constraints.constrained_beam_search` (beam 1: one
            hypothesis per bank), the others exactly as without constraints.

    Raises:
        InputTooLongError: a long line with ``long_inputs="error"``.
        aiayn.errors.ConfigError: an ``nbest`` the search cannot give (a ``ValueError``).
        ValueError: bad search settings; an ensemble :func:`check_ensemble` refuses.
        aiayn.decoding.constraints.ConstraintError: constraints for another number of lines,
            longer than a line's maximum output, with tokens the model never produces, or
            with sampling.
        RuntimeError: a worker process failed (its traceback in the message).
    """
    if nbest > 1 and (decode.beam_size == 1 or sampling is not None):
        raise ConfigError(f"nbest={nbest} needs beam search (beam_size > 1, no sampling)")
    if not 1 <= nbest <= decode.beam_size and sampling is None:
        raise ConfigError(f"nbest must be in [1, beam_size={decode.beam_size}], got {nbest}")
    if shortlist is not None and not use_cache:
        raise ConfigError("a shortlist needs the decoder cache (use_cache=True)")
    models = list(model) if isinstance(model, Sequence) else [model]
    check_ensemble(models)
    was_training = [m.training for m in models]
    for m in models:
        m.eval()  # no dropout while decoding; the caller's mode is restored below
    try:
        return _translate([as_engine(m) for m in models], vocab, lines, decode, nbest, sampling,
                          bf16, use_cache,
                          min_len, long_inputs, warn, progress, stats, workers, shortlist,
                          processors, constraints)
    finally:
        for m, mode in zip(models, was_training):
            m.train(mode)


def check_ensemble(models: list) -> None:
    """Refuse models that cannot decode together: none at all, or members with different
    output vocabularies, start tokens (``decoder_start_id``) or devices.

    Raises:
        ValueError: naming what differs.
    """
    if not models:
        raise ValueError("an ensemble needs at least one model")
    sizes = [m.config.target_vocab_size for m in models]
    if len(set(sizes)) > 1:
        raise ValueError(f"ensemble members have different output vocabularies ({sizes} "
                         "tokens); an ensemble needs models trained on one vocabulary")
    starts = [m.config.decoder_start_id for m in models]
    if len(set(starts)) > 1:
        raise ValueError(f"ensemble members start decoding from different tokens {starts} "
                         "(decoder_start_id); an ensemble needs one")
    devices = [str(next(m.parameters()).device) for m in models]
    if len(set(devices)) > 1:
        raise ValueError(f"ensemble members are on different devices: {devices}")


def _translate(models, vocab, lines, decode, nbest, sampling, bf16, use_cache, min_len,
               long_inputs, warn, progress, stats, workers, shortlist, processors,
               constraints=None):
    from aiayn.decoding.workers import choose_workers, run_in_workers

    batch_size = decode.batch_size
    device = next(models[0].parameters()).device
    max_len = min(m.config.max_len for m in models)
    sources = encode_sources(vocab, lines, max_len, long_inputs=long_inputs, warn=warn)
    results: list[list[Translation]] = [[Translation("", 0.0, 0.0, [])] for _ in lines]
    todo = sorted((i for i, s in enumerate(sources) if len(s) > 1), key=lambda i: -len(sources[i]))
    constrained: list[list[int]] = []
    if constraints is not None:  # constrained lines in batches of their own
        todo, constrained = _constrained_lines(models, vocab, sources, constraints, decode,
                                               max_len, sampling, todo)
    chunks = [todo[start : start + batch_size] for start in range(0, len(todo), batch_size)]
    chunks += constrained
    workers = choose_workers(workers, device, len(chunks), sampling=sampling is not None)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(lines), unit="sent", desc="translate")
        bar.update(len(lines) - len(todo))
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())
    # each model scores only the tokens it can produce where it can (its int8 copy's
    # compact_token_ids); an ensemble only where its members' columns agree
    ids = [m.compact_token_ids if use_cache else None for m in models]
    compact = all(same_columns(ids[0], i) for i in ids[1:])

    def decode_chunk(chunk: list[int]) -> list[list[Translation]]:
        src = pad_sources([sources[i] for i in chunk]).to(device)  # (B, S)
        wanted = None if constraints is None else [constraints[i] for i in chunk]
        if wanted is not None and not wanted[0]:
            wanted = None
        with torch.inference_mode(), autocast:
            encoded = [model.encode(src) for model in models]  # (memory, src_mask) each
            src_lengths = encoded[0][1].sum(dim=1) - 1  # without EOS
            max_lens = max_output_lengths(src_lengths, decode.max_len_a, decode.max_len_b,
                                          max_len)
            if shortlist is not None:
                steps = _shortlist_steps(models, encoded, shortlist,
                                         [sources[i] for i in chunk], ids[0] if compact
                                         else None, int(max_lens.max()) + 1, wanted)
            elif use_cache:  # the start token plus at most max_lens tokens
                steps = [CachedStep.start(model, memory, src_mask, int(max_lens.max()) + 1,
                                          compact)
                         for model, (memory, src_mask) in zip(models, encoded)]
            else:
                steps = [UncachedStep.start(model, memory, src_mask)
                         for model, (memory, src_mask) in zip(models, encoded)]
            step = steps[0] if len(steps) == 1 else EnsembleStep(steps)
            rules = tuple(processors(list(chunk))) if processors is not None else ()
            if wanted is not None:
                from aiayn.decoding.constraints import constrained_beam_search, search_beam_size

                hyps = constrained_beam_search(
                    step, max_lens, wanted, beam_size=search_beam_size(decode.beam_size,
                                                                       wanted[0]),
                    alpha=decode.alpha, nbest=nbest, min_len=min_len, rules=decode.beam_rules,
                    stats=stats, processors=rules)
            elif sampling is not None or decode.beam_size == 1:
                hyps = [[h] for h in greedy_search(step, max_lens, min_len=min_len,
                                                   sampling=sampling, stats=stats,
                                                   processors=rules)]
            else:
                hyps = beam_search(step, max_lens, beam_size=decode.beam_size,
                                   alpha=decode.alpha, nbest=nbest, min_len=min_len,
                                   rules=decode.beam_rules, stats=stats, processors=rules)
        return [[_to_translation(vocab, h) for h in hs] for hs in hyps]

    def keep(b: int, translations: list[list[Translation]]) -> None:
        for i, ts in zip(chunks[b], translations):
            results[i] = ts
        if bar is not None:
            bar.update(len(chunks[b]))

    try:
        if workers == 1:
            for b, chunk in enumerate(chunks):
                keep(b, decode_chunk(chunk))
        else:  # each child counts into its own copy of stats; the parent adds them up
            from aiayn.model.kernels import warm_up

            warm_up()  # compiled (or loaded) once here, not once per child
            counted = run_in_workers(decode_chunk, chunks, workers, on_result=keep,
                                     finish=lambda: stats)
            if stats is not None:
                for child in counted:
                    stats.calls += child.calls
                    stats.row_steps += child.row_steps
    finally:
        if bar is not None:
            bar.close()
    return results


def _shortlist_steps(models, encoded, shortlist, sources, producible, capacity, wanted=None):
    """One :class:`ShortlistStep` per model: the output layer over the batch's union of
    lists (less the tokens the models cannot produce), each row held to its own list (and
    its constraints' tokens, ``wanted``)."""
    ids, allowed = shortlist.candidates(sources, EOS_ID + 1, models[0].config.target_vocab_size)
    if wanted is not None:
        from aiayn.decoding.constraints import allow_tokens

        ids, allowed = allow_tokens(ids, allowed, [[t for p in ps for t in p] for ps in wanted])
    if producible is not None:  # a target-only output layer: its -inf columns stay out
        keep = torch.isin(ids, producible.cpu())
        ids, allowed = ids[keep], allowed[:, keep]
    device = encoded[0][0].device
    ids = ids.to(device)
    banned = (~allowed).to(device)
    return [ShortlistStep(CachedStep.start(model, memory, src_mask, capacity, token_ids=ids),
                          banned)
            for model, (memory, src_mask) in zip(models, encoded)]


def _constrained_lines(models, vocab, sources, constraints, decode, max_len, sampling, todo):
    """(the unconstrained lines of ``todo``, batches of the constrained ones), once the
    constraints are checked (:func:`~aiayn.decoding.constraints.check_constraints`)."""
    from aiayn.decoding.constraints import (
        ConstraintError,
        check_constraints,
        constrained_chunks,
        producible_tokens,
    )

    if len(constraints) != len(sources):
        raise ConstraintError(f"constraints are given for {len(constraints)} lines but there "
                              f"are {len(sources)} input lines")
    if sampling is not None and any(constraints):
        raise ConstraintError("constraints need a search (beam or greedy), not sampling")
    lens = max_output_lengths(torch.tensor([len(s) - 1 for s in sources], dtype=torch.long),
                              decode.max_len_a, decode.max_len_b, max_len).tolist()
    check_constraints(vocab, constraints, sources, lens, producible_tokens(models))
    return constrained_chunks(todo, constraints, decode.batch_size, decode.beam_size)


def _to_translation(vocab: Vocabulary, h: Hypothesis) -> Translation:
    return Translation(vocab.decode(h.tokens), h.score, h.log_prob, h.tokens)
