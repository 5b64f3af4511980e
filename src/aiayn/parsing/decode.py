"""Decoding linearized trees that are always well-formed: a step function that wraps the
model's and bans, at every step, each token that would break the tree (constrained decoding).

Allowed next tokens, given the open-bracket depth d, the placeholders emitted w of the n input
words, and the steps left before the maximum length L:
- an open bracket ``(X``: as the first token, or inside the root (d > 0), while w < n and
  the tree can still be finished in time (t + 1 + (n - w) + (d + 1) <= L);
- ``XX``: inside a bracket (d > 0) while w < n;
- ``)``: when d > 0, the constituent is not empty (the last token is not its open bracket),
  and, for the root (d = 1), all n words are placed;
- EOS: once the root is closed (d = 0 after the first token) and w = n.
Every other token (source words, ``<unk>``) is banned. Beam search over this step function
therefore only finishes hypotheses that :func:`~aiayn.parsing.trees.delinearize` accepts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.data.vocab import EOS_ID, Vocabulary
from aiayn.parsing.trees import CLOSE, PLACEHOLDER

NEG_INF = float("-inf")


class TreeVocabulary:
    """Which target ids are open brackets, the close bracket and the placeholder."""

    def __init__(self, vocab: Vocabulary) -> None:
        tokens = vocab.tokenizer.get_vocab()
        self.size = len(vocab)
        self.is_open = torch.zeros(self.size, dtype=torch.bool)
        for tok, i in tokens.items():
            if tok.startswith("(") and len(tok) > 1:
                self.is_open[i] = True
        self.close_id = tokens.get(CLOSE)
        self.xx_id = tokens.get(PLACEHOLDER)
        if self.close_id is None or self.xx_id is None or not bool(self.is_open.any()):
            raise ValueError("the vocabulary has no tree tokens ('(X', ')', 'XX'): was it made "
                             "by `aiayn parse prepare`?")


class ConstrainedStep:
    """A :class:`~aiayn.decoding.search.StepFunction` over ``inner`` that masks the logits of
    tokens breaking the tree (module docstring).

    Args:
        inner: the model's step function (n rows).
        tv: the tree tokens of the vocabulary.
        n_words: long (n,), words of each row's sentence.
        max_lens: long (n,), the search's maximum output lengths (EOS forced at t = L).
    """

    def __init__(self, inner, tv: TreeVocabulary, n_words: Tensor, max_lens: Tensor,
                 state: tuple[Tensor, ...] | None = None, t: int = 0) -> None:
        self.inner, self.tv = inner, tv
        self.n_words, self.max_lens = n_words, max_lens
        n = n_words.shape[0]
        z = torch.zeros(n, dtype=torch.long, device=n_words.device)
        f = torch.zeros(n, dtype=torch.bool, device=n_words.device)
        # depth, words placed, any token emitted, last token was an open bracket
        self.depth, self.words, self.started, self.last_open = state or (z, z.clone(), f,
                                                                         f.clone())
        self.t = t

    @property
    def start_id(self) -> int:
        return self.inner.start_id

    def _advance(self, tokens: Tensor) -> None:
        is_open = self.tv.is_open.to(tokens.device)[tokens]
        is_close = tokens == self.tv.close_id
        self.depth = self.depth + is_open.long() - is_close.long()
        self.words = self.words + (tokens == self.tv.xx_id).long()
        self.started = self.started | is_open
        self.last_open = is_open

    def __call__(self, tokens: Tensor) -> Tensor:
        if self.t > 0:  # the first call feeds BOS
            self._advance(tokens)
        logits = self.inner(tokens).float()  # (n, V)
        d, w, n, L, t = self.depth, self.words, self.n_words, self.max_lens, self.t
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        can_open = ((d > 0) | ~self.started) & (w < n) & (t + 1 + (n - w) + d + 1 <= L)
        allowed |= can_open[:, None] & self.tv.is_open.to(logits.device)[None, :]
        allowed[:, self.tv.xx_id] = (d > 0) & (w < n)
        allowed[:, self.tv.close_id] = (d > 0) & ~self.last_open & ((d > 1) | (w == n))
        allowed[:, EOS_ID] = self.started & (d == 0) & (w == n)
        # a hypothesis already dead (score -inf, kept only to fill the beam) may be in no valid
        # state; let it end rather than turn its log-softmax into NaN
        allowed[~allowed.any(dim=1), EOS_ID] = True
        self.t += 1
        return logits.masked_fill(~allowed, NEG_INF)

    def select(self, index: Tensor) -> ConstrainedStep:
        state = tuple(s.index_select(0, index) for s in
                      (self.depth, self.words, self.started, self.last_open))
        return ConstrainedStep(self.inner.select(index), self.tv,
                               self.n_words.index_select(0, index),
                               self.max_lens.index_select(0, index), state, self.t)


@torch.inference_mode()
def parse(model, vocab: Vocabulary, sentences: list[list[str]], *, beam_size: int = 21,
          alpha: float = 0.3, max_len_b: int = 300, batch_size: int = 16,
          constrained: bool = True, progress: bool = False) -> list[list[str]]:
    """Linearized trees (target tokens, EOS removed) for tokenized ``sentences``, by beam
    search (§6.3: beam 21, alpha 0.3, maximum length input + 300) over
    :class:`ConstrainedStep` (or the bare model when ``constrained`` is False).

    A sentence for which search returns nothing gives an empty list; callers repair it.
    """
    from aiayn.data.batching import pad_sources
    from aiayn.decoding.search import CachedStep, beam_search, greedy_search, max_output_lengths
    from aiayn.decoding.translate import encode_sources

    model.eval()
    device = next(model.parameters()).device
    tv = TreeVocabulary(vocab)
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
        memory, src_mask = model.encode(src)
        n_words = torch.tensor([len(sentences[i]) for i in chunk], device=device)
        max_lens = max_output_lengths(n_words, 1.0, max_len_b, model.config.max_len)
        step = CachedStep.start(model, memory, src_mask)
        if constrained:
            step = ConstrainedStep(step, tv, n_words, max_lens)
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
        sentences: tokenized words; targets: their linearized trees (tokens, no EOS).
    """
    from aiayn.data.batching import pad_sources
    from aiayn.data.vocab import PAD_ID
    from aiayn.decoding.translate import encode_sources

    model.eval()
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
        logits = model(src, tgt_in)  # (B, T, V)
        real = out != PAD_ID
        correct += int(((logits.argmax(-1) == out) & real).sum())
        total += int(real.sum())
    return 100.0 * correct / max(1, total)
