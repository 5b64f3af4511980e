"""Search over a step function: greedy, sampling and beam search as §6.1 ran it.

The searches never see the model. They drive a *step function*: an object that maps the newest
token of every live row to next-token logits, and that can keep or reorder its rows. The model's
incremental key/value cache is one such object (:class:`CachedStep`); the same weights without
the cache (:class:`UncachedStep`, for tests and benchmarks) and hand-written stubs are others.
Every one subclasses the declared protocol, :class:`StepFunction`, whose log-probabilities and
greedy choice have default implementations a step may replace with faster ones.

Rules over the scores (the length rules, and any the caller adds) are :class:`ScoreProcessor`
objects the search applies, as Hugging Face's ``LogitsProcessor``s: the model and the steps
know nothing of them.

Shape legend: B sentences, K beam size, n live rows, V vocabulary, t tokens generated so far.

Lengths: a hypothesis of ``|Y|`` tokens counts its final EOS. A sentence may generate at most
``max_lens[b]`` tokens before EOS; at that point only EOS is allowed, so every hypothesis ends
in EOS and its score includes the EOS probability. PAD and BOS are never generated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from aiayn.data.vocab import BOS_ID, EOS_ID, PAD_ID
from aiayn.model import kernels
from aiayn.model.engine import as_engine

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SearchState:
    """Where a search stands at a step, what score processors read.

    Attributes:
        t: tokens generated so far (the step scores token t + 1).
        max_lens: long (n,), the tokens each live row may generate before its forced EOS.
        rows: long (n,), the sentence of each live row: its index in the search's input
            (0..B-1), so a per-sentence rule (a prefix, a constraint) finds its sentence's
            data. The searches fill it (and ``tokens``) only when the caller gives
            processors; None otherwise (and in a hand-made state).
        tokens: long (n, t), the token ids each live row has generated so far (not the
            step's columns), oldest first; None as ``rows``.
        token_ids: long (V',), the token of each of the step's columns (its ``token_ids``);
            None where column j is token j. A rule that bans or forces a token maps its id
            to a column with it.
    """

    t: int
    max_lens: Tensor
    rows: Tensor | None = None
    tokens: Tensor | None = None
    token_ids: Tensor | None = None


class ScoreProcessor(Protocol):
    """A rule over next-token scores, as Hugging Face's ``LogitsProcessor``: it takes the
    live rows' float32 log-probabilities (n, V') and the :class:`SearchState`, and returns
    them with the rule applied (it may change them in place). Columns are the step
    function's (``token_ids``); columns 0-2 are PAD, BOS and EOS. A new search rule (a
    repetition penalty, a constraint) is a new processor, not a change to the model or the
    steps."""

    def __call__(self, logp: Tensor, state: SearchState) -> Tensor: ...


@dataclass(frozen=True)
class LengthRules:
    """The searches' length rules, one :class:`ScoreProcessor`: PAD and BOS are banned; EOS
    is banned while t < ``min_len``; rows with t >= ``max_lens`` may only take EOS, at its
    own log-probability (or at 0 with ``free_forced_eos``, as Hugging Face's
    ``forced_eos_token_id`` does). A step may apply them in its own kernel
    (:meth:`eos_masks`; :meth:`CachedStep.greedy`).
    """

    min_len: int = 0
    free_forced_eos: bool = False

    def __call__(self, logp: Tensor, state: SearchState) -> Tensor:
        logp[:, PAD_ID] = NEG_INF
        logp[:, BOS_ID] = NEG_INF
        if state.t < self.min_len:
            logp[:, EOS_ID] = NEG_INF
        at_max = state.t >= state.max_lens
        if bool(at_max.any()):
            eos = logp[:, EOS_ID].clone()
            logp[at_max] = NEG_INF
            logp[at_max, EOS_ID] = 0.0 if self.free_forced_eos else eos[at_max]
        return logp

    def eos_masks(self, state: SearchState) -> tuple[np.ndarray, np.ndarray] | None:
        """The rules as :func:`aiayn.model.kernels.rescale_greedy` takes them: (EOS banned,
        EOS only), bool numpy (n,) each, with PAD and BOS (the columns before EOS) banned;
        None where the kernel cannot apply them (a forced EOS for free, lengths off the
        CPU)."""
        if self.free_forced_eos or not state.max_lens.is_cpu:
            return None
        n = state.max_lens.shape[0]
        return np.full(n, state.t < self.min_len), (state.t >= state.max_lens).numpy()


def apply_processors(logp: Tensor, processors: Sequence[ScoreProcessor],
                     state: SearchState) -> Tensor:
    """``logp`` (n, V') float32 with each processor applied, in order."""
    for processor in processors:
        logp = processor(logp, state)
    return logp


class StepFunction(Protocol):
    """What a search needs from a decoder; a class that implements it subclasses it, for its
    default :meth:`log_probs` and :meth:`greedy`.

    ``step(tokens)`` takes the newest token of each of the n rows, ``tokens`` long (n,), and
    returns next-token logits (n, V) (any float dtype); the first call receives ``start_id``,
    the decoder's start token (the model's ``config.decoder_start_id``: BOS, or pad in Marian
    models). Calling it advances the rows by one position, as :meth:`log_probs` and
    :meth:`greedy` do (a search calls one of the three per step). ``step.select(index)``
    returns a step function whose row i continues row ``index[i]`` of this one (index long
    (n',), repeats allowed). A step function may score fewer columns than the vocabulary has
    (``token_ids``, long (V',): the token of each column, or None where column j is token j);
    its columns 0-2 are then still PAD, BOS and EOS, and it leaves out only tokens it gives
    probability 0, so the searches' results are the same.
    """

    start_id: int
    token_ids: Tensor | None = None

    def __call__(self, tokens: Tensor) -> Tensor: ...

    def select(self, index: Tensor) -> StepFunction: ...

    def log_probs(self, tokens: Tensor) -> Tensor:
        """float32 (n, V') next-token log-probabilities: the log-softmax of the logits
        (:func:`aiayn.model.kernels.log_softmax`, decoding's one log-softmax)."""
        return kernels.log_softmax(self(tokens))

    def greedy(self, tokens: Tensor, processors: Sequence[ScoreProcessor],
               state: SearchState) -> tuple[Tensor, Tensor]:
        """Each row's most likely next token under ``processors``: (column long (n,), its
        log-probability float32 (n,)), the argmax of :meth:`log_probs` with the processors
        applied."""
        return choose_greedy(self.log_probs(tokens), processors, state)


def choose_greedy(logp: Tensor, processors: Sequence[ScoreProcessor], state: SearchState
                  ) -> tuple[Tensor, Tensor]:
    """The default of :meth:`StepFunction.greedy` from log-probabilities ``logp`` (n, V'):
    (column long (n,), log-probability float32 (n,)) of each row's best column once the
    processors are applied."""
    logp = apply_processors(logp, processors, state)
    column = _argmax(logp)
    return column, logp.gather(1, column[:, None]).squeeze(1)


@dataclass(frozen=True)
class Hypothesis:
    """One finished output.

    Attributes:
        tokens: generated ids, ending in EOS (BOS not included).
        log_prob: sum of the token log-probabilities (natural log), EOS included.
        score: ``log_prob / lp(|tokens|)``, the quantity beam search ranks by (equal to
            ``log_prob`` for greedy search and sampling, and when alpha = 0).
    """

    tokens: list[int]
    log_prob: float
    score: float


@dataclass
class DecodeStats:
    """The decoder work a search did, summed over its calls (pass one to a search, or to
    :func:`~aiayn.decoding.translate_nbest`, and read it afterwards).

    Attributes:
        calls: step-function calls (decoder steps, each over all live rows).
        row_steps: rows fed to the decoder, summed over the calls: the unit of decoder work
            (a beam search of K over B sentences and T steps makes at most B * K * T).
    """

    calls: int = 0
    row_steps: int = 0

    def count(self, rows: int) -> None:
        """Book one decoder call over ``rows`` rows."""
        self.calls += 1
        self.row_steps += rows


@dataclass(frozen=True)
class SamplingConfig:
    """Ancestral sampling instead of argmax (not used in the paper).

    Attributes:
        temperature: logits are divided by it; > 0.
        top_k: keep only the k most likely tokens; 0 = all.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p
            (nucleus sampling); 1.0 = all.
        seed: seed of the sampler's own generator; None = torch's global generator.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """Wu et al. (2016), as used in §6.1: lp(Y) = ((5 + |Y|) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def _argmax(logp: Tensor) -> Tensor:
    """``logp.argmax(dim=-1)`` for (n, V) ``logp``, by :func:`aiayn.model.kernels.row_argmax`
    where it can run (the same columns, faster)."""
    if kernels.usable(logp, kind="search"):
        column = kernels.row_argmax(logp)
        if column is not None:
            return column
    return logp.argmax(dim=-1)


def _best_extensions(logp: Tensor, live: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` best extensions of each sentence's live hypotheses: (scores (n, k), indices
    (n, k) into K * V, beam-major), from ``logp`` (n * G, V), G = 1 (the first step: beam 0
    only) or K rows per sentence, and the raw log-prob sums ``live`` (n, K). One float
    addition per candidate, then top-k; by :func:`aiayn.model.kernels.beam_top` where it can
    run (the same sums without making them all)."""
    n, K = live.shape
    G = logp.shape[0] // n
    V = logp.shape[-1]
    if G * V >= k and kernels.usable(logp, live, kind="search"):
        found = kernels.beam_top(logp, live[:, :G], k)
        if found is not None:
            return found
    if G == 1:  # beams 1..K-1 are not alive yet (-inf)
        logp = torch.cat([logp[:, None], logp.new_full((n, K - 1, V), NEG_INF)], dim=1)
    cand = (live.unsqueeze(2) + logp.view(n, K, V)).view(n, K * V)
    return cand.topk(k, dim=1)


def _check_lens(max_lens: Tensor, min_len: int) -> None:
    if max_lens.dim() != 1 or max_lens.numel() == 0:
        raise ValueError(f"max_lens must be a non-empty 1-D tensor, got shape "
                         f"{tuple(max_lens.shape)}")
    if int(max_lens.min()) < 0 or min_len < 0:
        raise ValueError(f"lengths must be >= 0, got min(max_lens)={int(max_lens.min())}, "
                         f"min_len={min_len}")


def check_beam_settings(beam_size: int, alpha: float, nbest: int, rules: str) -> None:
    """The settings every beam search takes, checked once for all of them.

    Raises:
        ValueError: beam_size < 1, nbest outside [1, beam_size], alpha < 0 (the early
            termination of §6.1 relies on lp growing with length), or rules not "t2t"/"hf".
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest must be in [1, beam_size={beam_size}], got {nbest}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0 (early termination relies on it), got {alpha}")
    if rules not in ("t2t", "hf"):
        raise ValueError(f"rules must be 't2t' or 'hf', got {rules!r}")


def greedy_search(
    step: StepFunction,
    max_lens: Tensor,
    *,
    min_len: int = 0,
    sampling: SamplingConfig | None = None,
    stats: DecodeStats | None = None,
    processors: Sequence[ScoreProcessor] = (),
) -> list[Hypothesis]:
    """Pick the most likely token at each position (or sample one), for B sentences at once.

    Rows that reach EOS leave the batch (``step.select``), so the step function only ever
    computes live rows.

    Args:
        step: step function with B rows, not yet called.
        max_lens: long (B,), tokens each sentence may generate before the forced EOS.
        min_len: EOS is banned before this many tokens (benchmarks use it to fix lengths).
        sampling: sample from the (temperature / top-k / top-p filtered) distribution instead
            of taking the argmax.
        stats: where to count the decoder calls and row-steps, if given.
        processors: rules applied to the scores after the length rules (:class:`LengthRules`
            with ``min_len``), in order.

    Returns:
        One :class:`Hypothesis` per sentence, in input order (``score == log_prob``).

    Raises:
        ValueError: bad ``max_lens`` or ``min_len``.
    """
    _check_lens(max_lens, min_len)
    B = max_lens.shape[0]
    device = max_lens.device
    generator = None
    if sampling is not None and sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    rows = torch.arange(B, device=device)  # sentence of each live row
    lens = max_lens.clone()
    tokens = torch.full((B,), step.start_id, dtype=torch.long, device=device)
    ids = step.token_ids  # column -> token id (one map for every step)
    rules = (LengthRules(min_len), *processors)
    log_prob = torch.zeros(B, device=device)
    out_tokens: list[list[int]] = [[] for _ in range(B)]
    out_logp = [0.0] * B
    history: list[Tensor] = []  # (n_t,) chosen tokens per step, rows aligned with `rows` then
    history_rows: list[Tensor] = []
    # (n, t) the live rows' tokens, kept only for the caller's processors (the length rules
    # read none of it): no work is added to the loop when there are none
    seq = torch.empty(B, 0, dtype=torch.long, device=device) if processors else None
    t = 0
    while rows.numel() > 0:
        if stats is not None:
            stats.count(rows.numel())
        state = SearchState(t, lens, rows, seq, ids)
        if sampling is None:
            column, chosen_logp = step.greedy(tokens, rules, state)
        else:
            logp = apply_processors(step.log_probs(tokens), rules, state)  # (n, V) or V'
            column = _sample(logp, sampling, generator)
            chosen_logp = logp.gather(1, column[:, None]).squeeze(1)
        log_prob = log_prob + chosen_logp
        chosen = column if ids is None else ids[column]
        history.append(chosen)
        history_rows.append(rows)
        if seq is not None:
            seq = torch.cat([seq, chosen[:, None]], dim=1)
        done = chosen == EOS_ID
        if bool(done.any()):
            for r, lp in zip(rows[done].tolist(), log_prob[done].tolist()):
                out_logp[r] = lp
            keep = (~done).nonzero().squeeze(1)
            rows, lens, log_prob, chosen = rows[keep], lens[keep], log_prob[keep], chosen[keep]
            if seq is not None:
                seq = seq[keep]
            if rows.numel() > 0:
                step = step.select(keep)
        tokens = chosen
        t += 1
    for chosen, r in zip(history, history_rows):
        for row, tok in zip(r.tolist(), chosen.tolist()):
            out_tokens[row].append(tok)
    return [Hypothesis(out_tokens[b], out_logp[b], out_logp[b]) for b in range(B)]


def _sample(logp: Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> Tensor:
    """Draw one token per row from (n, V) log-probabilities after temperature, top-k, top-p."""
    scores = logp / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < scores.shape[-1]:
        kth = scores.topk(cfg.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, NEG_INF)
    if cfg.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first stays)
        drop_sorted = probs.cumsum(dim=-1) - probs >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, NEG_INF)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def beam_search(
    step: StepFunction,
    max_lens: Tensor,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    nbest: int = 1,
    min_len: int = 0,
    rules: str = "t2t",
    stats: DecodeStats | None = None,
    processors: Sequence[ScoreProcessor] = (),
) -> list[list[Hypothesis]]:
    """Beam search with the length penalty of Wu et al. (2016), §6.1, for B sentences at once.

    Each sentence keeps K live hypotheses (raw log-probability sums) and its K best finished
    ones (ranked by ``log_prob / lp(|Y|)``). At every step the 2K best extensions of the live
    hypotheses are taken; those ending in EOS join the finished set, the K best others stay
    live. A sentence stops when no live hypothesis can still beat its ``nbest``-th finished one:
    since log-probabilities only fall as tokens are added, and lp grows with length when
    alpha >= 0, a live hypothesis of raw score s can at best reach s / lp(max_len + 1)
    (the early termination of §6.1, as in tensor2tensor). Finished sentences leave the batch
    (``step.select``), so mixed lengths cost no work on sentences already done. The first
    step runs on one row per sentence (all K beams start from the same state), and only then
    is each sentence's row copied to K.

    ``beam_size=1`` is beam search of width 1, not greedy search: an EOS among the 2 best
    extensions finishes a hypothesis while the best non-EOS one lives on (as in fairseq and
    tensor2tensor). The live path is the greedy path, so the result is the greedy output or
    one with a better length-penalised score. :func:`translate_nbest` runs
    :func:`greedy_search` for ``beam_size=1``.

    Args:
        step: step function with B rows, not yet called (it is expanded to B*K rows here).
        max_lens: long (B,), tokens each sentence may generate before the forced EOS.
        beam_size: K >= 1.
        alpha: length penalty exponent, >= 0 (0: rank by raw log-probability).
        nbest: hypotheses returned per sentence, 1 <= nbest <= K.
        min_len: EOS is banned before this many tokens.
        rules: "t2t" (tensor2tensor, the paper's code): every EOS extension among the 2K best
            finishes a hypothesis. "hf" (Hugging Face ``generate``, fairseq): only those ranked
            among the K best do, and the EOS forced at the length limit costs nothing; with
            ``alpha=0`` (``length_penalty=0.0`` there) the outputs are ``generate``'s.
        stats: where to count the decoder calls and row-steps, if given.
        processors: rules applied to the scores after the length rules, in order.

    Returns:
        For each sentence in input order, ``nbest`` hypotheses, best first (fewer only when
        fewer than ``nbest`` distinct outputs exist).

    Raises:
        ValueError: bad beam_size, alpha, nbest or lengths.
    """
    _check_lens(max_lens, min_len)
    check_beam_settings(beam_size, alpha, nbest, rules)
    K = beam_size
    B = max_lens.shape[0]
    device = max_lens.device
    sentence = torch.arange(B, device=device)  # input index of each live sentence
    lens = max_lens.clone()  # (n,)
    # live: raw log-prob sums (n, K); only beam 0 is alive before the first step
    live = torch.full((B, K), NEG_INF, device=device)
    live[:, 0] = 0.0
    live_tokens = torch.empty(B, K, 0, dtype=torch.long, device=device)  # (n, K, t)
    fin_score = torch.full((B, K), NEG_INF, device=device)  # (n, K) sorted, best first
    fin_logp = torch.full((B, K), NEG_INF, device=device)
    fin_tokens = torch.empty(B, K, 0, dtype=torch.long, device=device)  # (n, K, t)
    results: list[list[Hypothesis]] = [[] for _ in range(B)]
    last = torch.full((B,), step.start_id, dtype=torch.long, device=device)  # one row each
    ids = step.token_ids  # column -> token id (one map for every step)
    score_rules = (LengthRules(min_len, free_forced_eos=rules == "hf"), *processors)
    t = 0
    while True:
        n = live.shape[0]
        if stats is not None:
            stats.count(last.shape[0])
        per = last.shape[0] // n  # rows per sentence: 1 on the first step, then K
        if processors:  # rows and tokens are for the caller's processors only
            state = SearchState(t, lens.repeat_interleave(per), sentence.repeat_interleave(per),
                                live_tokens.reshape(n * per, t) if per == K
                                else live_tokens[:, 0], ids)
        else:
            state = SearchState(t, lens.repeat_interleave(per), token_ids=ids)
        logp = apply_processors(step.log_probs(last), score_rules, state)  # (n*K or n, V)
        V = logp.shape[-1]
        # on step 0, one row per sentence: its beams 1..K-1 are not alive yet (-inf)
        top, idx = _best_extensions(logp, live, min(2 * K, K * V))  # (n, 2K)
        beam, tok = idx // V, idx % V
        if ids is not None:  # columns -> token ids
            tok = ids[tok]
        is_eos = tok == EOS_ID
        # --- finished: merge EOS extensions into the K best finished ------------------------
        seq = torch.cat([live_tokens.gather(1, beam[:, :, None].expand(-1, -1, t)),
                         tok.unsqueeze(2)], dim=2)  # (n, 2K, t+1)
        finishing = is_eos
        if rules == "hf":  # an EOS ranked below the K best neither finishes nor stays live
            finishing = is_eos & (torch.arange(is_eos.shape[1], device=device) < K)
        new_score = torch.where(finishing, top / length_penalty(t + 1, alpha), NEG_INF)
        new_logp = torch.where(finishing, top, NEG_INF)
        pad = torch.full((n, K, 1), EOS_ID, dtype=torch.long, device=device)
        all_tokens = torch.cat([torch.cat([fin_tokens, pad], dim=2), seq], dim=1)
        all_score = torch.cat([fin_score, new_score], dim=1)
        all_logp = torch.cat([fin_logp, new_logp], dim=1)
        fin_score, pick = all_score.topk(K, dim=1)  # stable order not needed: ties are rare
        fin_logp = all_logp.gather(1, pick)
        fin_tokens = all_tokens.gather(1, pick[:, :, None].expand(-1, -1, t + 1))
        # --- live: the K best extensions that did not end -----------------------------------
        live_top, live_pick = torch.where(is_eos, NEG_INF, top).topk(K, dim=1)  # (n, K)
        live = live_top
        src_beam = beam.gather(1, live_pick)  # (n, K) beam each new live hypothesis extends
        live_tokens = seq.gather(1, live_pick[:, :, None].expand(-1, -1, t + 1))
        last = tok.gather(1, live_pick).reshape(-1)
        t += 1
        # --- early termination, per sentence ------------------------------------------------
        bound = live[:, 0] / length_penalty((lens + 1).float(), alpha)  # best reachable score
        done = (fin_score[:, nbest - 1] >= bound) | (live[:, 0] == NEG_INF)
        if t == 1:  # every beam continues its sentence's one row
            rows = torch.arange(n, device=device).repeat_interleave(K)
        else:
            rows = (torch.arange(n, device=device)[:, None] * K + src_beam).reshape(-1)
        if bool(done.any()):
            for i in done.nonzero().squeeze(1).tolist():
                hyps = []
                for k in range(nbest):
                    s = float(fin_score[i, k])
                    if s == NEG_INF:
                        break
                    toks = fin_tokens[i, k].tolist()
                    toks = toks[: toks.index(EOS_ID) + 1]
                    hyps.append(Hypothesis(toks, float(fin_logp[i, k]), s))
                results[int(sentence[i])] = hyps
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                return results
            sentence, lens = sentence[keep], lens[keep]
            live, live_tokens = live[keep], live_tokens[keep]
            fin_score, fin_logp, fin_tokens = fin_score[keep], fin_logp[keep], fin_tokens[keep]
            last = last.view(n, K)[keep].reshape(-1)
            rows = rows.view(n, K)[keep].reshape(-1)
        step = step.select(rows)


# --- step functions over the Transformer ----------------------------------------------------


class CachedStep(StepFunction):
    """Step function over a model's incremental decoding with its K/V cache: each call feeds
    one token per row and extends the cache by one position; earlier positions are never
    recomputed. ``select`` reorders the cache rows (beam reordering, pruning).

    It drives decoding's engine (:func:`aiayn.model.engine.as_engine`: a
    :class:`~aiayn.model.Transformer` gets a :class:`~aiayn.model.engine.CpuEngine`, an int8
    copy is its own): ``decoder_output`` for the newest positions, then the engine's output
    layer (``output_layer``) for the logits, the log-probabilities and greedy search's
    choice, the last two in one kernel on an int8 output layer.

    Args:
        model: the engine.
        cache: its cache (``start_cache``), rows as the step's.
        output: the output layer (``model.output_layer(token_ids)``); its ``token_ids`` are
            the step's columns.
    """

    def __init__(self, model, cache, output) -> None:
        self.model = model
        self.cache = cache
        self.output = output
        self.token_ids = output.token_ids

    @classmethod
    def start(cls, model, memory: Tensor, src_mask: Tensor, max_steps: int = 0,
              compact: bool = True, token_ids: Tensor | None = None) -> CachedStep:
        """From encoder output ``memory`` (B, S, d_model) and ``src_mask`` bool (B, S) (the
        engine's ``encode`` of the sources; the model's own gives the same within float
        rounding); ``max_steps``, when known, reserves the cache for that many steps.

        Args:
            model: a :class:`~aiayn.model.Transformer` or an engine
                (:class:`~aiayn.model.engine.Int8Transformer`, ...).
            compact: score only the tokens the model can produce where the engine has a map
                for that (its ``compact_token_ids``: an int8 copy of a model trained with a
                target-only output layer).
            token_ids: long (V',): score only these columns (a shortlist's); wins over
                ``compact``.
        """
        engine = as_engine(model)
        if token_ids is None and compact:
            token_ids = engine.compact_token_ids
        return cls(engine, engine.start_cache(memory, src_mask, capacity=max_steps),
                   engine.output_layer(token_ids))

    @property
    def start_id(self) -> int:
        return self.model.config.decoder_start_id

    def _decoder_output(self, tokens: Tensor) -> Tensor:
        """The output layer's input for the newest tokens (n,): (n, d_model)."""
        return self.model.decoder_output(tokens[:, None], self.cache)[:, -1]

    def __call__(self, tokens: Tensor) -> Tensor:
        return self.output.logits(self._decoder_output(tokens))  # (n, V) or (n, V')

    def log_probs(self, tokens: Tensor) -> Tensor:
        """``log_softmax(self(tokens))``, float32 (n, V) or (n, V'): an int8 output layer's in
        one kernel."""
        return self.output.log_probs(self._decoder_output(tokens))

    def greedy(self, tokens: Tensor, processors: Sequence[ScoreProcessor],
               state: SearchState) -> tuple[Tensor, Tensor]:
        """:meth:`StepFunction.greedy`; where the processors are the length rules alone, from
        the output layer's kernel where it has one (an int8 layer's: the same numbers,
        without a row of log-probabilities written)."""
        x = self._decoder_output(tokens)
        masks = None
        if len(processors) == 1 and isinstance(processors[0], LengthRules):
            masks = processors[0].eos_masks(state)
        if masks is not None:
            found = self.output.greedy(x, EOS_ID, *masks)
            if found is not None:
                return found
        return choose_greedy(self.output.log_probs(x), processors, state)

    def select(self, index: Tensor) -> CachedStep:
        """The step for rows ``index``; reorders the cache in place (``select_``), so this
        step must not be called again (the searches never do)."""
        return CachedStep(self.model, self.cache.select_(index), self.output)


class UncachedStep(StepFunction):
    """The same decoder without a cache: every call reruns :meth:`Transformer.decode` over the
    whole prefix (quadratic work). For tests and for measuring what the cache gains. It runs
    the model's own torch pass (a :class:`~aiayn.model.Transformer`; an engine has no
    uncached pass)."""

    def __init__(self, model, memory: Tensor, src_mask: Tensor, prefix: Tensor | None = None):
        self.model = model
        self.memory = memory
        self.src_mask = src_mask
        self.prefix = prefix if prefix is not None else memory.new_empty(
            memory.shape[0], 0, dtype=torch.long)

    @classmethod
    def start(cls, model, memory: Tensor, src_mask: Tensor) -> UncachedStep:
        return cls(model, memory, src_mask)

    @property
    def start_id(self) -> int:
        return self.model.config.decoder_start_id

    def __call__(self, tokens: Tensor) -> Tensor:
        self.prefix = torch.cat([self.prefix, tokens[:, None]], dim=1)  # (n, t+1)
        return self.model.decode(self.prefix, self.memory, self.src_mask)[:, -1]

    def select(self, index: Tensor) -> UncachedStep:
        return UncachedStep(self.model, self.memory.index_select(0, index),
                            self.src_mask.index_select(0, index),
                            self.prefix.index_select(0, index))


class EnsembleStep(StepFunction):
    """Step function over several step functions whose models share one target vocabulary:
    an ensemble (not in the paper; Sutskever et al. 2014 and Wu et al. 2016 decode with one).

    Each call advances every member by one position and returns the log of the members'
    mean next-token probability, log((1/M) sum_m softmax(logits_m)), as float32 (n, V); the
    search's log-softmax leaves it unchanged. A token that one member forbids (-inf) keeps the
    others' probability, weighted 1/M. ``select`` reorders every member's rows alike.

    The members share one start token (:func:`aiayn.decoding.check_ensemble` refuses models
    that do not); the first one's is the ensemble's.

    Raises:
        ValueError: no members, or members whose vocabularies differ in size.
    """

    def __init__(self, steps: list[StepFunction]) -> None:
        if not steps:
            raise ValueError("EnsembleStep needs at least one step function")
        self.steps = list(steps)
        self.start_id = steps[0].start_id
        self.token_ids = steps[0].token_ids
        if not all(same_columns(self.token_ids, s.token_ids) for s in steps[1:]):
            raise ValueError("ensemble members score different token columns; start their "
                             "steps with compact=False (see same_columns)")

    def __call__(self, tokens: Tensor) -> Tensor:
        logp = [step.log_probs(tokens) for step in self.steps]
        sizes = {lp.shape[-1] for lp in logp}
        if len(sizes) > 1:
            raise ValueError(f"ensemble members have different vocabulary sizes {sorted(sizes)}")
        if len(logp) == 1:
            return logp[0]
        return torch.logsumexp(torch.stack(logp), dim=0) - math.log(len(logp))

    def select(self, index: Tensor) -> EnsembleStep:
        return EnsembleStep([step.select(index) for step in self.steps])


def same_columns(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether two step functions' ``token_ids`` name the same columns (both None, or equal)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def max_output_lengths(src_lengths: Tensor, max_len_a: float, max_len_b: int,
                       model_max_len: int, max_ratio: float | None = None) -> Tensor:
    """§6.1: maximum output length = input length + 50, i.e. ``a * len + b`` with a=1, b=50.

    ``src_lengths``: long (B,) source tokens without EOS. ``max_ratio`` (the guard
    ``DecodeConfig.max_length_ratio``, :mod:`aiayn.decoding.guards`), when given, caps it
    at ``floor(max_ratio * len)``. Capped at ``model_max_len - 1`` so the start token plus
    the output fits the positional table. Returns long (B,): the tokens each sentence may
    generate before its forced EOS (:class:`LengthRules`).
    """
    lens = torch.floor(src_lengths.double() * max_len_a + max_len_b).long()
    if max_ratio is not None:
        cap = torch.floor(src_lengths.double() * max_ratio).clamp(max=model_max_len)
        lens = torch.minimum(lens, cap.long())
    return lens.clamp(min=0, max=model_max_len - 1)


__all__ = [
    "CachedStep", "DecodeStats", "EnsembleStep", "Hypothesis", "LengthRules", "SamplingConfig",
    "ScoreProcessor", "SearchState", "StepFunction", "UncachedStep", "apply_processors",
    "beam_search", "check_beam_settings", "choose_greedy", "greedy_search", "length_penalty",
    "max_output_lengths", "same_columns",
]
