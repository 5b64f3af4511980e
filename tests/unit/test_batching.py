"""Token batching (§5.1): bounds, coverage of an epoch, shards, determinism, padding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from aiayn.data.batching import collate, encode_corpus, make_batches, pad_sources
from aiayn.data.corpus import ParallelCorpus, load_dataset
from aiayn.data.vocab import BOS_ID, EOS_ID, PAD_ID, Vocabulary


def random_lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 80, n)
    tgt = np.clip(src + rng.integers(-10, 11, n), 1, 90)
    return src, tgt


def assert_bounds(batches, src, tgt, max_tokens):
    for b in batches:
        assert b, "empty batch"
        assert len(b) * int(src[b].max()) <= max_tokens
        assert len(b) * int(tgt[b].max()) <= max_tokens


def assert_partition(batches, n):
    counts = Counter(i for b in batches for i in b)
    assert sorted(counts) == list(range(n)), "a pair is missing"
    assert max(counts.values()) == 1, "a pair is repeated"


@pytest.mark.parametrize("max_tokens", [90, 500, 4096])
def test_full_epoch_bounds_and_every_pair_once(max_tokens):
    src, tgt = random_lengths(5000)
    batches = make_batches(src, tgt, max_tokens, seed=3, epoch=1)
    assert_bounds(batches, src, tgt, max_tokens)
    assert_partition(batches, 5000)


@pytest.mark.parametrize("num_shards", [2, 3, 4, 7])
def test_shards_partition_the_epoch_with_equal_batch_counts(num_shards):
    src, tgt = random_lengths(3001, seed=1)
    shards = [make_batches(src, tgt, 1000, seed=5, epoch=2, num_shards=num_shards,
                           shard_index=k) for k in range(num_shards)]
    assert len({len(s) for s in shards}) == 1, [len(s) for s in shards]
    assert_partition([b for s in shards for b in s], 3001)
    for s in shards:
        assert_bounds(s, src, tgt, 1000)


def test_shard_split_keeps_every_pair_when_batches_are_few():
    # 3 batches for 4 shards: the largest batch must be split to give each shard one.
    src, tgt = np.full(12, 10), np.full(12, 10)
    assert len(make_batches(src, tgt, 40, shuffle=False)) == 3
    shards = [make_batches(src, tgt, 40, num_shards=4, shard_index=k) for k in range(4)]
    assert [len(s) for s in shards] == [1, 1, 1, 1]
    assert_partition([b for s in shards for b in s], 12)


def test_deterministic_for_a_seed_and_epoch():
    src, tgt = random_lengths(2000)
    a = make_batches(src, tgt, 800, seed=1, epoch=0)
    assert a == make_batches(src, tgt, 800, seed=1, epoch=0)
    assert a != make_batches(src, tgt, 800, seed=1, epoch=1)
    assert a != make_batches(src, tgt, 800, seed=2, epoch=0)
    fixed = make_batches(src, tgt, 800, seed=1, shuffle=False)
    assert fixed == make_batches(src, tgt, 800, seed=9, epoch=4, shuffle=False)
    # unshuffled batches come in length order
    longest = [int(tgt[b].max()) for b in fixed]
    assert longest == sorted(longest)


def test_batch_order_is_shuffled():
    src, tgt = random_lengths(2000)
    batches = make_batches(src, tgt, 800, seed=0)
    longest = [int(tgt[b].max()) for b in batches]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_similar_lengths_keep_padding_low():
    src, tgt = random_lengths(5000)
    batches = make_batches(src, tgt, 2000, seed=0)
    real = int(tgt.sum())
    padded = sum(len(b) * int(tgt[b].max()) for b in batches)
    assert real / padded > 0.95


def test_bad_arguments():
    src, tgt = random_lengths(10)
    with pytest.raises(ValueError, match="cannot fit max_tokens=20"):
        make_batches(src, tgt, 20)
    with pytest.raises(ValueError, match=r"shard_index=2 is not in \[0, num_shards=2\)"):
        make_batches(src, tgt, 1000, num_shards=2, shard_index=2)
    with pytest.raises(ValueError, match="10 pairs cannot give each of num_shards=11"):
        make_batches(src, tgt, 1000, num_shards=11, shard_index=0)
    with pytest.raises(ValueError, match="must be 1-D and of one length"):
        make_batches(src, tgt[:5], 1000)
    assert make_batches(np.zeros(0, int), np.zeros(0, int), 100) == []


# --- encoding and collation -------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    src = ["a b c", "a", "b c a b c a b", "c", "a b"]
    tgt = ["x y", "x y z w", "x", "y y y y y y y y y y", "z"]
    vocab = Vocabulary.learn(src + tgt, 20)
    return vocab, ParallelCorpus(src, tgt, "small")


def test_encode_corpus_filters_and_counts(small):
    vocab, corpus = small
    full = encode_corpus(vocab, corpus, max_len=100)
    assert full.filtered == 0 and full.index == [0, 1, 2, 3, 4]
    assert all(s[-1] == EOS_ID for s in full.src)
    assert [len(t) for t in full.tgt] == [len(vocab.encode(t)) for t in corpus.tgt]
    short = encode_corpus(vocab, corpus, max_len=6)  # drops "b c a b c a b" and "y" * 10
    assert short.filtered == 2 and short.index == [0, 1, 4]
    assert "3 of 5 pairs kept, 2 over the maximum length filtered" in short.describe()
    assert short.src_lengths().tolist() == [len(full.src[i]) for i in (0, 1, 4)]
    assert short.tgt_lengths().tolist() == [len(full.tgt[i]) + 1 for i in (0, 1, 4)]


def test_collate_layout(small):
    vocab, corpus = small
    enc = encode_corpus(vocab, corpus, max_len=100)
    b = collate(enc, [3, 0], start_id=BOS_ID)
    assert b.indices == [3, 0]
    s0, t0 = enc.src[3], enc.tgt[3]
    assert b.src.shape == (2, max(len(enc.src[3]), len(enc.src[0])))
    assert b.tgt_in.shape == b.tgt_out.shape == (2, max(len(t0), len(enc.tgt[0])) + 1)
    assert b.src[0, : len(s0)].tolist() == s0
    assert b.tgt_in[0, : len(t0) + 1].tolist() == [BOS_ID, *t0]
    assert b.tgt_out[0, : len(t0) + 1].tolist() == [*t0, EOS_ID]
    short = len(enc.tgt[0]) + 1
    assert (b.tgt_out[1, short:] == PAD_ID).all() and (b.tgt_in[1, short:] == PAD_ID).all()
    assert b.tgt_tokens == len(t0) + 1 + short
    assert b.src_tokens == len(s0) + len(enc.src[0])
    assert b.src.dtype == torch.long
    p = pad_sources([[5, EOS_ID], [EOS_ID]])
    assert p.tolist() == [[5, EOS_ID], [EOS_ID, PAD_ID]]


# --- real data --------------------------------------------------------------------------------
def test_multi30k_epoch(data_dir, monkeypatch):
    monkeypatch.setenv("AIAYN_DATA_DIR", str(data_dir))
    corpus = load_dataset("multi30k", "train", "en", "de")
    vocab = Vocabulary.learn(corpus.src + corpus.tgt, 8000)
    enc = encode_corpus(vocab, corpus, max_len=128)
    assert len(enc) + enc.filtered == 29000
    src, tgt = enc.src_lengths(), enc.tgt_lengths()
    max_tokens = 4096
    batches = make_batches(src, tgt, max_tokens, seed=0, epoch=0)
    assert_partition(batches, len(enc))
    seen = Counter()
    for idx in batches:
        b = collate(enc, idx, start_id=BOS_ID)
        assert b.src.numel() <= max_tokens and b.tgt_out.numel() <= max_tokens
        seen.update(b.indices)
    assert sorted(seen) == enc.index and max(seen.values()) == 1
    shards = [make_batches(src, tgt, max_tokens, seed=0, epoch=3, num_shards=4, shard_index=k)
              for k in range(4)]
    assert len({len(s) for s in shards}) == 1
    assert_partition([b for s in shards for b in s], len(enc))


def _greedy_reference(src, tgt, max_tokens, seed, epoch, shuffle):
    """The batching loop as it was written first (one pair at a time, in Python): the numpy
    cut must give exactly its batches, so every Multi30k figure keeps its batches."""
    rng = np.random.default_rng([seed, epoch])
    tiebreak = rng.random(len(src)) if shuffle else np.arange(len(src))
    order = np.lexsort((tiebreak, src, tgt))
    batches, current, max_src, max_tgt = [], [], 0, 0
    for i in order.tolist():
        s, t = int(src[i]), int(tgt[i])
        rows = len(current) + 1
        if current and (max(max_src, s) * rows > max_tokens or max(max_tgt, t) * rows > max_tokens):
            batches.append(current)
            current, max_src, max_tgt = [], 0, 0
        current.append(i)
        max_src, max_tgt = max(max_src, s), max(max_tgt, t)
    batches.append(current)
    if shuffle:
        batches = [batches[j] for j in rng.permutation(len(batches))]
    return batches


@pytest.mark.parametrize("trial", range(40))
def test_numpy_batching_gives_the_batches_of_the_reference_loop(trial):
    rng = np.random.default_rng(trial)
    n = int(rng.integers(1, 2000))
    tgt = rng.integers(1, 100, n)
    src = np.maximum(1, tgt + rng.integers(-40, 40, n)) if trial % 2 else rng.integers(1, 100, n)
    max_tokens = int(rng.integers(max(src.max(), tgt.max()), 3000))
    for shuffle in (True, False):
        assert make_batches(src, tgt, max_tokens, seed=trial, epoch=2, shuffle=shuffle) == \
            _greedy_reference(src, tgt, max_tokens, trial, 2, shuffle)
