"""Word alignments from cross-attention (not in the paper), and guided alignment training.

**Soft alignment.** After decoding, one teacher-forced pass of the model's torch path over the
output (the recording machinery of :mod:`aiayn.viz.attention`, as
:meth:`aiayn.Translator.attention` uses it; never the int8 engine) gives the encoder-decoder
attention (§3.2.3) of one decoder layer, averaged over its heads: (T target subwords x S
source subwords). Row t is the position that *predicts* output token t (fairseq's
convention: the attention of the step that produced the token).

**Which layer.** fairseq's ``--print-alignment`` averages the heads of the last decoder layer
(its ``alignment_layer`` default) and its ``transformer_align`` model supervises one head of
the penultimate layer (Garg et al. 2019, EMNLP, who found the penultimate layer's averaged
attention the best unsupervised alignment of their 6-layer models); Marian's guided alignment
defaults to the last layer. Here: a model trained with guided alignment
(``train.guided_alignment_weight`` > 0) is read at its supervised layer and head; any other at
the last decoder layer, all heads averaged, as fairseq (:func:`alignment_head`): on the 2-layer
Multi30k model of ``docs/benchmarks.md`` its alignment error rate was 0.17 against the first
(penultimate) layer's 0.45. Callers may name a layer.

**Subwords to words.** Words are the whitespace-separated words of the source as given and of
the output text (or the given target). A subword whose string begins with the word-boundary
marker ``▁`` (:mod:`aiayn.data.vocab`) starts a new word; any other continues the word before
it. ``</s>`` (and padding) belong to no word. The soft word matrix (J target words x I
source words) is, for each target word, the mean over its subwords of the attention summed
over each source word's subwords (so a row sums to at most 1: the rest went to ``</s>``).
Under ``data.preprocess = lc-norm-tok`` the model reads tokenized text: its words are mapped
back to the words as given by tokenizing each given word alone; where those counts do not
add up, the model's own words are the words.

**Hard alignment (Pharaoh).** For each target word j, the source word i of the largest soft
weight: one link per target word, as fairseq's per-token argmax (Marian's ``--alignment hard``
is a threshold on the same matrix). Written ``i-j`` (source, target, 0-based), space
separated, in target order: ``"0-0 1-2 2-1"``.

**Guided alignment** (Garg et al. 2019): with ``train.guided_alignment_weight`` = lambda > 0,
training adds lambda x the cross-entropy between one head's attention (layer, head of the
config) and reference links, each target token's links normalized to sum to 1, over the
target tokens that have a link (:class:`GuidedAlignment`). The links are IBM Model 1's
Viterbi alignment on subwords (:func:`aiayn.decoding.shortlist.ibm_model1`, the shortlist's
model, learned on the training pairs when training starts): target token t links to the
source token s of the largest p(t | s), unless the NULL word's is larger (no link); ``</s>``
links to ``</s>``. Off by default: then no hook is registered and the loss is untouched.
"""

from __future__ import annotations

import bisect
import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from aiayn.data.vocab import BOS_ID, EOS_ID, PAD_ID

WORD_START = "▁"  # the vocabulary's word-boundary marker (aiayn.data.vocab)
_SPECIAL_IDS = (PAD_ID, BOS_ID, EOS_ID)


@dataclass(frozen=True)
class Alignment:
    """The word alignment of one (source, translation) pair.

    Attributes:
        pairs: (source word i, target word j) links, 0-based, in target order; one per
            target word (see the module docstring).
        soft: float32 (J, I): per target word, its attention over the source words (a row
            sums to at most 1; the rest went to ``</s>``).
        source_words: the I whitespace words of the source as given.
        target_words: the J whitespace words of the translation (or the given target).
    """

    pairs: tuple[tuple[int, int], ...]
    soft: Tensor
    source_words: tuple[str, ...]
    target_words: tuple[str, ...]

    def pharaoh(self) -> str:
        """The links as ``"i-j i-j ..."`` (source-target, 0-based), fairseq's and Marian's
        format; an empty string when there are none."""
        return " ".join(f"{i}-{j}" for i, j in self.pairs)

    def __str__(self) -> str:
        return self.pharaoh()


def parse_pharaoh(text: str) -> list[tuple[int, int]]:
    """``"0-0 1-2"`` as [(0, 0), (1, 2)] (source, target).

    Raises:
        ValueError: a link that is not two non-negative integers joined by ``-``.
    """
    pairs = []
    for link in text.split():
        i, sep, j = link.partition("-")
        if not (sep and i.isdigit() and j.isdigit()):
            raise ValueError(f"not a Pharaoh link (i-j, 0-based): {link!r}")
        pairs.append((int(i), int(j)))
    return pairs


# --- subwords to words -------------------------------------------------------------------------
def _piece(vocab, token_id: int, side: str) -> str:
    if hasattr(vocab, "source_pieces"):  # SentencePiece (a converted Marian model)
        pieces = vocab.source_pieces if side == "src" else vocab.output_pieces
        return pieces[token_id] if token_id < len(pieces) else ""
    return vocab.tokenizer.id_to_token(token_id) or ""


def subword_words(vocab, ids: Sequence[int], text: str, side: str = "tgt") -> list[int]:
    """The word of ``text`` (its whitespace words, 0-based) each token id belongs to; -1 for
    ``</s>``, padding and subwords that decode to nothing.

    A subword starting with ``▁`` begins a word, any other continues the one before. Each
    word's subwords are decoded and found in ``text`` from left to right, so the numbering is
    that of ``text.split()`` even where the two disagree (an unknown character).

    Args:
        ids: token ids of ``text`` (``vocab.encode(text)``, or the model's output for it).
        text: the text the words are counted in.
        side: "src" or "tgt" (a converted Marian model has one vocabulary per side).
    """
    groups: list[list[int]] = []
    for pos, token_id in enumerate(ids):
        if token_id in _SPECIAL_IDS:
            continue
        if not groups or _piece(vocab, token_id, side).startswith(WORD_START):
            groups.append([])
        groups[-1].append(pos)
    out = [-1] * len(ids)
    if not groups:
        return out
    starts = [m.start() for m in re.finditer(r"\S+", text)]
    decoded = vocab.decode_batch([[ids[p] for p in g] for g in groups])
    cursor = 0
    for group, word in zip(groups, decoded):
        word = word.strip()
        if not word or not starts:
            continue
        at = text.find(word, cursor)
        if at < 0:  # not where expected (a normalizer changed it): the next word in line
            at = cursor
        else:
            cursor = at + len(word)
        index = max(0, bisect.bisect_right(starts, at) - 1)
        for p in group:
            out[p] = index
    return out


def word_matrix(cross: Tensor, src_word: Sequence[int], tgt_word: Sequence[int],
                n_src: int, n_tgt: int) -> Tensor:
    """Subword attention to a word matrix.

    Args:
        cross: (T, S) attention, rows over the source subwords.
        src_word: (S,) word index of each source subword, -1 for none.
        tgt_word: (T,) word index of each target subword, -1 for none.
        n_src, n_tgt: the words I and J.

    Returns:
        float32 (J, I): row j the mean over target word j's subwords of their attention summed
        over each source word's subwords; a word without subwords has a zero row.
    """
    cross = cross.float().cpu()
    T, S = cross.shape
    src_map = torch.zeros(S, n_src)
    for s, w in enumerate(src_word[:S]):
        if w >= 0:
            src_map[s, w] = 1.0
    tgt_map = torch.zeros(n_tgt, T)
    for t, w in enumerate(tgt_word[:T]):
        if w >= 0:
            tgt_map[w, t] = 1.0
    tgt_map = tgt_map / tgt_map.sum(dim=1, keepdim=True).clamp_min(1.0)
    return tgt_map @ cross @ src_map


def hard_links(soft: Tensor) -> tuple[tuple[int, int], ...]:
    """One link per target word: (argmax source word, target word), in target order; none
    for a row of zeros or when there is no source word.

    Args:
        soft: (J, I) word matrix (:func:`word_matrix`).
    """
    if soft.numel() == 0:
        return ()
    best = soft.argmax(dim=1).tolist()
    has = (soft.sum(dim=1) > 0).tolist()
    return tuple((i, j) for j, (i, ok) in enumerate(zip(best, has)) if ok)


def given_words(model_text: str, given: str, model_word: list[int],
                tokenize: Callable[[str], str] | None) -> tuple[list[int], tuple[str, ...]]:
    """Renumber word indices of the model's text as words of the text as given.

    Args:
        model_text: the text as the model read it; ``model_word`` counts its words.
        given: the text as given.
        tokenize: the model's preprocessing of one piece of text (None: the model reads the
            text as given).

    Returns:
        (word index per token in ``given``'s words, the words); the model's own words when
        tokenizing each given word alone does not give the model's word count.
    """
    words = tuple(given.split())
    if tokenize is None or model_text.split() == list(words):
        return model_word, words
    counts = [len(tokenize(w).split()) for w in words]
    if sum(counts) != len(model_text.split()):
        return model_word, tuple(model_text.split())
    owner = [i for i, c in enumerate(counts) for _ in range(c)]
    return [owner[w] if w >= 0 else -1 for w in model_word], words


# --- the teacher-forced pass -------------------------------------------------------------------
def alignment_head(config, layer: int | None = None) -> tuple[int, int | None]:
    """(decoder layer, head or None for the mean of all heads) the alignment is read from.

    Args:
        config: the model's run :class:`~aiayn.config.Config`.
        layer: a decoder layer (0-based; negative counts from the top), or None: the guided
            layer and head of a model trained with guided alignment, else the last layer,
            all heads.

    Raises:
        ValueError: a layer the model does not have.
    """
    N = config.model.N
    if layer is not None:
        if not -N <= layer < N:
            raise ValueError(f"alignment layer {layer} is not a decoder layer of this model "
                             f"(N={N}: 0 .. {N - 1}, or -1 .. -{N})")
        return layer % N, None
    tc = config.train
    if tc.guided_alignment_weight > 0:
        return tc.guided_alignment_layer % N, tc.guided_alignment_head
    return N - 1, None


@torch.inference_mode()
def cross_attention(model, sources: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                    layer: int, head: int | None = None, *,
                    batch_size: int = 64) -> list[Tensor]:
    """The encoder-decoder attention of one decoder layer over given outputs (teacher
    forcing), one float32 (T_b, S_b) matrix per pair (CPU).

    Args:
        model: a :class:`~aiayn.model.Transformer` (run in eval mode, its mode restored).
        sources: token ids, ``</s>`` last (as the encoder reads them).
        outputs: token ids of each output (``</s>`` last, or cut at the maximum length).
        layer: the decoder layer (0-based); head: one head, or None for their mean.
        batch_size: pairs per forward pass.
    """
    from aiayn.data.batching import pad_sources
    from aiayn.model.recording import record_attention

    device = next(model.parameters()).device
    start = model.config.decoder_start_id
    # batches of similar lengths (little padding); the results go back in the given order
    order = sorted(range(len(sources)), key=lambda n: (len(sources[n]), len(outputs[n])))
    found: dict[int, Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        for lo in range(0, len(order), batch_size):
            chunk = order[lo:lo + batch_size]
            src_ids = [list(sources[n]) for n in chunk]
            out_ids = [list(outputs[n]) for n in chunk]
            src = pad_sources(src_ids).to(device)  # (B, S)
            tgt_in = pad_sources([[start] + t[:-1] for t in out_ids]).to(device)  # (B, T)
            with record_attention(model) as rec:
                memory, src_mask = model.encode(src)
                model.decode(tgt_in, memory, src_mask, project=False)
            w = rec.weights("cross")[layer]  # (B, h, T, S)
            w = w.mean(dim=1) if head is None else w[:, head]  # (B, T, S)
            w = w.float().cpu()
            for b, n in enumerate(chunk):
                found[n] = w[b, :len(out_ids[b]), :len(src_ids[b])]
    finally:
        model.train(was_training)
    return [found[n] for n in range(len(sources))]


def align_pairs(model, vocab, config, sources: Sequence[str], model_sources: Sequence[str],
                source_ids: Sequence[Sequence[int]], targets: Sequence[str],
                model_targets: Sequence[str], target_ids: Sequence[Sequence[int]], *,
                layer: int | None = None, batch_size: int = 64,
                tokenize: Callable[[str, str], str] | None = None) -> list[Alignment]:
    """Word alignments of N pairs: one teacher-forced pass (:func:`cross_attention`), then
    subwords to words and links (see the module docstring).

    Args:
        sources, targets: the texts as given (their whitespace words are the words).
        model_sources, model_targets: the texts as the model reads and writes them.
        source_ids: each source's token ids, ``</s>`` last; target_ids: each output's.
        layer: see :func:`alignment_head`.
        tokenize: ``(text, side)`` -> the model's preprocessing of a piece of text, None
            when the model reads text as given.
    """
    at, head = alignment_head(config, layer)
    keep = [n for n, t in enumerate(target_ids) if len(t) and len(source_ids[n])]
    crosses = cross_attention(model, [source_ids[n] for n in keep],
                              [target_ids[n] for n in keep], at, head, batch_size=batch_size)
    found = dict(zip(keep, crosses))
    out = []
    for n in range(len(sources)):
        side_src = None if tokenize is None else (lambda text: tokenize(text, "src"))
        side_tgt = None if tokenize is None else (lambda text: tokenize(text, "tgt"))
        src_word, src_words = given_words(
            model_sources[n], sources[n],
            subword_words(vocab, source_ids[n], model_sources[n], "src"), side_src)
        tgt_word, tgt_words = given_words(
            model_targets[n], targets[n],
            subword_words(vocab, target_ids[n], model_targets[n], "tgt"), side_tgt)
        if n in found:
            soft = word_matrix(found[n], src_word, tgt_word, len(src_words), len(tgt_words))
        else:
            soft = torch.zeros(len(tgt_words), len(src_words))
        out.append(Alignment(hard_links(soft), soft, src_words, tgt_words))
    return out


def join_alignments(parts: Sequence[Alignment | None]) -> Alignment | None:
    """One alignment for a line translated in parts: the parts' words one after the other,
    their links shifted by the words before them, the soft matrix block-diagonal. None when
    a part has none."""
    if any(a is None for a in parts):
        return None
    pairs, di, dj = [], 0, 0
    for a in parts:
        pairs += [(i + di, j + dj) for i, j in a.pairs]
        di, dj = di + len(a.source_words), dj + len(a.target_words)
    return Alignment(tuple(pairs), torch.block_diag(*[a.soft for a in parts]),
                     tuple(w for a in parts for w in a.source_words),
                     tuple(w for a in parts for w in a.target_words))


# --- guided alignment (training) ---------------------------------------------------------------
class GuidedAlignment:
    """Guided alignment's reference links and loss (Garg et al. 2019; see the module
    docstring).

    Args:
        table: IBM Model 1's p(t | s) (:class:`aiayn.decoding.shortlist.LexicalTable`).
        weight: lambda, the loss's weight (> 0).
        layer: the supervised decoder layer (0-based; negative counts from the top).
        head: the supervised head.
    """

    def __init__(self, table, weight: float, layer: int, head: int) -> None:
        if weight <= 0:
            raise ValueError(f"guided alignment needs a weight > 0, got {weight}")
        self.keys = torch.from_numpy(np.ascontiguousarray(table.keys))
        self.prob = torch.from_numpy(table.prob.astype(np.float32))
        self.vocab_size = table.vocab_size
        self.weight, self.layer, self.head = weight, layer, head

    @classmethod
    def from_corpus(cls, config, encoded, progress: Callable[[str], None] | None = None,
                    ) -> GuidedAlignment:
        """IBM Model 1 learned on ``encoded`` (an :class:`~aiayn.data.batching.EncodedCorpus`
        or a prepared corpus, :class:`~aiayn.data.prepared.PreparedCorpus`: sources end in
        ``</s>``, which is left out), with ``config.train``'s settings."""
        from aiayn.decoding.shortlist import ibm_model1

        both = zip(encoded.src, encoded.tgt) if hasattr(encoded, "src") else \
            (encoded.pair(i) for i in range(len(encoded)))
        pairs = ((s[:-1] if len(s) and s[-1] == EOS_ID else s, t) for s, t in both)
        table = ibm_model1(pairs, config.model.vocab_size, progress=progress)
        tc = config.train
        return cls(table, tc.guided_alignment_weight, tc.guided_alignment_layer,
                   tc.guided_alignment_head)

    def references(self, src: Tensor, tgt_out: Tensor) -> Tensor:
        """Reference links of a batch.

        Args:
            src: (B, S) source ids, ``</s>`` last, PAD-padded.
            tgt_out: (B, T) target ids, ``</s>`` last, PAD-padded.

        Returns:
            float32 (B, T, S): per target token, its links normalized to sum to 1 (one-hot
            here), a zero row where it has none (NULL, padding).
        """
        V = self.vocab_size
        s = src.cpu().long()[:, None, :]  # (B, 1, S)
        t = tgt_out.cpu().long()[:, :, None]  # (B, T, 1)
        prob = self._lookup(s * (V + 1) + t)  # (B, T, S)
        null = self._lookup(V * (V + 1) + t)  # (B, T, 1)
        real = (s != PAD_ID) & (s != EOS_ID) & (s < V) & (t < V)
        prob = prob.masked_fill(~real, 0.0)
        best, where = prob.max(dim=2, keepdim=True)  # (B, T, 1)
        linked = (best > null) & (best > 0) & (t != PAD_ID) & (t != EOS_ID)
        ref = torch.zeros(prob.shape).scatter_(2, where, linked.float())
        eos = (t == EOS_ID) & (s == EOS_ID)  # </s> to </s>
        ref = torch.where(eos, torch.ones(()), ref)
        return ref.to(src.device)

    def _lookup(self, keys: Tensor) -> Tensor:
        flat = keys.reshape(-1)
        at = torch.searchsorted(self.keys, flat).clamp_max(len(self.keys) - 1)
        hit = self.keys[at] == flat
        return torch.where(hit, self.prob[at], torch.zeros(())).reshape(keys.shape)

    @contextlib.contextmanager
    def capture(self, model) -> Iterator[dict]:
        """While the block runs, each forward pass of ``model``'s supervised cross-attention
        keeps the log of that head's attention, float32 (B, T, S) with gradient, in the
        yielded dict under ``"log_attention"`` (recomputed from the layer's inputs: eq. 1
        before attention dropout)."""
        module = model.decoder[self.layer].cross_attn
        found: dict = {}
        head, d_k = self.head, module.d_k

        def hook(mod, args, kwargs, output):
            query, (k, _), mask = args[0], args[1], args[2] if len(args) > 2 else kwargs["mask"]
            rows = slice(head * d_k, (head + 1) * d_k)
            q = torch.nn.functional.linear(query, mod.W_q.weight[rows], mod.W_q.bias[rows])
            scores = (q.float() * d_k**-0.5) @ k[:, head].float().transpose(1, 2)  # (B, T, S)
            if mask is not None:
                scores = scores.masked_fill(~mask[:, 0], float("-inf"))
            found["log_attention"] = scores.log_softmax(dim=-1)

        handle = module.register_forward_hook(hook, with_kwargs=True)
        try:
            yield found
        finally:
            handle.remove()

    def loss(self, log_attention: Tensor, src: Tensor, tgt_out: Tensor) -> Tensor:
        """lambda x the summed cross-entropy -sum_t sum_s ref[t, s] log A[t, s] over the
        target tokens with a link (Garg et al. 2019, eq. 5, summed, not averaged: the caller
        divides by the batch's target tokens, as the translation loss).

        Args:
            log_attention: (k B, T, S) from :meth:`capture` (k > 1: the batch stacked k times,
                as R-Drop runs it).
            src, tgt_out: the batch's (B, S) and (B, T) ids.
        """
        ref = self.references(src, tgt_out)
        repeat = log_attention.shape[0] // ref.shape[0]
        if repeat > 1:
            ref = ref.repeat(repeat, 1, 1)
        terms = ref * log_attention.masked_fill(ref == 0, 0.0)  # no 0 * -inf
        return -self.weight * terms.sum()


__all__ = ["Alignment", "GuidedAlignment", "align_pairs", "alignment_head", "cross_attention",
           "given_words", "hard_links", "join_alignments", "parse_pharaoh", "subword_words",
           "word_matrix"]
