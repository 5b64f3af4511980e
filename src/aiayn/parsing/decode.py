"""Decoding linearized trees that are always well-formed: a step function that wraps the
model's and bans, at every step, each token that would break the tree (constrained decoding).

Allowed next tokens, given the open-bracket depth d, the words placed w of the n input words,
and the steps left before the maximum length L:
- an open bracket ``(X``: as the first token, or inside the root (d > 0), while w < n and
  the tree can still be finished in time (t + 1 + (n - w) + (d + 1) <= L);
- the next word: ``XX``, or in the ``words`` form (:class:`~aiayn.parsing.trees.TargetForm`)
  the input's word w itself, inside a bracket (d > 0) while w < n. In that form the word's
  score is the model's probability of any word there (the log-sum-exp of every word token's
  logit): which word comes next is known, the choice is only word or bracket, and an unseen
  word (``<unk>``, perhaps outside the output vocabulary) keeps a score;
- the close bracket: ``)``, or with labelled closes the one of the innermost open bracket
  (``)NP`` after ``(NP``), when d > 0, the constituent is not empty (the last token is not its
  open bracket), and, for the root (d = 1), all n words are placed;
- EOS: once the root is closed (d = 0 after the first token) and w = n.
Every other token is banned. Beam search over this step function therefore only finishes
hypotheses that :func:`~aiayn.parsing.trees.delinearize` accepts (after
:func:`~aiayn.parsing.trees.canonical`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocabulary
from aiayn.decoding.search import StepFunction
from aiayn.parsing.trees import CLOSE, PLACEHOLDER, TargetForm, is_close, is_open

NEG_INF = float("-inf")


class TreeVocabulary:
    """Which target ids are open brackets, close brackets and the placeholder, for ``form``.

    Raises:
        ValueError: a vocabulary without the tree tokens of ``form``.
    """

    def __init__(self, vocab: Vocabulary, form: TargetForm = TargetForm()) -> None:
        tokens = vocab.tokenizer.get_vocab()
        self.form, self.tokens = form, tokens
        self.size = len(vocab)
        self.is_open = torch.zeros(self.size, dtype=torch.bool)
        self.is_close = torch.zeros(self.size, dtype=torch.bool)
        # the close id each open id needs: its labelled close, or the bare one
        self.close_of = torch.full((self.size,), -1, dtype=torch.long)
        self.is_word = torch.ones(self.size, dtype=torch.bool)
        for tok, i in tokens.items():
            if is_open(tok):
                self.is_open[i] = True
                close = tokens.get(CLOSE + tok[1:]) if form.labelled_close else tokens.get(CLOSE)
                if close is not None:
                    self.close_of[i] = close
            elif is_close(tok):
                self.is_close[i] = (len(tok) > 1) == form.labelled_close
                self.is_word[i] = False
        self.is_word &= ~self.is_open  # words: neither brackets nor specials
        self.is_word[[PAD_ID, BOS_ID, EOS_ID]] = False
        self.xx_id = tokens.get(PLACEHOLDER)
        if not bool(self.is_open.any()) or not bool(self.is_close.any()) or \
                (not form.words and self.xx_id is None):
            raise ValueError(f"the vocabulary has no tree tokens of the {form.name} form "
                             "('(X', ')' or ')X', 'XX'): was it made by `aiayn parse prepare` "
                             "for this form?")

    def word_ids(self, sentences: list[list[str]]) -> Tensor:
        """long (n, max words): each sentence's words as target ids (``<unk>`` for unseen
        ones), padded with -1; the tokens the ``words`` form writes."""
        width = max((len(s) for s in sentences), default=0) + 1
        out = torch.full((len(sentences), width), -1, dtype=torch.long)
        for r, words in enumerate(sentences):
            out[r, : len(words)] = torch.tensor([self.tokens.get(w, UNK_ID) for w in words],
                                                dtype=torch.long)
        return out


class ConstrainedStep(StepFunction):
    """A :class:`~aiayn.decoding.search.StepFunction` over ``inner`` that masks the logits of
    tokens breaking the tree (module docstring).

    Args:
        inner: the model's step function (n rows).
        tv: the tree tokens of the vocabulary.
        n_words: long (n,), words of each row's sentence.
        max_lens: long (n,), the search's maximum output lengths (EOS forced at t = L).
        word_ids: long (n, W), each row's words as target ids (:meth:`TreeVocabulary.word_ids`),
            needed in the ``words`` form.
    """

    def __init__(self, inner, tv: TreeVocabulary, n_words: Tensor, max_lens: Tensor,
                 word_ids: Tensor | None = None, state: tuple[Tensor, ...] | None = None,
                 t: int = 0) -> None:
        self.inner, self.tv = inner, tv
        self.n_words, self.max_lens, self.word_ids = n_words, max_lens, word_ids
        if tv.form.words and word_ids is None:
            raise ValueError("the words form needs word_ids")
        n = n_words.shape[0]
        dev = n_words.device
        z = torch.zeros(n, dtype=torch.long, device=dev)
        f = torch.zeros(n, dtype=torch.bool, device=dev)
        # depth, words placed, any token emitted, last token was an open bracket, and the
        # stack of the close ids the open brackets need (row, depth - 1)
        self.depth, self.words, self.started, self.last_open, self.stack = state or (
            z, z.clone(), f, f.clone(), torch.full((n, 8), -1, dtype=torch.long, device=dev))
        self.t = t

    @property
    def start_id(self) -> int:
        return self.inner.start_id

    def _advance(self, tokens: Tensor) -> None:
        opened = self.tv.is_open.to(tokens.device)[tokens]
        closed = self.tv.is_close.to(tokens.device)[tokens]
        rows = opened.nonzero().squeeze(1)
        if rows.numel():
            if int(self.depth.max()) >= self.stack.shape[1]:  # a deeper tree: widen the stack
                self.stack = torch.cat([self.stack, torch.full_like(self.stack, -1)], dim=1)
            self.stack[rows, self.depth[rows]] = self.tv.close_of.to(tokens.device)[tokens[rows]]
        word = ~opened & ~closed & (tokens != EOS_ID)
        self.depth = self.depth + opened.long() - closed.long()
        self.words = self.words + word.long()
        self.started = self.started | opened
        self.last_open = opened

    def __call__(self, tokens: Tensor) -> Tensor:
        if self.t > 0:  # the first call feeds BOS
            self._advance(tokens)
        logits = self.inner(tokens).float()  # (n, V)
        d, w, n, L, t = self.depth, self.words, self.n_words, self.max_lens, self.t
        rows = torch.arange(logits.shape[0], device=logits.device)
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        can_open = ((d > 0) | ~self.started) & (w < n) & (t + 1 + (n - w) + d + 1 <= L)
        allowed |= can_open[:, None] & self.tv.is_open.to(logits.device)[None, :]
        can_word = (d > 0) & (w < n)
        if self.tv.form.words:
            next_word = self.word_ids.gather(1, w.clamp(max=self.word_ids.shape[1] - 1)[:, None])
            next_word = next_word.squeeze(1).clamp(min=0)
            any_word = logits.masked_fill(~self.tv.is_word.to(logits.device), NEG_INF)
            logits[rows, next_word] = any_word.logsumexp(dim=1)
            allowed[rows, next_word] |= can_word
        else:
            allowed[:, self.tv.xx_id] = can_word
        can_close = (d > 0) & ~self.last_open & ((d > 1) | (w == n))
        top = self.stack.gather(1, (d - 1).clamp(min=0)[:, None]).squeeze(1)
        can_close &= top >= 0
        allowed[rows, top.clamp(min=0)] |= can_close
        allowed[:, EOS_ID] = self.started & (d == 0) & (w == n)
        # a hypothesis already dead (score -inf, kept only to fill the beam) may be in no valid
        # state, and a token allowed here may be one the model never outputs (logit -inf,
        # model.output_vocab = "target"); let such a row end rather than turn its log-softmax
        # into NaN (a live one ends malformed, and the caller repairs and counts it)
        allowed[~(allowed & (logits > NEG_INF)).any(dim=1), EOS_ID] = True
        self.t += 1
        return logits.masked_fill(~allowed, NEG_INF)

    def select(self, index: Tensor) -> ConstrainedStep:
        state = tuple(s.index_select(0, index) for s in
                      (self.depth, self.words, self.started, self.last_open, self.stack))
        word_ids = None if self.word_ids is None else self.word_ids.index_select(0, index)
        return ConstrainedStep(self.inner.select(index), self.tv,
                               self.n_words.index_select(0, index),
                               self.max_lens.index_select(0, index), word_ids, state, self.t)


@torch.inference_mode()
def parse(model, vocab: Vocabulary, sentences: list[list[str]], *, beam_size: int = 21,
          alpha: float = 0.3, max_len_b: int = 300, batch_size: int = 16,
          constrained: bool = True, form: TargetForm = TargetForm(),
          progress: bool = False) -> list[list[str]]:
    """Linearized trees (target tokens in ``form``, EOS removed) for tokenized
    ``sentences`` by ``model`` (a :class:`~aiayn.model.Transformer`, or a list of them: an
    ensemble, :class:`~aiayn.decoding.search.EnsembleStep`), by beam search (§6.3: beam 21,
    alpha 0.3, maximum length input + 300) over :class:`ConstrainedStep` (or the bare model
    when ``constrained`` is False).

    A sentence for which search returns nothing gives an empty list; callers repair it.
    """
    from aiayn.data.batching import pad_sources
    from aiayn.decoding.search import (CachedStep, EnsembleStep, beam_search, greedy_search,
                                       max_output_lengths)
    from aiayn.decoding.translate import encode_sources
    from aiayn.model.engine import as_engine

    models = list(model) if isinstance(model, (list, tuple)) else [model]
    model = models[0]
    for m in models:
        m.eval()
    device = next(model.parameters()).device
    tv = TreeVocabulary(vocab, form)
    sources = encode_sources(vocab, [" ".join(s) for s in sentences], model.config.max_len,
                             long_inputs="truncate", warn=lambda msg: None)
    order = sorted(range(len(sentences)), key=lambda i: -len(sources[i]))
    out: list[list[str]] = [[] for _ in sentences]
    id_to_tok = {i: t for t, i in vocab.tokenizer.get_vocab().items()}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sentences), unit="sent", desc="parse")
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        src = pad_sources([sources[i] for i in chunk]).to(device)
        n_words = torch.tensor([len(sentences[i]) for i in chunk], device=device)
        max_lens = max_output_lengths(n_words, 1.0, max_len_b, model.config.max_len)
        steps = [CachedStep.start(e, *e.encode(src)) for e in map(as_engine, models)]
        step = steps[0] if len(steps) == 1 else EnsembleStep(steps)
        if constrained:
            step = ConstrainedStep(step, tv, n_words, max_lens,
                                   tv.word_ids([sentences[i] for i in chunk]).to(device))
        if beam_size == 1:
            hyps = [[h] for h in greedy_search(step, max_lens)]
        else:
            hyps = beam_search(step, max_lens, beam_size=beam_size, alpha=alpha)
        for i, hs in zip(chunk, hyps):
            if hs:
                out[i] = [id_to_tok[x] for x in hs[0].tokens if x != EOS_ID]
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return out


@torch.inference_mode()
def teacher_forced_accuracy(model, vocab: Vocabulary, sentences: list[list[str]],
                            targets: list[list[str]], *, batch_size: int = 32) -> float:
    """Share (%) of target tokens, EOS included, that are the model's argmax given the gold
    prefix (teacher forcing, as in training): a check that separates a model that has not
    learned the target language from a search that loses what it learned.

    Args:
        model: a :class:`~aiayn.model.Transformer`, or a list of them (an ensemble: the
            argmax of the members' mean probability).
        sentences: tokenized words; targets: their linearized trees (tokens, no EOS).
    """
    from aiayn.data.batching import pad_sources
    from aiayn.data.vocab import PAD_ID
    from aiayn.decoding.translate import encode_sources

    models = list(model) if isinstance(model, (list, tuple)) else [model]
    model = models[0]
    for m in models:
        m.eval()
    device = next(model.parameters()).device
    max_len = model.config.max_len
    sources = encode_sources(vocab, [" ".join(s) for s in sentences], max_len,
                             long_inputs="truncate", warn=lambda msg: None)
    outputs = [ids[: max_len - 2] + [EOS_ID]
               for ids in vocab.encode_batch([" ".join(t) for t in targets])]
    correct = total = 0
    for start in range(0, len(sources), batch_size):
        src = pad_sources(sources[start : start + batch_size]).to(device)
        out = pad_sources(outputs[start : start + batch_size]).to(device)  # (B, T)
        tgt_in = torch.cat([torch.full_like(out[:, :1], model.config.decoder_start_id),
                            out[:, :-1]], dim=1)
        tgt_in = tgt_in.masked_fill(tgt_in == EOS_ID, PAD_ID)
        logits = torch.stack([torch.log_softmax(m(src, tgt_in).float(), -1)
                              for m in models]).logsumexp(0)  # (B, T, V), up to log M
        real = out != PAD_ID
        correct += int(((logits.argmax(-1) == out) & real).sum())
        total += int(real.sum())
    return 100.0 * correct / max(1, total)
