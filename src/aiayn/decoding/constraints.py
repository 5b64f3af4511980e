"""Terminology constraints in the beam: target phrases that must appear in the output, placed
by dynamic beam allocation (Post & Vilar 2018, "Fast lexically constrained decoding with
dynamic beam allocation", NAACL; the banks filled round-robin as in Hu et al. 2019, NAACL).

Each sentence has a list of *phrases* (token id sequences). A hypothesis carries its
:class:`ConstraintState`: which phrases it has produced, the phrase it is in the middle of
and how far, and so how many constraint tokens it has *met* (a phrase in progress counts its
tokens so far; breaking it off un-meets them: that is what breaking costs). At every step,
for each sentence, the candidates are

1. the 2K best extensions of its live hypotheses (as :func:`~aiayn.decoding.beam_search`),
2. for each hypothesis, the next constraint token(s) it could take (the next token of its
   phrase in progress, else the first token of every phrase it has not produced),
3. for each hypothesis, its single best extension,

and the beam of K is divided among *banks* by the number of constraint tokens met: the best
candidate of each bank (most tokens met first), then each bank's second best, and so on,
until K are chosen; a bank with too few candidates leaves its places to the others. The beam
stays K whatever the number C of constraint tokens (C + 1 banks), so the work per step is
K rows plus O(K * phrases) bookkeeping, not the K * 2^C of a beam per subset (grid beam
search).

EOS is banned for a hypothesis until it has met every constraint; at the length limit the
forced EOS is still allowed (the fallback: such an output, its constraints not all placed,
ranks below every output that has them). The §6.1 length penalty is unchanged; early
termination stays correct with two changes: only finished hypotheses that meet every
constraint count, and the bound is taken over every live hypothesis (the banks do not keep
the beam in score order).

A sentence without constraints never comes here: :func:`~aiayn.decoding.translate_nbest`
decodes constrained lines in their own batches (searches are batch-invariant), so
unconstrained decoding's code path, outputs and speed are unchanged.

The rest of the module reads the faces' inputs: a constraints file (TSV or JSON Lines), a
glossary (source term -> target term) and the phrases' encoding as the model's target text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from aiayn.data.vocab import EOS_ID
from aiayn.decoding.search import (
    NEG_INF,
    DecodeStats,
    Hypothesis,
    LengthRules,
    ScoreProcessor,
    SearchState,
    StepFunction,
    _best_extensions,
    apply_processors,
    check_beam_settings,
    length_penalty,
)
from aiayn.errors import ConfigError, DataError

Phrase = tuple[int, ...]


class ConstraintError(ConfigError):
    """Constraints the search cannot take: an empty phrase, one longer than the output may be
    (the maximum output length), a token the model never produces, or a count of lines that
    does not match the input."""


class ConstraintState(NamedTuple):
    """One hypothesis's place in its sentence's constraints.

    Attributes:
        met: bit i set when phrase i has been produced.
        phrase: the phrase in progress (-1: none).
        progress: tokens of that phrase produced so far.
        count: constraint tokens met (the bank): produced phrases' tokens plus ``progress``.
    """

    met: int = 0
    phrase: int = -1
    progress: int = 0
    count: int = 0


@dataclass(frozen=True)
class Constraints:
    """One sentence's phrases (each a non-empty tuple of token ids), and the rules that move a
    hypothesis's :class:`ConstraintState` along."""

    phrases: tuple[Phrase, ...]

    @property
    def total(self) -> int:
        """C, the constraint tokens a complete output meets."""
        return sum(len(p) for p in self.phrases)

    def advance(self, s: ConstraintState, token: int) -> ConstraintState:
        """The state after ``token``: it continues the phrase in progress, or breaks it off
        (its tokens so far no longer count) and may start a phrase not yet produced (the
        first such phrase in order when several start with ``token``)."""
        met, count = s.met, s.count
        if s.phrase >= 0:
            phrase = self.phrases[s.phrase]
            if token == phrase[s.progress]:
                if s.progress + 1 == len(phrase):
                    return ConstraintState(met | 1 << s.phrase, -1, 0, count + 1)
                return ConstraintState(met, s.phrase, s.progress + 1, count + 1)
            count -= s.progress
        for i, phrase in enumerate(self.phrases):
            if not met >> i & 1 and phrase[0] == token:
                if len(phrase) == 1:
                    return ConstraintState(met | 1 << i, -1, 0, count + 1)
                return ConstraintState(met, i, 1, count + 1)
        return ConstraintState(met, -1, 0, count)

    def next_tokens(self, s: ConstraintState) -> list[int]:
        """The tokens that meet one more constraint token from ``s``."""
        if s.phrase >= 0:
            return [self.phrases[s.phrase][s.progress]]
        return list(dict.fromkeys(p[0] for i, p in enumerate(self.phrases)
                                  if not s.met >> i & 1))


def placed(phrases: Sequence[Sequence[int]], tokens: Sequence[int]) -> list[bool]:
    """For each phrase, whether it occurs in ``tokens`` as a contiguous run."""
    toks = list(tokens)
    return [any(toks[i:i + len(p)] == list(p) for i in range(len(toks) - len(p) + 1))
            for p in phrases]


class _Hyp(NamedTuple):
    log_prob: float  # raw sum, natural log
    tokens: tuple[int, ...]
    state: ConstraintState


def constrained_beam_search(
    step: StepFunction,
    max_lens: Tensor,
    constraints: Sequence[Sequence[Sequence[int]]],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    nbest: int = 1,
    min_len: int = 0,
    rules: str = "t2t",
    stats: DecodeStats | None = None,
    processors: Sequence[ScoreProcessor] = (),
) -> list[list[Hypothesis]]:
    """Beam search in which every output of sentence b holds each of ``constraints[b]``'s
    phrases, by dynamic beam allocation (module docstring), for B sentences at once.

    Every EOS among a sentence's candidates finishes a hypothesis (as ``rules="t2t"`` does;
    ``rules="hf"`` keeps only its forced EOS at no cost). Finished outputs are ranked by
    ``log_prob / lp(|Y|)`` (§6.1), those that meet every constraint first.

    Args:
        step: step function with B rows, not yet called.
        max_lens: long (B,), tokens each sentence may generate before the forced EOS.
        constraints: B lists of phrases, each a non-empty sequence of token ids (> EOS);
            a sentence may have none.
        beam_size: K >= 1, shared by the banks.
        alpha: length penalty exponent, >= 0.
        nbest: hypotheses returned per sentence, 1 <= nbest <= K.
        min_len: EOS is banned before this many tokens.
        rules: "t2t" or "hf" (see above).
        stats: where to count the decoder calls and row-steps, if given.
        processors: rules applied to the scores after the length rules, in order.

    Returns:
        For each sentence in input order, up to ``nbest`` hypotheses, best first; an output
        that does not hold every phrase comes only when no hypothesis could place them
        within ``max_lens`` (check with :func:`placed`).

    Raises:
        ValueError: bad settings; a phrase that is empty, holds PAD/BOS/EOS, is longer than
            its sentence's ``max_lens`` (all phrases together), or holds a token outside the
            step's columns (``step.token_ids``).
    """
    B = max_lens.shape[0]
    if len(constraints) != B:
        raise ValueError(f"{len(constraints)} constraint lists for {B} sentences")
    check_beam_settings(beam_size, alpha, nbest, rules)
    K = beam_size
    device = max_lens.device
    ids = step.token_ids
    id_list = None if ids is None else ids.tolist()
    column = None if id_list is None else {tok: j for j, tok in enumerate(id_list)}
    sentences = [Constraints(tuple(tuple(int(x) for x in p) for p in c)) for c in constraints]
    lens_list = max_lens.tolist()
    for b, c in enumerate(sentences):
        for p in c.phrases:
            if not p or min(p) <= EOS_ID:
                raise ValueError(f"sentence {b}: a phrase must be non-empty token ids > "
                                 f"{EOS_ID}, got {list(p)}")
            if column is not None and any(tok not in column for tok in p):
                missing = [tok for tok in p if tok not in column]
                raise ValueError(f"sentence {b}: constraint token(s) {missing} are not among "
                                 "the step's columns (token_ids)")
        if c.total > lens_list[b]:
            raise ValueError(f"sentence {b}: the constraints need {c.total} tokens, but at "
                             f"most {lens_list[b]} may be generated")
    col = (lambda tok: tok) if column is None else column.__getitem__
    score_rules = (LengthRules(min_len, free_forced_eos=rules == "hf"), *processors)

    sentence = list(range(B))  # input index of each live sentence
    lens = max_lens.clone()
    beams: list[list[_Hyp]] = [[_Hyp(0.0, (), ConstraintState())] for _ in range(B)]
    finished: list[list[tuple[bool, float, float, tuple[int, ...]]]] = [[] for _ in range(B)]
    results: list[list[Hypothesis]] = [[] for _ in range(B)]
    last = torch.full((B,), step.start_id, dtype=torch.long, device=device)
    t = 0
    while True:
        n, per = len(sentence), len(beams[0])  # per: 1 on the first step, then K
        if stats is not None:
            stats.count(n * per)
        hyps = [h for hs in beams for h in hs]
        sent_t = torch.tensor(sentence, device=device)
        tokens = (torch.tensor([h.tokens for h in hyps], dtype=torch.long, device=device)
                  .view(n * per, t) if processors else None)
        state = SearchState(t, lens.repeat_interleave(per), sent_t.repeat_interleave(per),
                            tokens)
        logp = apply_processors(step.log_probs(last), score_rules, state)  # (n*per, V')
        # EOS only once every constraint is met, until the length limit forces it
        unmet = torch.tensor([h.state.count < sentences[s].total
                              for s, hs in zip(sentence, beams) for h in hs], device=device)
        logp[unmet & (t < state.max_lens), EOS_ID] = NEG_INF
        V = logp.shape[-1]
        live = torch.full((n, K), NEG_INF, device=device)
        live[:, :per] = torch.tensor([[h.log_prob for h in hs] for hs in beams], device=device)
        top, idx = _best_extensions(logp, live, min(2 * K, per * V))  # (n, 2K)
        best_val, best_col = logp.max(dim=1)  # (n*per,)
        wanted = [(r, tok) for r, h in enumerate(hyps) if h.log_prob > NEG_INF
                  for tok in sentences[sentence[r // per]].next_tokens(h.state)]
        at = dict(dtype=torch.long, device=logp.device)
        wanted_val = (logp[torch.tensor([r for r, _ in wanted], **at),
                           torch.tensor([col(tok) for _, tok in wanted], **at)].tolist()
                      if wanted else [])
        cands: list[dict[tuple[int, int], float]] = [{} for _ in range(n)]

        def offer(i: int, b: int, tok: int, score: float) -> None:
            if score > NEG_INF:
                cands[i][(b, tok)] = score

        for i, (scores, where) in enumerate(zip(top.tolist(), idx.tolist())):
            for score, x in zip(scores, where):
                offer(i, x // V, x % V if id_list is None else id_list[x % V], score)
        for r, (v, c) in enumerate(zip(best_val.tolist(), best_col.tolist())):
            offer(r // per, r % per, c if id_list is None else id_list[c],
                  hyps[r].log_prob + v)
        for (r, tok), v in zip(wanted, wanted_val):
            offer(r // per, r % per, tok, hyps[r].log_prob + v)

        rows: list[int] = []
        new_last: list[int] = []
        keep: list[int] = []
        new_beams: list[list[_Hyp]] = []
        lp_max = length_penalty((lens + 1).float(), alpha).tolist()  # lp(max_len + 1)
        for i, s in enumerate(sentence):
            c = sentences[s]
            banks: dict[int, list[tuple[float, int, int, ConstraintState]]] = {}
            for (b, tok), score in cands[i].items():
                h = beams[i][b]
                if tok == EOS_ID:
                    finished[s].append((h.state.count == c.total,
                                        score / length_penalty(t + 1, alpha), score,
                                        h.tokens + (tok,)))
                    continue
                st = c.advance(h.state, tok)
                banks.setdefault(st.count, []).append((score, b, tok, st))
            finished[s].sort(key=lambda f: (f[0], f[1]), reverse=True)
            del finished[s][K:]
            ranked = []  # round-robin over the banks: (rank in its bank, most met first)
            for count, group in banks.items():
                group.sort(key=lambda x: (-x[0], x[1], x[2]))
                ranked += [(rank, -count, x) for rank, x in enumerate(group)]
            ranked.sort(key=lambda r: (r[0], r[1], -r[2][0], r[2][1], r[2][2]))
            chosen = [x for _, _, x in ranked[:K]]
            best_live = max((x[0] for x in chosen), default=NEG_INF)
            complete = [f for f in finished[s] if f[0]]
            done = best_live == NEG_INF or (len(complete) >= nbest and
                                            complete[nbest - 1][1] >= best_live / lp_max[i])
            if done:
                results[s] = [Hypothesis(list(f[3]), f[2], f[1]) for f in finished[s][:nbest]]
                continue
            keep.append(i)
            beam = [_Hyp(score, beams[i][b].tokens + (tok,), st) for score, b, tok, st in chosen]
            rows += [i * per + b for _, b, _, _ in chosen]
            new_last += [tok for _, _, tok, _ in chosen]
            while len(beam) < K:  # too few candidates: dead rows keep the shape
                beam.append(_Hyp(NEG_INF, beam[0].tokens, beam[0].state))
                rows.append(i * per)
                new_last.append(EOS_ID)
            new_beams.append(beam)
        t += 1
        if not keep:
            return results
        sentence = [sentence[i] for i in keep]
        lens = lens[torch.tensor(keep, device=device)]
        beams = new_beams
        last = torch.tensor(new_last, dtype=torch.long, device=device)
        step = step.select(torch.tensor(rows, dtype=torch.long, device=device))


def search_beam_size(beam_size: int, phrases: Sequence[Sequence[int]]) -> int:
    """The beam a constrained line decodes with: ``beam_size``, or with ``beam_size=1``
    (greedy) one hypothesis per bank, C + 1 for C constraint tokens (a beam of 1 would
    place every constraint at once, wherever the search stands)."""
    if beam_size > 1:
        return beam_size
    return sum(len(p) for p in phrases) + 1


def constrained_chunks(todo: list[int], constraints: Sequence[Any], batch_size: int,
                       beam_size: int) -> tuple[list[int], list[list[int]]]:
    """Split translate_nbest's line order ``todo`` into the unconstrained lines (as they
    were) and batches of constrained ones, each of one beam size (:func:`search_beam_size`),
    at most ``batch_size`` lines, in ``todo``'s order."""
    plain = [i for i in todo if not constraints[i]]
    groups: dict[int, list[int]] = {}
    for i in todo:
        if constraints[i]:
            groups.setdefault(search_beam_size(beam_size, constraints[i]), []).append(i)
    chunks = [g[j:j + batch_size] for _, g in sorted(groups.items())
              for j in range(0, len(g), batch_size)]
    return plain, chunks


def check_constraints(vocab, constraints: Sequence[Any], sources: Sequence[Sequence[int]],
                      max_lens: Sequence[int], producible: Tensor | None) -> None:
    """Refuse constraints the search cannot place, before any decoding.

    Args:
        constraints: per line, its phrases' token ids, or None.
        sources: per line, its source ids (EOS included); an empty line is not decoded.
        max_lens: per line, the tokens its output may have (§6.1: source + 50).
        producible: the tokens the models can produce (an int8 copy's compact columns), or
            None (every token).

    Raises:
        ConstraintError: naming the line (1-based) and the phrase.
    """
    allowed = None if producible is None else set(producible.tolist())
    for n, (phrases, src, most) in enumerate(zip(constraints, sources, max_lens), 1):
        if not phrases or len(src) <= 1:
            continue
        need = sum(len(p) for p in phrases)
        if need > most:
            raise ConstraintError(
                f"line {n}: the constraints need {need} target tokens but its translation may "
                f"have at most {most} (max_len_a * source tokens + max_len_b, capped by the "
                "model's max_len); shorten or drop them")
        if allowed is not None:
            for p in phrases:
                off = [tok for tok in p if tok not in allowed]
                if off:
                    raise ConstraintError(
                        f"line {n}: constraint {vocab.decode(list(p))!r} holds token(s) "
                        f"{[vocab.decode([t]) for t in off]} that the model never produces "
                        "(its output layer leaves them out)")


def producible_tokens(models: Sequence[Any]) -> Tensor | None:
    """long (V',): the tokens the engines ``models`` can produce, or None for every token: an
    int8 copy's compact columns, a target-only output layer's finite-bias tokens; for an
    ensemble, those any member can produce."""
    found = []
    for m in models:
        ids = m.compact_token_ids
        if ids is None and hasattr(getattr(m, "model", None), "output_token_ids"):
            ids = m.model.output_token_ids(EOS_ID + 1)
        if ids is None:
            return None
        found.append(ids.cpu())
    return torch.unique(torch.cat(found))


def allow_tokens(ids: Tensor, allowed: Tensor, extra: Sequence[Sequence[int]]
                 ) -> tuple[Tensor, Tensor]:
    """A shortlist's columns ``ids`` (V',) and per-sentence ``allowed`` (B, V') with each
    sentence's ``extra`` tokens (its constraints' tokens) added, so they stay reachable."""
    more = sorted({t for toks in extra for t in toks} - set(ids.tolist()))
    if more:
        ids = torch.cat([ids, torch.tensor(more, dtype=ids.dtype)])
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], len(more))], dim=1)
        order = ids.argsort()
        ids, allowed = ids[order], allowed[:, order]
    where = {t: j for j, t in enumerate(ids.tolist())}
    for b, toks in enumerate(extra):
        for t in toks:
            allowed[b, where[t]] = True
    return ids, allowed


# --- the faces' inputs: phrases as text, files, glossaries -----------------------------------


def encode_constraints(translator, constraints: Sequence[Sequence[str] | None], n_lines: int,
                       *, preprocessed: bool = False) -> list[list[list[int]] | None]:
    """Per line, its phrases as the model's target token ids (``data.preprocess`` on the
    target side unless ``preprocessed``).

    Raises:
        ConstraintError: a count other than ``n_lines``, a phrase that is not text, or one
            that is empty as the model reads it (naming the line, 1-based).
    """
    if len(constraints) != n_lines:
        raise ConstraintError(f"constraints are given for {len(constraints)} lines but there "
                              f"are {n_lines} input lines; give one entry (None or [] for "
                              "none) per line")
    out: list[list[list[int]] | None] = []
    for n, phrases in enumerate(constraints, 1):
        if not phrases:
            out.append(None)
            continue
        if isinstance(phrases, str) or not all(isinstance(p, str) for p in phrases):
            raise ConstraintError(f"line {n}: constraints must be a list of target phrases "
                                  f"(text), got {phrases!r}")
        texts = list(phrases) if preprocessed else translator.preprocess(list(phrases), "tgt")
        ids = [translator.vocab.encode(x) for x in texts]
        empty = [p for p, i in zip(phrases, ids) if not i]
        if empty:
            raise ConstraintError(f"line {n}: constraint {empty[0]!r} is empty as the model "
                                  "reads it")
        out.append(ids)
    return out


def preprocess_constraints(translator, constraints: Sequence[Sequence[str] | None]
                           ) -> list[list[str] | None]:
    """Each line's phrases as the model's target text (``data.preprocess``)."""
    return [list(translator.preprocess(list(p), "tgt")) if p else None for p in constraints]


def warn_unplaced(constraints: Sequence[Any], results: Sequence[Sequence[Any]], warn) -> None:
    """Name (to ``warn``) the lines whose best translation does not hold every phrase: the
    search ran out of length (the stated fallback: the best output it ended)."""
    missed = [n for n, (ps, out) in enumerate(zip(constraints, results), 1)
              if ps and out and out[0].tokens and not all(placed(ps, out[0].tokens))]
    if missed:
        shown = ", ".join(map(str, missed[:10])) + (", ..." if len(missed) > 10 else "")
        warn(f"{len(missed)} line(s) translated without all their constraints: the search "
             f"reached the maximum output length first (line {shown})")


def spread_over_parts(constraints: Sequence[Any], counts: Sequence[int]) -> list[Any]:
    """Per part, its constraints, for lines translated in ``counts[i]`` parts: a line's
    constraints go to its first part (the fallback for a line too long for the model: the
    joined translation holds them, wherever the source term was)."""
    out: list[Any] = []
    for phrases, k in zip(constraints, counts):
        out += [phrases] + [None] * (k - 1)
    return out


def read_constraints(path: str | Path, n_lines: int) -> list[list[str] | None]:
    """A constraints file, line-aligned with the input: JSON Lines (``.jsonl``/``.json``, or
    a first line that starts with ``{``), ``{"constraints": ["phrase", ...]}`` per line
    (``{}`` or an empty line for none); or TSV, target phrases separated by tabs, an empty
    line for none.

    Raises:
        DataError: an unreadable file, bad JSON, a wrong line count (naming file and line).
    """
    from aiayn.data.corpus import read_lines

    lines = read_lines(str(path), strip=False)
    is_json = Path(path).suffix in (".jsonl", ".json") or (
        bool(lines) and lines[0].lstrip().startswith("{"))
    if len(lines) != n_lines:
        raise DataError(f"{path}: {len(lines)} lines of constraints for {n_lines} input lines; "
                        "give one line per input line (an empty line for none)")
    out: list[list[str] | None] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            out.append(None)
            continue
        if is_json:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}, line {n}: bad JSON ({err.msg})") from None
            phrases = obj.get("constraints", []) if isinstance(obj, dict) else None
            if not isinstance(phrases, list) or not all(isinstance(p, str) for p in phrases):
                raise DataError(f'{path}, line {n}: expected {{"constraints": ["phrase", ...]}}'
                                f", got {line.strip()[:80]!r}")
        else:
            phrases = line.split("\t")
        phrases = [p.strip() for p in phrases if p.strip()]
        out.append(phrases or None)
    return out


def read_glossary(path: str | Path) -> list[tuple[str, str]]:
    """A glossary: one ``source term<TAB>target term`` per line (blank lines and lines
    starting with ``#`` skipped).

    Raises:
        DataError: a line without exactly one tab or with an empty side (naming file, line).
    """
    from aiayn.data.corpus import read_lines

    entries = []
    for n, line in enumerate(read_lines(str(path), strip=False), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise DataError(f"{path}, line {n}: expected 'source term<TAB>target term', got "
                            f"{line[:80]!r}")
        entries.append((parts[0].strip(), parts[1].strip()))
    return entries


def glossary_constraints(glossary: Sequence[tuple[str, str]], lines: Sequence[str]
                         ) -> list[list[str] | None]:
    """Per line, the target terms of the glossary entries whose source term occurs in it (as
    whole words, case-sensitive), in glossary order, each once."""
    patterns = [(re.compile(r"(?<!\w)" + re.escape(src) + r"(?!\w)"), tgt)
                for src, tgt in glossary]
    out: list[list[str] | None] = []
    for line in lines:
        found = list(dict.fromkeys(tgt for pat, tgt in patterns if pat.search(line)))
        out.append(found or None)
    return out


def merge_constraints(*lists: Sequence[Any] | None) -> list[list[str] | None] | None:
    """Per line, the phrases of every given list (files, glossary), each once; None when no
    list is given."""
    given = [x for x in lists if x is not None]
    if not given:
        return None
    out = []
    for per_line in zip(*given):
        phrases = list(dict.fromkeys(p for ps in per_line if ps for p in ps))
        out.append(phrases or None)
    return out


def join_items(parts: Sequence[str], constraints: Sequence[Any], counts: Sequence[int]
               ) -> list[Any]:
    """The server's batch items: each part as text, or (text, phrases) for the first part of
    a line with constraints (:func:`spread_over_parts`)."""
    spread = spread_over_parts(constraints, counts)
    return [(p, tuple(ps)) if ps else p for p, ps in zip(parts, spread)]


def check_request(translator, read: Sequence[str], constraints: Sequence[Sequence[str]]
                  ) -> list[list[str] | None]:
    """A request's constraints for ``read`` (its lines as the model reads them), checked as
    translate_nbest will check them, so one request's bad constraints never fail a batch
    shared with others: per line, its phrases as the model's target text, or None.

    Raises:
        ConstraintError: naming the line (1-based).
    """
    from aiayn.decoding.search import max_output_lengths

    phrases = preprocess_constraints(translator, constraints) if len(constraints) == len(
        read) else list(constraints)
    ids = encode_constraints(translator, phrases, len(read), preprocessed=True)
    decode = translator.decode_config
    max_len = min(m.config.max_len for m in translator.models)
    sources = [translator.vocab.encode(line) + [EOS_ID] for line in read]
    lens = max_output_lengths(torch.tensor([len(s) - 1 for s in sources], dtype=torch.long),
                              decode.max_len_a, decode.max_len_b, max_len).tolist()
    from aiayn.model.engine import as_engine

    models = translator.decoding_models
    check_constraints(translator.vocab, ids, sources, lens,
                      producible_tokens([as_engine(m) for m in models]))
    return [p if i else None for p, i in zip(phrases, ids)]


def split_items(items: Sequence[Any]) -> tuple[list[str], list[Any] | None]:
    """The server's batch items, text or (text, phrases), as (texts, per-line phrases or
    None when no item has any)."""
    texts = [x if isinstance(x, str) else x[0] for x in items]
    if all(isinstance(x, str) for x in items):
        return texts, None
    return texts, [None if isinstance(x, str) else x[1] for x in items]


__all__ = [
    "ConstraintError", "ConstraintState", "Constraints", "allow_tokens", "check_constraints", "check_request",
    "constrained_beam_search", "constrained_chunks", "encode_constraints", "glossary_constraints",
    "join_items", "merge_constraints", "placed", "producible_tokens", "preprocess_constraints", "read_constraints", "read_glossary",
    "search_beam_size", "split_items", "spread_over_parts", "warn_unplaced",
]
