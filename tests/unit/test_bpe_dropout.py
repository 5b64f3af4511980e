"""BPE-dropout (aiayn.data.bpe_dropout) on a slice of Multi30k: p = 0 is the vocabulary's own
BPE, the sampler's shortcut samples the distribution of the step-by-step definition, every
sample decodes to the same text, and an epoch is a pure function of (seed, epoch)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from aiayn.config import DataConfig
from aiayn.data.batching import encode_corpus
from aiayn.data.bpe_dropout import BpeDropout, DroppedCorpus
from aiayn.data.corpus import load_dataset
from aiayn.data.vocab import Vocabulary


@pytest.fixture(scope="module")
def slice_(data_dir):
    corpus = load_dataset("multi30k", "train", "en", "de")
    src, tgt = corpus.src[:1500], corpus.tgt[:1500]
    vocab = Vocabulary.learn(src + tgt, 2000)
    return vocab, src, tgt


def test_without_dropout_it_is_the_vocabularys_own_bpe(slice_):
    vocab, src, tgt = slice_
    for texts in (src, tgt):
        sampler = BpeDropout(vocab, texts, 0.0)
        assert sampler.deterministic() == vocab.encode_batch(texts)
        assert sampler.sample(np.random.default_rng(0)) == vocab.encode_batch(texts)


def test_samples_keep_the_text_and_vary(slice_):
    vocab, src, _ = slice_
    sampler = BpeDropout(vocab, src, 0.1)
    a = sampler.sample(np.random.default_rng(7))
    b = sampler.sample(np.random.default_rng(7))
    c = sampler.sample(np.random.default_rng(8))
    assert a == b  # the generator alone decides
    assert a != c
    det = vocab.encode_batch(src)
    assert vocab.decode_batch(a) == vocab.decode_batch(det) == src
    changed = sum(x != y for x, y in zip(a, det)) / len(src)
    assert 0.3 < changed < 1.0
    assert sum(map(len, a)) > 1.1 * sum(map(len, det))  # smaller pieces: longer sentences


def reference_dropout(word: str, ranks: dict[tuple[str, str], int], p: float,
                      draw: random.Random) -> tuple[str, ...]:
    """Provilkov et al.'s definition, step by step: at every merge step each applicable merge
    is skipped with probability p, the best-ranked kept one is applied; stop when none is."""
    symbols = list(word)
    while True:
        cands = sorted((ranks[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:]))
                       if pair in ranks)
        kept = [i for _, i in cands if draw.random() >= p]
        if not kept:
            return tuple(symbols)
        i = kept[0]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]


def test_the_shortcut_samples_the_definition(slice_):
    vocab, src, _ = slice_
    words = sorted({w for line in src[:300] for w in line.split()}, key=len, reverse=True)
    word = next(w for w in words if len(vocab.encode(w)) == 1)  # held whole
    assert len(word) >= 7  # a long word: many merges to skip
    n, p = 20_000, 0.2
    sampler = BpeDropout(vocab, [word] * n, p)
    ids = sampler.sample(np.random.default_rng(3))
    got = Counter(tuple(vocab.tokenizer.id_to_token(i) for i in row) for row in ids)
    ranks = sampler._ranks
    draw = random.Random(3)
    want = Counter(reference_dropout("▁" + word, ranks, p, draw) for _ in range(n))
    assert len(got) >= 8
    for seg in set(got) | set(want):  # frequencies agree within ~4 standard errors
        f, g = got[seg] / n, want[seg] / n
        assert abs(f - g) <= 4 * np.sqrt(max(f, g, 1 / n) / n) + 1e-3, (seg, f, g)


def test_epochs_are_a_function_of_seed_and_epoch(slice_):
    vocab, src, tgt = slice_
    from aiayn.data.corpus import ParallelCorpus

    base = encode_corpus(vocab, ParallelCorpus(src, tgt), 40)
    kept_src = [src[i] for i in base.index]
    kept_tgt = [tgt[i] for i in base.index]
    make = lambda seed: DroppedCorpus(vocab, kept_src, kept_tgt, base, 0.1, 40, seed,  # noqa: E731
                                      restrict_target=True)
    one, again, other = make(1), make(1), make(2)
    e1 = one.epoch(1)
    assert e1.src == again.epoch(1).src and e1.tgt == again.epoch(1).tgt
    assert e1.src != one.epoch(2).src and e1.src != other.epoch(1).src
    assert e1.index == base.index
    assert max(e1.src_lengths().max(), e1.tgt_lengths().max()) <= 40  # max_len holds
    assert all(s[-1] == vocab.eos_id for s in e1.src)
    assert vocab.decode_batch(e1.tgt) == vocab.decode_batch(base.tgt)
    allowed = set(base.target_token_ids().tolist())
    assert {i for t in e1.tgt for i in t} <= allowed  # the output vocabulary holds
    free = DroppedCorpus(vocab, kept_src, kept_tgt, base, 0.1, 40, 1).epoch(1)
    assert {i for t in free.tgt for i in t} - allowed  # ... which the restriction kept


def test_bad_settings_are_refused(slice_):
    vocab, src, _ = slice_
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        BpeDropout(vocab, src, 1.0)
    with pytest.raises(ValueError, match="bpe_dropout must be in"):
        DataConfig(bpe_dropout=-0.1)
    with pytest.raises(ValueError, match="needs vocab_kind 'bpe'"):
        DataConfig(bpe_dropout=0.1, vocab_kind="wordpiece")
    wordpiece = Vocabulary.learn(src[:200], 300, kind="wordpiece")
    with pytest.raises(ValueError, match="needs a BPE vocabulary"):
        BpeDropout(wordpiece, src, 0.1)
